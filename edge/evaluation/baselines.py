"""The known policies ours is compared with, and the oracle that bounds them all.

Each runs over the same :class:`~edge.evaluation.sim.Simulator` with its own
radio (:class:`~edge.core.energy.RadioState`), so a baseline that offloads often
enjoys a warm radio exactly as ours does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

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


def run_bound(sim: Simulator) -> Result:
    """A per-request lower bound: each request's cheapest outcome, alone.

    Candidates: run locally; offload with the radio idle; offload with the
    radio already connected (no promotion, no tail: the cheapest radio state
    there is); or decline at once (the miss penalty and the whole deadline).
    Any policy's outcome for a request is one of these, or costs at least as
    much as one of them: a fallback costs more than running locally at
    once, a cascade more than its local half, an attempt cut off later costs
    more than one cut off at the deadline, and a radio in its tail pays the
    connected transfer plus some tail.  So the oracle is a per-request lower
    bound; it is not a schedule any single policy could follow (its radio is
    both warm and cold), so it is far out of reach wherever the radio's tail
    matters: :func:`run_oracle` is the bound policies are graded against.
    """
    req = sim.requests
    result = Result("bound")
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


def run_oracle(sim: Simulator) -> Result:
    """The cheapest schedule for the whole workload, knowing the trace and every draw.

    A dynamic programme over the requests in arrival order whose state is
    the one radio's last transfer end (the radio is what couples requests:
    a transfer in the tail of the previous one skips the promotion and pays
    only the tail that ran).  Per request: run locally; decline; offload
    from a sleeping radio; offload from the radio as the schedule left it
    (paying ``tail_power_w`` for the idle time since its last transfer); or
    offload on a radio "pre-warmed" by something outside the schedule, at
    the price any warming costs at least (a promotion and a whole tail) but
    with no promotion delay.  That last option, and tail idle time priced
    at the tail's power however long, make it a lower bound on the total
    cost of any policy, probes and failed attempts included (an attempt
    keeps the radio at or above tail power while it lasts).  Unlike
    :func:`run_bound` it is a schedule one radio can follow, so a policy can
    come close to it.
    """
    req, link, device = sim.requests, sim.link, sim.device
    p_tail = link.tail_power_w
    warm_up_j = (link.promotion_power_w + device.idle_power_w) * link.promotion_s + (
        p_tail * link.tail_s
    )
    horizon = warm_up_j / p_tail if p_tail > 0 else link.tail_s
    # state: last transfer end (None: asleep) -> (cost so far, chain of outcomes)
    states: dict[float | None, tuple[float, tuple | None]] = {None: (0.0, None)}
    for i, t in enumerate(req.arrivals.tolist()):
        deadline = float(req.deadlines_s[i])
        size, server = int(req.in_bytes[i]), float(sim.server_s[i])
        cold = sim.attempt(t, size, sim.output_bytes, server, t + deadline, None)
        warm = sim.attempt(t, size, sim.output_bytes, server, t + deadline, 0.0)
        cold_out = sim.cloud_outcome(i, t, cold, CLOUD)
        warm_out = sim.cloud_outcome(i, t, warm, CLOUD)
        pre_out = _with_energy(warm_out, warm_out.energy_j + warm_up_j)
        stay = min((sim.local(i), no_answer(deadline)), key=sim.cost)
        stay_cost = sim.cost(stay)
        nxt: dict[float | None, tuple[float, tuple | None]] = {}

        def offer(
            end: float | None, cost: float, out: Outcome, chain: tuple | None, t: float = t, nxt=nxt
        ) -> None:
            if end is not None and t - end > horizon:
                end = None  # as good as asleep
            best = nxt.get(end)
            if best is None or cost < best[0]:
                nxt[end] = (cost, (out, chain))

        for end, (cost, chain) in states.items():
            offer(end, cost + stay_cost, stay, chain)
            after = cold.end if end is None else max(end, cold.end)
            offer(after, cost + sim.cost(cold_out), cold_out, chain)
            after = warm.end if end is None else max(end, warm.end)
            offer(after, cost + sim.cost(pre_out), pre_out, chain)
            if end is not None:
                gap = max(t - end, 0.0)
                out = _with_energy(warm_out, warm_out.energy_j + p_tail * gap)
                offer(after, cost + sim.cost(out), out, chain)
        states = nxt
    _, chain = min(states.values(), key=lambda v: v[0])
    outcomes: list[Outcome] = []
    while chain is not None:
        out, chain = chain
        outcomes.append(out)
    outcomes.reverse()
    return Result("oracle", outcomes, req.arrivals.tolist())


def _with_energy(out: Outcome, energy_j: float) -> Outcome:
    return replace(out, energy_j=energy_j)
