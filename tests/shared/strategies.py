"""Hypothesis strategies for tensors of every V2 datatype."""

from __future__ import annotations

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
def tensors(draw: st.DrawFn, datatypes: list[str] | None = None, finite: bool = False) -> Tensor:
    """A tensor of any datatype; ``finite`` keeps floats JSON-representable."""
    datatype = draw(st.sampled_from(datatypes or sorted(DATATYPES)))
    shape = draw(shapes)
    name = draw(names)
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        items = draw(st.lists(st.binary(max_size=16), min_size=count, max_size=count))
        arr = np.empty(count, dtype=object)
        arr[:] = items
        if finite:  # JSON carries BYTES as UTF-8 strings
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


def same(a: Tensor, b: Tensor) -> bool:
    """Bit-exact equality (NaNs included) of two tensors."""
    if a.name != b.name or a.datatype != b.datatype or a.shape != b.shape:
        return False
    if a.datatype == "BYTES":
        return [bytes(x) for x in a.data.reshape(-1)] == [bytes(x) for x in b.data.reshape(-1)]
    return np.ascontiguousarray(a.data).tobytes() == np.ascontiguousarray(b.data).tobytes()
