"""Tuning maths: the fit recovers l(b), the choice respects half the objective."""

from __future__ import annotations

import pytest

from cloud.tuning.fit import Candidate, Point, choose, fit_linear


def _point(batch: int, mean_ms: float, p99_ms: float | None = None) -> Point:
    return Point(batch, mean_ms / 1000, (p99_ms or mean_ms * 1.1) / 1000, mean_ms / 1000, 20)


def test_the_fit_recovers_intercept_and_slope() -> None:
    fit = fit_linear([_point(b, 2.0 + 0.75 * b) for b in (1, 2, 4, 8, 16)])
    assert fit.a_s == pytest.approx(0.002)
    assert fit.beta_s == pytest.approx(0.00075)
    assert fit.spread_s == pytest.approx(0.0, abs=1e-12)


def test_a_single_point_is_all_slope_and_noise_never_gives_negative_figures() -> None:
    one = fit_linear([_point(1, 5.0)])
    assert one.a_s == 0.0 and one.beta_s == pytest.approx(0.005)
    noisy = fit_linear([_point(1, 5.0), _point(2, 4.9), _point(4, 4.8)])
    assert noisy.a_s >= 0 and noisy.beta_s > 0


def test_the_choice_is_the_most_throughput_within_half_the_objective() -> None:
    candidates = [
        Candidate("onnxruntime", 1, _point(4, 10.0, 12.0)),  # 400/s
        Candidate("onnxruntime", 2, _point(8, 16.0, 30.0)),  # 500/s, p99 30 ms
        Candidate("openvino", 2, _point(32, 40.0, 60.0)),  # 800/s but p99 60 ms
    ]
    assert choose(candidates, 0.100).point.batch == 8  # 60 ms > 50 ms is out
    assert choose(candidates, 0.130).backend == "openvino"
    assert choose(candidates, 0.010) is None
