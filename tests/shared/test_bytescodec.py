"""The BYTES wire codec: runs cut out in vectorised steps parse like one element at a time."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.bytescodec import decode_bytes, encode_bytes
from shared.errors import InvalidInput


def _reference(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def _array(items: list[bytes]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


# runs of repeated elements mixed with singles: what the vectorised path cuts out
_runs = st.lists(
    st.tuples(st.binary(max_size=6), st.integers(1, 60)), max_size=12
).map(lambda pairs: [item for item, n in pairs for _ in range(n)])


@settings(max_examples=200, deadline=None)
@given(_runs)
def test_encode_and_decode_agree_with_the_element_by_element_format(items):
    wire = encode_bytes(_array(items))
    assert wire == _reference(items)
    decoded = decode_bytes("x", (len(items),), len(items), wire)
    assert decoded.tolist() == items


@settings(max_examples=200, deadline=None)
@given(_runs, st.integers(0, 10_000), st.integers(1, 5))
def test_a_cut_or_padded_body_is_refused_never_misread(items, cut, pad):
    wire = _reference(items)
    if wire:
        with pytest.raises(InvalidInput):
            decode_bytes("x", (len(items),), len(items), wire[: cut % len(wire)])
    with pytest.raises(InvalidInput):
        decode_bytes("x", (len(items),), len(items), wire + b"\0" * pad)


def test_a_long_run_of_empty_elements_decodes_in_one_pass():
    n = 300_000
    out = decode_bytes("x", (n,), n, b"\0\0\0\0" * n)
    assert out.shape == (n,) and out[0] == b"" and out[-1] == b""


def test_a_run_whose_last_element_runs_past_the_body_is_refused():
    items = [b"ab"] * 100
    wire = _reference(items)[:-1]
    with pytest.raises(InvalidInput, match="element 99"):
        decode_bytes("x", (100,), 100, wire)


def test_str_elements_are_sent_as_utf8():
    assert encode_bytes(_array(["é", "ab"])) == _reference(["é".encode(), b"ab"])


def test_a_few_elements_from_a_view_decode_alike_and_refuse_truncation():
    import numpy as np
    import pytest

    from shared.bytescodec import decode_bytes, encode_bytes
    from shared.errors import InvalidInput

    items = np.empty(3, dtype=object)
    items[:] = [b"x" * 70_000, b"", b"yz"]
    wire = encode_bytes(items)
    got = decode_bytes("img", (3,), 3, memoryview(wire))
    assert got.tolist() == items.tolist()
    with pytest.raises(InvalidInput):
        decode_bytes("img", (3,), 3, memoryview(wire[:-1]))
    with pytest.raises(InvalidInput):
        decode_bytes("img", (2,), 2, memoryview(wire))
