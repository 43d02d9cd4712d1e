"""Trace-driven replay of a policy, beside baselines and the oracle.

A workload of requests is replayed through a simulated link whose capacity
follows an uplink/downlink trace.  *Our* policy is the agent's real
:class:`~edge.policy.Policy` over real :class:`~edge.estimators.Estimators`
that learn from each simulated outcome exactly as the agent learns from
real ones (same ``observe`` calls, the simulation clock as ``now``).
Compute times are drawn from profiles measured on real runtimes
(``ferry-edge profile``).

Requests are independent: each transfer sees the trace's capacity from its
own start (no cross-request queueing), so the per-request oracle, which
knows the trace and picks each request's cheapest feasible outcome, is a
true lower bound on every policy's total cost.  Cost = the policy file's
weighted sum + ``miss_penalty`` per missed deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from devices.profiles import DeviceProfile, LinkProfile
from edge.breaker import CircuitBreaker
from edge.energy import local_energy_j, transfer_energy_j
from edge.estimators import Estimators
from edge.policy import LOCAL, Context, ModelPolicy, Policy, PolicyConfig
from edge.traces import Trace

TRANSPORT = "mqtt"  # the simulated link carries one transport
CLOUD = f"cloud-{TRANSPORT}"


@dataclass(frozen=True)
class Workload:
    count: int = 500
    arrival: str = "poisson"  # poisson | periodic
    rate_per_s: float = 2.0
    input_bytes: int = 602_368
    output_bytes: int = 1_024
    deadline_ms: float = 500.0
    seed: int = 0

    def arrivals(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        if self.arrival == "periodic":
            return np.arange(self.count) / self.rate_per_s
        return np.cumsum(rng.exponential(1.0 / self.rate_per_s, self.count))


@dataclass(frozen=True)
class ComputeProfile:
    """Measured latency samples (seconds) and local top-1 confidences."""

    local_s: tuple[float, ...]
    cloud_s: tuple[float, ...]
    confidences: tuple[float, ...] = ()
    local_speed_factor: float = 1.0  # device slowdown applied to local samples


@dataclass
class Outcome:
    where: str
    latency_s: float
    energy_j: float
    up_bytes: int
    down_bytes: int
    money: float
    missed: bool
    fallback: bool = False


@dataclass
class Result:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)


class Simulator:
    """Computes what each option really costs a request arriving at ``t``."""

    def __init__(
        self,
        up: Trace,
        down: Trace,
        link: LinkProfile,
        device: DeviceProfile,
        profile: ComputeProfile,
        config: PolicyConfig,
        model: str,
        miss_penalty: float,
        seed: int,
    ) -> None:
        self.up, self.down, self.link, self.device = up, down, link, device
        self.profile, self.config, self.model = profile, config, model
        self.miss_penalty = miss_penalty
        self.rtt_s = link.rtt_ms / 1000.0
        rng = np.random.default_rng(seed + 1)
        self._local = np.asarray(profile.local_s) * profile.local_speed_factor
        self._cloud = np.asarray(profile.cloud_s)
        self._conf = np.asarray(profile.confidences or (1.0,))
        self._draws: dict[int, tuple[float, float, float]] = {}
        self._rng = rng

    def draws(self, i: int) -> tuple[float, float, float]:
        """Per-request random compute times and confidence, shared by every policy."""
        found = self._draws.get(i)
        if found is None:
            r = self._rng
            found = (
                float(self._local[r.integers(len(self._local))]),
                float(self._cloud[r.integers(len(self._cloud))]),
                float(self._conf[r.integers(len(self._conf))]),
            )
            self._draws[i] = found
        return found

    def local(self, i: int, t: float, deadline_s: float, spent_s: float = 0.0) -> Outcome:
        compute = self.draws(i)[0]
        latency = spent_s + compute
        return Outcome(
            LOCAL, latency, local_energy_j(self.device, compute), 0, 0, 0.0, latency > deadline_s
        )

    def cloud(
        self, i: int, t: float, up_bytes: int, down_bytes: int, timeout_s: float
    ) -> tuple[Outcome, bool]:
        """(outcome, delivered): not delivered when the reply cannot arrive by ``timeout_s``."""
        server = self.draws(i)[1]
        # Requests are independent, so the radio is taken as idle: promotion first
        # (the same assumption the energy model makes with radio_idle_s=None).
        start = t + self.link.promotion_s
        up_done = self.up.finish_time(start + self.rtt_s / 2, up_bytes)
        reply_at = up_done + server + self.rtt_s / 2
        down_done = self.down.finish_time(reply_at, down_bytes)
        latency = down_done - t
        delivered = math.isfinite(latency) and latency <= timeout_s
        spent = latency if delivered else timeout_s
        up_bps = (
            up_bytes * 8 / max(up_done - start - self.rtt_s / 2, 1e-6)
            if delivered
            else self.link.up_mbps * 1e6
        )
        down_bps = (
            down_bytes * 8 / max(down_done - reply_at, 1e-6)
            if delivered
            else self.link.down_mbps * 1e6
        )
        energy = transfer_energy_j(
            self.link,
            up_bytes,
            down_bytes if delivered else 0,
            up_bps,
            down_bps,
            server + self.rtt_s,
            self.device,
            None,
        )
        money = (up_bytes + down_bytes) / 1e6 * self.link.cost_per_mb if self.link.metered else 0.0
        return Outcome(
            CLOUD, spent, energy, up_bytes, down_bytes if delivered else 0, money, not delivered
        ), delivered

    def cost(self, o: Outcome) -> float:
        w = self.config.weights
        return (
            w.latency_s * o.latency_s
            + w.energy_j * o.energy_j
            + w.data_mb * (o.up_bytes + o.down_bytes) / 1e6
            + w.money * o.money
            + (self.miss_penalty if o.missed else 0.0)
        )


def _cloud_then_fallback(
    sim: Simulator, i: int, t: float, wl: Workload, deadline: float, reserve_s: float | None
) -> Outcome:
    """Offload; when the reply cannot come in time, fall back to local (agent semantics)."""
    timeout = deadline - reserve_s if reserve_s is not None else deadline
    out, ok = sim.cloud(i, t, wl.input_bytes, wl.output_bytes, max(timeout, 0.0))
    if ok or reserve_s is None:
        return out
    fb = sim.local(i, t, deadline, spent_s=out.latency_s)
    fb.energy_j += out.energy_j
    fb.up_bytes, fb.fallback, fb.where = out.up_bytes, True, LOCAL
    return fb


def run_ours(sim: Simulator, wl: Workload, mp: ModelPolicy, name: str = "ferry") -> Result:
    est = Estimators()
    est.set_link_prior(TRANSPORT, sim.link.up_mbps * 1e6, sim.link.down_mbps * 1e6, sim.rtt_s)
    policy = Policy(sim.config, est, sim.device, {TRANSPORT: sim.link})
    breaker = CircuitBreaker()
    deadline = wl.deadline_ms / 1000
    result = Result(name)
    for i, t in enumerate(wl.arrivals()):
        t = float(t)
        if breaker.state != "closed" and breaker.allow(t):
            # the light probe the agent sends: a tiny round trip over the current link
            ok = math.isfinite(sim.up.finish_time(t, 300)) and sim.up.finish_time(t, 300) - t < 2.0
            (breaker.record_success if ok else breaker.record_failure)(t)
        ctx = Context(
            now=t,
            deadline_s=deadline,
            in_bytes=wl.input_bytes,
            connected={TRANSPORT: breaker.state == "closed"},
            radio_idle_s=None,  # the simulator's radio is idle before every request
            out_bytes=wl.output_bytes,
        )
        decision = policy.decide(sim.model, ctx)
        choice = decision.choice
        if choice is None or choice.name == LOCAL:
            out = sim.local(i, t, deadline)
            est.local(mp.local_model or sim.model).add(out.latency_s, t + out.latency_s)
        else:
            local = next((o for o in decision.options if o.name == LOCAL), None)
            reserve = local.latency_q_s * 1.5 if local is not None else None
            if reserve is not None and reserve >= deadline:
                reserve = None  # local cannot make it either: the cloud gets the whole deadline
            out = _cloud_then_fallback(sim, i, t, wl, deadline, reserve)
            done = t + out.latency_s
            if out.fallback or (out.missed and out.where == CLOUD):
                breaker.record_failure(done)
                spent = deadline - reserve if reserve is not None else out.latency_s
                est.link(TRANSPORT).observe_timeout(wl.input_bytes, max(spent, 1e-3), done)
                if out.fallback:
                    est.local(mp.local_model or sim.model).add(sim.draws(i)[0], done)
            else:
                breaker.record_success(done)
                server = sim.draws(i)[1]
                est.observe_reply(mp.cloud_model or sim.model, 0, int(server * 1e6), done)
                # The transport's timer starts once the radio is up (as in the agent).
                est.link(TRANSPORT).observe(
                    out.up_bytes, out.down_bytes, out.latency_s - sim.link.promotion_s, server, done
                )
        result.outcomes.append(out)
        result.arrivals.append(t)
    return result


def run_fixed(sim: Simulator, wl: Workload, name: str, pick: Callable[[int, float], str]) -> Result:
    deadline = wl.deadline_ms / 1000
    result = Result(name)
    for i, t in enumerate(wl.arrivals()):
        t = float(t)
        where = pick(i, t)
        if where == LOCAL:
            out = sim.local(i, t, deadline)
        else:
            out, _ = sim.cloud(i, t, wl.input_bytes, wl.output_bytes, deadline)
        result.outcomes.append(out)
        result.arrivals.append(t)
    return result


def run_static(sim: Simulator, wl: Workload) -> Result:
    """Neurosurgeon-style: one choice from the link's long-run average, never revisited."""
    up_bps = sim.up.mean_mbps() * 1e6
    down_bps = sim.down.mean_mbps() * 1e6
    expected_cloud = (
        sim.rtt_s
        + wl.input_bytes * 8 / max(up_bps, 1)
        + wl.output_bytes * 8 / max(down_bps, 1)
        + float(np.mean(sim.profile.cloud_s))
    )
    expected_local = float(np.mean(sim.profile.local_s)) * sim.profile.local_speed_factor
    where = LOCAL if expected_local <= expected_cloud else CLOUD
    return run_fixed(sim, wl, "static (Neurosurgeon)", lambda i, t: where)


def run_cascade(sim: Simulator, wl: Workload, threshold: float) -> Result:
    """Sedna joint inference: local first; offload when the top-1 confidence is low."""
    deadline = wl.deadline_ms / 1000
    result = Result("cascade (Sedna)")
    for i, t in enumerate(wl.arrivals()):
        t = float(t)
        local = sim.local(i, t, deadline)
        if sim.draws(i)[2] >= threshold:
            out = local
        else:
            cloud, _ = sim.cloud(
                i, t + local.latency_s, wl.input_bytes, wl.output_bytes, deadline - local.latency_s
            )
            out = Outcome(
                CLOUD,
                local.latency_s + cloud.latency_s,
                local.energy_j + cloud.energy_j,
                cloud.up_bytes,
                cloud.down_bytes,
                cloud.money,
                cloud.missed,
            )
        result.outcomes.append(out)
        result.arrivals.append(t)
    return result


def run_oracle(sim: Simulator, wl: Workload) -> Result:
    deadline = wl.deadline_ms / 1000
    result = Result("oracle")
    for i, t in enumerate(wl.arrivals()):
        t = float(t)
        local = sim.local(i, t, deadline)
        cloud, _ = sim.cloud(i, t, wl.input_bytes, wl.output_bytes, deadline)
        result.outcomes.append(min((local, cloud), key=sim.cost))
        result.arrivals.append(t)
    return result


def summarize(sim: Simulator, result: Result) -> dict[str, float]:
    outs = result.outcomes
    lat = np.array([o.latency_s for o in outs]) * 1000
    costs = [sim.cost(o) for o in outs]
    return {
        "mean_cost": float(np.mean(costs)),
        "miss_rate": float(np.mean([o.missed for o in outs])),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "energy_j": float(np.mean([o.energy_j for o in outs])),
        "mb_sent": float(sum(o.up_bytes for o in outs) / 1e6),
        "offload_share": float(np.mean([o.where != LOCAL for o in outs])),
        "fallbacks": float(sum(o.fallback for o in outs)),
    }


def evaluate(
    *,
    up: Trace,
    down: Trace,
    link: LinkProfile,
    device: DeviceProfile,
    profile: ComputeProfile,
    config: PolicyConfig,
    model: str,
    workload: Workload,
    miss_penalty: float = 1.0,
) -> tuple[Simulator, dict[str, Result]]:
    mp = config.models.get(model) or ModelPolicy(local_model=model, cloud_model=model)
    config = PolicyConfig(
        weights=config.weights,
        deadline_quantile=config.deadline_quantile,
        battery_floor_percent=config.battery_floor_percent,
        data_cap_mb_per_day=config.data_cap_mb_per_day,
        default_deadline_ms=config.default_deadline_ms,
        models={
            model: ModelPolicy(
                mode="cost",
                local_model=mp.local_model or model,
                cloud_model=mp.cloud_model or model,
                deadline_ms=workload.deadline_ms,
                transports=(TRANSPORT,),
                output_bytes=workload.output_bytes,
            )
        },
    )
    sim = Simulator(up, down, link, device, profile, config, model, miss_penalty, workload.seed)
    results = {
        "ferry": run_ours(sim, workload, mp),
        "always-local": run_fixed(sim, workload, "always-local", lambda i, t: LOCAL),
        "always-cloud": run_fixed(sim, workload, "always-cloud", lambda i, t: CLOUD),
        "static (Neurosurgeon)": run_static(sim, workload),
        "cascade (Sedna)": run_cascade(sim, workload, mp.cascade_threshold),
        "oracle": run_oracle(sim, workload),
    }
    return sim, results
