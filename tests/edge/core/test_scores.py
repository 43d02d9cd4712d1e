import numpy as np

from edge.core.scores import confidence


def test_an_int8_softmax_that_sums_to_0_99_is_read_as_probabilities():
    assert confidence(np.array([0.922, 0.024, 0.024, 0.024])) > 0.9


def test_logits_go_through_softmax():
    c = confidence(np.array([2.0, 0.0, -1.0]))
    e = np.exp([2.0, 0.0, -1.0])
    assert abs(c - e[0] / e.sum()) < 1e-12


def test_nan_scores_give_no_confidence():
    assert confidence(np.array([np.nan, 0.5])) == 0.0
