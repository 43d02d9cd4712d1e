"""The replay's ground truth: transfer arithmetic, the radio state, failed attempts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from devices.profiles import LinkProfile, load_device
from edge.core.energy import RadioState
from edge.core.policy import Weights
from edge.evaluation.baselines import run_cascade, static_choice
from edge.evaluation.sim import ComputeProfile, Simulator
from edge.evaluation.workload import Range, Requests, Workload, load_workload
from edge.netem.traces import Trace, steady
from shared.errors import ConfigError

# A made-up link with round numbers, so every figure below can be worked by hand.
LINK = LinkProfile(
    name="hand",
    kind="lte",
    up_mbps=1.0,
    down_mbps=1.0,
    rtt_ms=40.0,
    alpha_up_w_per_mbps=0.5,
    alpha_down_w_per_mbps=0.1,
    base_power_w=1.0,
    promotion_s=0.1,
    promotion_power_w=1.2,
    tail_s=2.0,
    tail_power_w=0.8,
    metered=True,
    cost_per_mb=0.5,
)
PI = load_device("raspberry-pi-4b")  # idle 2.7 W, compute 6.4 W
UP = Trace("up", np.array([100, 150, 200, 300, 600]), 1000)  # opportunities, ms
DOWN = Trace("down", np.array([50, 400, 700]), 1000)


def _sim(up=UP, down=DOWN, arrivals=(0.02,), deadline_s=5.0, in_bytes=3000, link=LINK, **kw):
    n = len(arrivals)
    requests = Requests(
        np.asarray(arrivals, float), np.full(n, in_bytes, np.int64), np.full(n, deadline_s)
    )
    return Simulator(
        up=up,
        down=down,
        link=link,
        device=PI,
        profile=kw.pop("profile", ComputeProfile((0.2,), (0.03,), (0.5,))),
        weights=kw.pop("weights", Weights(latency_s=1.0, energy_j=0.01, data_mb=0.1, money=1.0)),
        requests=requests,
        output_bytes=kw.pop("output_bytes", 1000),
        miss_penalty=1.0,
        seed=0,
    )


def test_an_offload_follows_the_trace_the_rtt_and_the_radio_by_hand():
    sim = _sim()
    radio = RadioState()
    a = sim.offload(0, 0.02, give_up_at=10.0, radio=radio)
    # idle radio: promoted until 0.12 s; two packets take the 150 and 200 ms
    # opportunities; +20 ms to the server, 30 ms there, +20 ms back; the one
    # reply packet waits for the 400 ms downlink opportunity.
    assert a.delivered and a.start == pytest.approx(0.12)
    assert a.end == pytest.approx(0.400)
    assert UP.finish_time(0.12, 3000) == pytest.approx(0.200)
    assert DOWN.finish_time(0.200 + 0.020 + 0.030 + 0.020, 1000) == pytest.approx(0.400)
    on = 0.400 - 0.12
    by_hand = (
        (1.0 + 2.7) * on  # radio base + device idle while the radio is on
        + 0.5 * 3000 * 8 / 1e6  # alpha_up per megabit sent
        + 0.1 * 1000 * 8 / 1e6
        + (1.2 + 2.7) * 0.1  # promotion, the device waiting for it
        + 0.8 * 2.0  # a full tail
    )
    assert a.energy_j == pytest.approx(by_hand)
    assert a.money == pytest.approx(4000 / 1e6 * 0.5)
    out = sim.cloud_outcome(0, 0.02, a, "cloud")
    assert out.latency_s == pytest.approx(0.38) and not out.missed

    # 0.6 s later the radio is in its tail: no promotion, the tail is only extended
    b = sim.offload(0, 1.0, give_up_at=10.0, radio=radio)
    assert b.start == 1.0
    assert b.end == pytest.approx(1.400)  # 1100/1150 ms up, then the 1400 ms downlink slot
    on = 0.400
    assert b.energy_j == pytest.approx(3.7 * on + 0.5 * 0.024 + 0.1 * 0.008 + 0.8 * (1.0 - 0.400))


def test_an_abandoned_attempt_pays_for_the_radio_time_and_only_the_bytes_that_crossed():
    sim = _sim(in_bytes=4500)
    a = sim.offload(0, 0.02, give_up_at=0.17, radio=RadioState())
    assert not a.delivered and a.end == 0.17
    assert a.up_bytes == 1500  # only the 150 ms opportunity fell before the give-up
    assert a.down_bytes == 0
    assert a.energy_j == pytest.approx(3.7 * 0.05 + 0.5 * 1500 * 8 / 1e6 + 3.9 * 0.1 + 1.6)
    out = sim.cloud_outcome(0, 0.02, a, "cloud")
    assert out.missed and out.latency_s == pytest.approx(0.15)
    # an error before the deadline costs the whole deadline of latency, never less
    assert sim.cost(out) >= 1.0 * 5.0 + 1.0


def test_an_outage_never_delivers_and_the_attempt_ends_at_the_give_up():
    sim = _sim(up=Trace("dead", np.array([], np.int64), 1000))
    a = sim.offload(0, 0.0, give_up_at=2.0, radio=RadioState())
    assert not a.delivered and a.end == 2.0 and a.up_bytes == 0 and math.isfinite(a.energy_j)


def test_requests_close_together_share_the_radio_and_skip_the_promotion():
    fast = steady(50, 60)
    sim = _sim(up=fast, down=fast, arrivals=(0.0, 1.0, 5.0), in_bytes=50_000)
    radio = RadioState()
    first = sim.offload(0, 0.0, 100.0, radio)
    second = sim.offload(1, 1.0, 100.0, radio)  # within the 2 s tail
    third = sim.offload(2, 5.0, 100.0, radio)  # after it: idle again
    assert first.start == pytest.approx(0.1) and third.start == pytest.approx(5.1)
    assert second.start == 1.0
    assert (second.end - 1.0) < (first.end - 0.0)
    assert second.energy_j < first.energy_j - 1.0  # no promotion, no new full tail
    assert third.energy_j == pytest.approx(first.energy_j, rel=0.02)


def test_the_cascade_baseline_never_sends_when_no_time_is_left():
    # local takes 0.2 s of a 0.15 s deadline: nothing left for the cloud
    sim = _sim(deadline_s=0.15, profile=ComputeProfile((0.2,), (0.03,), (0.1,)))
    out = run_cascade(sim, threshold=0.8).outcomes[0]
    assert out.where == "local" and out.up_bytes == 0 and out.energy_j == pytest.approx(6.4 * 0.2)
    assert out.latency_s == pytest.approx(0.2) and out.missed


def test_static_choice_prices_the_promotion_and_the_energy_at_the_mean_rate():
    up, down = steady(8, 60), steady(20, 60)
    lte = LinkProfile(**{**LINK.__dict__, "promotion_s": 0.26, "tail_s": 11.6, "rtt_ms": 70})

    def choice(local_s: float, rate: float, **weights: float) -> str:
        sim = _sim(
            up=up,
            down=down,
            link=lte,
            in_bytes=602_368,
            profile=ComputeProfile((local_s,), (0.01,), (0.9,)),
            weights=Weights(**weights),
        )
        return static_choice(sim, 602_368, deadline_s=5.0, rate_per_s=rate)

    # offloading at 8 Mbps: 0.68 s with the radio connected, 0.94 s after a promotion
    assert choice(0.8, rate=5.0, latency_s=1.0) == "cloud"  # requests keep the radio up
    assert choice(0.8, rate=0.01, latency_s=1.0) == "local"  # each one promotes it
    assert choice(1.2, rate=0.01, latency_s=1.0) == "cloud"
    # by cost, not latency alone: a full LTE tail per request outweighs 0.26 s
    assert choice(1.2, rate=0.01, latency_s=1.0, energy_j=0.1) == "local"


def test_workload_draws_sizes_and_deadlines_from_lists_and_ranges(tmp_path: Path):
    path = tmp_path / "w.toml"
    path.write_text(
        "count = 400\nseed = 3\ninput_bytes = [1000, 602368]\n"
        "deadline_ms = { min = 200, max = 800 }\n"
    )
    wl = load_workload(path)
    assert wl.input_bytes == (1000, 602368) and wl.deadline_ms == Range(200, 800)
    req = wl.draw(default_deadline_ms=1000)
    assert set(req.in_bytes.tolist()) == {1000, 602368}
    assert 0.2 <= req.deadlines_s.min() < 0.3 and 0.7 < req.deadlines_s.max() <= 0.8
    again = wl.draw(default_deadline_ms=1000)
    assert np.array_equal(again.in_bytes, req.in_bytes)  # seeded
    unset = Workload(deadline_ms=None, count=3).draw(default_deadline_ms=750)
    assert np.allclose(unset.deadlines_s, 0.75)  # the policy's deadline when the workload has none


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("counts = 3\n", "unknown key 'counts'"),
        ("input_bytes = []\n", "empty"),
        ("deadline_ms = { min = 5 }\n", "range"),
        ("deadline_ms = { min = 9, max = 5 }\n", "min <= max"),
        ("rate_per_s = 0\n", "rate_per_s"),
        ('arrival = "bursty"\n', "poisson"),
        ("count = 2.5\n", "integer"),
    ],
)
def test_bad_workload_is_a_config_error_naming_the_key(tmp_path: Path, text: str, match: str):
    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_workload(path)
