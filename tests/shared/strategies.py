"""Hypothesis strategies for the codecs: valid tensors, and the adversarial
pieces (shapes, values, nesting) that structure-aware fuzzing plants in
otherwise well-formed JSON and MessagePack documents."""

from __future__ import annotations

import math
import struct

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.datatypes import DATATYPES, numpy_dtype
from shared.tensors import Tensor

FIXED = sorted(DATATYPES - {"BYTES", "BF16"})

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12
)


@st.composite
def tensors(
    draw: st.DrawFn,
    datatypes: list[str] | None = None,
    finite: bool = False,
    text_bytes: bool | None = None,
) -> Tensor:
    """A tensor of any datatype.

    ``finite`` keeps floats finite; ``text_bytes`` (default: ``finite``) keeps
    BYTES elements UTF-8, which JSON needs.
    """
    text_bytes = finite if text_bytes is None else text_bytes
    datatype = draw(st.sampled_from(datatypes or sorted(DATATYPES)))
    shape = draw(shapes)
    name = draw(names)
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        items = draw(st.lists(st.binary(max_size=16), min_size=count, max_size=count))
        arr = np.empty(count, dtype=object)
        arr[:] = items
        if text_bytes:  # JSON carries BYTES as UTF-8 strings
            arr[:] = [bytes(b).hex().encode() for b in items]
        return Tensor(name, "BYTES", arr.reshape(shape))
    if datatype == "BF16":
        base = draw(
            hnp.arrays(np.float32, shape, elements=st.floats(-1e6, 1e6, width=32))
            if finite
            else hnp.arrays(np.float32, shape)
        )
        return Tensor(name, "BF16", base.astype(numpy_dtype("BF16")))
    dtype = numpy_dtype(datatype)
    elements = None
    if finite and dtype.kind == "f":
        elements = st.floats(allow_nan=False, allow_infinity=False, width=dtype.itemsize * 8)
    return Tensor(name, datatype, draw(hnp.arrays(dtype, shape, elements=elements)))


def same(a: Tensor, b: Tensor, *, nan_equal: bool = False) -> bool:
    """Bit-exact equality of two tensors; ``nan_equal`` lets any NaN match any NaN.

    JSON has one spelling of NaN, so sign and payload bits of a NaN do not
    survive it; every other value (-0.0 and infinities included) must.
    """
    if a.name != b.name or a.datatype != b.datatype or a.shape != b.shape:
        return False
    if a.datatype == "BYTES":
        return [bytes(x) for x in a.data.reshape(-1)] == [bytes(x) for x in b.data.reshape(-1)]
    x = np.ascontiguousarray(a.data)
    y = np.ascontiguousarray(b.data)
    if nan_equal and a.datatype in ("FP16", "FP32", "FP64", "BF16"):
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        nans = np.isnan(xf)
        if not np.array_equal(nans, np.isnan(yf)):
            return False
        return x[~nans].tobytes() == y[~nans].tobytes()
    return x.tobytes() == y.tobytes()


# --- plain encodings built without the code under test ------------------------------


def json_leaves(tensor: Tensor) -> list:
    """A tensor's elements as JSON values, the way a V2 client writes them."""
    flat = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        return [bytes(v).decode() for v in flat]
    if tensor.datatype in ("FP16", "FP32", "FP64", "BF16"):
        out: list = []
        for v in flat.astype(np.float64).tolist():
            if math.isnan(v):
                out.append("NaN")
            elif math.isinf(v):
                out.append("Infinity" if v > 0 else "-Infinity")
            else:
                out.append(v)
        return out
    return flat.tolist()


def nest(flat: list, shape: tuple[int, ...]) -> list:
    """``flat`` as nested lists of ``shape`` (a scalar stays a one-element list)."""
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0] if shape[0] else 0
    if step == 0:
        return [nest([], shape[1:]) for _ in range(shape[0])]
    return [nest(flat[i : i + step], shape[1:]) for i in range(0, len(flat), step)]


def raw_bytes(tensor: Tensor) -> bytes:
    """A tensor's wire bytes: little-endian elements, BYTES with u32 length prefixes."""
    if tensor.datatype == "BYTES":
        return b"".join(
            struct.pack("<I", len(bytes(v))) + bytes(v) for v in tensor.data.reshape(-1)
        )
    return np.ascontiguousarray(tensor.data).tobytes()


# --- adversarial pieces ---------------------------------------------------------------

#: dims at and beyond every boundary a decoder has (element limit 2**24, int64, uint64)
HUGE_DIMS = [2**24, 2**24 + 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
#: placeholder that documents carry where a deeply nested value is spliced in
DEEP = "@@DEEP@@"


def adversarial_shapes(wire: str = "json") -> st.SearchStrategy[object]:
    """Shapes that are wrong in every way a decoder must survive.

    Huge dims beside a 0 (zero elements, yet numpy cannot describe them),
    negative and non-integer dims, too many dims, and non-list shapes.
    ``wire="msgpack"`` keeps integers within what MessagePack can carry.
    """
    huge = HUGE_DIMS + ([10**30, 2**70] if wire == "json" else [])
    low = -(2**63)
    dim = st.one_of(
        st.integers(0, 4),
        st.just(0),
        st.sampled_from(huge),
        st.integers(low, -1),
        st.floats(allow_nan=wire != "json", allow_infinity=wire != "json"),
        st.booleans(),
        st.none(),
        st.text(max_size=3),
        st.lists(st.integers(0, 3), max_size=2),
    )
    zero_beside_huge = st.lists(st.sampled_from([0, *huge]), min_size=2, max_size=6).map(
        lambda dims: [0, *dims]
    )
    return st.one_of(
        zero_beside_huge,
        st.lists(dim, max_size=12),
        st.lists(st.integers(0, 2), min_size=9, max_size=20),  # over the dims limit
        values(wire, max_leaves=3),
    )


def values(
    wire: str = "json", max_leaves: int = 8, wide_ints: bool = True
) -> st.SearchStrategy[object]:
    """Any value the wire format can carry (MessagePack adds bytes and non-finite floats);
    ``wide_ints=False`` keeps JSON integers to 64 bits, as parameters must be."""
    if wire == "json" and wide_ints:
        ints = st.one_of(st.integers(-(2**64), 2**64), st.sampled_from([10**30, -(10**30)]))
        floats = st.floats(allow_nan=False, allow_infinity=False)
        scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8))
    elif wire == "json":
        ints = st.integers(-(2**63), 2**64 - 1)
        floats = st.floats(allow_nan=False, allow_infinity=False)
        scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8))
    else:
        ints = st.integers(-(2**63), 2**64 - 1)
        scalars = st.one_of(
            st.none(), st.booleans(), ints, st.floats(), st.text(max_size=8), st.binary(max_size=8)
        )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def parameters(wire: str = "json") -> st.SearchStrategy[dict]:
    """Well-formed but random parameters (keys too short to collide with V2's own)."""
    return st.dictionaries(
        st.text(max_size=5), values(wire, max_leaves=4, wide_ints=False), max_size=3
    )


deep_depths = st.integers(min_value=1_000, max_value=20_000)


def splice_deep_json(body: bytes, depth: int, as_map: bool) -> bytes:
    """Replace the DEEP placeholder with ``depth`` nested JSON arrays or objects."""
    nested = ('{"k":' * depth + "0" + "}" * depth) if as_map else ("[" * depth + "]" * depth)
    return body.replace(f'"{DEEP}"'.encode(), nested.encode())


def splice_deep_msgpack(payload: bytes, depth: int, as_map: bool) -> bytes:
    """Replace the DEEP placeholder with ``depth`` nested MessagePack arrays or maps."""
    nested = (b"\x81\xa1k" if as_map else b"\x91") * depth + b"\xc0"
    return payload.replace(b"\xa8" + DEEP.encode(), nested)
