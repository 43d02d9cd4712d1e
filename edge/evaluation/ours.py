"""Our policy in a replay: the agent's request loop, step for step, on simulated time.

The decisions come from the agent's own objects: :class:`~edge.core.policy.Policy`
over :class:`~edge.core.estimators.Estimators`, one
:class:`~edge.core.breaker.CircuitBreaker` per transport with its defaults, and
:func:`~edge.core.policy.fallback_plan` for when to give up on the cloud.  What
the agent's dataplane does around them is mirrored here, with the
simulation clock as ``now`` (keep the two in step; ``edge/dataplane.py``
is the reference):

* the context: breakers closed -> connected, the data used today (bytes of
  answered offloads, and the bytes sent by failed ones), the radio's idle
  time as the agent's :class:`~edge.core.energy.RadioState` knows it (set when
  an offload is answered), the last reply size, the battery when the
  workload gives one;
* the policy file's mode: ``cost``, ``local``, ``cloud`` (a local variant
  still serves as the fallback) and ``cascade`` (local first, the cloud
  when unsure, the local answer when the cloud fails);
* learning: what the agent learns from an answer, a timeout or a probe is
  applied when it would happen (a completion event at the reply's or the
  give-up's time), not when the request is decided, so a request that
  arrives while an earlier one is in flight decides on what the agent
  knew then;
* the periodic probe (``probe_interval_s``, the agent's 5 s by default): a
  small round trip when a breaker is open (its half-open trial), or when
  the link estimate is older than 30 s and the radio is still up from real
  traffic (a probe from idle would pay a promotion and a whole tail).  A probe wakes the radio like any
  transfer; its energy and bytes are charged to the next request, so the
  cost of keeping estimates fresh shows in ours.

Local runs do not queue in the simulator (see :mod:`edge.evaluation.sim`), so
the context carries no local backlog.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import replace

from edge.core.breaker import CircuitBreaker
from edge.core.energy import RadioState
from edge.core.estimators import Estimators
from edge.core.policy import (
    LOCAL,
    Context,
    ModelPolicy,
    Option,
    Policy,
    PolicyConfig,
    fallback_plan,
)
from edge.dataplane import STALE_PROBE_S
from edge.evaluation.sim import Outcome, Result, Simulator, no_answer

#: The agent's default probe interval (agent.toml ``probe_interval_s``).
PROBE_INTERVAL_S = 5.0


def make_estimators(config: PolicyConfig) -> Estimators:
    """Estimators tracking the policy's deadline quantile, as the agent builds them."""
    return Estimators(quantile=config.deadline_quantile)


class _Agent:
    def __init__(
        self,
        sim: Simulator,
        config: PolicyConfig,
        model: str,
        transports: tuple[str, ...],
        probe_interval_s: float,
        battery_percent: float | None,
        data_used_mb: float,
    ) -> None:
        self.sim, self.model = sim, model
        self.est = make_estimators(config)
        rtt = sim.link.rtt_ms / 1000.0
        for tr in transports:
            self.est.set_link_prior(tr, sim.link.up_mbps * 1e6, sim.link.down_mbps * 1e6, rtt)
        self.policy = Policy(config, self.est, sim.device, {tr: sim.link for tr in transports})
        self.mp = self.policy.model_policy(model)
        self.transports = transports
        self.breakers = {tr: CircuitBreaker() for tr in transports}
        self.known_radio = RadioState()  # what the agent's dataplane records
        self.radio = RadioState()  # the radio itself (energy and promotions)
        self.usage_day, self.usage_mb = 0, data_used_mb
        self.out_bytes: int | None = None
        self.probe_interval_s = probe_interval_s
        self.battery = battery_percent if sim.device.battery_wh else None
        self.drained_j = 0.0  # energy above idle drawn by requests so far
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._overhead = Outcome("probe", 0.0, 0.0, 0, 0, 0.0, False)

    # -- events -------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    def advance(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            heapq.heappop(self._events)[2]()

    # -- what the agent knows -------------------------------------------------------

    def add_usage(self, now: float, nbytes: int) -> None:
        day = int(now // 86400)
        if day != self.usage_day:
            self.usage_day, self.usage_mb = day, 0.0
        self.usage_mb += nbytes / 1e6

    def context(self, now: float, deadline_s: float, in_bytes: int, mp: ModelPolicy) -> Context:
        battery = None
        if self.battery is not None:
            device = self.sim.device
            used_wh = (device.idle_power_w * now + self.drained_j) / 3600.0
            assert device.battery_wh is not None
            battery = max(self.battery - 100.0 * used_wh / device.battery_wh, 0.0)
        return Context(
            now=now,
            deadline_s=deadline_s,
            in_bytes=in_bytes,
            connected={tr: b.state == "closed" for tr, b in self.breakers.items()},
            battery_percent=battery,
            data_used_mb_today=self.usage_mb if int(now // 86400) == self.usage_day else 0.0,
            radio_idle_s=self.known_radio.radio_idle_s(now),
            out_bytes=self.out_bytes,
        )

    # -- probes ---------------------------------------------------------------------

    def probe(self, now: float) -> None:
        """dataplane.probe: one pass over the transports, each probe awaited in turn."""
        for tr in self.transports:
            breaker, link = self.breakers[tr], self.est.link(tr)
            if breaker.state == "closed":
                idle = self.known_radio.radio_idle_s(now)
                warm = idle is not None and idle < self.sim.link.tail_s
                if not link.stale(now, STALE_PROBE_S) or not warm:
                    continue
            elif not breaker.allow(now):
                continue
            a = self.sim.probe(now, self.radio)
            o = self._overhead
            o.energy_j += a.energy_j
            o.up_bytes += a.up_bytes
            o.down_bytes += a.down_bytes
            o.money += a.money
            o.probes += 1
            started = now
            if a.delivered:
                self.at(
                    a.end,
                    lambda b=breaker, s=started, e=a.end, lk=link: self._probe_ok(b, lk, s, e),
                )
            else:
                self.at(a.end, lambda b=breaker, e=a.end: b.record_failure(e))
            now = a.end

    def _probe_ok(self, breaker: CircuitBreaker, link, started: float, now: float) -> None:
        breaker.record_success(now)
        self.known_radio.transfer_done(now)
        link.observe_probe(now - started, now)

    def charge_overhead(self, out: Outcome) -> Outcome:
        o = self._overhead
        if o.probes:
            out.energy_j += o.energy_j
            out.up_bytes += o.up_bytes
            out.down_bytes += o.down_bytes
            out.money += o.money
            out.probes = o.probes
            out.probe_energy_j = o.energy_j
            self._overhead = Outcome("probe", 0.0, 0.0, 0, 0, 0.0, False)
        return out

    # -- one request ------------------------------------------------------------------

    def local(self, i: int, t: float, begin: float = 0.0) -> Outcome:
        out = self.sim.local(i, begin)
        done = t + out.latency_s
        est = self.est.local(self.mp.local_model or self.model)
        self.at(done, lambda s=float(self.sim.local_s[i]): est.add(s, done))
        return out

    def request(self, i: int, t: float) -> Outcome:
        req, mp = self.sim.requests, self.mp
        deadline = t + float(req.deadlines_s[i])
        in_bytes = int(req.in_bytes[i])
        if mp.local_model is None and mp.mode == "local":
            return no_answer(deadline - t)
        mode = mp.mode if mp.local_model is not None else "cloud"
        if mode == "cascade":
            return self.cascade(i, t, deadline, in_bytes)
        decision = self.policy.decide(self.model, self.context(t, deadline - t, in_bytes, mp), mode)
        choice = decision.choice
        if choice is None:
            return no_answer(deadline - t)
        if choice.name == LOCAL:
            return self.local(i, t)
        local = next((o for o in decision.options if o.name == LOCAL), None)
        if local is None and mode == "cloud":
            local = self.policy.local_option(mp)
        return self.offload(i, t, t, deadline, choice, local, in_bytes)[0]

    def offload(
        self,
        i: int,
        t: float,
        now: float,
        deadline: float,
        choice: Option,
        local: Option | None,
        in_bytes: int,
    ) -> tuple[Outcome, bool]:
        """dataplane._offload from ``now`` for request ``i`` that arrived at ``t``.

        Returns the outcome and whether the cloud answered.
        """
        assert choice.transport is not None
        tr = choice.transport
        cloud_deadline, local = fallback_plan(now, deadline, local, choice)
        if self.mp.local_model is None:
            local = None
        a = self.sim.offload(i, now, cloud_deadline, self.radio, in_bytes)
        out = self.sim.cloud_outcome(i, t, a, choice.name)
        if a.delivered:
            # The agent subtracts the promotion it predicted from the transfer's time
            # (unless the transfer was quicker than the promotion).
            start = now + choice.promotion_s if a.end - now > choice.promotion_s else now
            self.at(
                a.end, lambda: self._learn(tr, a.up_bytes, a.down_bytes, start, a.end, a.server_s)
            )
            return out, True
        self.at(a.end, lambda: self._learn_failure(tr, choice.up_bytes, t, a.end))
        if local is not None and deadline - a.end > 0:
            fb = self.local(i, t, begin=a.end - t)
            fb.energy_j += a.energy_j
            fb.up_bytes, fb.down_bytes, fb.money = a.up_bytes, a.down_bytes, a.money
            fb.fallback, fb.radio = True, out.radio
            return fb, False
        return out, False  # the caller gets the timeout error

    def _learn(self, tr: str, sent: int, received: int, start: float, now: float, server: float):
        self.breakers[tr].record_success(now)
        self.est.observe_reply(self.mp.cloud_model or self.model, 0, int(server * 1e6), now)
        self.est.link(tr).observe(sent, received, now - start, server, now)
        self.known_radio.transfer_done(now)
        self.add_usage(now, sent + received)
        self.out_bytes = received

    def _learn_failure(self, tr: str, up_bytes: int, start: float, now: float) -> None:
        self.add_usage(now, up_bytes)
        self.breakers[tr].record_failure(now)
        self.est.link(tr).observe_timeout(up_bytes, now - start, now)

    def cascade(self, i: int, t: float, deadline: float, in_bytes: int) -> Outcome:
        """dataplane._cascade: local first, the cloud when unsure, else the local answer."""
        mp = self.mp
        local = self.local(i, t)
        if self.sim.confidence[i] >= mp.cascade_threshold:
            return local
        now = t + local.latency_s
        self.advance(now)  # the agent decides after its local run, knowing what it knows then
        ctx = self.context(now, deadline - now, in_bytes, mp)
        decision = self.policy.decide(self.model, ctx, "cloud")
        if decision.choice is None:
            return local
        cloud_only = replace(mp, local_model=None)
        saved, self.mp = self.mp, cloud_only
        try:
            out, answered = self.offload(i, t, now, deadline, decision.choice, None, in_bytes)
        finally:
            self.mp = saved
        out.energy_j += local.energy_j
        if answered:
            return out
        # The offload failed: the local answer, given when the cloud was given up on.
        local.latency_s = out.latency_s
        local.missed = local.missed or out.latency_s > local.deadline_s + 1e-9
        local.energy_j = out.energy_j
        local.up_bytes, local.down_bytes, local.money = out.up_bytes, out.down_bytes, out.money
        local.fallback, local.radio = True, out.radio
        return local

    def run(self, name: str) -> Result:
        arrivals = self.sim.requests.arrivals.tolist()
        if self.probe_interval_s > 0 and arrivals:
            last, k = arrivals[-1], 1
            while k * self.probe_interval_s <= last:
                self.at(
                    k * self.probe_interval_s, lambda p=k * self.probe_interval_s: self.probe(p)
                )
                k += 1
        result = Result(name)
        for i, t in enumerate(arrivals):
            self.advance(t)
            out = self.charge_overhead(self.request(i, t))
            self.drained_j += max(out.energy_j - self.sim.device.idle_power_w * out.latency_s, 0.0)
            result.outcomes.append(out)
            result.arrivals.append(t)
        return result


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
) -> Result:
    """Replay the workload through the agent's decision loop with ``config`` as given."""
    mp = Policy(config, Estimators(), sim.device, {}).model_policy(model)
    chosen = tuple(transports if transports is not None else mp.transports)
    agent = _Agent(sim, config, model, chosen, probe_interval_s, battery_percent, data_used_mb)
    return agent.run(name)
