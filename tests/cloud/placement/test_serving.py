"""The batch chain the packer plans with agrees with a Ferry node simulated event by
event, and the figures it hands the packer behave as the packing rule assumes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench._packing_sim import Result, simulate_node
from cloud.placement.packing import place
from cloud.placement.serving import BATCHES, GRID, assess, chain
from cloud.placement.sizing import Headroom, full_rate, size
from cloud.placement.types import LatencyProfile, ModelDemand, NodeSpec

MS = 1e-3


def _simulated_late(rate, slo_s, top, a, beta, cv, share, seed=3) -> float:
    """One copy alone on a node of speed ``share``: its batches run at that share
    (for 40,000 requests: the late shares compared are a few percent)."""
    horizon = 40_000 / rate
    result = Result()
    node = NodeSpec("n", 1 << 30, frozenset({"onnxruntime"}), speed=share)
    copies = [("m", rate, slo_s, top, a, beta, 0.0)]
    simulate_node(np.random.default_rng(seed), node, copies, cv, horizon, result)
    return 1 - result.within["m"] / result.sent["m"]


@pytest.mark.parametrize(
    ("rate", "slo_ms", "top", "a_ms", "beta_ms", "share", "cv"),
    [
        (75.0, 131.0, 32, 2.2, 1.0, 0.125, 1.0),  # a busy copy on a crowded node
        (28.0, 177.0, 32, 3.7, 2.2, 0.125, 1.0),
        (10.0, 60.0, 32, 1.0, 0.5, 0.05, 1.0),  # mostly idle: a request runs alone
        (500.0, 100.0, 32, 2.0, 0.8, 0.5, 1.0),  # batches of ten, half the node
        (75.0, 131.0, 32, 2.2, 1.0, 0.125, 2.0),  # bursty: requests come in clumps
        (10.0, 60.0, 32, 1.0, 0.5, 0.05, 2.0),
    ],
)
def test_the_chains_late_share_matches_a_simulated_node(
    rate, slo_ms, top, a_ms, beta_ms, share, cv
) -> None:
    late, _, _ = chain(np.array([share]), rate, a_ms * MS, beta_ms * MS, top, slo_ms * MS, cv)
    simulated = _simulated_late(rate, slo_ms * MS, top, a_ms * MS, beta_ms * MS, cv, share)
    assert late[0] == pytest.approx(simulated, rel=0.2, abs=0.005)


def test_a_burst_past_max_batch_rides_the_next_batch_when_the_objective_allows() -> None:
    profile = LatencyProfile("onnxruntime", 2 * MS, 0.8 * MS, 8, 1 << 20)
    patient = size(profile, 600.0, 0.4, 1.0, Headroom())
    assert patient.theta < 1  # fits: the slack absorbs batches that overflow 8
    _, _, spill = chain(np.array([1.0]), 600.0, 2 * MS, 0.8 * MS, 8, 0.4, 1.0)
    assert spill[0] > 0.001  # some requests miss their first batch ...
    assert _simulated_late(600.0, 0.4, 8, 2 * MS, 0.8 * MS, 1.0, 1.0) < 0.01  # ... in time


def test_need_node_time_and_variance_are_what_the_packing_rule_assumes() -> None:
    profile = LatencyProfile("onnxruntime", 1.5 * MS, 0.7 * MS, 32, 1 << 20)
    headroom = Headroom()
    for rate, slo in ((3.0, 0.06), (40.0, 0.1), (300.0, 0.3)):
        slot = size(profile, rate, slo, 1.0, headroom)
        args = (rate, profile.a_s, profile.beta_s, 32, slo, headroom)
        late, batch = assess(GRID, *args)
        assert 0 < slot.theta <= 1
        assert np.all(late[GRID >= slot.theta * 1.0001] <= headroom.late)  # in time above it
        assert assess(np.array([slot.theta / 1.02]), *args)[0][0] > headroom.late  # not below
        long_run, _, _ = chain(np.array([slot.theta]), *args[:-1], 1.0, BATCHES)
        assert long_run[0] < headroom.late  # a window's luck is planned on top
        assert np.all(np.diff(slot.curve) >= -1e-12)  # slower batches: less node time
        assert np.all(slot.curve <= GRID + 1e-12)  # never more than the share it runs at
        work = np.minimum(rate * profile.beta_s, GRID)  # the work, or all the share it gets
        assert np.all(slot.curve >= work * (1 - 1e-9))
        # its least node time: alone at its need, or taking turns (whichever is less)
        assert slot.floor <= slot.time(slot.theta) + 1e-12
        assert np.all(batch >= 1) and np.all(batch <= 32)


def test_a_window_of_sixty_seconds_rarely_sees_more_than_one_percent_late() -> None:
    """The window allowance, checked where it is largest: a copy alone on its node
    at the highest rate it is planned for, bursty traffic (late requests in runs)."""
    profile = LatencyProfile("onnxruntime", 4.35 * MS, 2.1 * MS, 32, 1 << 20)
    headroom = Headroom(cv=2.0)
    top = full_rate(profile, 0.135, 1.0, headroom)
    over = 0
    for seed in range(20):
        result = Result()
        node = NodeSpec("n", 1 << 30, frozenset({"onnxruntime"}))
        copies = [("m", top, 0.135, 32, profile.a_s, profile.beta_s, 0.0)]
        simulate_node(np.random.default_rng(seed), node, copies, 2.0, 60.0, result)
        over += result.within["m"] < 0.99 * result.sent["m"]
    assert over <= 1


def test_a_trickle_needs_the_share_that_runs_one_request_within_its_objective() -> None:
    profile = LatencyProfile("onnxruntime", 4 * MS, 1 * MS, 32, 1 << 20)
    slot = size(profile, 0.01, 0.05, 1.0, Headroom())
    assert slot.theta == pytest.approx(5 * MS / 0.05, rel=0.03)  # l(1)/theta <= L
    assert math.isinf(size(profile, 0.01, 0.004, 1.0, Headroom()).theta)


@pytest.mark.parametrize("quantile", [0.5, 0.99])
def test_a_copy_that_cannot_keep_up_in_full_batches_is_never_planned(quantile: float) -> None:
    # 3 ms batches of one hold 333 req/s at most: at 400 req/s the queue only grows,
    # however many late requests the plan allows (found by hypothesis: at the 0.5
    # quantile one node was planned for it, under the bound of two).
    profile = LatencyProfile("onnxruntime", 0.001, 0.002, 1, 10 << 20)
    headroom = Headroom(quantile=quantile, cv=0.0)
    assert size(profile, 400.0, 0.02, 1.0, headroom).theta == math.inf
    assert full_rate(profile, 0.02, 1.0, headroom) < 1 / 0.003
    late, _ = assess(np.array([0.5, 1.0]), 400.0, 0.001, 0.002, 1, 0.02, headroom)
    assert (late == 1.0).all()
    # a node and a half of work becomes two copies on two nodes
    nodes = [NodeSpec(f"n{i}", 2 << 30, frozenset({"onnxruntime"})) for i in range(2)]
    demand = ModelDemand("m", 400.0, 0.02, (profile,))
    placement = place([demand], nodes, headroom=headroom)
    assert len(placement.nodes_used()) == 2
    assert sum(c.rate for c in placement.copies) == pytest.approx(400.0)
