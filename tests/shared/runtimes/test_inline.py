"""InlineGate: when a model has earned running on the caller's thread."""

from __future__ import annotations

import numpy as np

from shared.runtimes.inline import (
    HOP_CAP,
    HOP_WINDOW,
    SLACK,
    WARMUP_RUNS,
    WINDOW,
    InlineGate,
    input_bytes,
)


def warmed(budget_us: float = 100.0, run_ns: int = 20_000, nbytes: int = 1024) -> InlineGate:
    gate = InlineGate(budget_us)
    for _ in range(WARMUP_RUNS):
        gate.record(run_ns, nbytes)
    return gate


def test_the_gate_stays_shut_until_the_model_has_run_enough_times():
    gate = InlineGate(100.0)
    for _ in range(WARMUP_RUNS - 1):
        gate.record(20_000, 1024)
        assert not gate.allows(1024)
    gate.record(20_000, 1024)
    assert gate.allows(1024)


def test_a_zero_budget_never_opens():
    gate = warmed(budget_us=0.0)
    assert not gate.allows(0)


def test_one_run_far_over_budget_shuts_the_gate_for_a_whole_window():
    gate = warmed()
    gate.record(1_500_000, 1024)  # 1.5 ms: 15 times the 100 us budget
    for _ in range(WINDOW - 1):
        assert not gate.allows(1024)
        gate.record(20_000, 1024)
    gate.record(20_000, 1024)  # the slow run leaves the window
    assert gate.allows(1024)


def test_a_few_preempted_runs_leave_the_gate_open_but_more_shut_it():
    gate = warmed()
    for _ in range(SLACK):
        gate.record(400_000, 1024)  # 0.4 ms: a run the scheduler interrupted
        assert gate.allows(1024)
    gate.record(400_000, 1024)
    assert not gate.allows(1024)


def test_an_input_larger_than_any_recent_one_goes_to_a_worker():
    gate = warmed(nbytes=1024)
    assert gate.allows(1024)
    assert gate.allows(10)
    assert not gate.allows(1025)


def test_the_largest_input_is_forgotten_when_it_leaves_the_window():
    gate = warmed(nbytes=64)
    gate.record(20_000, 4096)
    assert gate.allows(4096)
    for _ in range(WINDOW):
        gate.record(20_000, 64)
    assert not gate.allows(4096)
    assert gate.allows(64)


def test_a_hop_dearer_than_the_budget_raises_it_to_what_the_hop_costs():
    # Runs of 150 us against a 100 us budget: shut, until the hand-offs they go through
    # are seen to cost 200 us each; running in place then costs the loop less than the hop.
    gate = warmed(run_ns=150_000)
    assert not gate.allows(1024)
    for _ in range(HOP_WINDOW):
        gate.record_hop(200_000)
    assert gate.budget_us == 200.0
    assert gate.allows(1024)
    for _ in range(HOP_WINDOW):  # the host got quick again: back to the configured budget
        gate.record_hop(30_000)
    assert gate.budget_us == 100.0
    assert not gate.allows(1024)


def test_the_measured_hop_raises_the_budget_only_so_far_and_never_opens_a_zero_one():
    gate = warmed(run_ns=5_000_000)
    for _ in range(HOP_WINDOW):
        gate.record_hop(50_000_000)  # a preempted host: 50 ms hand-offs
    assert gate.budget_us == 100.0 * HOP_CAP
    assert not gate.allows(1024)
    shut = warmed(budget_us=0.0)
    for _ in range(HOP_WINDOW):
        shut.record_hop(200_000)
    assert not shut.allows(1024) and shut.budget_us == 0.0


def test_input_bytes_counts_every_array():
    inputs = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(5, np.int64)}
    assert input_bytes(inputs) == 24 + 40


def test_input_bytes_counts_what_a_bytes_array_holds_not_its_slots():
    """A 2 KB thumbnail and an 8 MB image had both counted 8 bytes, so a gate earned on
    thumbnails let the big image be decoded on the loop."""
    small = np.array([b"x" * 2048], dtype=object)
    big = np.array([b"x" * (8 << 20)], dtype=object)
    assert input_bytes({"img": small}) == 8 + 2048
    assert input_bytes({"img": big}) == 8 + (8 << 20)
    gate = warmed()
    for _ in range(WINDOW):
        gate.record(1_000, input_bytes({"img": small}))
    assert gate.allows(input_bytes({"img": small}))
    assert not gate.allows(input_bytes({"img": big}))
