"""Our policy in the replay behaves as the agent does: the policy file as given,
the data cap, the battery, the radio, the fallback plan, the breaker and the probe."""

from __future__ import annotations

import math

import pytest

from devices.profiles import load_device, load_link
from edge.core.policy import ModelPolicy, PolicyConfig, Weights
from edge.evaluation.evaluate import ComputeProfile, Workload, evaluate, summarize
from edge.evaluation.ours import make_estimators
from edge.netem.traces import from_phases, steady

SLOW_LOCAL = ComputeProfile((1.0,), (0.01,), (0.9, 0.3), 1.0)  # a heavy model, a fast cloud


def _config(energy: float = 0.0, **model: object) -> PolicyConfig:
    extra = {k: model.pop(k) for k in list(model) if k in PolicyConfig.__dataclass_fields__}
    model.setdefault("transports", ("mqtt",))
    return PolicyConfig(
        weights=Weights(latency_s=1.0, energy_j=energy),
        models={"m": ModelPolicy(local_model="m-local", cloud_model="m", **model)},
        **extra,
    )


def _run(config, *, up=None, down=None, profile=SLOW_LOCAL, device="raspberry-pi-4b", **wl):
    workload = Workload(
        **{"count": 60, "rate_per_s": 1.0, "input_bytes": 60_000, "deadline_ms": 3000.0, **wl}
    )
    return evaluate(
        up=up or steady(20, 120),
        down=down or steady(20, 120),
        link=load_link("lte"),
        device=load_device(device),
        profile=profile,
        config=config,
        model="m",
        workload=workload,
    )


def _where(ev, name="ferry"):
    return [o.where for o in ev.results[name].outcomes]


def test_the_policy_files_mode_is_honoured():
    assert set(_where(_run(_config(mode="local")))) == {"local"}
    cloud = _run(_config(mode="cloud"))
    assert set(_where(cloud)) == {"cloud-mqtt"}
    cost = _where(_run(_config()))
    assert cost.count("cloud-mqtt") > 40  # priced: the cloud is faster than a 1 s local run


def test_the_policy_files_transports_are_honoured():
    assert set(_where(_run(_config(mode="cloud", transports=("http",))))) == {"cloud-http"}
    # both listed: both ride the same link, each with its own estimates and breaker;
    # the policy moves between them only where it pays, never to one not listed
    both = set(_where(_run(_config(mode="cloud", transports=("mqtt", "http")))))
    assert both and both <= {"cloud-mqtt", "cloud-http"}


def test_cascade_mode_offloads_exactly_the_unsure_local_answers():
    ev = _run(_config(mode="cascade", cascade_threshold=0.8))
    conf = ev.sim.confidence
    for i, o in enumerate(ev.results["ferry"].outcomes):
        assert (o.where == "cloud-mqtt") == (conf[i] < 0.8), i
        if o.where == "cloud-mqtt":
            assert o.latency_s > ev.sim.local_s[i]  # local first, then the cloud


def test_the_daily_data_cap_binds():
    # 602 KB a request (~0.6 MB with the reply): a 3 MB cap allows four offloads
    capped = _config(data_cap_mb_per_day=3.0)
    where = _where(_run(capped, input_bytes=602_368, rate_per_s=0.5))
    assert where.count("cloud-mqtt") == 4
    last = max(i for i, w in enumerate(where) if w == "cloud-mqtt")
    assert where[last + 1 :] == ["local"] * (len(where) - last - 1)
    assert _where(_run(_config(), input_bytes=602_368, rate_per_s=0.5)).count("cloud-mqtt") > 40
    # usage already on the books when the replay starts counts too
    ev = _run(capped, input_bytes=602_368, rate_per_s=0.5, data_used_mb=2.0)
    assert _where(ev).count("cloud-mqtt") == 1
    # in cloud mode the local variant is the fallback: capped requests run locally, not refused
    ev = _run(_config(mode="cloud", data_cap_mb_per_day=3.0), input_bytes=602_368)
    capped_where = _where(ev)
    assert capped_where.count("cloud-mqtt") == 4 and capped_where.count("none") == 0
    ours = ev.results["ferry"].outcomes
    assert all(o.fallback for o in ours if o.where == "local")


def test_a_low_battery_makes_energy_the_objective():
    # 0.8 s locally at the laptop's 30 W beats 8 Mbps LTE on latency, not on energy
    profile = ComputeProfile((0.8,), (0.01,), (0.9,), 1.0)
    run = {
        pct: _run(
            _config(explore_after_s=0.0),
            up=steady(8, 120),
            profile=profile,
            device="x86-laptop",
            input_bytes=602_368,
            battery_percent=pct,
        )
        for pct in (90.0, 10.0)
    }
    assert summarize(run[90.0].sim, run[90.0].results["ferry"])["offload_share"] < 0.1
    assert summarize(run[10.0].sim, run[10.0].results["ferry"])["offload_share"] > 0.9
    low = run[10.0].results["ferry"].outcomes
    assert sum(o.energy_j for o in low) < sum(
        o.energy_j for o in run[90.0].results["ferry"].outcomes
    )


def test_a_low_battery_counts_on_a_device_profile_without_a_battery_size():
    # The agent applies the floor to what its battery reader says (a Pi on a UPS board);
    # the replay ignored the workload's level where the profile gives no battery size.
    from devices.profiles import load_device

    assert not load_device("raspberry-pi-4b").battery_wh
    profile = ComputeProfile((0.3,), (0.01,), (0.9,), 1.0)  # 2.4 s on the Pi: offloaded
    run = {
        pct: _run(_config(explore_after_s=0.0), profile=profile, battery_percent=pct)
        for pct in (None, 10.0)
    }
    shares = {p: summarize(r.sim, r.results["ferry"])["offload_share"] for p, r in run.items()}
    assert shares[None] > 0.9 and shares[10.0] == 0.0  # below the floor: least energy


def test_what_the_agent_learns_arrives_when_the_request_completes():
    # ten requests a second, 1 s locally, a fast cloud: requests overlap, and the
    # flow hears of each run or reply at the simulated moment it ends
    from edge.evaluation.ours import make_core, run_ours

    ev = _run(_config(), arrival="periodic", rate_per_s=10.0, count=40)
    core = make_core(ev.sim, _config(), ("mqtt",), journal=10_000)
    outs = run_ours(ev.sim, _config(), "m", core=core).outcomes
    arrivals = ev.sim.requests.arrivals
    begun = {e[1]: e[3] for e in core.events if e[0] == "begin"}
    done = [e for e in core.events if e[0] in ("local_done", "offload_done")]
    assert len(done) >= len(outs)
    times = [e[2] for e in core.events if e[0] in ("local_done", "offload_done", "offload_failed")]
    assert times == sorted(times)  # fed back in the order they happen
    ends = sorted(float(arrivals[i]) + o.latency_s for i, o in enumerate(outs))
    first: dict[int, float] = {}  # a hedged request hears of both: the first answers
    for e in done:
        first[e[1]] = min(first.get(e[1], math.inf), e[2])
    answered = sorted(first.values())
    assert answered == pytest.approx(ends)  # each at the moment its request was answered
    assert all(e[2] > begun[e[1]] for e in done)  # never at the decision


def test_an_outage_falls_back_at_the_planned_time_and_opens_the_breaker():
    link = from_phases([(20, 20.0), (20, 0.0), (40, 20.0)])
    # energy priced: an offload's local run waits until the deadline needs it
    ev = _run(_config(energy=0.05), up=link, down=link, count=80)
    sim, outs = ev.sim, ev.results["ferry"].outcomes
    arrivals = sim.requests.arrivals
    in_outage = [i for i, t in enumerate(arrivals) if 20 <= t < 40]
    fallbacks = [i for i in in_outage if outs[i].fallback]
    assert 1 <= len(fallbacks) <= 3  # the breaker opens after three failures
    for i in fallbacks:
        o = outs[i]
        # the local run started when it had to for the deadline, and answered when it
        # ended; the attempt was not abandoned then: it raced on to the deadline
        started = o.latency_s - sim.local_s[i]
        assert 0 < started <= o.deadline_s - sim.local_s[i]
        assert o.radio[1] - arrivals[i] == pytest.approx(o.deadline_s)
        assert not o.missed and o.up_bytes == 0  # nothing crossed a dead link
    direct = [i for i in in_outage if i > fallbacks[-1]]
    assert direct and all(outs[i].where == "local" and not outs[i].missed for i in direct)
    # no more waiting on the dead link: a request that still tried it (the breaker's
    # trial) did so beside its local run, answered when that run ended
    for i in direct:
        assert not outs[i].fallback
        assert outs[i].latency_s == pytest.approx(sim.local_s[i])


def test_an_outage_with_latency_alone_never_waits_and_probes_bring_the_link_back():
    link = from_phases([(20, 20.0), (20, 0.0), (40, 20.0)])
    # energy free: each offload runs locally beside it, so a dead link costs no wait
    ev = _run(_config(), up=link, down=link, count=80)
    sim, outs = ev.sim, ev.results["ferry"].outcomes
    arrivals = sim.requests.arrivals
    in_outage = [i for i, t in enumerate(arrivals) if 20 <= t < 40]
    assert all(outs[i].where == "local" and not outs[i].missed for i in in_outage)
    assert all(outs[i].latency_s == pytest.approx(sim.local_s[i]) for i in in_outage)
    tried = [i for i in in_outage if outs[i].radio is not None and not outs[i].probes]
    assert 1 <= len(tried) <= 3  # the breaker opens after three failures
    for i in tried:  # the attempt ran on beside the local answer, to the deadline
        assert outs[i].radio[1] - arrivals[i] == pytest.approx(outs[i].deadline_s)
        assert outs[i].up_bytes == 0  # nothing crossed a dead link
    assert sum(o.probes for o in outs) > 0  # the open breaker was probed ...
    back = [outs[i].where for i, t in enumerate(arrivals) if t > 48]
    assert back.count("cloud-mqtt") > 0.8 * len(back)  # ... and closed again after the tunnel
    for i, o in enumerate(outs):  # a probe's radio energy is charged to the next request
        if o.probes and o.where == "local" and not o.fallback:
            assert o.energy_j > 6.4 * sim.local_s[i] + 1.0


def test_estimators_track_the_policys_deadline_quantile():
    est = make_estimators(PolicyConfig(deadline_quantile=0.99))
    assert getattr(est, "quantile", 0.99) == 0.99


def test_a_race_the_cloud_wins_after_its_local_run_started_pays_only_the_part_it_ran():
    # A device that has run its 1 s model often (the estimate rests on enough runs to
    # stop one halfway) and a 1.4 s deadline: no room to fall back after an offload,
    # so each offload races a local run due at ~0.25 s, and the reply (60 KB up at
    # 2 Mbit/s, ~0.3 s) comes after it started.  A runtime that takes a cancel stops
    # the local run there; one that cannot runs it out.
    from dataclasses import replace

    from edge.core.flow import LOCAL_RUNS_TO_CANCEL
    from edge.evaluation.ours import make_core, run_ours
    from edge.evaluation.sim import Simulator

    device = load_device("raspberry-pi-4b")
    config = _config()
    workload = Workload(count=40, rate_per_s=1.0, input_bytes=60_000, deadline_ms=1400.0)
    runs = {}
    for cancellable in (False, True):
        sim = Simulator(
            up=steady(2, 120),
            down=steady(20, 120),
            link=load_link("lte"),
            device=device,
            profile=replace(SLOW_LOCAL, local_cancellable=cancellable),
            weights=config.weights,
            requests=workload.draw(1400.0),
            output_bytes=workload.output_bytes,
            miss_penalty=1.0,
            seed=0,
        )
        core = make_core(sim, config, ("mqtt",))
        for k in range(max(LOCAL_RUNS_TO_CANCEL, 20)):  # a settled estimate: due at ~0.25 s
            core.warmed("m-local", 1.0, -1.0 - k)
        runs[cancellable] = run_ours(sim, config, "m", core=core).outcomes
    kept, stopped = runs[False], runs[True]
    # energy is not weighed here, so the decisions are the same; only the spending differs
    assert [o.where for o in kept] == [o.where for o in stopped]
    assert not any(o.missed for o in stopped)
    won = [i for i, o in enumerate(stopped) if o.where == "cloud-mqtt" and o.latency_s > 0.26]
    assert len(won) > 20  # races the reply won after the local run had started
    full_run_j = device.compute_power_w * 1.0
    for i in won:  # each stopped well before its end (the reply took under 0.75 s)
        assert kept[i].energy_j - stopped[i].energy_j > 0.5 * full_run_j
