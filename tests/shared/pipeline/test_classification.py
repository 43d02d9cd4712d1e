"""Triton's classification format ("value:index") from shared.pipeline.classification.top_k."""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

from shared.pipeline.classification import top_k


def test_batched_float_output_gives_top_k_per_item_largest_first():
    probs = np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32)
    got = top_k(probs, 2, batched=True)
    assert got.shape == (2, 2)
    assert got.tolist() == [
        [b"0.600000:1", b"0.300000:2"],
        [b"0.500000:0", b"0.300000:2"],
    ]


def test_unbatched_output_is_classified_as_one_vector_of_all_its_elements():
    scores = np.array([[3, 9], [7, 1]], np.int32)
    got = top_k(scores, 3, batched=False)
    assert got.shape == (3,) and got.tolist() == [b"9:1", b"7:2", b"3:0"]


def test_batched_output_with_inner_dims_is_flattened_per_item():
    scores = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
    assert top_k(scores, 1, batched=True).tolist() == [[b"3:3"], [b"7:3"]]


def test_ties_keep_the_lower_index_first_and_bf16_prints_as_float():
    x = np.array([[0.5, 0.25, 0.5]], dtype=bfloat16)
    assert top_k(x, 3, batched=True).tolist() == [[b"0.500000:0", b"0.500000:2", b"0.250000:1"]]


def test_integers_are_ranked_and_printed_in_their_own_type():
    big = np.array([[2**53 + 1, 2**53, 1, -(2**63)]], np.int64)
    assert top_k(big, 4, batched=True).tolist() == [
        [b"9007199254740993:0", b"9007199254740992:1", b"1:2", b"-9223372036854775808:3"]
    ]
    top = np.array([[2**64 - 1, 2**64 - 2, 3, 3]], np.uint64)
    assert top_k(top, 4, batched=True).tolist() == [
        [b"18446744073709551615:0", b"18446744073709551614:1", b"3:2", b"3:3"]
    ]


def test_an_empty_output_gives_an_empty_classification_not_a_crash():
    assert top_k(np.zeros((0, 4), np.float32), 2, batched=True).shape == (0, 2)
    assert top_k(np.zeros((2, 0), np.int8), 2, batched=True).shape == (2, 0)
    assert top_k(np.zeros((0,), np.float32), 2, batched=False).shape == (0,)


def test_argmax_of_an_empty_batch_is_empty_and_of_no_classes_a_clear_error():
    import pytest

    from shared.errors import InvalidInput
    from shared.pipeline.post import argmax

    assert argmax(np.zeros((0, 4), np.float32), None, 1).shape == (0, 1)
    with pytest.raises(InvalidInput, match="no class"):
        argmax(np.zeros((2, 0), np.float32), None, 1)
