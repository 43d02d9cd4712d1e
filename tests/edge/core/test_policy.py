"""The cost model with fixed estimates: where each request goes, and why."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from devices.profiles import load_device, load_link
from edge.core.estimators import Estimators
from edge.core.policy import (
    Context,
    Decision,
    ModelPolicy,
    Option,
    Policy,
    PolicyConfig,
    Weights,
)

IMAGE = 602_112 + 256  # a 1x3x224x224 FP32 request


def _policy(
    *,
    local_ms: float | None = 40.0,
    up_mbps: float = 50.0,
    rtt_ms: float = 10.0,
    cloud_ms: float = 5.0,
    weights: Weights | None = None,
    link: str = "wifi",
    **cfg,
) -> Policy:
    est = Estimators()
    now = time.monotonic()
    if local_ms is not None:
        for _ in range(20):
            est.local("m-int8").add(local_ms / 1000, now)
    for t in ("mqtt", "http"):
        est.set_link_prior(t, up_mbps * 1e6, up_mbps * 4e6, rtt_ms / 1000)
    for _ in range(20):
        est.observe_reply("m", 500, int(cloud_ms * 1000), now)
    models = {"m": ModelPolicy(local_model="m-int8", cloud_model="m", **cfg.pop("model", {}))}
    cfg.setdefault("explore_after_s", 0.0)  # fixed estimates: exploration has its own tests
    config = PolicyConfig(weights=weights or Weights(), models=models, **cfg)
    return Policy(
        config,
        est,
        load_device("raspberry-pi-4b"),
        {"mqtt": load_link(link), "http": load_link(link)},
    )


def _ctx(deadline_ms: float = 1000, connected: bool = True, **kw) -> Context:
    return Context(
        now=kw.pop("now", time.monotonic()),
        deadline_s=deadline_ms / 1000,
        in_bytes=kw.pop("in_bytes", IMAGE),
        connected={"mqtt": connected, "http": connected},
        **kw,
    )


def test_slow_uplink_keeps_work_local():
    decision = _policy(local_ms=40, up_mbps=1.0).decide("m", _ctx())
    assert decision.where == "local"


def test_slow_local_model_and_good_link_go_to_the_cloud():
    decision = _policy(local_ms=400, up_mbps=100, rtt_ms=2).decide("m", _ctx())
    assert decision.where.startswith("cloud-")


def test_tight_deadline_rules_out_the_slow_option():
    p = _policy(local_ms=600, up_mbps=20, rtt_ms=20)
    assert p.decide("m", _ctx(deadline_ms=2000)).where.startswith("cloud-")
    p2 = _policy(local_ms=30, up_mbps=200, rtt_ms=1, cloud_ms=1)
    # cloud is cheaper on latency alone but misses a 20 ms deadline
    d = p2.decide("m", _ctx(deadline_ms=20))
    assert d.where == "local"
    assert any(o.reason == "deadline" for o in d.options if o.name != "local")


def test_no_link_means_local():
    decision = _policy(local_ms=400).decide("m", _ctx(connected=False))
    assert decision.where == "local"
    assert all(o.reason == "no link" for o in decision.options if o.transport)


def test_local_only_and_cloud_only_modes_are_honoured():
    assert _policy(local_ms=900, model={"mode": "local"}).decide("m", _ctx()).where == "local"
    d = _policy(local_ms=1, up_mbps=0.5, model={"mode": "cloud"}).decide(
        "m", _ctx(deadline_ms=60_000)
    )
    assert d.where.startswith("cloud-")


def test_cloud_only_without_link_has_no_option():
    d = _policy(model={"mode": "cloud"}).decide("m", _ctx(connected=False))
    assert d.choice is None and "no usable option" in d.reason


def test_data_cap_forbids_offloading_past_it():
    p = _policy(local_ms=400, up_mbps=100, data_cap_mb_per_day=5.0)
    assert p.decide("m", _ctx(data_used_mb_today=1.0)).where.startswith("cloud-")
    assert p.decide("m", _ctx(data_used_mb_today=4.8)).where == "local"


def test_battery_floor_makes_energy_the_objective():
    # A slow device on fast LTE: latency favours the cloud, but the radio's tail energy favours local.
    p = _policy(local_ms=600, up_mbps=100, rtt_ms=5, link="lte", battery_floor_percent=20)
    assert p.decide("m", _ctx(2000, battery_percent=80)).where.startswith("cloud-")
    low = p.decide("m", _ctx(2000, battery_percent=10))
    assert low.where == "local"
    assert low.choice.energy_j == min(o.energy_j for o in low.options if o.feasible)


def test_energy_weight_moves_the_choice():
    lat_only = _policy(local_ms=600, up_mbps=100, link="lte").decide("m", _ctx(2000))
    energy_heavy = _policy(
        local_ms=600, up_mbps=100, link="lte", weights=Weights(latency_s=1, energy_j=10)
    ).decide("m", _ctx(2000))
    assert lat_only.where.startswith("cloud-") and energy_heavy.where == "local"


def test_deadline_is_checked_against_the_quantile_not_the_mean():
    est_policy = _policy(local_ms=None, up_mbps=100)
    now = time.monotonic()
    local = est_policy.est.local("m-int8")
    for i in range(200):  # mean ~21 ms, but 1 in 10 takes 120 ms
        local.add(0.12 if i % 10 == 0 else 0.01, now)
    assert local.mean < 0.05 < local.quantile
    d = est_policy.decide("m", _ctx(deadline_ms=60, connected=False))
    # No feasible option: the fastest is still used, flagged as such.
    assert d.where == "local" and "deadline" in d.reason


def test_unmeasured_local_model_is_tried_first():
    assert _policy(local_ms=None, up_mbps=100).decide("m", _ctx()).where == "local"


def test_decision_takes_microseconds():
    p = _policy(local_ms=50)
    ctx = _ctx()
    samples = []
    for _ in range(2000):
        t = time.perf_counter()
        p.decide("m", ctx)
        samples.append(time.perf_counter() - t)
    # Behaviour bound, not a benchmark: far under a millisecond (bench/edge_overhead.py times it).
    assert statistics.median(samples) < 0.0005


@pytest.mark.parametrize("confidence, offload", [(0.95, False), (0.5, True)])
def test_cascade_offloads_only_unsure_answers(confidence, offload):
    p = _policy(model={"mode": "cascade", "cascade_threshold": 0.8})
    assert p.cascade_offload("m", confidence) is offload


def test_the_reason_names_the_data_cap_or_the_mode_that_decided():
    # "least cost" had named a local run the cap forced, and "low battery: least energy"
    # a cloud run the mode forced (that cost more energy than the local one).
    p = _policy(local_ms=400, up_mbps=100, data_cap_mb_per_day=5.0)
    capped = p.decide("m", _ctx(data_used_mb_today=4.8))
    assert capped.where == "local" and "data cap" in capped.reason, capped.reason
    forced = _policy(local_ms=1, model={"mode": "cloud"}, battery_floor_percent=15)
    d = forced.decide("m", _ctx(battery_percent=5.0))
    assert d.where.startswith("cloud-") and d.reason == "mode cloud", d.reason
    local = _policy(local_ms=900, model={"mode": "local"}).decide("m", _ctx())
    assert local.reason == "mode local"


def test_a_link_no_prior_lets_meet_a_tight_deadline_is_tried_beside_the_late_local_run():
    # A 150 ms deadline, a 200 ms device, a link only known by its prior (a wide belief
    # whose tail misses the deadline): every request ran locally and missed, though the
    # cloud answered in 10 ms.  Late anyway: the link is tried beside the local run.
    p = _policy(local_ms=200, up_mbps=20.0, rtt_ms=20.0, explore_after_s=5.0)
    ctx = _ctx(deadline_ms=150, in_bytes=602_112)
    first = p.decide("m", ctx)
    assert first.where.startswith("cloud-") and first.hedge and first.exploring, first.reason
    assert "beside the local run" in first.reason
    second = p.decide("m", ctx)  # the other transport, then the claims hold
    assert second.where.startswith("cloud-") and second.where != first.where
    assert p.decide("m", ctx).where == "local"
    # a link it knows is slow is not tried again and again (its belief widens with age:
    # a 5 s link had been tried every explore_after_s, 434 MB an hour)
    known = _policy(local_ms=200, up_mbps=20.0, rtt_ms=20.0, explore_after_s=5.0)
    now, tried = time.monotonic(), 0
    for i in range(600):  # ten minutes of requests, a second apart; the link takes 5 s
        d = known.decide("m", _ctx(deadline_ms=150, in_bytes=602_112, now=now + i))
        if d.choice is not None and d.choice.transport is not None:
            tried += 1
            known.est.link(d.choice.transport).observe(602_112, 500, 5.0, 0.005, now + i + 5)
    # tried when the belief (widening back to the prior with age) lets it beat the local
    # run again, not at every explore_after_s: 120 in ten minutes before
    assert 2 <= tried <= 16, tried


def test_a_link_that_could_win_is_explored_once_then_the_claim_holds():
    # Never measured: the cloud's rate is only the prior (a wide belief); at its
    # mean the cloud loses narrowly to local, but it may well be faster.
    p = _policy(local_ms=150, up_mbps=8.0, explore_after_s=5.0)
    ctx = _ctx(deadline_ms=5000, in_bytes=60_000, rate_per_s=1.0)
    first, second = p.decide("m", ctx), p.decide("m", ctx)  # one per transport
    assert {first.where, second.where} == {"cloud-mqtt", "cloud-http"}
    assert "explore" in first.reason and "P(better)" in first.reason
    # While those explorations are in flight, requests stay on the cost choice.
    assert p.decide("m", ctx).where == "local"


def test_a_link_whose_tail_recent_local_runs_left_unshared_is_still_explored():
    # LTE, the radio up from a transfer a second ago, but 9 of 10 recent requests ran
    # locally: this offload alone would pay a long tail.  The offloads an exploration
    # leads to would share it, one request to the next, so it is priced at that.
    weights = Weights(latency_s=1.0, energy_j=0.05)

    def decide(share: float) -> str:
        p = _policy(local_ms=500, up_mbps=10.0, explore_after_s=5.0, link="lte", weights=weights)
        ctx = _ctx(deadline_ms=5000, rate_per_s=0.5, radio_idle_s=1.0, radio_share=share)
        return p.decide("m", ctx).reason

    assert "explore" in decide(1.0)
    assert "explore" in decide(0.1)


def test_a_link_that_cannot_win_is_never_explored_however_old():
    # On LTE a 60 KB offload pays a promotion and ~12 J of tail: with energy
    # priced, even an infinitely fast link loses to a 40 ms local run.
    weights = Weights(latency_s=1.0, energy_j=0.05)
    p = _policy(local_ms=40, up_mbps=8.0, explore_after_s=5.0, link="lte", weights=weights)
    for later in (0.0, 60.0, 3600.0):
        d = p.decide("m", _ctx(deadline_ms=5000, in_bytes=60_000, now=time.monotonic() + later))
        assert d.where == "local" and "explore" not in d.reason


def test_exploration_value_is_zero_without_upside_and_grows_with_doubt():
    from edge.core.policy import Option, exploration_value

    def option(cost: float, sigma: float) -> Option:
        o = Option("cloud-http", "http", 0.2, 0.3, 0.0, 60_000, 1_000, 0.0, cost=cost)
        o.cost_per_inv_bps, o.rate_bps, o.rate_sigma = 480_000.0, 4e6, sigma
        return o

    # The transfer is worth 0.12 of cost at 4 Mbps: a cost gap above it cannot close.
    assert exploration_value(option(0.5, 1.0), 0.3) == (0.0, 0.0)
    p_low, gain_low = exploration_value(option(0.3, 0.2), 0.25)
    p_high, gain_high = exploration_value(option(0.3, 1.0), 0.25)
    assert 0 < p_low < p_high < 0.5 and 0 < gain_low < gain_high
    # The closed form agrees with sampling the log-normal belief.
    rng = np.random.default_rng(0)
    x = 1 / (4e6 * np.exp(1.0 * rng.standard_normal(200_000)))
    costs = 0.3 + 480_000.0 * (x - 1 / 4e6)
    assert p_high == pytest.approx(np.mean(costs < 0.25), abs=0.01)
    assert gain_high == pytest.approx(np.mean(np.maximum(0.25 - costs, 0)), rel=0.05)


def test_an_old_bad_estimate_fades_back_to_the_prior():
    p = _policy(local_ms=800, up_mbps=20.0, explore_after_s=5.0)
    link = p.est.link("http")
    now = time.monotonic()
    for tr in ("http", "mqtt"):
        p.est.link(tr).observe_timeout(IMAGE, 8.0, now)  # a bad spell: at most ~0.6 Mbps
    assert link.up_bps < 1e6
    assert p.decide("m", _ctx(now=now, deadline_ms=2000)).where == "local"  # fresh: too slow
    much_later = now + 10 * link.up_belief.REVERT_S
    # one spell is a small part of the link's long run: most of the way back to the prior
    assert 10e6 < link.rates(much_later)[0] < 20e6
    # the timeouts have faded from the recent count; the long memory keeps a trace of them
    assert link.failure_rate(much_later) < link.failure_rate(now) / 2
    assert p.decide("m", _ctx(now=much_later, deadline_ms=2000)).where.startswith("cloud-")


def test_deadline_quantile_in_the_policy_file_changes_the_decision():
    # Local is usually 20 ms but one run in ten takes 300 ms; the deadline is 200 ms.
    # At the median local makes it; at the 95th percentile it does not.
    def decide(q: float) -> str:
        p = _policy(local_ms=None, up_mbps=5.0, rtt_ms=40, deadline_quantile=q)
        p.est.set_quantile(q)
        now = time.monotonic()
        for i in range(400):
            p.est.local("m-int8").add(0.3 if i % 10 == 0 else 0.02, now)
        return p.decide("m", _ctx(deadline_ms=200, connected=False)).reason

    assert decide(0.5) == "least cost"
    assert "deadline" in decide(0.95)


def test_requests_queued_on_the_local_model_add_their_time():
    p = _policy(local_ms=100, up_mbps=40, rtt_ms=10, cloud_ms=5)
    idle = p.decide("m", _ctx(deadline_ms=5000, local_backlog=0))
    busy = p.decide("m", _ctx(deadline_ms=5000, local_backlog=5))
    local_idle = next(o for o in idle.options if o.name == "local")
    local_busy = next(o for o in busy.options if o.name == "local")
    assert local_busy.latency_s == pytest.approx(6 * local_idle.latency_s)
    assert idle.where == "local" and busy.where.startswith("cloud-")


def test_an_unmeasured_batch_size_is_priced_as_that_many_single_runs():
    p = _policy(local_ms=10)
    one = next(o for o in p.decide("m", _ctx(batch=1)).options if o.name == "local")
    eight = next(o for o in p.decide("m", _ctx(batch=8)).options if o.name == "local")
    assert eight.latency_s == pytest.approx(8 * one.latency_s)
    now = time.monotonic()
    for _ in range(10):
        p.est.local("m-int8", 8).add(0.03, now)  # measured: batching pays
    eight = next(o for o in p.decide("m", _ctx(batch=8)).options if o.name == "local")
    assert eight.latency_s == pytest.approx(0.03)


def test_fallback_plan_keeps_room_for_a_local_answer():
    from edge.core.policy import FALLBACK_RESERVE, GIVE_UP_AFTER, Option, fallback_plan

    local = Option("local", None, 0.1, 0.2, 0.0, 0, 0, 0.0)
    cloud = Option("cloud-http", "http", 0.05, 0.08, 0.0, 1, 1, 0.0, measured=True)
    reserve = 0.2  # the quantile: above the mean and its margin (0.1 * FALLBACK_RESERVE)
    give_up, fallback = fallback_plan(10.0, 10.5, local, cloud)
    assert give_up == pytest.approx(10.5 - reserve) and fallback is local
    # A quantile close to the mean still leaves the mean's margin.
    tight = Option("local", None, 0.19, 0.2, 0.0, 0, 0, 0.0)
    give_up, _ = fallback_plan(10.0, 10.5, tight, cloud)
    assert give_up == pytest.approx(10.5 - 0.19 * FALLBACK_RESERVE)
    # A reply long past its own slow tail is given up on sooner (likely lost, not late).
    give_up, fallback = fallback_plan(10.0, 11.0, local, cloud)
    assert give_up == pytest.approx(10.0 + GIVE_UP_AFTER * 0.08)
    assert give_up < 11.0 - reserve
    # ... but only a prediction the link's own transfers back: a prior is no reason to give up
    cloud.measured = False
    assert fallback_plan(10.0, 11.0, local, cloud)[0] == pytest.approx(11.0 - reserve)
    # Local cannot make it anyway: the cloud gets the whole deadline, local stays the fallback.
    give_up, fallback = fallback_plan(10.0, 10.2, local, cloud)
    assert give_up == 10.2 and fallback is local
    give_up, fallback = fallback_plan(10.0, 10.05, None, cloud)
    assert give_up == pytest.approx(10.08) and fallback is None


def test_an_exploration_without_room_to_fall_back_races_the_local_run():
    p = _policy(local_ms=300, up_mbps=20.0, explore_after_s=5.0)  # local q ~300 ms
    # Deadline 440 ms: the cloud (~135 ms) alone fits, but not with the local reserve after it:
    # the exploration races the local run, which starts when it must to make the deadline
    # (or at once, hedged, when that is cheaper); the first answer stands.
    d = p.decide("m", _ctx(deadline_ms=440, in_bytes=100_000, rate_per_s=1.0))
    assert "explore" in d.reason
    assert d.hedge or d.choice.race_s == pytest.approx(0.44 - 0.3 * 1.15)
    roomy = _policy(local_ms=300, up_mbps=20.0, explore_after_s=5.0)
    d = roomy.decide("m", _ctx(deadline_ms=3000, in_bytes=100_000, rate_per_s=1.0))
    assert "explore" in d.reason and not d.hedge  # room to fall back: a plain exploration


def test_a_wake_up_too_slow_only_for_its_promotion_goes_beside_the_local_run():
    # LTE from idle: the 260 ms promotion puts even a 60 KB offload past a 380 ms
    # deadline that a warm radio meets easily.  The local run answers this request;
    # the offload beside it wakes the radio for the requests that follow.
    p = _policy(local_ms=250, up_mbps=8.0, rtt_ms=70, link="lte")
    cold = _ctx(deadline_ms=380, in_bytes=60_000, rate_per_s=0.5)
    d = p.decide("m", cold)
    cloud = next(o for o in d.options if o.name == d.where)
    assert d.where.startswith("cloud-") and d.hedge
    assert "wake the radio (hedged)" in d.reason
    assert cloud.reason == "deadline" and cloud.latency_q_s - cloud.promotion_s < 0.38
    # With the radio up, the same offload makes the deadline on its own: no hedge.
    d = p.decide("m", _ctx(deadline_ms=380, in_bytes=60_000, rate_per_s=0.5, radio_idle_s=1.0))
    assert d.where.startswith("cloud-") and not d.hedge and d.reason == "least cost"


def test_a_wake_up_with_room_to_fall_back_goes_hedged_where_energy_is_free():
    # LTE from idle, a 3 s deadline: the offload would have room to fall back after it.
    # Weighing latency alone, running locally beside it costs nothing, so the wake-up is
    # hedged (this request gets the local answer at worst); with energy priced it is not.
    free = _policy(local_ms=400, up_mbps=8.0, rtt_ms=70, link="lte")
    cold = _ctx(deadline_ms=3000, in_bytes=60_000, rate_per_s=0.5)
    d = free.decide("m", cold)
    assert "wake the radio (hedged)" in d.reason and d.hedge
    priced = _policy(
        local_ms=400, up_mbps=8.0, rtt_ms=70, link="lte", weights=Weights(energy_j=0.05)
    )
    d = priced.decide("m", cold)
    assert d.reason.startswith("wake the radio:") and not d.hedge


def _lte_choice(local_ms: float, idle: float | None, share: float) -> Decision:
    weights = Weights(latency_s=1.0, energy_j=0.05)
    p = _policy(local_ms=local_ms, up_mbps=8.0, rtt_ms=70, link="lte", weights=weights)
    ctx = _ctx(deadline_ms=600, in_bytes=60_000, rate_per_s=0.5, radio_idle_s=idle)
    ctx.radio_share = share
    return p.decide("m", ctx)


def test_the_tail_still_running_is_not_charged_to_the_offload_that_cuts_it_short():
    # Up 5 s ago, 6.6 s of tail left, a third of recent requests offloaded: the tail
    # left burns whether this request runs locally or not, so offloading is cheaper
    # (charged the whole tail it opens, it cost about 0.5 against the local run's 0.32 and the
    # radio was let go, on a steady link where offloading every request pays).
    d = _lte_choice(240, 5.0, 0.3)
    assert d.where.startswith("cloud-") and d.reason == "least cost"
    cloud = next(o for o in d.options if o.name == "cloud-http")
    assert cloud.cost < d.options[0].cost < cloud.cost + 0.1


def test_a_radio_still_up_is_kept_up_when_the_warm_run_pays_for_this_offloads_tail():
    # Up 9 s ago, 2.6 s of tail left, one request in ten offloaded: the offload now pays
    # most of a tail alone and costs more than the local run, but in a run of offloads,
    # each paying its share of the tail (to the next), every request would cost less
    # than locally, even at the slow edge of the link's belief: the radio stays up.
    d = _lte_choice(360, 9.0, 0.1)
    assert d.where.startswith("cloud-")
    assert d.reason.startswith("keep the radio up:")
    chosen = next(o for o in d.options if o.name == d.where)
    local = d.options[0]
    assert chosen.cost > local.cost > chosen.cost - chosen.shared_saving
    # where a run of offloads would not pay (its requests' whole tail shares priced),
    # the local run stays
    assert _lte_choice(280, 9.0, 0.1).where == "local"


def test_a_run_of_offloads_dearer_than_local_runs_is_not_kept_on_a_tail_bargain():
    # From a radio up, an offload adds little tail (the rest burns anyway): priced one at
    # a time, every offload of a run looked cheap, and on a link where offloading every
    # request costs more than running each locally the radio stayed up for good.  A
    # typical request's run price (its whole share of the tail) is charged instead.
    d = _lte_choice(200, 5.0, 1.0)
    cloud = next(o for o in d.options if o.name == "cloud-http")
    assert cloud.run_extra > 0.0
    assert d.where == "local" and cloud.cost > d.options[0].cost
    # where the run pays, the offload keeps its marginal price
    d = _lte_choice(320, 5.0, 1.0)
    assert d.where.startswith("cloud-")


def test_an_offload_pays_the_tail_until_the_next_request_that_uses_the_radio():
    # At 0.5 requests/s the next request comes in ~2 s; if only one in ten uses the
    # radio, the tail this offload opens runs ~10x as long before another closes it.
    from edge.core.energy import expected_tail_s, tail_extension_s

    weights = Weights(latency_s=1.0, energy_j=0.05)
    p = _policy(local_ms=300, up_mbps=8.0, rtt_ms=70, link="lte", weights=weights)
    lte = load_link("lte")

    def cloud(idle: float | None, share: float | None):
        ctx = _ctx(deadline_ms=5000, in_bytes=60_000, rate_per_s=0.5, radio_idle_s=idle)
        ctx.radio_share = share
        return next(o for o in p.decide("m", ctx).options if o.name == "cloud-http")

    shared, alone = cloud(1.0, 1.0), cloud(1.0, 0.1)
    # (less what is left of the running tail up to that request: it burns either way)
    added = [tail_extension_s(lte, r, expected_tail_s(lte, r), 1.0) for r in (0.05, 0.5)]
    longer = added[0] - added[1]
    assert longer > 0.0
    assert alone.energy_j - shared.energy_j == pytest.approx(lte.tail_power_w * longer)
    # ... and what sharing it would save: a warm run's request is judged by its whole
    # share of the tail (to the next request), so 1 s into the tail (little of it new)
    # nothing, 9 s in (most of a tail alone) the difference
    run_share = expected_tail_s(lte, 0.5)
    assert added[0] < run_share and alone.shared_saving == 0.0
    late = tail_extension_s(lte, 0.05, expected_tail_s(lte, 0.05), 9.0)
    assert cloud(9.0, 0.1).shared_saving == pytest.approx(
        0.05 * lte.tail_power_w * (late - run_share)
    )
    assert shared.shared_saving == 0.0
    assert cloud(1.0, None).energy_j == pytest.approx(shared.energy_j)  # unknown: shared
    # From idle, what a wake-up is weighed with is the warm run that follows, in which
    # each request closes the tail of the one before: the same whatever the share was.
    cold_shared, cold_alone = cloud(None, 1.0), cloud(None, 0.1)
    assert cold_alone.cost > cold_shared.cost
    assert cold_alone.warm_cost == pytest.approx(cold_shared.warm_cost)


def test_a_link_always_slower_than_its_kind_relaxes_to_its_own_level_not_the_prior():
    from edge.core.estimators import LogRate

    belief = LogRate()
    now = 0.0
    rng = np.random.default_rng(0)
    for _ in range(60):  # a link that has shown ~1 Mbps, give or take 30%, for a while
        now += 2.0
        belief.add(1e6 * float(np.exp(0.3 * rng.standard_normal())), now)
    later = now + 20 * LogRate.REVERT_S
    rate, sigma = belief.at(1e6, 6e6, later)  # its kind's median (the prior) is 6 Mbps
    assert 0.8e6 < rate < 1.6e6
    assert LogRate.HOME_MIN_SIGMA <= sigma < 0.6  # not the prior's factor of e either way
    # with nothing seen, the prior rules as before
    assert LogRate().at(0.0, 6e6, later) == (6e6, LogRate.PRIOR_SIGMA)
    # the long run survives a restart
    again = LogRate.from_dict(belief.to_dict(now), now)
    assert again.at(1e6, 6e6, later) == pytest.approx(belief.at(1e6, 6e6, later))


def test_a_typical_requests_run_price_counts_the_bytes_own_price():
    # the size correction counted time and energy only: on a data-weighted link a run
    # of mixed sizes was priced at a third of its slope
    def cloud(data_mb: float, size: int) -> Option:
        weights = Weights(latency_s=1.0, energy_j=0.05, data_mb=data_mb)
        p = _policy(local_ms=300, up_mbps=8.0, rtt_ms=70, link="lte", weights=weights)
        ctx = _ctx(deadline_ms=5000, in_bytes=size, rate_per_s=0.5, radio_idle_s=2.0)
        ctx.radio_share = 1.0
        return next(o for o in p.decide("m", ctx).options if o.name == "cloud-http")

    priced = cloud(2.0, 20_000)
    assert priced.run_per_byte - cloud(0.0, 20_000).run_per_byte == pytest.approx(2.0 / 1e6)
    slope = (cloud(2.0, 120_000).cost - priced.cost) / 100_000
    assert 0.7 * slope < priced.run_per_byte <= slope  # (races add a little more per byte)


def test_an_unbounded_window_never_makes_a_transfer_late() -> None:
    import math

    from edge.core.policy import _late

    assert _late(2.0, 0.5, math.inf) == 0.0  # (log(b / inf) had raised a math domain error)
    assert _late(2.0, 0.5, 1.0) > 0.5
