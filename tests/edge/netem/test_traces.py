from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.netem.traces import (
    Trace,
    commute,
    from_phases,
    load_trace,
    markov_fading,
    read_mahimahi,
    read_tsmbps,
    steady,
    trace_from_spec,
    write_mahimahi,
)
from shared.errors import ConfigError
from tests.support import cellular_trace_dir


def real_files() -> list[Path]:
    """The real cellular traces, or generated ones of the same format (never skipped)."""
    folder = cellular_trace_dir()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".up", ".down"))
    assert files, f"no .up/.down trace files in {folder}"
    return files


@functools.cache
def _cached(name: str) -> Trace:
    if name == "verizon-up":
        return read_mahimahi(real_files()[-1])
    if name == "commute":
        return commute(40, seed=3)
    if name == "markov":
        return markov_fading(30, seed=5, step_s=0.5)
    if name == "bursty":  # repeats in one ms, a gap, and a stamp at the period
        return Trace("bursty", np.array([0, 3, 3, 3, 9, 250, 400, 400]), 400)
    raise KeyError(name)


# -- readers --------------------------------------------------------------------------------


def test_reader_parses_every_real_trace_with_plausible_rate_and_period() -> None:
    for path in real_files():
        stamps = [int(s) for s in path.read_text().split()]
        trace = load_trace(path)
        assert trace.name == path.name
        assert trace.opportunities_ms.size == len(stamps)
        assert trace.period_ms == stamps[-1]
        assert 100_000 <= trace.period_ms <= 2_000_000, path  # 140 s to ~17 min recordings
        assert 0.3 < trace.mean_mbps() < 50, (path, trace.mean_mbps())
        whole = trace.bytes_between(0, trace.period_ms / 1000)
        assert whole == len(stamps) * Trace.PACKET_BYTES


def test_real_uplink_trace_varies_over_time() -> None:
    trace = read_mahimahi(real_files()[-1])  # Verizon-LTE-short.up
    _, mbps = trace.series(2.0)
    assert mbps.max() > 3 * max(mbps.min(), 0.1)
    assert math.isclose(np.mean(mbps), trace.mean_mbps(), rel_tol=0.02)


def test_tsmbps_reader_holds_each_rate_until_the_next_line(tmp_path: Path) -> None:
    path = tmp_path / "link.txt"
    path.write_text("# t_seconds mbps\n0 4\n\n2 12   # faster\n3 0\n")
    for trace in (read_tsmbps(path), load_trace(path)):
        assert trace.period_ms == 4000  # the last rate lasts one step (1 s)
        assert trace.capacity_mbps(0, 2) == pytest.approx(4, abs=0.01)
        assert trace.capacity_mbps(2, 1) == pytest.approx(12, abs=0.02)
        assert trace.bytes_between(3.001, 4) == 0  # a packet is stamped at the end of its ms


def test_tsmbps_times_are_relative_to_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_text("100.0 6\n100.5 3\n")
    trace = read_tsmbps(path)
    assert trace.period_ms == 1000
    assert trace.capacity_mbps(0, 0.5) == pytest.approx(6, rel=1e-2)
    assert trace.capacity_mbps(0.5, 0.5) == pytest.approx(3, rel=1e-2)


def test_write_then_read_mahimahi_round_trips(tmp_path: Path) -> None:
    for trace in (steady(12, 5), _cached("bursty"), read_mahimahi(real_files()[-1])):
        path = tmp_path / f"{trace.name}.trace"
        write_mahimahi(trace, path)
        back = load_trace(path)
        np.testing.assert_array_equal(back.opportunities_ms, trace.opportunities_ms)
        assert back.period_ms == trace.period_ms


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("10\n20\nabc\n30\n", 3, "integer"),
        ("10\n20\n30 40\n", 3, "integer"),
        ("10\n20\n15\n", 3, "back in time"),
        ("5\n-1\n", 2, "negative"),
        ("1\n2.5\n", 2, "integer"),
    ],
)
def test_garbage_mahimahi_line_is_a_config_error_naming_file_and_line(
    tmp_path: Path, text: str, line: int, what: str
) -> None:
    path = tmp_path / "bad.up"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"bad\.up:{line}: .*{what}"):
        read_mahimahi(path)


@pytest.mark.parametrize(
    ("text", "line"),
    [("0 4\n1 fast\n", 2), ("0 4\n1 2 3\n", 2), ("0 4\n0 5\n", 2), ("# x\n0 -3\n", 2)],
)
def test_garbage_tsmbps_line_is_a_config_error_naming_the_line(
    tmp_path: Path, text: str, line: int
) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"bad\.txt:{line}:"):
        read_tsmbps(path)


def test_empty_or_missing_trace_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(ConfigError, match="empty"):
        load_trace(tmp_path / "empty")
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "missing.up")


def test_trace_rejects_unsorted_or_out_of_period_stamps() -> None:
    with pytest.raises(ConfigError, match="non-decreasing"):
        Trace("x", np.array([5, 3]), 10)
    with pytest.raises(ConfigError, match=r"\[0, 10\]"):
        Trace("x", np.array([5, 11]), 10)


# -- generators ------------------------------------------------------------------------------


def test_steady_trace_has_the_exact_rate_in_every_window() -> None:
    trace = steady(8, 10)
    assert trace.period_ms == 10_000
    assert trace.mean_mbps() == pytest.approx(8, rel=1e-3)
    _, mbps = trace.series(0.5)
    assert np.all(np.abs(mbps - 8) <= 0.05)  # +-2 packets of quantisation


def test_a_steady_rate_past_what_a_trace_may_hold_is_refused_before_allocating() -> None:
    with pytest.raises(ConfigError, match="1e\\+12 Mbps is past the fastest"):
        steady(1e12, 60)


@pytest.mark.parametrize("body", ["0 1e12\n", "0 1e12\n1 1\n", "0 0\n1e9 0\n"])
def test_a_rate_file_past_what_a_trace_may_hold_is_refused_before_allocating(
    tmp_path: Path, body: str
) -> None:
    path = tmp_path / "huge.tsv"
    path.write_text(body)
    with pytest.raises(ConfigError, match="past what a generated trace may hold"):
        read_tsmbps(path)


def test_from_phases_follows_each_phase_and_zero_is_an_outage() -> None:
    trace = from_phases([(3, 4), (2, 0), (3, 12)])
    assert trace.period_ms == 8000
    assert trace.capacity_mbps(0, 3) == pytest.approx(4, abs=0.01)
    assert trace.bytes_between(3.001, 5) == 0
    assert trace.capacity_mbps(5, 3) == pytest.approx(12, abs=0.01)


def test_generators_are_deterministic_per_seed_and_differ_across_seeds() -> None:
    builders = [
        lambda s: markov_fading(60, seed=s),
        lambda s: commute(60, seed=s),
        lambda s: from_phases([(2, 5), (2, 1)], seed=s),
    ]
    for build in builders:
        a, b, c = build(1), build(1), build(2)
        np.testing.assert_array_equal(a.opportunities_ms, b.opportunities_ms)
        assert a.period_ms == b.period_ms
        assert not np.array_equal(a.opportunities_ms, c.opportunities_ms)


def test_markov_fading_switches_between_two_rates_near_its_stationary_mix() -> None:
    trace = markov_fading(
        2000, seed=7, good_mbps=12, bad_mbps=0.5, p_good_to_bad=0.1, p_bad_to_good=0.3
    )
    _, mbps = trace.series(1.0)
    good = np.isclose(mbps, 12, atol=0.05)
    bad = np.isclose(mbps, 0.5, atol=0.05)
    assert np.all(good | bad)
    assert 0.19 < bad.mean() < 0.31  # stationary share of the bad state: 0.1 / 0.4


def test_markov_fading_can_make_its_bad_state_a_full_outage() -> None:
    trace = markov_fading(600, seed=11, good_mbps=12, bad_mbps=0.0)
    t, mbps = trace.series(1.0)
    off = np.flatnonzero(mbps < 0.1)  # (a packet stamped at a step's edge may spill over)
    assert 0.15 < off.size / mbps.size < 0.35  # stationary share of the bad state: 0.25
    assert np.all(np.isclose(mbps[mbps >= 0.1], 12, atol=0.05))
    start = t[off[0]]
    assert trace.bytes_between(start + 0.01, start + 0.99) == 0
    assert trace.finish_time(start + 0.01, 1500) >= start + 1.0  # waits for the next good step
    spec = trace_from_spec("markov-off:11")
    assert spec.series(1.0)[1].min() == 0 and spec.period_ms == 300_000


@pytest.mark.parametrize("kw", [{"good_mbps": 0}, {"bad_mbps": -1}, {"good_mbps": math.inf}])
def test_markov_fading_rejects_rates_that_make_no_link(kw: dict) -> None:
    with pytest.raises(ConfigError, match="good_mbps > 0 and bad_mbps >= 0"):
        markov_fading(10, seed=1, **kw)


def test_commute_has_an_outage_and_recovers() -> None:
    for seed in range(5):
        trace = commute(120, seed=seed)
        assert trace.period_ms == 120_000
        t, mbps = trace.series(1.0)
        dead = np.flatnonzero(mbps == 0)
        assert dead.size >= 5, seed  # at least a 5 s stretch with no capacity at all
        assert np.all(np.diff(dead) == 1), seed  # one contiguous tunnel
        assert mbps[: dead[0]].max() > 10  # good WiFi before
        assert mbps[dead[-1] + 1 :].mean() > 3  # LTE again after
        # a transfer started in the tunnel waits for it to end
        assert trace.finish_time(t[dead[0]] + 0.5, 1500) > t[dead[-1]] + 1


# -- finish_time, bytes_between and wrapping ----------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["verizon-up", "commute", "markov", "bursty"]),
    start=st.floats(min_value=0, max_value=400, allow_nan=False),
    nbytes=st.integers(min_value=1, max_value=5_000_000),
)
def test_finish_time_and_bytes_between_agree(name: str, start: float, nbytes: int) -> None:
    trace = _cached(name)
    end = trace.finish_time(start, nbytes)
    assert end >= start
    assert trace.bytes_between(start, end) < nbytes <= trace.bytes_between(start, end + 0.001)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(["verizon-up", "commute", "markov", "bursty"]),
    t0_us=st.integers(min_value=0, max_value=300_000_000),
    span_us=st.integers(min_value=0, max_value=300_000_000),
    nbytes=st.integers(min_value=1, max_value=2_000_000),
)
def test_trace_wraps_around_its_period(name: str, t0_us: int, span_us: int, nbytes: int) -> None:
    # a microsecond grid: times closer than float noise to a stamp are not meaningful
    t0, span = t0_us / 1e6, span_us / 1e6
    trace = _cached(name)
    period = trace.period_ms / 1000
    whole = trace.opportunities_ms.size * Trace.PACKET_BYTES
    assert trace.bytes_between(t0, t0 + period) == whole
    assert trace.bytes_between(t0 + period, t0 + period + span) == trace.bytes_between(
        t0, t0 + span
    )
    assert trace.finish_time(t0 + period, nbytes) == pytest.approx(
        trace.finish_time(t0, nbytes) + period
    )
    assert (
        trace.bytes_between(t0, t0 + span + 2 * period)
        == trace.bytes_between(t0, t0 + span) + 2 * whole
    )


def test_bursty_trace_counts_repeats_and_period_stamp() -> None:
    trace = _cached("bursty")
    assert trace.bytes_between(0.003, 0.004) == 3 * 1500  # three packets in ms 3
    assert trace.finish_time(0.004, 1500) == pytest.approx(0.009)
    assert trace.finish_time(0.251, 3000) == pytest.approx(0.4)  # the two stamped at the period
    assert trace.finish_time(0.251, 4500) == pytest.approx(0.4)  # ... then phase 0 of the next lap
    assert trace.finish_time(0.251, 6000) == pytest.approx(0.403)


def test_trace_without_opportunities_never_finishes() -> None:
    trace = Trace("dead", np.array([], dtype=np.int64), 1000)
    assert trace.finish_time(3.0, 1) == math.inf
    assert trace.finish_time(3.0, 0) == 3.0
    assert trace.bytes_between(0, 100) == 0
    assert trace.mean_mbps() == 0


def test_series_covers_requested_duration_and_matches_capacity() -> None:
    trace = from_phases([(1, 2), (1, 6)])
    t, mbps = trace.series(0.5, duration_s=4)
    np.testing.assert_allclose(t, [0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5])
    np.testing.assert_allclose(mbps, [2, 2, 6, 6, 2, 2, 6, 6], rtol=0.02)
    assert trace.capacity_mbps(1.5, 1.0) == pytest.approx(4, rel=0.02)


def test_trace_spec_names_a_file_or_a_synthetic_trace(tmp_path: Path) -> None:
    assert trace_from_spec("steady:5").mean_mbps() == pytest.approx(5, rel=1e-3)
    np.testing.assert_array_equal(
        trace_from_spec("commute:2").opportunities_ms, commute(120, seed=2).opportunities_ms
    )
    path = tmp_path / "t.txt"
    path.write_text("0 3\n")
    assert trace_from_spec(str(path)).capacity_mbps(0, 1) == pytest.approx(3, abs=0.02)
    with pytest.raises(ConfigError, match="no such file"):
        trace_from_spec("/nonexistent/x.up")
    with pytest.raises(ConfigError, match="bad synthetic"):
        trace_from_spec("steady:fast")


def test_a_trace_whose_every_timestamp_is_zero_is_refused_as_mahimahi_refuses_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "zeros.up"
    path.write_text("0\n" * 100)  # read as 1,200 Mbps over 1 ms before
    with pytest.raises(ConfigError, match="nonzero time"):
        read_mahimahi(path)
