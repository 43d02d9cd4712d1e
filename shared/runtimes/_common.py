"""Checks every backend runs before handing a request to its runtime.

Runtimes disagree on what they do with a bad request: ONNX Runtime raises,
OpenVINO silently converts an FP64 array or runs a wrong inner dimension,
TFLite may abort in a kernel.  Checking names, datatypes and fixed dims here,
against the specs the backend reported, gives every backend the same
:class:`~shared.errors.InvalidInput` messages for the same mistakes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from shared.datatypes import v2_datatype
from shared.errors import InvalidInput, ModelNotReady
from shared.runtimes.base import TensorSpec

#: Runtimes' vector kernels take a different path over memory off this boundary, and
#: their sums come out in another order: a binary tensor's bytes sit wherever the
#: JSON header before them ends, and ONNX Runtime's ReduceSum gave a 1-ulp different
#: answer for 3 in 4 header lengths.  Every numpy allocation is aligned so; such a
#: view is copied to one (the batcher's concatenation already does).
ALIGN = 16


def check_inputs(
    specs: Sequence[TensorSpec], inputs: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Validate ``inputs`` against ``specs``; return C-contiguous, native-order arrays
    aligned as numpy aligns its own (``ALIGN``).

    Only fixed dims are checked (-1 takes any size); the runtime still checks
    what only it knows (e.g. that two dynamic dims agree).
    """
    if not isinstance(inputs, Mapping):
        raise InvalidInput(
            f"inputs must be a mapping of name to array, got {type(inputs).__name__}"
        )
    by_name = {s.name: s for s in specs}
    unknown = [n for n in inputs if n not in by_name]
    if unknown:
        raise InvalidInput(f"unknown inputs {sorted(unknown)}; the model takes {sorted(by_name)}")
    missing = [n for n in by_name if n not in inputs]
    if missing:
        raise InvalidInput(f"missing inputs {sorted(missing)}; the model takes {sorted(by_name)}")
    checked: dict[str, np.ndarray] = {}
    for spec in specs:
        array = inputs[spec.name]
        if not isinstance(array, np.ndarray):
            raise InvalidInput(
                f"input {spec.name!r}: expected a numpy array, got {type(array).__name__}"
            )
        got = _datatype_of(array)
        if got != spec.datatype:
            raise InvalidInput(
                f"input {spec.name!r}: expected datatype {spec.datatype}, got {got} ({array.dtype})"
            )
        if spec.ranked and not shape_matches(spec.dims, array.shape):
            raise InvalidInput(
                f"input {spec.name!r}: expected shape {list(spec.dims)} (-1: any size), "
                f"got {list(array.shape)}"
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        # np.require, not np.ascontiguousarray: that one makes a scalar (rank 0) a [1]
        array = np.require(array, requirements="C")
        if array.ctypes.data % ALIGN and array.dtype.kind != "O" and array.size:
            array = array.copy()
        checked[spec.name] = array
    return checked


def check_outputs(names: Sequence[str], requested: Iterable[str] | None) -> list[str]:
    """The outputs to compute: all when ``requested`` is None or empty, else those (deduplicated)."""
    if not requested:
        return list(names)
    if isinstance(requested, str):
        raise InvalidInput(f"outputs must be a list of names, got the string {requested!r}")
    wanted = list(dict.fromkeys(requested))
    known = set(names)
    bad = [n for n in wanted if n not in known]
    if bad:
        raise InvalidInput(f"unknown outputs {bad}; the model gives {list(names)}")
    return wanted


def shape_matches(dims: Sequence[int], shape: Sequence[int]) -> bool:
    return len(dims) == len(shape) and all(d in (-1, s) for d, s in zip(dims, shape, strict=True))


def bytes_array(array: np.ndarray, name: str = "") -> np.ndarray:
    """An object array of ``bytes`` (the BYTES carrier) from str/bytes/object arrays.

    Runtimes hand strings back as ``str`` or fixed-width ``S``/``U`` arrays;
    callers always get bytes (str is encoded as UTF-8).
    """
    items = []
    for x in array.reshape(-1).tolist():
        if isinstance(x, str):
            x = x.encode()
        elif not isinstance(x, bytes | bytearray):
            raise InvalidInput(
                f"tensor {name!r}: BYTES elements must be bytes, got {type(x).__name__}"
            )
        items.append(bytes(x))
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(array.shape)


def text_array(array: np.ndarray, name: str, backend: str) -> np.ndarray:
    """An object array of ``str`` for runtimes whose string tensors hold text only."""
    items = []
    for x in array.reshape(-1).tolist():
        if isinstance(x, bytes | bytearray):
            try:
                x = bytes(x).decode()
            except UnicodeDecodeError:
                raise InvalidInput(
                    f"input {name!r}: {backend} string tensors must hold UTF-8 text"
                ) from None
        elif not isinstance(x, str):
            raise InvalidInput(
                f"input {name!r}: BYTES elements must be bytes, got {type(x).__name__}"
            )
        items.append(x)
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(array.shape)


def closed_error(backend: str) -> ModelNotReady:
    return ModelNotReady(f"this {backend} session has been closed")


def _datatype_of(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except InvalidInput:
        return str(array.dtype)
