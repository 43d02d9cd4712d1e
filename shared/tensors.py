"""Tensors as both tiers hold them, and the checks that guard their bytes.

Every decoder turns wire bytes into :class:`Tensor` objects through
:func:`array_from_buffer`, which checks the declared shape and datatype
against the byte length *before* allocating anything, and returns a
zero-copy view over the caller's buffer for fixed-size datatypes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import msgspec
import numpy as np

from shared.bytescodec import decode_bytes, encode_bytes
from shared.datatypes import element_size, numpy_dtype, v2_datatype, validate_datatype
from shared.errors import InvalidInput, PayloadTooLarge

_U32 = struct.Struct("<I")
#: numpy refuses a shape whose non-zero dims x item size exceed this, even with no elements
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)
_MAX_ITEMSIZE = 8  # the widest V2 element (FP64, INT64, UINT64; BYTES as object pointers)


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every decoded request (explicit config, no globals).

    ``max_body_bytes`` caps a whole HTTP body or MQTT payload;
    ``max_json_body_bytes`` caps the JSON part of a V2 body, which is smaller
    because decoded JSON costs many times its size (a Python object per
    number) while binary tensors are views over the body;
    ``max_elements`` caps one tensor's element count and every single
    dimension (so a tiny body cannot declare a shape that would allocate
    gigabytes, nor one numpy cannot even describe).
    """

    #: 16 MiB: 26 FP32 images of 224x224 in one request.  Bigger bodies work when
    #: raised, at a price: CPython copies a body a few times holding the GIL (the
    #: socket read, the runtime's output, the reply), and at 60 MB each copy
    #: holds every other connection for tens of milliseconds (bench/stalls.py)
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_body_bytes: int = 4 * 1024 * 1024
    max_elements: int = 16 * 1024 * 1024
    #: BYTES elements in one tensor: runtimes convert each to and from a Python
    #: object holding the GIL (ONNX Runtime: ~0.2 us per element each way), so a
    #: million strings freeze the whole process for a fraction of a second
    max_bytes_elements: int = 64 * 1024
    max_tensors: int = 64
    max_dims: int = 8
    max_name_length: int = 256


DEFAULT_LIMITS = Limits()


@dataclass(slots=True)
class Tensor:
    """A named array with its V2 datatype (BYTES arrays hold ``bytes`` objects)."""

    name: str
    datatype: str
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @classmethod
    def from_array(cls, name: str, array: np.ndarray | list | bytes) -> Tensor:
        """Wrap an array, inferring the V2 datatype (str and bytes become BYTES)."""
        arr = np.asarray(array)
        datatype = v2_datatype(arr.dtype)
        if datatype == "BYTES":
            arr = _as_bytes_array(arr)
        return cls(name, datatype, arr)


def _as_bytes_array(arr: np.ndarray) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat_in = arr.reshape(-1)
    flat_out = out.reshape(-1)
    for i, item in enumerate(flat_in):
        flat_out[i] = item.encode() if isinstance(item, str) else bytes(item)
    return out


def check_name(name: object, what: str, limits: Limits) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{what} name must be a non-empty string, got {name!r}")
    if len(name) > limits.max_name_length:
        raise InvalidInput(f"{what} name longer than {limits.max_name_length} characters")
    return name


def check_shape(shape: object, name: str, limits: Limits) -> tuple[int, ...]:
    """Validate a declared shape and return it as a tuple, in O(dims).

    Caps each dimension and the element count; a zero dimension makes the
    count 0, but numpy still refuses shapes whose other dimensions multiply
    past its address space, so those are refused here too.
    """
    if not isinstance(shape, (list, tuple)):
        raise InvalidInput(f"input {name!r}: shape must be a list of integers, got {shape!r}")
    if len(shape) > limits.max_dims:
        raise InvalidInput(
            f"input {name!r}: {len(shape)} dims exceeds the limit of {limits.max_dims}"
        )
    count = 1
    extent = 1  # product of the non-zero dims
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise InvalidInput(
                f"input {name!r}: shape must hold non-negative integers, got {list(shape)!r}"
            )
        if dim > limits.max_elements:
            raise PayloadTooLarge(
                f"input {name!r}: dimension {dim} of shape {list(shape)} is over the "
                f"element limit of {limits.max_elements}"
            )
        count *= dim
        if dim:
            extent *= dim
    if count > limits.max_elements:
        raise PayloadTooLarge(
            f"input {name!r}: shape {list(shape)} has {count} elements, "
            f"over the limit of {limits.max_elements}"
        )
    if extent * _MAX_ITEMSIZE > _MAX_ARRAY_BYTES:
        raise InvalidInput(
            f"input {name!r}: shape {list(shape)} cannot be represented as an array "
            "(its non-zero dimensions multiply past the address space)"
        )
    return tuple(shape)


def check_bytes_count(name: str, datatype: str, shape: tuple[int, ...], limits: Limits) -> None:
    """BYTES tensors have their own, smaller element bound (see Limits)."""
    if datatype == "BYTES":
        count = element_count(shape)
        if count > limits.max_bytes_elements:
            raise PayloadTooLarge(
                f"input {name!r}: {count} BYTES elements exceed the limit of "
                f"{limits.max_bytes_elements} (limits.max_bytes_elements)"
            )


def element_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def array_from_buffer(
    name: str, datatype: str, shape: tuple[int, ...], buf: memoryview | bytes
) -> np.ndarray:
    """Interpret raw little-endian bytes as a tensor, without copying.

    Fixed-size datatypes return a read-only view over ``buf``; the length
    must match shape x element size exactly, so truncated or padded payloads
    are errors rather than silently reinterpreted data.
    """
    validate_datatype(datatype)
    count = element_count(shape)
    if datatype == "BYTES":
        return bytes_array_from_buffer(name, shape, count, buf)
    size = element_size(datatype)
    if len(buf) != count * size:
        raise InvalidInput(
            f"input {name!r}: shape {list(shape)} of {datatype} needs {count * size} bytes, "
            f"got {len(buf)}"
        )
    if datatype == "BOOL" and count:
        # numpy would carry any byte as "true" and pass it to the model unchanged.
        top = int(np.frombuffer(buf, dtype=np.uint8, count=count).max())
        if top > 1:
            raise InvalidInput(f"input {name!r}: BOOL bytes must be 0 or 1, found {top}")
    return np.frombuffer(buf, dtype=numpy_dtype(datatype), count=count).reshape(shape)


def bytes_array_from_buffer(
    name: str, shape: tuple[int, ...], count: int, buf: memoryview | bytes
) -> np.ndarray:
    """Parse ``count`` length-prefixed BYTES elements, which must fill ``buf`` exactly."""
    return decode_bytes(name, shape, count, buf)


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements as 4-byte little-endian length + data, in C order."""
    return encode_bytes(array)


def array_to_buffer(array: np.ndarray, datatype: str) -> memoryview | bytes:
    """Raw little-endian bytes of a tensor: a view when already contiguous LE."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    dtype = numpy_dtype(datatype)
    if array.dtype != dtype:
        array = array.astype(dtype)
    # A uint8 view also covers dtypes the buffer protocol cannot export (bfloat16).
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


_INTS = "iu"

#: the protobuf JSON mapping's spelling of non-finite floats (JSON has no literal for them)
NON_FINITE_TOKENS: dict[str, float] = {
    "NaN": float("nan"),
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
}
_FloatOrToken = float | Literal["NaN", "Infinity", "-Infinity"]
#: V2 datatype -> the Python type every JSON leaf must have (msgspec checks it in C)
_JSON_LEAVES: dict[str, Any] = {
    "BOOL": bool,
    **{t: int for t in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")},
    **{t: float for t in ("FP16", "FP32", "FP64", "BF16")},
}
_LEAF_WORDS = {
    bool: "true/false values",
    int: "integer numbers",
    float: 'numbers (or "NaN", "Infinity", "-Infinity")',
}
#: numpy's own limit on dimensions; deeper JSON nesting can never be a regular array
_MAX_JSON_DEPTH = 64


@cache
def _nested(leaf: Any, depth: int) -> Any:
    for _ in range(depth):
        leaf = list[leaf]
    return leaf


def _depth(data: list) -> int:
    """Nesting depth along the first elements (msgspec then checks every branch)."""
    depth = 0
    item: object = data
    while isinstance(item, list):
        depth += 1
        if depth > _MAX_JSON_DEPTH:
            break
        item = item[0] if item else None
    return depth


def cast_json_data(name: str, datatype: str, shape: tuple[int, ...], data: object) -> np.ndarray:
    """Build an array from V2 JSON ``data`` (flat or nested lists), checking the count.

    Leaf types are checked by msgspec before numpy sees the data, so a string
    among numbers is an error rather than a (possibly huge) unicode array,
    and a float datatype's finite values that overflow it are refused rather
    than silently becoming infinities.
    """
    count = element_count(shape)
    if datatype == "BYTES":
        flat = _flatten(name, data, count)
        out = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if isinstance(item, str):
                out[i] = item.encode()
            elif isinstance(item, (bytes, bytearray)):
                out[i] = bytes(item)
            else:
                raise InvalidInput(f"input {name!r}: BYTES data must hold strings, got {item!r}")
        return out.reshape(shape)
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: data must be a list, got {type(data).__name__}")
    depth = _depth(data)
    if depth > _MAX_JSON_DEPTH:
        raise InvalidInput(f"input {name!r}: data is nested deeper than {_MAX_JSON_DEPTH} levels")
    if len(data) > _JSON_CAST_CHUNK:
        # In steps, so a worker thread casting a big body lets the event loop have the
        # GIL between them (one numpy call over a million numbers holds it ~20 ms).
        parts = [
            _json_array(name, datatype, data[i : i + _JSON_CAST_CHUNK], depth)
            for i in range(0, len(data), _JSON_CAST_CHUNK)
        ]
        tokens = any(t for _, t in parts)
        try:
            arr = np.concatenate([a for a, _ in parts])
        except ValueError as exc:
            raise InvalidInput(
                f"input {name!r}: data is not a regular list of numbers: {exc}"
            ) from None
    else:
        arr, tokens = _json_array(name, datatype, data, depth)
    if arr.size != count:
        raise InvalidInput(f"input {name!r}: shape needs {count} elements, data holds {arr.size}")
    target = numpy_dtype(datatype)
    if count and target.kind in _INTS:
        if arr.dtype.kind not in _INTS:
            # Mixed magnitudes beyond int64 make numpy infer float or object: recheck as ints.
            flat = _flatten(name, data, count)
            info = np.iinfo(target)
            if min(flat) < info.min or max(flat) > info.max:
                raise InvalidInput(f"input {name!r}: values out of range for {datatype}")
            return np.array(flat, dtype=target).reshape(shape)
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidInput(f"input {name!r}: values out of range for {datatype}")
    with np.errstate(over="ignore"):
        out = arr.astype(target)
    if count and target.kind != "b" and target.kind not in _INTS and target.itemsize < 8:
        overflow = ~np.isfinite(out)
        if tokens or overflow.any():  # a value non-finite as sent is no overflow
            overflow &= np.isfinite(arr)
        if overflow.any():
            value = float(arr.reshape(-1)[np.flatnonzero(overflow.reshape(-1))[0]])
            raise InvalidInput(
                f"input {name!r}: value {value!r} is out of range for {datatype} "
                "(finite values must stay finite)"
            )
    return out.reshape(shape)


#: top-level items of JSON data cast per step (see cast_json_data)
_JSON_CAST_CHUNK = 1 << 16


def _json_array(name: str, datatype: str, data: list, depth: int) -> tuple[np.ndarray, bool]:
    """Check the leaves' types (msgspec, in C) and build the array; True when the
    data held non-finite tokens ("NaN", "Infinity")."""
    leaf = _JSON_LEAVES[datatype]
    tokens = False
    try:
        data = msgspec.convert(data, _nested(leaf, depth))
    except msgspec.ValidationError as exc:
        error = InvalidInput(
            f"input {name!r}: {datatype} data must hold {_LEAF_WORDS[leaf]}: {exc}"
        )
        if leaf is not float:
            raise error from None
        try:
            data = msgspec.convert(data, _nested(_FloatOrToken, depth))
        except msgspec.ValidationError:
            raise error from None
        data = _resolve_tokens(data)
        tokens = True
    try:
        return np.array(data), tokens
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(
            f"input {name!r}: data is not a regular list of numbers: {exc}"
        ) from None


def _resolve_tokens(data: list) -> list:
    """A copy of nested ``data`` with the non-finite tokens replaced by floats."""
    out: list = []
    stack = [(iter(data), out)]
    while stack:
        items, target = stack[-1]
        for item in items:
            if isinstance(item, list):
                child: list = []
                target.append(child)
                stack.append((iter(item), child))
                break
            target.append(NON_FINITE_TOKENS[item] if isinstance(item, str) else item)
        else:
            stack.pop()
    return out


def _flatten(name: str, data: object, count: int) -> list:
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: data must be a list, got {type(data).__name__}")
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > count:
                raise InvalidInput(
                    f"input {name!r}: data holds more than the shape's {count} elements"
                )
        else:
            stack.pop()
    if len(flat) != count:
        raise InvalidInput(f"input {name!r}: shape needs {count} elements, data holds {len(flat)}")
    return flat


def json_data(array: np.ndarray, datatype: str) -> list:
    """A tensor's elements as a flat JSON-ready list (non-finite floats as tokens)."""
    if datatype == "BYTES":
        out = []
        for item in array.reshape(-1):
            try:
                out.append(item.decode() if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError:
                raise InvalidInput(
                    "BYTES output is not UTF-8; request it as binary data "
                    "(parameters.binary_data = true)"
                ) from None
        return out
    flat = array.reshape(-1)
    if datatype in ("BF16", "FP16"):
        flat = flat.astype(np.float32)
    values = flat.tolist()
    if flat.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(flat))
        for i in bad.tolist():
            v = values[i]
            values[i] = "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    return values
