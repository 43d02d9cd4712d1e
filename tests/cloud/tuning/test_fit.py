"""Tuning maths: the fit recovers l(b), the choice respects half the objective."""

from __future__ import annotations

import pytest

from cloud.tuning.fit import Candidate, Point, choose, fit_linear, fit_within, queue_delay_us


def _point(batch: int, mean_ms: float, p99_ms: float | None = None) -> Point:
    return Point(batch, mean_ms / 1000, (p99_ms or mean_ms * 1.1) / 1000, mean_ms / 1000, 20)


def test_the_fit_recovers_intercept_and_slope() -> None:
    fit = fit_linear([_point(b, 2.0 + 0.75 * b) for b in (1, 2, 4, 8, 16)])
    assert fit.a_s == pytest.approx(0.002)
    assert fit.beta_s == pytest.approx(0.00075)
    assert fit.spread_s == pytest.approx(0.0, abs=1e-12)


def test_the_spread_is_the_residual_standard_deviation() -> None:
    noise = [0.1, -0.1, 0.1, -0.1]  # ms, around l(b) = 1 + 2b
    points = [_point(b, 1.0 + 2.0 * b + e) for b, e in zip((1, 2, 4, 8), noise, strict=True)]
    fit = fit_linear(points)
    assert fit.a_s == pytest.approx(0.001, abs=2e-4)
    assert fit.beta_s == pytest.approx(0.002, abs=5e-5)
    assert 0.00005 < fit.spread_s < 0.0002


def test_a_single_point_is_all_slope_and_noise_never_gives_negative_figures() -> None:
    one = fit_linear([_point(1, 5.0)])
    assert one.a_s == 0.0 and one.beta_s == pytest.approx(0.005)
    noisy = fit_linear([_point(1, 5.0), _point(2, 4.9), _point(4, 4.8)])
    assert noisy.a_s >= 0 and noisy.beta_s > 0
    # a negative intercept is refit through the origin, not just cut off
    through = fit_linear([_point(1, 0.5), _point(2, 1.9), _point(4, 4.1)])
    assert through.a_s == 0.0
    assert through.beta_s == pytest.approx((0.5 + 3.8 + 16.4) / 21 / 1000)
    with pytest.raises(ValueError):
        fit_linear([])


def test_the_fit_leaves_out_batches_slower_than_the_objective() -> None:
    # linear up to batch 8, then the curve bends upwards (caches)
    points = [_point(b, 2.0 + 1.0 * b) for b in (1, 2, 4, 8)] + [_point(16, 60.0)]
    fit, used = fit_within(points, 0.050)  # batch 16's p99 is 66 ms
    assert used == [1, 2, 4, 8]
    assert fit.a_s == pytest.approx(0.002) and fit.beta_s == pytest.approx(0.001)
    # nothing within the objective: the two smallest batches still give a line
    fit, used = fit_within(list(reversed(points)), 0.001)
    assert used == [1, 2] and fit.beta_s == pytest.approx(0.001)


def test_the_choice_is_the_most_throughput_within_half_the_objective() -> None:
    candidates = [
        Candidate("onnxruntime", 1, _point(4, 10.0, 12.0)),  # 400/s
        Candidate("onnxruntime", 2, _point(8, 16.0, 30.0)),  # 500/s, p99 30 ms
        Candidate("openvino", 2, _point(32, 40.0, 60.0)),  # 800/s but p99 60 ms
    ]
    assert choose(candidates, 0.100).point.batch == 8  # 60 ms > 50 ms is out
    assert choose(candidates, 0.130).backend == "openvino"
    assert choose(candidates, 0.010) is None
    assert choose([], 0.100) is None


def test_a_configuration_exactly_at_half_the_objective_qualifies_and_above_does_not() -> None:
    at = Candidate("onnxruntime", 1, _point(8, 40.0, 50.0))
    above = Candidate("onnxruntime", 1, _point(16, 60.0, 50.001))
    assert choose([at, above], 0.100) is at


def test_a_near_tie_goes_to_fewer_threads_then_the_smaller_batch() -> None:
    two_threads = Candidate("onnxruntime", 2, _point(8, 8.0))  # 1000/s
    one_thread = Candidate("onnxruntime", 1, _point(8, 8.1))  # 988/s: within 2 %
    bigger = Candidate("onnxruntime", 1, _point(16, 16.2))  # 988/s, larger batch
    assert choose([two_threads, one_thread, bigger], 0.100) is one_thread
    clear_win = Candidate("onnxruntime", 2, _point(8, 6.0))  # 1333/s
    assert choose([clear_win, one_thread], 0.100) is clear_win


def test_the_queue_delay_stays_inside_the_queueing_half() -> None:
    # L = 100 ms, batch p99 = 20 ms: at most 30 ms may go to waiting for the batch
    assert queue_delay_us(0.100, 0.020, None) == 20_000  # one batch time
    assert queue_delay_us(0.100, 0.020, 2_000) == 2_000  # the user's smaller value stays
    assert queue_delay_us(0.100, 0.020, 90_000) == 30_000  # a larger one is cut
    assert queue_delay_us(0.100, 0.050, None) == 0
