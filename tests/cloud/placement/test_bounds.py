"""The lower bound's two lemmas checked by brute force, its figure for Poisson arrivals
checked by simulation, and DESIGN.md's bound never above it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud.placement.bounds import bound_sums, copy_rate
from cloud.placement.sizing import Headroom
from tests.cloud.placement.test_packing import SETTINGS, instances


def greedy_cover(points: list[float], window: float) -> int:
    """Windows of length ``window``, each from the first point not yet covered."""
    count, end = 0, -math.inf
    for p in sorted(points):
        if p > end:
            count, end = count + 1, p + window
    return count


def partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def fewest_batches(points: list[float], window: float, late: int) -> int:
    """Brute force: every partition of the requests into batches and every choice of at
    most ``late`` requests allowed past the objective; a batch is possible when its
    requests in time arrived within ``window`` of each other."""
    best = len(points)
    indices = list(range(len(points)))
    for part in partitions(indices):
        if len(part) >= best:
            continue
        spans = [
            sorted(points[i] for i in block) for block in part
        ]  # a block may leave its earliest and latest requests late
        needed = 0
        for block in spans:
            # fewest requests to drop so the rest fit a window
            keep = max(sum(1 for p in block if lo <= p <= lo + window) for lo in block)
            needed += len(block) - keep
        if needed <= late:
            best = len(part)
    return best


@settings(max_examples=80, **SETTINGS)
@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=7),
    st.floats(0.1, 5),
    st.integers(0, 2),
)
def test_no_batching_beats_the_greedy_cover_less_the_late_requests(points, window, late):
    assert fewest_batches(points, window, late) >= greedy_cover(points, window) - late


@pytest.mark.parametrize(("rate", "window"), [(5.0, 0.1), (50.0, 0.1), (200.0, 0.05)])
def test_the_greedy_cover_of_poisson_arrivals_renews_every_window_and_one_gap(rate, window):
    rng = np.random.default_rng(11)
    horizon = 20_000 / rate
    points = np.cumsum(rng.exponential(1 / rate, int(rate * horizon * 1.2)))
    points = points[points < horizon].tolist()
    assert greedy_cover(points, window) / horizon == pytest.approx(
        rate / (rate * window + 1), rel=0.03
    )


@settings(max_examples=80, **SETTINGS)
@given(instances())
def test_the_bound_is_never_below_designs(instance) -> None:
    models, nodes, headroom = instance
    speed = max(n.speed for n in nodes)
    design = 0.0
    for m in models:
        usable = [
            p
            for p in m.profiles
            if any(p.backend in n.backends and p.memory_bytes <= n.memory_bytes for n in nodes)
            and p.latency(1, speed) <= m.slo_s
        ]
        if not usable or m.rate <= 0:
            continue
        hosts = sum(
            1
            for n in nodes
            if any(p.backend in n.backends and p.memory_bytes <= n.memory_bytes for p in usable)
        )
        rate = min(m.rate, min(hosts, m.max_copies or hosts) * copy_rate(usable, m.slo_s, speed))
        design += min(p.beta_s / speed * rate * m.slo_s / (m.slo_s - p.a_s / speed) for p in usable)
    compute, _ = bound_sums(models, nodes, headroom)
    assert compute >= design * (1 - 1e-9)


def test_bursty_arrivals_lower_the_bound_a_clairvoyant_scheduler_could_reach() -> None:
    from tests.cloud.placement.test_packing import _model, _nodes

    models = [_model(f"m{i}", 30.0) for i in range(10)]
    poisson, _ = bound_sums(models, _nodes(4), Headroom())
    bursty, _ = bound_sums(models, _nodes(4), Headroom(cv=2.0))
    assert bursty <= poisson  # clumps batch better (Lorden's bound on the wait for one)
