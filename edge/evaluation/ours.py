"""Our policy in a replay: the agent's own flow, driven on simulated time.

The agent's per-request logic lives in :mod:`edge.core.flow` (decide,
fallback plan, exploration, probes, breaker, cascade, learning); the live
dataplane drives it with sockets and this module drives the very same
:class:`~edge.core.flow.EdgeCore` with the simulator of
:mod:`edge.evaluation.sim`.  Nothing of the agent is re-implemented here:
an action is turned into a simulated outcome, and the event that ends it
(a local run done, a reply in, a give-up) is fed back to the flow *at the
simulated time it happens*, so a request that arrives while an earlier one
is in flight decides on what the agent knew then.

The replay's radio is the simulator's (energy and promotions are charged
from the trace); the agent's idea of the radio is the core's, as live.
Link probes run on the agent's cadence (``probe_interval_s``); a probe's
energy and bytes are charged to the next request, so the cost of keeping
estimates fresh shows in ours.  Local runs do not queue in the simulator
(see :mod:`edge.evaluation.sim`), so the context carries no local backlog.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge.core.energy import RadioState, local_energy_j
from edge.core.estimators import Estimators
from edge.core.flow import (
    Action,
    Answer,
    Defer,
    EdgeCore,
    Fail,
    Hedge,
    Offload,
    RequestFlow,
    RunLocal,
    fresh_core,
)
from edge.core.policy import Policy, PolicyConfig
from edge.evaluation.sim import EPS, Outcome, Result, Simulator
from shared.errors import DeadlineExceeded

#: The agent's default probe interval (agent.toml ``probe_interval_s``).
PROBE_INTERVAL_S = 5.0

# Completions before arrivals at the same instant: the agent learns, then decides.
_DONE, _ARRIVE = 0, 1


def make_estimators(config: PolicyConfig) -> Estimators:
    """Estimators tracking the policy's deadline quantile, as the agent builds them."""
    return Estimators(quantile=config.deadline_quantile)


def make_core(
    sim: Simulator, config: PolicyConfig, transports: tuple[str, ...], journal: int = 0
) -> EdgeCore:
    """The core an agent on ``sim``'s device and link starts with (link priors from its profile)."""
    links = {tr: sim.link for tr in transports}
    return fresh_core(
        config, sim.device, links, journal=journal, day=lambda now: str(int(now // 86400))
    )


@dataclass
class _Spent:
    """What one request has cost so far, from the simulator's ground truth."""

    energy_j: float = 0.0
    up_bytes: int = 0
    down_bytes: int = 0
    money: float = 0.0
    probes: int = 0
    probe_energy_j: float = 0.0
    radio: tuple[float, float] | None = None
    spans: list[tuple[float, float]] = field(default_factory=list)


class _Replay:
    def __init__(
        self,
        sim: Simulator,
        core: EdgeCore,
        model: str,
        probe_interval_s: float,
        battery_percent: float | None,
    ) -> None:
        self.sim, self.core, self.model = sim, core, model
        self.radio = RadioState()  # the radio itself (the core keeps the agent's view)
        self.probe_interval_s = probe_interval_s
        # (a profile without a battery size, a Pi on a UPS board: the level stays put,
        # and the agent still applies the floor to what its battery reader says)
        self.battery = battery_percent
        self.drained_j = 0.0  # energy above idle drawn by requests so far
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._overhead = _Spent()
        self._local_runs: dict[int, list[float]] = {}  # request -> [start, compute] running
        self.outcomes: list[Outcome | None] = [None] * len(sim.requests)

    def at(self, when: float, fn: Callable[[], None], prio: int = _DONE) -> None:
        heapq.heappush(self._events, (when, prio, next(self._seq), fn))

    # -- requests ---------------------------------------------------------------------

    def battery_now(self, now: float) -> float | None:
        if self.battery is None:
            return None
        device = self.sim.device
        if not device.battery_wh:
            return self.battery
        used_wh = (device.idle_power_w * now + self.drained_j) / 3600.0
        return max(self.battery - 100.0 * used_wh / device.battery_wh, 0.0)

    def arrive(self, i: int, t: float) -> None:
        req = self.sim.requests
        mp = self.core.policy.model_policy(self.model)
        spent, self._overhead = self._overhead, _Spent()
        flow = self.core.begin(
            self.model,
            now=t,
            in_bytes=int(req.in_bytes[i]),
            connected=dict.fromkeys(self.core.transports, True),
            local_available=mp.local_model is not None,
            deadline_ms=float(req.deadlines_s[i]) * 1000.0,
            battery=self.battery_now(t),
            local_cancellable=self.sim.profile.local_cancellable,
        )
        self.step(i, t, flow, flow.start(), t, spent)

    def step(
        self, i: int, t: float, flow: RequestFlow, action: Action | None, now: float, spent: _Spent
    ) -> None:
        """Carry out ``action`` for request ``i`` (arrived at ``t``) at simulated ``now``."""
        sim = self.sim
        if action is None:
            return  # a hedge's other half: what it taught is learnt, the answer stands
        if isinstance(action, Hedge):
            at = action.local_at
            if at is None:
                self.step(i, t, flow, action.local, now, spent)
            else:  # a race: the local run is due at ``at`` unless answered by then
                self.at(at, lambda: self.step(i, t, flow, flow.race_due(at), at, spent))
            self.step(i, t, flow, action.offload, now, spent)
        elif isinstance(action, RunLocal):
            compute = float(sim.local_s[i])
            spent.energy_j += local_energy_j(sim.device, compute)
            done = now + compute
            conf = float(sim.confidence[i])
            self._local_runs[i] = [now, compute]

            def local_end() -> None:
                if self._local_runs.pop(i, None) is None:
                    return  # cancelled: it never finished, and taught nothing
                self.step(i, t, flow, flow.local_done(done, compute, conf), done, spent)

            self.at(done, local_end)
        elif isinstance(action, Offload):
            a = sim.offload(i, now, action.give_up_at, self.radio, flow.in_bytes)
            spent.energy_j += a.energy_j
            spent.up_bytes += a.up_bytes
            spent.down_bytes += a.down_bytes
            spent.money += a.money
            spent.radio = (a.start, a.end)
            end = a.end
            if a.delivered:

                def reply() -> None:
                    nxt = flow.offload_done(
                        end,
                        sent=a.up_bytes,
                        received=a.down_bytes,
                        elapsed_s=end - now,
                        compute_us=int(a.server_s * 1e6),
                    )
                    self.step(i, t, flow, nxt, end, spent)

                self.at(end, reply)
            else:
                error = DeadlineExceeded("no reply before the agent gave up")
                self.at(
                    end, lambda: self.step(i, t, flow, flow.offload_failed(end, error), end, spent)
                )
        elif isinstance(action, (Answer, Fail, Defer)):
            if isinstance(action, Answer) and action.cancel_local:
                run = self._local_runs.pop(i, None)
                if run is not None:  # stopped now: the part it did not run is not spent
                    spent.energy_j -= local_energy_j(sim.device, run[0] + run[1] - now)
            self.finish(i, t, action, now, spent)

    def finish(self, i: int, t: float, action: Action, now: float, spent: _Spent) -> None:
        if self.outcomes[i] is not None:
            return  # answered already (a hedge answers once)
        deadline = float(self.sim.requests.deadlines_s[i])
        latency = now - t
        answered = isinstance(action, Answer)
        out = Outcome(
            action.where if isinstance(action, Answer) else "none",
            latency,
            spent.energy_j,
            spent.up_bytes,
            spent.down_bytes,
            spent.money,
            not answered or latency > deadline + EPS,
            deadline,
            fallback=isinstance(action, Answer) and action.fallback,
            radio=spent.radio,
            probes=spent.probes,
            probe_energy_j=spent.probe_energy_j,
        )
        idle = self.sim.device.idle_power_w * latency
        self.drained_j += max(out.energy_j - spent.probe_energy_j - idle, 0.0)
        self.outcomes[i] = out

    # -- probes -----------------------------------------------------------------------

    def probe(self, now: float) -> None:
        """dataplane.probe: the core's probes, each awaited in turn."""
        for name in self.core.probes(now):
            started = now
            a = self.sim.probe(now, self.radio)
            o = self._overhead
            o.energy_j += a.energy_j
            o.probe_energy_j += a.energy_j
            o.up_bytes += a.up_bytes
            o.down_bytes += a.down_bytes
            o.money += a.money
            o.probes += 1
            end = a.end
            if a.delivered:
                self.at(end, lambda n=name, s=started, e=end: self.core.probe_done(n, e, e - s))
            else:
                self.at(end, lambda n=name, e=end: self.core.probe_failed(n, e))
            now = end

    # -- the run ------------------------------------------------------------------------

    def run(self, name: str) -> Result:
        arrivals = self.sim.requests.arrivals.tolist()
        if self.probe_interval_s > 0 and arrivals:
            k = 1
            while k * self.probe_interval_s <= arrivals[-1]:
                p = k * self.probe_interval_s
                self.at(p, lambda p=p: self.probe(p), _ARRIVE)
                k += 1
        for i, t in enumerate(arrivals):
            self.at(t, lambda i=i, t=t: self.arrive(i, t), _ARRIVE)
        while self._events:
            heapq.heappop(self._events)[3]()
        assert all(o is not None for o in self.outcomes), "every request gets one answer"
        return Result(name, list(self.outcomes), list(arrivals))  # type: ignore[arg-type]


def run_ours(
    sim: Simulator,
    config: PolicyConfig,
    model: str,
    *,
    transports: tuple[str, ...] | None = None,
    probe_interval_s: float = PROBE_INTERVAL_S,
    battery_percent: float | None = None,
    data_used_mb: float = 0.0,
    name: str = "ferry",
    core: EdgeCore | None = None,
) -> Result:
    """Replay the workload through the agent's flow with ``config`` as given."""
    mp = Policy(config, Estimators(), sim.device, {}).model_policy(model)
    chosen = tuple(transports if transports is not None else mp.transports)
    core = core or make_core(sim, config, chosen)
    if mp.local_model is not None:
        # The agent times its warm-up runs at start (Agent._warm_up): as many draws.
        runs = np.asarray(sim.profile.local_s) * sim.profile.local_speed_factor
        for seconds in np.random.default_rng(0).choice(
            runs, core.latency_seeds(config.warm_up_runs)
        ):
            core.warmed(mp.local_model, float(seconds), 0.0)
    if data_used_mb:
        core.usage.add(int(data_used_mb * 1e6), 0.0)
    core.serving(0.0)  # the workload's arrivals count from the agent's start
    return _Replay(sim, core, model, probe_interval_s, battery_percent).run(name)
