"""The V2 datatype table and the numpy dtypes that carry each one.

BF16 is carried by ``ml_dtypes.bfloat16`` so BF16 tensors are real numpy
arrays; ml_dtypes is imported on the first BF16 tensor only (an agent that
never sees one does not pay its ~2 MiB).  BYTES tensors are numpy object arrays whose elements are ``bytes``;
on the wire each element carries a 4-byte little-endian length prefix.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from shared.errors import InvalidInput

#: V2 datatype name -> numpy dtype (little-endian).  BYTES maps to object.
V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

DATATYPES: frozenset[str] = frozenset({*V2_TO_NUMPY, "BF16"})

_NUMPY_TO_V2: dict[np.dtype, str] = {
    dt: name for name, dt in V2_TO_NUMPY.items() if name != "BYTES"
}


@cache
def bf16_dtype() -> np.dtype:
    """numpy's dtype for BF16 (imports ml_dtypes on first use)."""
    from ml_dtypes import bfloat16

    return np.dtype(bfloat16)


def element_size(datatype: str) -> int:
    """Bytes per element for fixed-size types; 0 for BYTES (variable)."""
    if datatype == "BYTES":
        return 0
    return numpy_dtype(datatype).itemsize


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return V2_TO_NUMPY[datatype]
    except (KeyError, TypeError):
        if datatype == "BF16":
            return bf16_dtype()
        raise InvalidInput(
            f"unknown datatype {datatype!r}; expected one of {sorted(DATATYPES)}"
        ) from None


def v2_datatype(dtype: np.dtype) -> str:
    """The V2 name for a numpy dtype (strings and object arrays are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    key = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    try:
        return _NUMPY_TO_V2[key]
    except KeyError:
        if dtype.name == "bfloat16":  # ml_dtypes' (only a caller that imported it has one)
            return "BF16"
        raise InvalidInput(f"numpy dtype {dtype} has no V2 datatype") from None


def validate_datatype(datatype: object) -> str:
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidInput(f"unknown datatype {datatype!r}; expected one of {sorted(DATATYPES)}")
    return datatype
