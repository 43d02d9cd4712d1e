"""Trace-driven replay of a policy file, beside baselines and the oracle.

A workload of requests (:mod:`edge.evaluation.workload`) is replayed through
a simulated link whose capacity follows an uplink and a downlink trace
(:mod:`edge.evaluation.sim`, which states the model and its one big
simplification: requests do not share the link).  *Our* policy is the
agent's real :class:`~edge.core.policy.Policy`, estimators, breaker and fallback
plan, driven by a replica of the agent's request loop
(:mod:`edge.evaluation.ours`); the policy file is used as given, mode and
transports included.  The baselines and the oracle
(:mod:`edge.evaluation.baselines`) run through the same simulator.
Deterministic given the workload's seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devices.profiles import DeviceProfile, LinkProfile
from edge.core.policy import LOCAL, ModelPolicy, PolicyConfig
from edge.evaluation.baselines import run_cascade, run_fixed, run_oracle, run_static
from edge.evaluation.ours import PROBE_INTERVAL_S, run_ours
from edge.evaluation.sim import ComputeProfile, Outcome, Result, Simulator
from edge.evaluation.workload import MAX_REPLAY_S, MAX_REQUESTS, Range, Workload
from edge.netem.traces import Trace
from shared.errors import ConfigError

__all__ = [
    "BASELINES",
    "ComputeProfile",
    "Evaluation",
    "Outcome",
    "Range",
    "Result",
    "Simulator",
    "Workload",
    "evaluate",
    "summarize",
]

BASELINES = ("always-local", "always-cloud", "static (Neurosurgeon)", "cascade (Sedna)")


#: Link probes a replay may simulate (each is an event with its own transfer).
MAX_PROBES = 1_000_000


@dataclass
class Evaluation:
    sim: Simulator
    results: dict[str, Result]
    static_choice: str

    def __iter__(self):  # (sim, results) = evaluate(...) keeps working
        return iter((self.sim, self.results))


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
    transports: tuple[str, ...] | None = None,
    probe_interval_s: float = PROBE_INTERVAL_S,
) -> Evaluation:
    """Replay ``workload`` through every policy; ``config`` is used unchanged.

    A workload without deadlines takes the policy's (the model's
    ``deadline_ms``, else the default); ``transports`` are those the agent
    has endpoints for (default: all the model's policy lists).
    """
    mp = config.models.get(model) or ModelPolicy(local_model=model, cloud_model=model)
    default_ms = mp.deadline_ms or config.default_deadline_ms
    if workload.count > MAX_REQUESTS:
        raise ConfigError(f"workload: at most {MAX_REQUESTS:,} requests, got {workload.count}")
    requests = workload.draw(default_ms)
    span = float(requests.arrivals[-1]) if len(requests.arrivals) else 0.0
    if not span <= MAX_REPLAY_S:
        raise ConfigError(
            f"workload: its requests span {span:.3g} s; a replay spans at most "
            f"{MAX_REPLAY_S:.0f} s (30 days)"
        )
    if probe_interval_s > 0 and span / probe_interval_s > MAX_PROBES:
        raise ConfigError(
            f"probe interval {probe_interval_s:g} s over a {span:.6g} s replay makes "
            f"{span / probe_interval_s:.3g} probes; at most {MAX_PROBES:,}: a longer interval"
        )
    sim = Simulator(
        up=up,
        down=down,
        link=link,
        device=device,
        profile=profile,
        weights=config.weights,
        requests=requests,
        output_bytes=workload.output_bytes,
        miss_penalty=miss_penalty,
        seed=workload.seed,
    )
    typical_deadline_s = workload.typical_deadline_ms(default_ms) / 1000.0
    static = run_static(sim, workload.mean_in_bytes(), typical_deadline_s, workload.rate_per_s)
    results = {
        "ferry": run_ours(
            sim,
            config,
            model,
            transports=transports,
            probe_interval_s=probe_interval_s,
            battery_percent=workload.battery_percent,
            data_used_mb=workload.data_used_mb,
        ),
        "always-local": run_fixed(sim, "always-local", lambda i, t: LOCAL),
        "always-cloud": run_fixed(sim, "always-cloud", lambda i, t: "cloud"),
        "static (Neurosurgeon)": static,
        "cascade (Sedna)": run_cascade(sim, mp.cascade_threshold),
        "oracle": run_oracle(sim),
    }
    where = "local" if static.outcomes and static.outcomes[0].where == LOCAL else "cloud"
    return Evaluation(sim, results, where)


def overlap_share(result: Result) -> float:
    """Share of offload attempts that started while an earlier one was still on the link."""
    spans = [o.radio for o in result.outcomes if o.radio is not None]
    if not spans:
        return 0.0
    overlapped, busy_until = 0, -np.inf
    for start, end in spans:
        overlapped += start < busy_until
        busy_until = max(busy_until, end)
    return overlapped / len(spans)


def summarize(sim: Simulator, result: Result) -> dict[str, float]:
    outs = result.outcomes
    if not outs:
        raise ValueError(f"{result.name}: no requests were replayed")
    # an unanswered request counts at least its deadline (as Simulator.cost charges it),
    # never as an instant answer
    lat = (
        np.array(
            [max(o.latency_s, o.deadline_s) if o.where == "none" else o.latency_s for o in outs]
        )
        * 1000
    )
    costs = [sim.cost(o) for o in outs]
    return {
        "mean_cost": float(np.mean(costs)),
        "miss_rate": float(np.mean([o.missed for o in outs])),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "energy_j": float(np.mean([o.energy_j for o in outs])),
        "mb_sent": float(sum(o.up_bytes for o in outs) / 1e6),
        "mb_received": float(sum(o.down_bytes for o in outs) / 1e6),
        "offload_share": float(np.mean([o.where not in (LOCAL, "none") for o in outs])),
        "fallbacks": float(sum(o.fallback for o in outs)),
        "probes": float(sum(o.probes for o in outs)),
        "overlap_share": overlap_share(result),
    }
