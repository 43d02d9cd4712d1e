"""The sans-IO decision flow: events in, actions out, one answer per request."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devices.profiles import load_device, load_link
from edge.core.flow import Answer, Fail, Hedge, Offload, RunLocal, fresh_core, replay_journal
from edge.core.policy import NO_ROOM, Context, ModelPolicy, PolicyConfig, Weights
from shared.errors import DeadlineExceeded, EndpointUnavailable, InvalidInput

MODELS = {"m": ModelPolicy(local_model="m-local", cloud_model="m")}


def _core(mode: str = "cost", journal: int = 0, energy: float = 0.05, **cfg):
    models = {"m": ModelPolicy(mode=mode, local_model="m-local", cloud_model="m")}
    config = PolicyConfig(weights=Weights(latency_s=1.0, energy_j=energy), models=models, **cfg)
    lte = load_link("lte")
    core = fresh_core(config, load_device("raspberry-pi-4b"), {"http": lte}, journal=journal)
    core.warmed("m-local", 1.0, 0.0)  # a slow device: the cloud is worth it
    return core


def _raced(core, deadline_ms: float = 3000):
    flow = core.begin(
        "m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=deadline_ms
    )
    action = flow.start()
    assert isinstance(action, Hedge) and action.local_at is not None, action
    assert 1.0 < action.local_at <= flow.deadline - 1.0  # room kept for the local run
    assert action.offload.give_up_at == flow.deadline  # the offload is never abandoned
    return flow, action


def test_a_failed_offload_falls_back_locally_and_answers_once():
    core = _core(journal=100)
    flow, action = _raced(core)
    run = flow.offload_failed(1.5, DeadlineExceeded("no reply"))
    assert isinstance(run, RunLocal) and run.fallback  # at once, not when it was due
    assert flow.race_due(action.local_at) is None  # started already
    answer = flow.local_done(action_end := 2.5, 1.0)
    assert isinstance(answer, Answer) and answer.where == "local" and answer.fallback
    assert answer.extra["bytes_attempted"] == 60_000
    assert core.radio.radio_idle_s(action_end) is not None  # the radio was on while waiting


def test_a_raced_reply_in_before_the_local_run_is_due_answers_and_runs_nothing_locally():
    core = _core(journal=100)
    flow, action = _raced(core)
    answer = flow.offload_done(1.4, sent=60_000, received=1_000, elapsed_s=0.4)
    assert isinstance(answer, Answer) and answer.where == "cloud-http"
    assert answer.extra.get("raced") and not answer.extra.get("hedged")
    assert answer.energy_j == pytest.approx(answer.option.energy_j)  # no local run paid
    assert flow.race_due(action.local_at) is None  # answered: the local run never starts


def test_a_late_reply_races_the_local_run_and_the_first_answer_stands():
    core = _core(journal=100)
    flow, action = _raced(core)
    run = flow.race_due(action.local_at)
    assert isinstance(run, RunLocal) and run.fallback
    # the reply is late but comes before the local run ends: it answers
    answer = flow.offload_done(action.local_at + 0.2, sent=60_000, received=1_000, elapsed_s=1.0)
    assert isinstance(answer, Answer) and answer.where == "cloud-http" and answer.extra["hedged"]
    assert flow.local_done(action.local_at + 1.0, 1.0) is None  # it only teaches
    # replayed, the same events make the same decisions
    replica = _core(journal=100)
    replica.events.clear()
    core_events = [e for e in core.events if e[0] != "warmed"]
    assert [d.where for d in replay_journal(core_events, replica)] == [
        d.where for d in core.decisions
    ]


def test_with_energy_free_the_local_run_starts_with_the_offload_and_a_lost_reply_costs_no_wait():
    # weighing latency only, running locally beside the offload costs nothing: the first
    # answer wins, and a reply lost in an outage is not waited out before the local run
    core = _core(energy=0.0)
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=3000)
    action = flow.start()
    assert isinstance(action, Hedge) and action.local_at is None, action
    assert flow.decision.choice.race_s == 0.0
    answer = flow.local_done(2.0, 1.0)
    assert isinstance(answer, Answer) and answer.where == "local"
    assert flow.offload_failed(2.5, DeadlineExceeded("no reply")) is None  # answered already
    # with the example's energy weight the same request races: its local run waits
    flow, action = _raced(_core(energy=0.05))
    assert flow.decision.choice.race_s > 0.0


def test_a_cloud_only_model_runs_its_local_variant_when_no_link_is_usable():
    core = _core(mode="cloud")
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": False})
    action = flow.start()
    assert isinstance(action, RunLocal) and action.fallback
    assert "cloud unusable" in action.reason


def test_a_bad_input_is_the_requests_own_failure_and_opens_no_breaker():
    core = _core()
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True})
    action = flow.start()
    assert isinstance(action, Offload)
    assert isinstance(flow.offload_failed(1.1, InvalidInput("bad shape")), Fail)
    assert core.breakers["http"].state == "closed" and core.breakers["http"]._consecutive == 0


def test_a_deadline_shorter_than_an_answer_takes_opens_no_breaker():
    # A few requests with 2 ms deadlines had opened the breaker: every app's requests
    # over the transport were refused while it was healthy.
    core = _core()
    for i in range(8):
        t = 1.0 + i
        flow = core.begin("m", now=t, in_bytes=60_000, connected={"http": True})
        action = flow.start()
        assert isinstance(action, Offload)
        expected = action.option.latency_s
        flow.offload_failed(t + expected / 10, DeadlineExceeded("gave up"))
    assert core.breakers["http"].state == "closed" and core.breakers["http"]._consecutive == 0
    # a wait past what an answer takes still counts against the endpoint
    flow = core.begin("m", now=20.0, in_bytes=60_000, connected={"http": True})
    action = flow.start()
    flow.offload_failed(20.0 + 3 * action.option.latency_s, DeadlineExceeded("lost"))
    assert core.breakers["http"]._consecutive == 1


def test_a_journal_replays_to_the_same_decisions():
    core = _core(journal=1000)
    t = 1.0
    for i in range(30):
        flow = core.begin("m", now=t, in_bytes=60_000, connected={"http": True})
        action = flow.start()
        if isinstance(action, Hedge) and action.local_at is not None:  # a race
            if i % 7 == 3:
                assert isinstance(flow.offload_failed(t + 0.2, DeadlineExceeded("lost")), RunLocal)
                flow.local_done(t + 1.2, 1.0)
            elif i % 5 == 1:
                assert isinstance(flow.race_due(action.local_at), RunLocal)
                late = action.local_at + 0.1
                flow.offload_done(late, sent=60_000, received=1_000, elapsed_s=late - t)
                flow.local_done(action.local_at + 1.0, 1.0)
            else:
                flow.offload_done(t + 0.3, sent=60_000, received=1_000, elapsed_s=0.3)
        elif isinstance(action, Offload):
            flow.offload_done(t + 0.3, sent=60_000, received=1_000, elapsed_s=0.3)
        else:
            flow.local_done(t + 1.0, 1.0)
        t += 2.0
    replica = _core(journal=1000)
    replica.events.clear()  # _core's warm-up is in the journal already
    assert [(d.where, d.reason, d.predicted_s) for d in replay_journal(core.events, replica)] == [
        (d.where, d.reason, d.predicted_s) for d in core.decisions
    ]


@settings(max_examples=300, deadline=None)
@given(
    local_s=st.floats(0.005, 5.0),
    up_mbps=st.floats(0.05, 100.0),
    rtt_ms=st.floats(5.0, 500.0),
    deadline_s=st.floats(0.05, 10.0),
    in_bytes=st.sampled_from([1_000, 60_000, 602_368]),
    energy=st.sampled_from([0.0, 0.05, 1.0]),
    idle=st.one_of(st.none(), st.floats(0.0, 30.0)),
    rate=st.one_of(st.none(), st.floats(0.01, 10.0)),
    age_s=st.floats(0.0, 600.0),
)
def test_ours_never_picks_a_deadline_infeasible_option_when_a_feasible_one_exists(
    local_s, up_mbps, rtt_ms, deadline_s, in_bytes, energy, idle, rate, age_s
):
    config = PolicyConfig(weights=Weights(latency_s=1.0, energy_j=energy), models=MODELS)
    lte = load_link("lte")
    core = fresh_core(config, load_device("raspberry-pi-4b"), {"mqtt": lte, "http": lte})
    core.warmed("m-local", local_s, 0.0)
    for tr in ("mqtt", "http"):
        link = core.est.link(tr)
        for _ in range(5):
            link.observe(in_bytes, 1_000, in_bytes * 8 / (up_mbps * 1e6) + rtt_ms / 1000, 0.0, 0.0)
    now = age_s
    ctx = Context(
        now=now,
        deadline_s=deadline_s,
        in_bytes=in_bytes,
        connected={"mqtt": True, "http": True},
        radio_idle_s=idle,
        rate_per_s=rate,
    )
    decision = core.policy.decide("m", ctx)
    feasible = [o for o in decision.options if o.latency_q_s <= deadline_s]
    assert decision.choice is not None
    if feasible:
        assert math.isfinite(decision.choice.cost)
        if decision.hedge:
            # Beside a local run that makes the deadline (the first answer wins): an
            # offload with no room to fall back, or one late only for the promotion.
            local = decision.options[0]
            assert local.transport is None and local.latency_q_s <= deadline_s, decision
            assert decision.choice.feasible or decision.choice.reason in (NO_ROOM, "deadline")
        else:
            assert decision.choice.latency_q_s <= deadline_s, decision
            assert decision.choice.feasible


def test_a_weak_signal_lowers_the_link_prior_and_a_jump_restarts_the_estimates():
    core = _core()
    lte = load_link("lte")
    link = core.est.link("http")
    for _ in range(5):
        link.observe(60_000, 1_000, 0.2, 0.0, 1.0)
    assert core.link_changed("http", lte, 2.0, signal_dbm=-115.0)  # first reading: restart
    assert core.est.link("http").prior_up_bps == pytest.approx(lte.up_mbps * 1e6 / 4)
    assert core.est.link("http").samples == 0
    learnt = core.est.link("http")
    learnt.observe(60_000, 1_000, 0.5, 0.0, 3.0)
    assert not core.link_changed("http", lte, 4.0, signal_dbm=-112.0)  # a small move: kept
    assert core.est.link("http") is learnt and learnt.samples == 1
    assert core.link_changed("http", lte, 5.0, signal_dbm=-85.0)  # 27 dB better: a new regime
    assert core.est.link("http").prior_up_bps == pytest.approx(lte.up_mbps * 1e6 * 2)
    assert core.link_changed("http", load_link("wifi"), 6.0)  # another kind of network
    assert core.policy.links["http"].kind == "wifi"


def test_a_probe_or_an_offload_sent_before_a_new_network_does_not_teach_that_network():
    # A probe sent in an outage answers 1.9 s later, once the next network is up: as
    # that network's first RTT it priced every offload 1.9 s slow (the demo stayed local
    # through a good LTE phase); one sent after the change is that network's RTT.
    core = _core()
    lte = load_link("lte")
    assert core.link_changed("http", lte, 10.0, signal_dbm=-125.0)  # the outage
    assert core.link_changed("http", lte, 20.0, signal_dbm=-90.0)  # LTE again
    link = core.est.link("http")
    core.probe_done("http", 20.1, 1.9)  # sent at 18.2, in the outage
    assert link.rtt_s == pytest.approx(lte.rtt_ms / 1000)  # still the prior
    core.probe_done("http", 21.0, 0.05)  # sent at 20.95
    assert link.rtt_s == pytest.approx(0.05)
    # an offload sent in the outage, answered on the new network: no rate learnt from it
    flow = core.begin("m", now=19.0, in_bytes=60_000, connected={"http": True})
    cloud = flow.policy.cloud_option(flow.mp, "http", flow.context(19.0))
    flow._attempt = cloud
    samples = link.samples
    flow.offload_done(21.5, sent=60_000, received=1_000, elapsed_s=2.5)
    assert link.samples == samples


def test_a_hedge_answers_with_the_first_half_and_learns_from_the_second():
    core = _core()
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=1200)
    # Force the choice the policy makes for an exploration with no room to fall back.
    local = flow.policy.local_option(flow.mp, flow.context(1.0))
    cloud = flow.policy.cloud_option(flow.mp, "http", flow.context(1.0))
    action = flow._hedge(1.0, cloud, local, "explore (hedged)")
    assert isinstance(action, Hedge) and action.offload.give_up_at == flow.deadline
    answer = flow.offload_done(1.4, sent=60_000, received=1_000, elapsed_s=0.4)
    assert isinstance(answer, Answer) and answer.where == "cloud-http"
    assert answer.extra["hedged"] and answer.energy_j > cloud.energy_j  # both halves ran
    assert flow.local_done(2.0, 1.0) is None  # the slower half only teaches
    assert core.est.local("m-local").count == 2  # the warm-up and this run


def test_a_hedge_whose_offload_fails_is_answered_locally():
    core = _core()
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=1200)
    local = flow.policy.local_option(flow.mp, flow.context(1.0))
    cloud = flow.policy.cloud_option(flow.mp, "http", flow.context(1.0))
    flow._hedge(1.0, cloud, local, "explore (hedged)")
    assert flow.offload_failed(1.2, DeadlineExceeded("lost")) is None  # wait for the local run
    answer = flow.local_done(2.0, 1.0)
    assert isinstance(answer, Answer) and answer.where == "local" and not answer.fallback


def test_a_breaker_trial_that_says_nothing_of_the_endpoint_is_given_back():
    from shared.errors import ModelNotFound

    core = _core()
    breaker = core.breakers["http"]
    for t in (1.0, 1.1, 1.2):
        breaker.record_failure(t)
    assert breaker.state == "open"
    flow = core.begin("m", now=5.0, in_bytes=60_000, connected={"http": True}, deadline_ms=3000)
    action = flow.start()
    assert isinstance(action, Hedge)  # the request carries the half-open trial
    flow.offload_failed(5.2, ModelNotFound("no such model"))
    assert core.usable(6.0, {"http": True}) == {"http": True}  # not stuck half-open
    assert core.breakers["http"].ready(6.0)


def test_a_cascade_keeps_its_local_answer_when_the_cloud_calls_the_input_bad():
    core = _core(mode="cascade")
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=5000)
    assert isinstance(flow.start(), RunLocal)
    action = flow.local_done(2.0, 1.0, confidence=0.3)  # unsure: ask the cloud
    assert isinstance(action, Offload)
    answer = flow.offload_failed(2.2, InvalidInput("the cloud refuses it"))
    assert isinstance(answer, Answer) and answer.where == "local"


def test_a_model_the_cloud_cannot_load_cools_down_alone_and_the_transport_stays_open():
    from shared.errors import EndpointUnavailable, ModelNotReady

    models = {
        name: ModelPolicy(mode="cost", local_model=f"{name}-local", cloud_model=name)
        for name in ("a", "b")
    }
    config = PolicyConfig(weights=Weights(latency_s=1.0), models=models)
    core = fresh_core(config, load_device("raspberry-pi-4b"), {"http": load_link("lte")})
    core.warmed("a-local", 1.0, 0.0)
    core.warmed("b-local", 1.0, 0.0)
    now = 1.0
    for _ in range(5):  # more failures than any breaker threshold
        flow = core.begin("a", now=now, in_bytes=60_000, connected={"http": True})
        action = flow.start()
        if isinstance(action, Offload):
            flow.offload_failed(now + 0.1, ModelNotReady("model 'a' failed to load"))
        now += 0.5
    assert core.breakers["http"].state == "closed"
    flow = core.begin("a", now=now, in_bytes=60_000, connected={"http": True})
    assert isinstance(flow.start(), RunLocal)  # 'a' cools down on this transport
    flow = core.begin("b", now=now, in_bytes=60_000, connected={"http": True})
    assert isinstance(flow.start(), Offload)  # every other model still goes out
    # an unreachable endpoint is the transport's trouble: it counts on the breaker
    for _ in range(5):
        flow = core.begin("b", now=now, in_bytes=60_000, connected={"http": True})
        action = flow.start()
        if isinstance(action, Offload):
            flow.offload_failed(now + 0.1, EndpointUnavailable("connection refused"))
        now += 0.5
    assert core.breakers["http"].state == "open"


def _begin(core, deadline_ms: float = 3000, **kw):
    """A 60 KB request for "m" at t=1 s with the HTTP link up."""
    return core.begin(
        "m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=deadline_ms, **kw
    )


def _begin_cancellable(core, deadline_ms: float = 3000):
    flow = _begin(core, deadline_ms, local_cancellable=True)
    action = flow.start()
    assert isinstance(action, Hedge) and action.local_at is not None, action
    return flow, action


def test_a_late_reply_stops_a_cancellable_local_run_and_pays_only_what_it_ran():
    from edge.core.energy import local_energy_j
    from edge.core.flow import LOCAL_RUNS_TO_CANCEL

    core = _core(journal=100)
    for k in range(LOCAL_RUNS_TO_CANCEL - 1):  # with the warm-up: enough finished runs
        core.warmed("m-local", 1.0, 0.1 * k)
    flow, action = _begin_cancellable(core)
    assert flow.context(1.0).local_cancellable  # the policy prices the partial run too
    flow.race_due(action.local_at)
    answer = flow.offload_done(action.local_at + 0.2, sent=60_000, received=1_000, elapsed_s=1.0)
    assert isinstance(answer, Answer) and answer.where == "cloud-http"
    assert answer.cancel_local and answer.extra["local_cancelled"]
    ran_j = local_energy_j(core.policy.device, 0.2)
    assert answer.energy_j == pytest.approx(answer.option.energy_j + ran_j)
    # replayed, the same events (the flag in "begin" included) decide alike
    replica = _core(journal=100)
    replica.events.clear()
    events = [e for e in core.events if e[0] != "warmed" or e[3] > 0.0]
    assert [d.where for d in replay_journal(events, replica)] == [d.where for d in core.decisions]


def test_a_stopped_local_run_that_outlasted_its_estimate_teaches_a_slower_device():
    # Stopped runs taught nothing: a device that slowed down while the cloud kept
    # winning its races was believed fast, and its fallbacks started too late.
    from edge.core.flow import LOCAL_RUNS_TO_CANCEL

    core = _core()
    for k in range(LOCAL_RUNS_TO_CANCEL - 1):
        core.warmed("m-local", 1.0, 0.1 * k)
    local = core.est.local("m-local")
    before = local.mean
    flow, action = _begin_cancellable(core)
    flow.race_due(action.local_at)
    flow.offload_done(action.local_at + 0.5, sent=60_000, received=1_000, elapsed_s=1.0)
    assert local.mean == before  # stopped sooner than it is believed to take: nothing
    flow, action = _begin_cancellable(core)
    flow.race_due(action.local_at)
    flow.offload_done(action.local_at + 2.5, sent=60_000, received=1_000, elapsed_s=1.0)
    assert local.mean > before  # it ran 2.5 s of a 1 s model: at least that slow now


def test_a_young_local_estimate_keeps_the_local_run_going_to_learn_from_it():
    core = _core(journal=100)  # one warm-up run only
    flow, action = _begin_cancellable(core)
    flow.race_due(action.local_at)
    answer = flow.offload_done(action.local_at + 0.2, sent=60_000, received=1_000, elapsed_s=1.0)
    assert isinstance(answer, Answer) and not answer.cancel_local
    assert answer.energy_j == pytest.approx(answer.option.energy_j + flow._local_option.energy_j)
    assert flow.local_done(action.local_at + 1.0, 1.0) is None  # it ran out, and taught
    assert core.est.local("m-local").count == 2


def test_a_blind_probe_wakes_the_radio_only_for_a_link_a_request_would_have_used():
    from edge.core.flow import BLIND_PROBE_S

    def opened(core):
        breaker = core.breakers["http"]
        for _ in range(10):
            breaker.record_failure(0.0)
        assert breaker.state != "closed"
        return breaker

    # a 1 s local run: the cloud would pay had the link been up; a blind probe goes
    core = _core()
    opened(core)
    core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}).start()
    assert core.probes(BLIND_PROBE_S + 1.0) == ["http"]
    # a 1 ms local run: no link at any speed beats it; no wake-up to learn it is back
    core = _core()
    core.est.local("m-local").add(0.001, 0.5)
    for _ in range(30):
        core.est.local("m-local").add(0.001, 0.5)
    opened(core)
    core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}).start()
    assert core.probes(BLIND_PROBE_S + 1.0) == []


def test_a_wake_up_beside_the_local_run_waits_for_its_reply_past_the_deadline():
    # LTE from idle, a 380 ms deadline: the promotion alone makes the offload late, so
    # it goes beside the local run, and its reply is awaited to its own tail: cut at
    # the deadline it would teach a failure that was only the radio waking up.
    core = _core(energy=0.0)
    core.est.set_link_prior("http", 8e6, 32e6, 0.07)  # the signal's hint: a good cell
    core.warmed("m-local", 0.25, 0.0)
    for _ in range(20):
        core.est.local("m-local").add(0.25, 0.0)
    action = None
    for t in (0.0, 2.0, 4.0, 6.0):  # arrivals: the rate the warm run is priced at
        flow = core.begin("m", now=t, in_bytes=60_000, connected={"http": True}, deadline_ms=380)
        action = flow.start()
        if isinstance(action, Hedge):
            break
        assert isinstance(action, RunLocal)
        flow.local_done(t + 0.25, 0.25)
    assert isinstance(action, Hedge) and action.local_at is None, action
    assert "wake the radio (hedged)" in flow.decision.reason
    assert action.offload.give_up_at == pytest.approx(t + flow.decision.choice.latency_q_s)
    assert action.offload.give_up_at > flow.deadline
    # The local run answers; the late reply only teaches the link.
    answer = flow.local_done(t + 0.25, 0.25)
    assert isinstance(answer, Answer) and answer.where == "local"
    assert flow.offload_done(t + 0.45, sent=60_000, received=1_000, elapsed_s=0.45) is None
    assert core.est.link("http").samples == 1


def test_the_share_of_requests_that_used_the_radio_follows_the_decisions():
    core = _core()
    assert core.radio_share is None
    flow = core.begin("m", now=1.0, in_bytes=60_000, connected={"http": True}, deadline_ms=3000)
    used = isinstance(flow.start(), Offload | Hedge)  # an offload, raced or hedged
    assert core.radio_share == (1.0 if used else 0.0)
    core.used_radio(not used)
    assert core.radio_share == pytest.approx(0.8 if used else 0.2)  # an EWMA: ~10 requests


def test_a_request_that_would_offload_in_a_warm_run_counts_as_using_the_radio():
    # Counting only the offloads made, the first requests after a wake-up price
    # their offload as the last to use the radio, run locally, and the run ends.
    from edge.core.flow import _warm_run_offloads
    from edge.core.policy import Decision, Option

    def local(cost: float) -> Option:
        return Option("local", None, 0.3, 0.35, 1.7, 0, 0, 0.0, cost=cost)

    def cloud(cost: float, latency_q_s: float = 0.16, **kw) -> Option:
        return Option(
            "cloud-http", "http", 0.15, latency_q_s, 5.0, 60_000, 1_000, 0.0, cost=cost, **kw
        )

    def counts(*options: Option) -> bool:
        return _warm_run_offloads(Decision(options[0], list(options), "least cost"), 0.4)

    # Warm radio: dearer alone, cheaper once the next request shares its tail.
    assert counts(local(0.35), cloud(0.50, shared_saving=0.2))
    assert not counts(local(0.35), cloud(0.50, shared_saving=0.1))
    # Cold radio: judged at its warm cost, even where the promotion misses the deadline now
    late = {"feasible": False, "reason": "deadline", "promotion_s": 0.26}
    assert counts(local(0.35), cloud(1.1, warm_cost=0.2, **late))
    assert not counts(local(0.35), cloud(1.1, warm_cost=0.2, latency_q_s=0.7, **late))
    assert not counts(local(0.35), cloud(1.1, warm_cost=0.2, feasible=False, reason="no link"))
    assert not counts(local(0.35), cloud(1.1, warm_cost=0.4))
    # An offload made uses it; no choice does not.
    assert _warm_run_offloads(Decision(cloud(0.2), [local(0.35), cloud(0.2)], "least cost"), 0.4)
    assert not _warm_run_offloads(Decision(None, [], "no usable option"), 0.4)


def test_an_exploration_counts_in_the_radio_share_as_its_least_cost_option_would():
    # An exploration is an offload the policy would not make on cost: counted as using
    # the radio, it makes the next offloads look as if they shared its tail, and on a
    # link never worth offloading to, explorations bring more offloads after them.
    from edge.core.flow import _warm_run_offloads
    from edge.core.policy import Decision, Option

    local = Option("local", None, 0.3, 0.35, 1.7, 0, 0, 0.0, cost=0.35)
    dear = Option("cloud-http", "http", 0.15, 0.16, 5.0, 60_000, 1_000, 0.0, cost=0.5)
    cheap = Option("cloud-mqtt", "mqtt", 0.15, 0.16, 5.0, 60_000, 1_000, 0.0, cost=0.2)
    explored = Decision(dear, [local, dear], "explore", exploring=True)
    assert not _warm_run_offloads(explored, 0.4)
    assert _warm_run_offloads(Decision(dear, [local, dear], "least cost"), 0.4)
    # Exploring one link while another is the least cost: the request uses the radio.
    assert _warm_run_offloads(Decision(dear, [local, dear, cheap], "explore", exploring=True), 0.4)


def test_a_first_request_reads_its_rate_from_the_wait_since_the_agent_began_serving():
    core = _core()
    core.begin("m", now=1.0, in_bytes=1000, connected={"http": True})
    assert core.rate_per_s("m") is None  # nothing to measure it by
    core = _core()
    core.serving(10.0)
    core.begin("m", now=12.0, in_bytes=1000, connected={"http": True})
    assert core.rate_per_s("m") == pytest.approx(0.5)  # one request in 2 s
    core.begin("m", now=12.1, in_bytes=1000, connected={"http": True})
    assert core.rate_per_s("m") == pytest.approx(10.0)  # the first real gap takes over


def test_a_journal_replays_the_start_of_serving_and_so_the_first_requests_rate():
    core = _core(journal=100)
    core.events.clear()
    core.serving(0.0)
    flow = core.begin("m", now=1.5, in_bytes=60_000, connected={"http": True})
    flow.start()
    replica = _core(journal=100)
    replica.events.clear()
    replay_journal(core.events, replica)
    assert replica.rate_per_s("m") == core.rate_per_s("m") == pytest.approx(1 / 1.5)


def test_the_arrival_rate_is_steady_under_poisson_and_follows_a_burst_or_a_lull():
    core = _core()
    rng = np.random.default_rng(3)
    now, reads = 0.0, []
    for _ in range(400):  # 0.5 requests/s: a gap of 2 s on average, as variable as that
        now += rng.exponential(2.0)
        core.begin("m", now=now, in_bytes=1000, connected={"http": True})
        reads.append(core.rate_per_s("m"))
    steady = np.array(reads[100:]) / 0.5
    # ~40 gaps of memory: nearly always within 30% of the true rate (the last ~10 gaps
    # alone were within it two times in three), and centred on it
    assert np.mean(np.abs(steady - 1) < 0.3) > 0.9 and abs(np.median(steady) - 1) < 0.15
    for _ in range(8):  # a burst: ten times the rate
        now += rng.exponential(0.2)
        core.begin("m", now=now, in_bytes=1000, connected={"http": True})
    assert core.rate_per_s("m") > 1.5  # the long memory alone would still read ~0.7/s
    for _ in range(100):
        now += rng.exponential(0.2)
        core.begin("m", now=now, in_bytes=1000, connected={"http": True})
    for _ in range(3):  # and back to a lull
        now += rng.exponential(2.0)
        core.begin("m", now=now, in_bytes=1000, connected={"http": True})
    assert core.rate_per_s("m") < 1.5


def test_offloads_under_way_count_against_the_data_cap():
    # 20 requests at once each passed the check (the cap counted finished transfers
    # only): 12 MB sent against a 3 MB cap.
    core = _core(data_cap_mb_per_day=1.0)
    wheres = []
    for i in range(4):
        flow = core.begin(
            "m", now=1.0 + i * 0.01, in_bytes=400_000, connected={"http": True}, deadline_ms=9000
        )
        action = flow.start()
        offload = action.offload if isinstance(action, Hedge) else action
        wheres.append("cloud" if isinstance(offload, Offload) else "local")
    assert wheres.count("cloud") == 2  # 0.8 MB under way: a third would pass the cap
    assert core.reserved_mb(2.0) == pytest.approx(0.8, rel=0.05)  # (and replies expected)
    assert core.reserved_mb(1e9) == 0.0  # past their give-up time they no longer count


def test_without_a_data_cap_nothing_is_reserved_and_kept():
    # reservations whose offload never reported its end piled up without a cap
    core = _core()
    for i in range(50):
        flow = core.begin("m", now=1.0 + i, in_bytes=400_000, connected={"http": True})
        flow.start()
    assert core.reserved == {}


@pytest.mark.parametrize("deadline_ms", [300, 2000])
def test_a_deferrable_offload_gives_up_in_time_for_its_receipt_by_the_deadline(deadline_ms):
    # Given up at the deadline, the deferral's durable write came after it (10-16 ms).
    from edge.core.flow import DEFER_RESERVE_S, Defer

    core = _core(mode="cloud")
    core.policy.config.models["m"] = ModelPolicy(mode="cloud", local_model=None, cloud_model="m")
    flow = _begin(core, deadline_ms, deferrable=True)
    action = flow.start()
    assert isinstance(action, Offload)
    reserve = min(DEFER_RESERVE_S, 0.25 * deadline_ms / 1000)
    assert action.give_up_at == pytest.approx(flow.deadline - reserve)
    after = flow.offload_failed(action.give_up_at, DeadlineExceeded("no reply"))
    assert isinstance(after, Defer)


def test_a_missing_version_marks_nothing_missing_live_and_in_the_replay():
    # "No such version" says nothing of the model's others: no missing-model cooldown.
    # Set after begin() and not journalled, it had made the replay decide otherwise.
    from shared.errors import ModelNotFound

    live = _core(journal=1000)
    flow = live.begin(
        "m", now=1.0, in_bytes=60_000, connected={"http": True}, cloud_only=True, versioned=True
    )
    assert isinstance(flow.start(), Offload)
    flow.offload_failed(1.2, ModelNotFound("model 'm' has no version 7"))
    assert not live.missing
    after = live.begin("m", now=2.0, in_bytes=60_000, connected={"http": True})
    after.start()
    replica = _core(journal=100)
    replica.events.clear()
    replayed = replay_journal([e for e in live.events if e[0] != "warmed"], replica)
    assert [d.where for d in replayed] == [d.where for d in live.decisions]
    assert not replica.missing


def test_a_spell_of_slow_replies_does_not_keep_a_cost_mode_agent_local_for_good():
    # A WiFi agent learns its link, then an outage's replies come 2.5 s late: it goes
    # local, and from then on nothing it sends could correct the RTT it learnt.
    models = {"m": ModelPolicy(mode="cost", local_model="m-local", cloud_model="m")}
    config = PolicyConfig(weights=Weights(latency_s=1.0, energy_j=0.05), models=models)
    core = fresh_core(config, load_device("raspberry-pi-4b"), {"http": load_link("wifi")})
    core.warmed("m-local", 0.8, 0.0)

    def request(now: float, elapsed_s: float) -> bool:
        flow = core.begin("m", now=now, in_bytes=1_000, connected={"http": True})
        action = flow.start()
        offload = action.offload if isinstance(action, Hedge) else action
        if not isinstance(offload, Offload):
            flow.local_done(now + 0.8, 0.8)
            return False
        flow.offload_done(now + elapsed_s, sent=1_000, received=1_000, elapsed_s=elapsed_s)
        return True

    assert all(request(2.0 * i, 0.03) for i in range(1, 20))
    spell = [request(40.0 + 2.0 * i, 2.5) for i in range(8)]
    assert not spell[-2]  # the spell is believed: local while it lasts
    assert request(56.0 + 120.0, 0.03)  # two minutes on, the cloud is tried again


def test_a_cloud_only_offload_that_hangs_gives_up_in_time_for_the_other_transport():
    # A hung HTTP endpoint held every cloud-only request to its 504 while MQTT was up.
    models = {"c": ModelPolicy(mode="cloud", local_model=None, cloud_model="c")}
    config = PolicyConfig(models=models)
    wifi = load_link("wifi")
    core = fresh_core(config, load_device("raspberry-pi-4b"), {"http": wifi, "mqtt": wifi})
    both = {"http": True, "mqtt": True}
    flow = core.begin("c", now=1.0, in_bytes=1_000, connected=both, deadline_ms=3000)
    first = flow.start()
    assert isinstance(first, Offload) and first.give_up_at < flow.deadline - 0.1
    second = flow.offload_failed(first.give_up_at, DeadlineExceeded("no reply"))
    assert isinstance(second, Offload), second
    assert second.option.transport != first.option.transport
    assert second.give_up_at == flow.deadline and "instead" in second.reason
    answer = flow.offload_done(first.give_up_at + 0.05, sent=1_000, received=500, elapsed_s=0.05)
    assert isinstance(answer, Answer) and answer.where == second.option.name
    # said as a fallback, paying for the attempt before it
    assert answer.fallback and "instead" in answer.reason
    assert answer.extra["bytes_attempted"] == 1_000
    assert answer.energy_j == pytest.approx(first.option.energy_j + second.option.energy_j)
    # a fast failure moves over at once; a second failure is the answer
    flow = core.begin("c", now=10.0, in_bytes=1_000, connected=both, deadline_ms=3000)
    first = flow.start()
    second = flow.offload_failed(10.01, EndpointUnavailable("connection refused"))
    assert isinstance(second, Offload) and second.option.transport != first.option.transport
    assert isinstance(flow.offload_failed(10.02, EndpointUnavailable("down too")), Fail)
    # the request's own fault is not tried again elsewhere
    flow = core.begin("c", now=20.0, in_bytes=1_000, connected=both, deadline_ms=3000)
    flow.start()
    assert isinstance(flow.offload_failed(20.01, InvalidInput("bad")), Fail)
    # the other transport's short window is its own: given up before an answer could
    # come, it is no failure of that endpoint (it had been timed from the request's start)
    flow = core.begin("c", now=40.0, in_bytes=1_000, connected=both, deadline_ms=3000)
    first = flow.start()
    second = flow.offload_failed(first.give_up_at, DeadlineExceeded("no reply"))
    assert isinstance(second, Offload)
    other = core.breakers[second.option.transport]
    before = other._consecutive
    flow.offload_failed(first.give_up_at + 0.5 * second.option.latency_s, DeadlineExceeded("x"))
    assert other._consecutive == before
    # with one transport usable there is nothing to give up early for
    flow = core.begin("c", now=60.0, in_bytes=1_000, connected={"http": True}, deadline_ms=3000)
    only = flow.start()
    assert isinstance(only, Offload) and only.give_up_at == flow.deadline
