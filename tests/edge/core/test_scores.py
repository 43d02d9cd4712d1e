import numpy as np
import pytest

from edge.core.scores import confidence


def test_an_int8_softmax_that_sums_to_0_99_is_read_as_probabilities():
    assert confidence(np.array([0.922, 0.024, 0.024, 0.024])) > 0.9


def test_logits_go_through_softmax():
    c = confidence(np.array([2.0, 0.0, -1.0]))
    e = np.exp([2.0, 0.0, -1.0])
    assert abs(c - e[0] / e.sum()) < 1e-12


def test_nan_scores_give_no_confidence():
    assert confidence(np.array([np.nan, 0.5])) == 0.0


def test_a_single_score_is_a_binary_classifiers_and_p_half_is_unsure():
    # One column always read 1.0 (a softmax of one value): the cascade never offloaded.
    assert confidence(np.array([0.5])) == 0.5
    assert confidence(np.array([0.1])) == pytest.approx(0.9)
    assert confidence(np.array([-1.0])) == pytest.approx(1 / (1 + np.exp(-1.0)))  # a logit
    assert confidence(np.array([3.0])) == pytest.approx(1 / (1 + np.exp(-3.0)))
    assert confidence(np.array([128], np.uint8)) == pytest.approx(128 / 255)
    assert confidence(np.array([0], np.int8)) == pytest.approx(128 / 255)  # mid-range: unsure


def test_integer_scores_are_levels_of_a_quantized_softmax_not_logits():
    # A UINT8 softmax x 255 was softmaxed as raw integers: 1.0, an unsure answer kept local.
    assert confidence(np.array([82, 61, 50, 61], np.uint8)) == pytest.approx(82 / 254)
    # int8, zero point at the type's minimum
    row = np.array([82, 61, 50, 61], np.int16) - 128
    assert confidence(row.astype(np.int8)) == pytest.approx(82 / 254)
