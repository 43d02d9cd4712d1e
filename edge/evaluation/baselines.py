"""The known policies ours is compared with, and the oracle that bounds them all.

Each runs over the same :class:`~edge.evaluation.sim.Simulator` with its own
radio (:class:`~edge.core.energy.RadioState`), so a baseline that offloads often
enjoys a warm radio exactly as ours does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge.core.energy import RadioState, local_energy_j
from edge.core.policy import LOCAL
from edge.evaluation.sim import Outcome, Result, Simulator, no_answer

CLOUD = "cloud"  # the baselines' single cloud route (they know no transports)


def run_fixed(sim: Simulator, name: str, pick: Callable[[int, float], str]) -> Result:
    """Local or cloud per request as ``pick`` says; the cloud gets the whole deadline."""
    radio = RadioState()
    req = sim.requests
    result = Result(name)
    for i, t in enumerate(req.arrivals.tolist()):
        if pick(i, t) == LOCAL:
            out = sim.local(i)
        else:
            a = sim.offload(i, t, t + float(req.deadlines_s[i]), radio)
            out = sim.cloud_outcome(i, t, a, CLOUD)
        result.outcomes.append(out)
        result.arrivals.append(t)
    return result


def static_choice(
    sim: Simulator, mean_in_bytes: float, deadline_s: float, rate_per_s: float
) -> str:
    """Neurosurgeon-style: one choice, made offline from the link's long-run mean.

    Both options are priced with the simulator's own latency and energy model
    at the traces' mean rates and the profiles' mean compute times; the radio
    is taken as the workload leaves it when every request is offloaded (idle
    between requests when they are further apart than the tail).  The option
    of least policy cost that meets the deadline wins, else the faster one.
    """
    w = sim.weights
    local_s = float(np.mean(sim.profile.local_s)) * sim.profile.local_speed_factor
    options = {LOCAL: (local_s, local_energy_j(sim.device, local_s), 0.0, 0.0)}
    up_bps, down_bps = sim.up.mean_mbps() * 1e6, sim.down.mean_mbps() * 1e6
    if up_bps > 0 and down_bps > 0:
        server = float(np.mean(sim.profile.cloud_s))
        busy, _, _ = sim.expected_cloud(mean_in_bytes, up_bps, down_bps, server, 0.0)
        gap = 1.0 / rate_per_s - busy  # from one reply to the next request
        idle = max(gap, 0.0) if gap < sim.link.tail_s else None
        latency, energy, money = sim.expected_cloud(mean_in_bytes, up_bps, down_bps, server, idle)
        mb = (mean_in_bytes + sim.output_bytes) / 1e6
        options[CLOUD] = (latency, energy, mb, money)

    def cost(o: tuple[float, float, float, float]) -> float:
        return w.latency_s * o[0] + w.energy_j * o[1] + w.data_mb * o[2] + w.money * o[3]

    feasible = [name for name, o in options.items() if o[0] <= deadline_s]
    if feasible:
        return min(feasible, key=lambda name: cost(options[name]))
    return min(options, key=lambda name: options[name][0])


def run_static(
    sim: Simulator, mean_in_bytes: float, deadline_s: float, rate_per_s: float
) -> Result:
    where = static_choice(sim, mean_in_bytes, deadline_s, rate_per_s)
    return run_fixed(sim, "static (Neurosurgeon)", lambda i, t: where)


def run_cascade(sim: Simulator, threshold: float) -> Result:
    """Sedna joint inference: local first; offload when its top-1 confidence is low.

    The cloud gets what is left of the deadline (nothing tried when nothing
    is left); if it does not answer in that time, the local answer stands,
    given when the cloud was given up on.
    """
    radio = RadioState()
    req = sim.requests
    result = Result("cascade (Sedna)")
    for i, t in enumerate(req.arrivals.tolist()):
        local = sim.local(i)
        left = float(req.deadlines_s[i]) - local.latency_s
        out = local
        if sim.confidence[i] < threshold and left > 0:
            a = sim.offload(i, t + local.latency_s, t + local.latency_s + left, radio)
            latency = a.end - t
            out = Outcome(
                CLOUD if a.delivered else LOCAL,
                latency,
                local.energy_j + a.energy_j,
                a.up_bytes,
                a.down_bytes,
                a.money,
                latency > local.deadline_s + 1e-9,
                local.deadline_s,
                fallback=not a.delivered,
                radio=(a.start, a.end),
            )
        result.outcomes.append(out)
        result.arrivals.append(t)
    return result


def run_oracle(sim: Simulator) -> Result:
    """Each request's cheapest outcome, knowing the trace and every draw in advance.

    Candidates: run locally; offload with the radio idle; offload with the
    radio already connected (no promotion, no tail: the cheapest radio state
    there is); or decline at once (the miss penalty and the whole deadline).
    Any policy's outcome for a request is one of these, or costs at least as
    much as one of them: a fallback costs more than running locally at
    once, a cascade more than its local half, an attempt cut off later costs
    more than one cut off at the deadline, and a radio in its tail pays the
    connected transfer plus some tail.  So the oracle is a per-request lower
    bound; it is not a schedule any single policy could follow (its radio is
    both warm and cold), which is why it may be out of reach.
    """
    req = sim.requests
    result = Result("oracle")
    for i, t in enumerate(req.arrivals.tolist()):
        deadline = float(req.deadlines_s[i])
        candidates = [sim.local(i), no_answer(deadline)]
        for idle in (None, 0.0):
            size, server = int(req.in_bytes[i]), float(sim.server_s[i])
            a = sim.attempt(t, size, sim.output_bytes, server, t + deadline, idle)
            candidates.append(sim.cloud_outcome(i, t, a, CLOUD))
        result.outcomes.append(min(candidates, key=sim.cost))
        result.arrivals.append(t)
    return result
