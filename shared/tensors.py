"""Tensors as both tiers hold them, and the checks that guard their bytes.

Every decoder turns wire bytes into :class:`Tensor` objects through
:func:`array_from_buffer`, which checks the declared shape and datatype
against the byte length *before* allocating anything, and returns a
zero-copy view over the caller's buffer for fixed-size datatypes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.datatypes import element_size, numpy_dtype, v2_datatype, validate_datatype
from shared.errors import InvalidInput, PayloadTooLarge

_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every decoded request (explicit config, no globals).

    ``max_body_bytes`` caps a whole HTTP body or MQTT payload;
    ``max_elements`` caps one tensor's element count (so a tiny body cannot
    declare a shape that would allocate gigabytes).
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_elements: int = 16 * 1024 * 1024
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
    """Validate a declared shape and return it as a tuple; caps the element count."""
    if not isinstance(shape, (list, tuple)):
        raise InvalidInput(f"input {name!r}: shape must be a list of integers, got {shape!r}")
    if len(shape) > limits.max_dims:
        raise InvalidInput(
            f"input {name!r}: {len(shape)} dims exceeds the limit of {limits.max_dims}"
        )
    count = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise InvalidInput(
                f"input {name!r}: shape must hold non-negative integers, got {list(shape)!r}"
            )
        count *= dim
    if count > limits.max_elements:
        raise PayloadTooLarge(
            f"input {name!r}: shape {list(shape)} has {count} elements, "
            f"over the limit of {limits.max_elements}"
        )
    return tuple(shape)


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
    return np.frombuffer(buf, dtype=numpy_dtype(datatype), count=count).reshape(shape)


def bytes_array_from_buffer(
    name: str, shape: tuple[int, ...], count: int, buf: memoryview | bytes
) -> np.ndarray:
    """Parse ``count`` length-prefixed BYTES elements, which must fill ``buf`` exactly."""
    view = memoryview(buf)
    total = len(view)
    if count * 4 > total:
        raise InvalidInput(
            f"input {name!r}: {count} BYTES elements need at least {count * 4} bytes, got {total}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > total:
            raise InvalidInput(f"input {name!r}: BYTES element {i} truncated (no length prefix)")
        (length,) = _U32.unpack_from(view, offset)
        offset += 4
        end = offset + length
        if end > total:
            raise InvalidInput(
                f"input {name!r}: BYTES element {i} declares {length} bytes, "
                f"only {total - offset} remain"
            )
        out[i] = bytes(view[offset:end])
        offset = end
    if offset != total:
        raise InvalidInput(
            f"input {name!r}: {total - offset} bytes left over after {count} BYTES elements"
        )
    return out.reshape(shape)


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements as 4-byte little-endian length + data, in C order."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        raw = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


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
_JSON_KINDS: dict[str, str] = {
    "BOOL": "b",
    **{
        t: _INTS for t in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
    },
    **{t: _INTS + "f" for t in ("FP16", "FP32", "FP64", "BF16")},
}


def cast_json_data(name: str, datatype: str, shape: tuple[int, ...], data: object) -> np.ndarray:
    """Build an array from V2 JSON ``data`` (flat or nested lists), checking the count."""
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
    try:
        arr = np.array(data)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(
            f"input {name!r}: data is not a regular list of numbers: {exc}"
        ) from None
    if arr.size != count:
        raise InvalidInput(f"input {name!r}: shape needs {count} elements, data holds {arr.size}")
    target = numpy_dtype(datatype)
    if count and target.kind in _INTS and arr.dtype.kind in "fO":
        # Mixed magnitudes beyond int64 make numpy infer float or object: recheck as ints.
        flat = _flatten(name, data, count)
        if all(type(v) is int for v in flat):
            info = np.iinfo(target)
            if min(flat) < info.min or max(flat) > info.max:
                raise InvalidInput(f"input {name!r}: values out of range for {datatype}")
            return np.array(flat, dtype=target).reshape(shape)
    if count and arr.dtype.kind not in _JSON_KINDS[datatype]:
        raise InvalidInput(
            f"input {name!r}: {datatype} data must hold "
            f"{'true/false values' if datatype == 'BOOL' else 'numbers'}, got {arr.dtype.kind!r} data"
        )
    if count and target.kind in _INTS and arr.dtype.kind in _INTS:
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            raise InvalidInput(f"input {name!r}: values out of range for {datatype}")
    try:
        arr = arr.astype(target)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: data does not fit {datatype}: {exc}") from None
    return arr.reshape(shape)


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
    """A tensor's elements as a flat JSON-ready list."""
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
    if datatype in ("BF16", "FP16"):
        return array.astype(np.float32).reshape(-1).tolist()
    return array.reshape(-1).tolist()
