"""The agent's per-request flow, sans I/O: events in, actions out.

One :class:`EdgeCore` holds what the agent knows between requests (policy,
estimators, breakers, radio state, data used, reply sizes, models the
cloud said it lacks).  Each request is a :class:`RequestFlow` it begins:
the flow answers every event with the next :class:`Action` (run locally,
offload, defer, answer, fail).  Nothing here awaits, opens a socket or
reads a clock: every event carries its ``now``.

Two drivers run it.  The live :class:`~edge.dataplane.EdgeDataPlane` turns
actions into runtime calls and transfers on the event loop; the replay
(:mod:`edge.evaluation.ours`) turns them into simulated outcomes on
simulated time.  So a policy author's replay makes the agent's decisions,
with the agent's fallback plan, breaker, probes and learning.

Every event a core sees can be kept in a bounded journal; feeding a journal
to a fresh core (:func:`replay_journal`) repeats its decisions exactly,
which is how the live agent and the replay are held to one flow.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from devices.profiles import DeviceProfile, LinkProfile
from edge.core.accounting import Usage
from edge.core.breaker import CircuitBreaker
from edge.core.energy import RadioState, local_energy_j, wake_energy_j
from edge.core.estimators import Estimators, signal_factor
from edge.core.policy import (
    LOCAL,
    NO_ROOM,
    Context,
    Decision,
    ModelPolicy,
    Option,
    Policy,
    PolicyConfig,
    fallback_plan,
    fallback_reserve_s,
    late_only_for_promotion,
    race_start_s,
    reduce_by_init,
)
from edge.core.quantile import Ewma
from shared.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    IdempotencyConflict,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    PayloadTooLarge,
    error_from_code,
)

# Errors that say the endpoint (not this request) is in trouble: only these
# count towards a transport's circuit breaker.  A 404 or a bad input says
# nothing about whether the next request to another model will succeed.
ENDPOINT_FAILURES = (EndpointUnavailable, DeadlineExceeded, Overloaded)
#: how long before the deadline a cascade's offload gives up, so that the local answer
#: it holds goes out by the deadline
CASCADE_ANSWER_S = 0.02
# How long a cloud that answered "no such model" is not asked for it again.
MISSING_MODEL_COOLDOWN_S = 30.0
# How long a model the cloud says is not ready (failed load, unloading) is not
# offloaded on that transport; the transport stays open for every other model.
NOT_READY_MODEL_COOLDOWN_S = 10.0
#: Time kept before a deferrable request's deadline for its receipt (the store's durable
#: write, an fsync: receipts came 10-16 ms past a 300 ms deadline without it).
DEFER_RESERVE_S = 0.05
# The least time a stored (deferred) request is given to cross the link.
DEFERRED_SEND_S = 30.0
# A link estimate older than this is refreshed by a probe (when the radio is up).
STALE_PROBE_S = 30.0
# An open breaker is probed from an idle radio only when waking the radio costs
# less than this (WiFi: ~0.2 J; LTE: a promotion and a ~12 J tail), or after
# this long without a word from the link; otherwise a request the policy
# prices as worth it carries the breaker's trial.
PROBE_WAKE_J = 1.0
BLIND_PROBE_S = 60.0
# A blind probe is sent only if a request within this long would have offloaded
# over the link, were it up (at any speed: what a probe could find out).
WANTED_S = 300.0
# A signal that moves this much is a new radio regime (a cell edge, a new cell).
SIGNAL_JUMP_DB = 6.0
# Events kept for replay by default (a bounded ring; 0 keeps none).
JOURNAL_EVENTS = 0
# Finished local runs (the warm-up's included) before a race's local run may be
# stopped when the cloud answers first: a stopped run teaches nothing, and the
# race starts its local run by the latency those runs taught.
LOCAL_RUNS_TO_CANCEL = 5
#: the memory of a model's mean request size (the typical offload of a run)
IN_BYTES_ALPHA = 0.1
RADIO_SHARE_ALPHA = 0.2  # the last ~10 requests' use of the radio
# A model's arrival rate: EWMAs of the gaps between its requests.  The long one (~40
# gaps) is the estimate: Poisson gaps are so variable that the last ~10 alone put the
# rate off by a third, and a rate read low prices every offload's radio tail too long.
# The short one (~10 gaps) watches for a change: when the two part by RATE_SHIFT either
# way, the long memory restarts from the short one (a burst, a lull, a new app).
RATE_FAST, RATE_SLOW, RATE_SHIFT = 0.2, 0.05, 2.0


# ---- actions -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunLocal:
    """Run the request on the local model, then report :meth:`RequestFlow.local_done`."""

    option: Option | None
    reason: str
    fallback: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True, slots=True)
class Offload:
    """Send the request over ``option.transport``; stop waiting at ``give_up_at``."""

    option: Option
    cloud_model: str
    give_up_at: float
    reason: str

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True, slots=True)
class Hedge:
    """Run locally and offload at once; the first answer is the request's.

    Both outcomes are reported (``local_done``, then ``offload_done`` or
    ``offload_failed``, in whatever order they happen); the one after the
    answer only teaches, and its event returns no action.
    """

    local: RunLocal
    offload: Offload
    # A race: the local run starts only at this time (call RequestFlow.race_due
    # then), or when the offload fails first; None runs it at once.
    local_at: float | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True, slots=True)
class Defer:
    """Store the request and answer it later (``deadline_ms`` None: no deadline)."""

    reason: str
    deadline_ms: float | None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True, slots=True)
class Answer:
    """The request is answered: by the last local run, or by the cloud's reply."""

    where: str  # LOCAL or the cloud option's name
    option: Option | None
    reason: str
    fallback: bool
    energy_j: float
    sent: int = 0
    received: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # The cloud answered a race or hedge while its local run still goes on: stop it
    # (its runtime takes a cancel; the energy above is what it ran until now).
    cancel_local: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


@dataclass(frozen=True, slots=True)
class Fail:
    """The request is answered with ``error``."""

    error: FerryError

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


Action = RunLocal | Offload | Hedge | Defer | Answer | Fail


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One choice the flow made, for explanations and the live-vs-replay check."""

    flow: int
    now: float
    where: str
    reason: str
    predicted_s: float | None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_by_init(self)


def _cost(o: Option) -> float:
    return o.cost


def _warm_run_offloads(decision: Decision, deadline_s: float) -> bool:
    """Whether the request would use the radio in a warm run (radio up, its tail
    shared with the next request's): what the radio share counts.

    Counting only the offloads made would end at once every run the wake-up
    rule begins: the first warm requests would price each offload as if it
    were the last to use the radio, keep running locally, and the share
    would never rise.  A cold option counts at its warm cost, its deadline
    (``deadline_s`` from now) judged without the promotion (the wake-up
    rule's terms).  An exploration counts as its least cost option would: it
    is no sign that the next offloads will share its tail, and counted as
    one, every exploration of a link never worth it would bring more offloads.
    """
    choice = decision.choice
    if decision.exploring:
        choice = min((o for o in decision.options if o.feasible), key=_cost, default=None)
    if choice is None or choice.transport is not None:
        return choice is not None
    cost = choice.cost
    for o in decision.options:
        if o.transport is None:
            continue
        if o.warm_cost is None:
            if o.feasible and o.cost - o.shared_saving < cost:
                return True
        elif o.warm_cost < cost and (
            o.feasible or o.reason == NO_ROOM or late_only_for_promotion(o, deadline_s)
        ):
            return True
    return False


def _other_route(options: list[Option], choice: Option) -> Option | None:
    """The cheapest usable cloud option over another transport than ``choice``'s."""
    best: Option | None = None
    for o in options:
        if o.transport is None or o.transport == choice.transport:
            continue
        if not o.feasible and o.reason != "deadline":  # (no link, the data cap)
            continue
        if best is None or o.cost < best.cost:
            best = o
    return best


# ---- one request ---------------------------------------------------------------


class RequestFlow:
    """One request from arrival to its one answer (see the module doc)."""

    __slots__ = (
        "_alternative",
        "_answered",
        "_attempt",
        "_attempt_at",
        "_cascade_local",
        "_failed_attempt",
        "_fallback",
        "_hedging",
        "_local_option",
        "_local_started",
        "_local_started_at",
        "_reason",
        "_was_fallback",
        "batch",
        "battery",
        "began",
        "budget_ms",
        "connected",
        "core",
        "deadline",
        "decision",
        "deferrable",
        "id",
        "in_bytes",
        "local_backlog",
        "local_cancellable",
        "mode",
        "model",
        "mp",
        "policy",
        "versioned",
        "wants_confidence",
    )

    def __init__(
        self,
        core: EdgeCore,
        fid: int,
        model: str,
        mp: ModelPolicy,
        start: float,
        deadline: float,
        in_bytes: int,
        batch: int,
        connected: dict[str, bool],
        local_backlog: int,
        battery: float | None,
        deferrable: bool,
        mode: str,
        budget_ms: float,
        local_cancellable: bool = False,
    ) -> None:
        self.core, self.id, self.model, self.mp = core, fid, model, mp
        self.began, self.deadline = start, deadline
        self.in_bytes, self.batch = in_bytes, batch
        self.connected, self.local_backlog, self.battery = connected, local_backlog, battery
        self.deferrable, self.mode, self.budget_ms = deferrable, mode, budget_ms
        self.local_cancellable = local_cancellable
        # The app asked for a version of the model: the cloud's "no such version" says
        # nothing of the model (two such 404s had made every app's requests for it
        # skip the cloud for the missing-model cooldown).
        self.versioned = False
        self.policy = core.policy  # one snapshot for the whole request
        self.decision: Decision | None = None
        self._attempt: Option | None = None  # the offload in flight or given up on
        self._fallback: Option | None = None
        # A cloud-only model's other transport: tried when the offload fails in time
        self._alternative: Option | None = None
        self._failed_attempt: Option | None = None  # the attempt the alternative follows
        self._attempt_at = start  # when the attempt in flight was sent
        self._cascade_local: Answer | None = None
        self._local_option: Option | None = None
        self._reason = ""
        self._was_fallback = False
        self._hedging = self._answered = False
        self._local_started = True  # False while a race's local run waits for its time
        self._local_started_at = start  # when a hedge's or race's local run started
        self.wants_confidence = mode == "cascade"

    # -- the context the policy reads --------------------------------------------

    def context(self, now: float, mp: ModelPolicy | None = None) -> Context:
        core, mp = self.core, mp or self.mp
        return Context(  # (by position, in Context's field order: keywords cost ~0.2 us)
            now,
            self.deadline - now,  # deadline_s
            self.in_bytes,
            core.usable(now, self.connected, mp.cloud_model),  # connected
            self.battery,  # battery_percent
            # data_used_mb_today (read only against a cap: the day costs a clock read)
            core.usage.today(now) + core.reserved_mb(now)
            if self.policy.config.data_cap_mb_per_day is not None
            else 0.0,
            core.radio.radio_idle_s(now),
            core.out_bytes.get(self.model),
            self.batch,
            self.local_backlog if mp.local_model else 0,
            core.rate_per_s(self.model),
            self._cancels_local(mp),  # local_cancellable
            core.radio_share,
            core._in_bytes.get(self.model),  # mean_in_bytes
        )

    def _cancels_local(self, mp: ModelPolicy) -> bool:
        """Whether a race's local run is stopped when the cloud answers first.

        Only once the local latency rests on ``LOCAL_RUNS_TO_CANCEL`` finished
        runs: a stopped run teaches nothing of it, and a race starts its local
        run by that estimate, so the estimate must not starve while young.
        """
        if not self.local_cancellable or mp.local_model is None:
            return False
        est = self.core.est.local_known(mp.local_model, self.batch)  # (creates no entry)
        return est is not None and est.count >= LOCAL_RUNS_TO_CANCEL

    def _decide(self, now: float, mode: str, mp: ModelPolicy) -> Decision:
        decision = self.policy.decide_for(mp, self.context(now, mp), mode)
        self.core.used_radio(_warm_run_offloads(decision, self.deadline - now))
        self.decision = decision
        self.core.recent[self.model] = (now, decision)  # what a blind probe asks of
        if self.core.decisions is not None:
            choice = decision.choice
            self.core.decisions.append(
                DecisionRecord(
                    self.id,
                    now,
                    choice.name if choice else "none",
                    decision.reason,
                    choice.latency_s if choice else None,
                )
            )
        return decision

    # -- events ------------------------------------------------------------------

    def start(self) -> Action:
        """The first action, decided at arrival."""
        core, mp, now = self.core, self.mp, self.began
        core._journal(("start", self.id, now))
        if self.mode == "cascade":
            return self._run_local(self.policy.local_option(mp), "cascade: local first")
        if self.mode == "deferred":
            return self._send_deferred(now)
        decision = self._decide(now, self.mode, mp)
        choice = decision.choice
        if choice is None and self.mode == "cloud" and mp.local_model is not None:
            # Cloud by choice, but a local variant beats an error when no link is usable.
            option = self.policy.local_option(mp, self.context(now))
            return self._run_local(option, f"cloud unusable ({decision.reason}): local", True)
        if choice is None:
            if self.deferrable:
                return Defer(decision.reason, self.budget_ms)
            detail = ", ".join(f"{o.name}: {o.reason}" for o in decision.options) or "no options"
            return Fail(
                ModelNotReady(f"model {self.model!r} cannot run now: {decision.reason} ({detail})")
            )
        if choice.name == LOCAL:
            return self._run_local(choice, decision.reason)
        options = decision.options
        local = options[0] if options and options[0].transport is None else None
        if decision.hedge and local is not None and mp.local_model is not None:
            return self._hedge(now, choice, local, decision.reason)
        if choice.race_s is not None and local is not None and mp.local_model is not None:
            return self._hedge(now, choice, local, decision.reason, now + choice.race_s)
        if local is None and self.mode == "cloud":
            # Cloud by choice, but a local variant still beats an error when the cloud fails.
            local = self.policy.local_option(mp)
        return self._offload(now, choice, local, decision.reason, options)

    def _send_deferred(self, now: float) -> Action:
        # A stored request: nobody waits on it, so the cloud gets three times
        # what the link is expected to take (at least the deferred budget).
        decision = self._decide(now, "cloud", self.mp)
        choice = decision.choice
        if choice is None:
            return Fail(ModelNotReady(decision.reason))
        assert choice.transport is not None and self.mp.cloud_model is not None
        self.core.breakers[choice.transport].allow(now)
        self._attempt, self._fallback = choice, None
        give_up = now + max(DEFERRED_SEND_S, 3 * choice.latency_q_s)
        return self._sent(Offload(choice, self.mp.cloud_model, give_up, "deferred"), now)

    def _hedge(
        self, now: float, choice: Option, local: Option, reason: str, local_at: float | None = None
    ) -> Hedge:
        assert choice.transport is not None and self.mp.cloud_model is not None
        run = self._run_local(local, reason, local_at is not None and local_at > now)
        self.core.breakers[choice.transport].allow(now)
        self._attempt, self._fallback, self._hedging = choice, None, True
        self._local_started = local_at is None or local_at <= now
        if self._local_started:
            local_at = None
            self._local_started_at = now
        # The attempt runs its course (to the deadline, or to its own predicted tail
        # where that is later: a wake-up beside the local run): what it teaches is its
        # point, and a reply cut short would teach a failure that was only a promotion.
        tail = now + choice.latency_q_s
        give_up = tail if tail > self.deadline else self.deadline
        return Hedge(
            run, self._sent(Offload(choice, self.mp.cloud_model, give_up, reason), now), local_at
        )

    def _sent(self, offload: Offload, now: float) -> Offload:
        """An offload begins: its bytes count against the daily cap from now (until it
        ends, or at the latest its give-up time), so requests deciding meanwhile see them."""
        self.core.reserve(self.id, offload.option, offload.give_up_at, now)
        self._attempt_at = now
        return offload

    def race_due(self, now: float) -> RunLocal | None:
        """A race's local run is due (its ``local_at``): the run, unless already answered."""
        self.core._journal(("race_due", self.id, now))
        if self._answered or self._local_started:
            return None
        self._local_started, self._local_started_at = True, now
        attempt = self._attempt
        assert attempt is not None
        waited = (now - self.began) * 1000.0
        why = f"{attempt.name}: no reply in {waited:.0f} ms, the local run races it"
        return self._run_local(self._local_option, why, self._was_fallback)

    def _run_local(self, option: Option | None, reason: str, fallback: bool = False) -> RunLocal:
        # What the local answer will carry, kept for local_done.
        self._local_option, self._reason, self._was_fallback = option, reason, fallback
        return RunLocal(option, reason, fallback)

    def _offload(
        self,
        now: float,
        choice: Option,
        local: Option | None,
        reason: str,
        options: list[Option] | None = None,
    ) -> Offload | Hedge:
        assert choice.transport is not None and self.mp.cloud_model is not None
        give_up, local = fallback_plan(now, self.deadline, local, choice)
        if local is not None and self.mp.local_model is not None:
            # The local run starts when it must to make the deadline, and the offload
            # is not abandoned then: it races the local run, and a late reply still
            # answers if it comes first (an abandoned one is a wasted upload).  With
            # nothing given up, the cloud's trusted tail need not delay the local run.
            due = self.deadline - now - fallback_reserve_s(local)
            if due > 0.0:
                return self._hedge(now, choice, local, reason, now + race_start_s(choice, due))
        self.core.breakers[choice.transport].allow(now)  # a half-open breaker's trial
        self._attempt = choice
        self._fallback = local if self.mp.local_model is not None else None
        if self._fallback is None and options:
            # Nothing to run here: another transport is the fallback.  The attempt gives
            # up in time for it as it would for a local run (a hung HTTP endpoint had
            # held every cloud-only request to its 504 while MQTT was up); one that
            # cannot fit after it still takes over from an attempt that fails fast.
            other = _other_route(options, choice)
            if other is not None:
                give_up, self._alternative = fallback_plan(now, self.deadline, other, choice)
        if self.deferrable and self._fallback is None:
            # A deferral is the answer if the offload fails: its receipt (a durable
            # write) must come by the deadline too, not a store write after it.
            reserve = min(DEFER_RESERVE_S, 0.25 * max(self.deadline - now, 0.0))
            give_up = min(give_up, self.deadline - reserve)
        return self._sent(Offload(choice, self.mp.cloud_model, give_up, reason), now)

    def _learn_stopped(self, ran_s: float, now: float) -> None:
        """A local run stopped after ``ran_s`` without its answer: the model takes at
        least that long.  Where that is more than it is believed to take, it is learnt
        (a lower bound: still short of the truth).  Stopped runs had taught nothing, so
        a device that slowed down (heat, a busier CPU) while the cloud kept winning its
        races was still believed fast, and its fallbacks started too late to answer in
        time.  Only a run that queued behind none (its time is its compute)."""
        mp = self.mp
        if self.local_backlog or mp.local_model is None:
            return
        est = self.core.est.local(mp.local_model, self.batch)
        mean = est.mean
        if mean is not None and ran_s > mean:
            est.add(ran_s, now)

    def local_done(
        self, now: float, seconds: float, confidence: float | None = None
    ) -> Action | None:
        """The local run took ``seconds`` of compute and ended at ``now``."""
        core, mp = self.core, self.mp
        core._journal(("local_done", self.id, now, seconds, confidence))
        assert mp.local_model is not None
        core.est.local(mp.local_model, self.batch).add(seconds, now)
        energy = local_energy_j(self.policy.device, seconds)
        extra: dict[str, Any] = {"compute_us": int(seconds * 1e6)}
        if self._hedging:
            if self._answered:
                return None  # the cloud answered first: this run only taught
            self._answered = True
            attempt = self._attempt
            assert attempt is not None
            extra.update(hedged=True, bytes_attempted=attempt.up_bytes)
            energy += attempt.energy_j
            return Answer(
                LOCAL, self._local_option, self._reason, self._was_fallback, energy, 0, 0, extra
            )
        attempt = self._attempt
        if attempt is not None:
            # The failed offload kept the radio on and sent bytes a metered link bills.
            energy += attempt.energy_j
            extra["bytes_attempted"] = attempt.up_bytes
        reason = self._reason
        if not self.wants_confidence:
            return Answer(
                LOCAL, self._local_option, reason, self._was_fallback, energy, 0, 0, extra
            )
        # Cascade: the local answer stands when it is sure enough.
        assert confidence is not None, "a cascade's local run reports its confidence"
        extra["confidence"] = round(confidence, 4)
        local = Answer(LOCAL, self._local_option, reason, False, energy, 0, 0, extra)
        if confidence >= mp.cascade_threshold:
            return local
        cloud_only = replace(mp, local_model=None)
        decision = self._decide(now, "cloud", cloud_only)
        choice = decision.choice
        if choice is None or decision.reason.startswith("no option meets"):
            why = f"unsure ({confidence:.2f}) but no cloud in time: {decision.reason}"
            return replace(local, extra={**extra, "cascade": why})
        self._cascade_local = local
        self.mp = cloud_only
        assert choice.transport is not None and mp.cloud_model is not None
        core.breakers[choice.transport].allow(now)
        self._attempt, self._fallback = choice, None
        why = f"cascade: local confidence {confidence:.2f} < {mp.cascade_threshold}"
        # (gives up just before the deadline: the local answer it holds goes out in time;
        # given up at the deadline itself, it had come out late or been lost to a 504)
        give_up = max(now, self.deadline - CASCADE_ANSWER_S)
        return self._sent(Offload(choice, mp.cloud_model, give_up, why), now)

    def offload_done(
        self,
        now: float,
        *,
        sent: int,
        received: int,
        elapsed_s: float,
        queue_us: int = 0,
        compute_us: int = 0,
        resent: bool = False,
    ) -> Answer | None:
        """The cloud answered at ``now``; the transfer took ``elapsed_s`` end to end
        (``resent``: it went out more than once, so its time teaches the link nothing)."""
        core, choice = self.core, self._attempt
        core._journal(
            ("offload_done", self.id, now, sent, received, elapsed_s, queue_us, compute_us, resent)
        )
        assert choice is not None and choice.transport is not None
        core.breakers[choice.transport].record_success(now)
        core.est.observe_reply(self.mp.cloud_model or self.model, queue_us, compute_us, now)
        # The radio's promotion is in the transfer's time and the policy adds it
        # itself; a transfer quicker than the promotion found the radio up already.
        net = elapsed_s - choice.promotion_s if elapsed_s > choice.promotion_s else elapsed_s
        if not resent and core.measures_current_link(choice.transport, now - elapsed_s):
            core.est.link(choice.transport).observe(
                sent, received, net, (queue_us + compute_us) / 1e6, now
            )
        core.radio.transfer_done(now)
        core.reserved.pop(self.id, None)
        core.usage.add(sent + received, now)
        core.out_bytes[self.model] = received
        reason = self.decision.reason if self.decision else ""
        energy, cancel = choice.energy_j, False
        extra: dict[str, Any] = {}
        if self._hedging:
            if self._answered:
                return None  # the local run answered first: this reply only taught
            self._answered = True
            local = self._local_option
            if self._local_started:
                if local is not None:
                    if self._cancels_local(self.mp):
                        # Stopped now: it cost what it ran (at most the whole run).
                        ran_s = now - self._local_started_at
                        ran = local_energy_j(self.policy.device, ran_s)
                        energy += ran if ran < local.energy_j else local.energy_j
                        cancel = extra["local_cancelled"] = True
                        self._learn_stopped(ran_s, now)
                    else:
                        energy += local.energy_j
                extra["hedged"] = True
            else:
                extra["raced"] = True  # the cloud was in before the local run was due
        if self._cascade_local is not None:
            energy += self._cascade_local.energy_j
            extra["confidence"] = self._cascade_local.extra.get("confidence")
            reason = (
                f"cascade: local confidence {extra['confidence']} < {self.mp.cascade_threshold}"
            )
        failed = self._failed_attempt
        if failed is not None:  # the other transport's answer, after the first's failure
            energy += failed.energy_j
            extra["bytes_attempted"] = failed.up_bytes
            reason = self._reason
        fallback = failed is not None
        return Answer(choice.name, choice, reason, fallback, energy, sent, received, extra, cancel)

    def offload_failed(self, now: float, error: FerryError) -> Action | None:
        """The offload ended at ``now`` without an answer (``error`` says why)."""
        core, choice = self.core, self._attempt
        core._journal(("offload_failed", self.id, now, error.code.value, error.message))
        core.reserved.pop(self.id, None)
        assert choice is not None and choice.transport is not None
        if isinstance(error, InvalidInput | PayloadTooLarge | IdempotencyConflict):
            # says nothing of the endpoint (too large: its limit, not its health)
            core.breakers[choice.transport].release(now)
        else:
            core.learn_failure(
                choice,
                self.mp.cloud_model or self.model,
                error,
                self._attempt_at,  # (not the request's start: an alternative's own window)
                now,
                self.versioned,
            )
        if (
            isinstance(error, IdempotencyConflict)
            and self._local_started is False
            and not self._answered
        ):
            # the app reused its key with other inputs: the cloud's 409 is the answer (a
            # local run knows nothing of keys), not the race's local run
            self._hedging = False
            return Fail(error)
        if self._hedging:
            if not self._local_started and not self._answered:
                # A race's cloud half failed before the local run was due: run it now.
                self._local_started, self._local_started_at = True, now
                why = f"{choice.name} failed ({error.code.value}: {error.message})"
                return self._run_local(self._local_option, why, True)
            return None  # the local run answers (or has answered)
        why = f"{choice.name} failed ({error.code.value}: {error.message})"
        if self._cascade_local is None and isinstance(error, InvalidInput | IdempotencyConflict):
            return Fail(error)  # the request's own fault: no other route fixes it
        if self._cascade_local is not None:
            local = self._cascade_local
            return replace(
                local,
                fallback=True,
                energy_j=local.energy_j + choice.energy_j,
                extra={**local.extra, "cascade": f"offload failed: {error.message}"},
            )
        if self._fallback is not None and self.deadline - now > 0:
            return self._run_local(self._fallback, why, True)
        other, self._alternative = self._alternative, None
        if other is not None and self.deadline - now > 0 and self.mp.cloud_model is not None:
            assert other.transport is not None
            if core.breakers[other.transport].allow(now):
                self._failed_attempt, self._attempt = choice, other
                give_up = self.deadline
                if self.deferrable:  # (its receipt by the deadline, as above)
                    give_up -= min(DEFER_RESERVE_S, 0.25 * (self.deadline - now))
                self._reason = reason = f"{why}: {other.name} instead"
                return self._sent(Offload(other, self.mp.cloud_model, give_up, reason), now)
        if self.deferrable and not isinstance(error, PayloadTooLarge):  # (would fail again)
            return Defer(why, None)
        return Fail(error)


# ---- the agent's state between requests ---------------------------------------------


class EdgeCore:
    """What the agent knows between requests; begins each request's flow."""

    def __init__(
        self,
        policy: Policy,
        transports: Iterable[str],
        *,
        breakers: Mapping[str, CircuitBreaker] | None = None,
        day: Callable[[float], str] | None = None,
        journal: int = JOURNAL_EVENTS,
    ) -> None:
        self.policy = policy
        self.transports = tuple(transports)
        self.breakers = dict(breakers or {t: CircuitBreaker() for t in self.transports})
        self.radio = RadioState()
        self.usage = Usage(policy.est.extra.setdefault("usage", {}), day)
        self.out_bytes: dict[str, int] = {}
        self.missing: dict[tuple[str, str], float] = {}  # (transport, cloud model) -> until
        self.events: deque[tuple[Any, ...]] | None = deque(maxlen=journal) if journal else None
        self.decisions: deque[DecisionRecord] | None = deque(maxlen=journal) if journal else None
        self._ids = itertools.count(1)
        self._arrived: dict[str, float] = {}  # model -> last arrival
        self._gap: dict[str, float] = {}  # model -> long EWMA of the time between arrivals
        self._gap_fast: dict[str, float] = {}  # model -> short EWMA (RATE_FAST)
        self._gap_count: dict[str, int] = {}  # model -> gaps in the long EWMA since it started
        # When the agent began taking requests (serving()), and per model the wait from then
        # to its first request: the rate's only measure until a second request comes.
        self._serving_since: float | None = None
        self._first_wait: dict[str, float] = {}
        self._signal: dict[str, float | None] = {}  # transport -> last reported signal (dBm)
        # transport -> when its estimates last restarted for a new network (link_changed):
        # a probe or a transfer sent before then measured the old one
        self._restarted: dict[str, float] = {}
        # model -> (when, decision): its last decision (one per model: bounded)
        self.recent: dict[str, tuple[float, Decision]] = {}
        self._radio = Ewma(RADIO_SHARE_ALPHA)  # would a request use the radio, warm
        self._in_bytes: dict[str, float] = {}  # model -> EWMA of its requests' bytes
        # flow id -> (bytes, until): offloads under way, counted against the data cap
        self.reserved: dict[int, tuple[int, float]] = {}

    @property
    def est(self) -> Any:
        return self.policy.est

    # -- journal -------------------------------------------------------------------

    def _journal(self, event: tuple[Any, ...]) -> None:
        if self.events is not None:
            self.events.append(event)

    def reserve(self, flow_id: int, choice: Option, until: float, now: float) -> None:
        if self.policy.config.data_cap_mb_per_day is None:
            return  # (nothing to count against; and nothing kept)
        self.reserved_mb(now)  # (prunes those past their give-up time)
        self.reserved[flow_id] = (choice.up_bytes + choice.down_bytes, until)

    def reserved_mb(self, now: float) -> float:
        """Bytes of the offloads under way (their own ends release them; a bound in time
        keeps one whose end never came from holding the cap for good)."""
        total = 0
        for flow_id, (nbytes, until) in list(self.reserved.items()):
            if until < now:
                del self.reserved[flow_id]
            else:
                total += nbytes
        return total / 1e6

    @property
    def radio_share(self) -> float | None:
        """Share of the recent requests that used the radio, or would have in a warm run
        (:func:`_warm_run_offloads`; None: none yet)."""
        return self._radio.value

    def used_radio(self, used: bool) -> None:
        self._radio.add(1.0 if used else 0.0)

    def rate_per_s(self, model: str) -> float | None:
        """The model's recent request rate (None until it was measured).

        From the gaps between its requests; before a second one came, one
        request in the time since the agent began serving (the rate's maximum
        likelihood from that wait): a first request soon after start-up tells
        that more will follow, and a warm run may be worth waking the radio for.
        """
        gap = self._gap.get(model) or self._first_wait.get(model)
        return 1.0 / gap if gap else None

    def serving(self, now: float) -> None:
        """The agent takes requests from ``now`` on (after loading and warming its models)."""
        self._journal(("serving", now))
        self._serving_since = now

    def _arrival(self, model: str, now: float) -> None:
        last = self._arrived.get(model)
        self._arrived[model] = now
        if last is None:
            since = self._serving_since
            if since is not None and now > since:
                self._first_wait[model] = now - since
            return
        if now < last:
            return
        gap = now - last
        fast, slow = self._gap_fast.get(model), self._gap.get(model)
        n = self._gap_count.get(model, 0) + 1  # gaps since the last start: a plain mean until
        self._gap_count[model] = n  # each memory is full (one early gap must not rule ~40)
        if fast is None or slow is None:
            fast = slow = gap
        else:
            fast += max(RATE_FAST, 1.0 / n) * (gap - fast)
            slow += max(RATE_SLOW, 1.0 / n) * (gap - slow)
            if fast > RATE_SHIFT * slow or slow > RATE_SHIFT * fast:
                slow = fast  # the rate changed: the long memory starts over from the short one
                self._gap_count[model] = round(1.0 / RATE_FAST)
        self._gap_fast[model], self._gap[model] = fast, slow

    def link_changed(
        self, transport: str, link: LinkProfile, now: float, signal_dbm: float | None = None
    ) -> bool:
        """The connectivity manager's word on ``transport``: its link kind, maybe its signal.

        The kind sets the radio's energy model and the rate priors; a signal
        reading scales those priors (:func:`~edge.core.estimators.signal_factor`).
        A new kind, or a signal that moved by ``SIGNAL_JUMP_DB`` or more, is a
        new regime: what was learnt restarts from the new priors.  A small
        change only nudges the priors.  Returns whether the estimates restarted.
        """
        self._journal(("link", transport, link, now, signal_dbm))
        old = self.policy.links.get(transport)
        last = self._signal.get(transport)
        restart = old is None or old.kind != link.kind or old.name != link.name
        if signal_dbm is not None and last is not None:
            restart = restart or abs(signal_dbm - last) >= SIGNAL_JUMP_DB
        elif signal_dbm is not None:
            restart = True  # the first reading: the priors were the kind's median
        self._signal[transport] = signal_dbm
        f = signal_factor(link.kind, signal_dbm)
        if restart:
            self.est.reset_link(transport)
            self.breakers[transport].record_success(now)  # a new network: a clean slate
            self._restarted[transport] = now
        self.est.set_link_prior(
            transport, link.up_mbps * 1e6 * f, link.down_mbps * 1e6 * f, link.rtt_ms / 1000
        )
        self.policy.links[transport] = link
        return restart

    def latency_seeds(self, warm_up_runs: int) -> int:
        """How many warm-up runs seed the local latency estimate: none without a
        transport, since nothing is ever weighed against a local run then (the agent
        answers its first request that much sooner, and spends nothing to learn it)."""
        return warm_up_runs if self.transports else 0

    def warmed(self, local_model: str, seconds: float, now: float) -> None:
        """A warm-up run of ``local_model`` took ``seconds``: the first local estimate."""
        self._journal(("warmed", local_model, seconds, now))
        self.est.local(local_model).add(seconds, now)

    # -- what may be used -----------------------------------------------------------

    def usable(
        self, now: float, connected: Mapping[str, bool], cloud_model: str | None = None
    ) -> dict[str, bool]:
        """Transports a request for ``cloud_model`` may take now (link up, breaker closed)."""
        out = {}
        missing = self.missing if cloud_model is not None else None
        for name in self.transports:
            ok = connected.get(name, False)
            if ok:
                breaker = self.breakers[name]
                ok = breaker.state == "closed" or breaker.ready(now)  # (closed: the usual case)
            if ok and missing:
                ok = missing.get((name, cloud_model or ""), 0.0) <= now
            out[name] = ok
        return out

    # -- requests ----------------------------------------------------------------------

    def begin(
        self,
        model: str,
        *,
        now: float,
        in_bytes: int,
        connected: Mapping[str, bool],
        local_available: bool = True,
        deadline_ms: float | None = None,
        batch: int = 1,
        local_backlog: int = 0,
        battery: float | None = None,
        deferrable: bool = False,
        mode: str | None = None,
        cloud_only: bool = False,
        record: bool = True,
        local_cancellable: bool = False,
        versioned: bool = False,
    ) -> RequestFlow:
        """A new request's flow; raises the request's own errors (unknown model, bad deadline).

        ``record=False`` asks what-if: no arrival is counted and nothing journalled.
        ``versioned``: the app asked for a version of the model (see RequestFlow).
        """
        policy = self.policy
        mp = policy.model_policy(model)
        if cloud_only or (mp.local_model is not None and not local_available):
            mp = replace(mp, local_model=None)
        if mp.local_model is None and mp.cloud_model is None:
            raise ModelNotFound(f"unknown model {model!r}")
        if mp.local_model is None and mp.mode == "local" and not cloud_only:
            raise ModelNotReady(f"model {model!r} is local-only and its local variant is missing")
        budget_ms = deadline_ms or mp.deadline_ms or policy.config.default_deadline_ms
        if budget_ms <= 0:
            raise InvalidInput(f"deadline_ms must be positive, got {budget_ms}")
        links = {t: bool(connected.get(t, False)) for t in self.transports}
        fid = next(self._ids)
        if record:
            self._arrival(model, now)
            mean = self._in_bytes.get(model)
            self._in_bytes[model] = (
                float(in_bytes) if mean is None else mean + IN_BYTES_ALPHA * (in_bytes - mean)
            )
            if self.events is not None:  # (the tuple is built only for a journal that keeps it)
                self.events.append(
                    (
                        "begin",
                        fid,
                        model,
                        now,
                        in_bytes,
                        links,
                        local_available,
                        deadline_ms,
                        batch,
                        local_backlog,
                        battery,
                        deferrable,
                        mode,
                        cloud_only,
                        local_cancellable,
                        versioned,
                    )
                )
        run_mode = mode or (mp.mode if mp.local_model is not None else "cloud")
        flow = RequestFlow(
            self,  # (by position, in __init__'s order: keywords cost ~0.3 us per request)
            fid,
            model,
            mp,
            now,  # start
            now + budget_ms / 1000.0,  # deadline
            in_bytes,
            batch,
            links,  # connected
            local_backlog,
            battery,
            deferrable,
            run_mode,
            budget_ms,
            local_cancellable,
        )
        flow.versioned = versioned
        return flow

    def learn_failure(
        self,
        choice: Option,
        cloud_model: str,
        error: FerryError,
        start: float,
        now: float,
        versioned: bool = False,
    ) -> None:
        """What an offload that ended without an answer teaches (``versioned``: the
        request named a version, whose absence says nothing of the model's others)."""
        assert choice.transport is not None
        transport = choice.transport
        # Bytes that left the device count against the daily cap even without an answer.
        self.usage.add(choice.up_bytes, now)
        if versioned and isinstance(error, ModelNotFound | ModelNotReady):
            self.breakers[transport].release(now)
            return
        if isinstance(error, ModelNotFound | ModelNotReady):
            cooldown = (
                MISSING_MODEL_COOLDOWN_S
                if isinstance(error, ModelNotFound)
                else NOT_READY_MODEL_COOLDOWN_S
            )
            self.missing[(transport, cloud_model)] = now + cooldown
            self.breakers[transport].release(now)
            return
        if not isinstance(error, ENDPOINT_FAILURES):
            self.breakers[transport].release(now)
            return  # this request's own failure; the endpoint is fine
        self.radio.transfer_done(now)  # the radio was on until the agent gave up
        if isinstance(error, DeadlineExceeded) and now - start < choice.latency_s:
            # Given up sooner than an answer is expected to take: this request's deadline
            # says nothing of the endpoint (a few 2 ms deadlines had opened the breaker,
            # and every app's requests over the transport were refused).
            self.breakers[transport].release(now)
            return
        if not self.measures_current_link(transport, start):
            return  # lost on the network before: it says nothing of this one
        self.breakers[transport].record_failure(now)
        if isinstance(error, DeadlineExceeded):
            self.est.link(transport).observe_timeout(choice.up_bytes, now - start, now)
        else:
            self.est.link(transport).observe_failure(now)

    # -- probes ------------------------------------------------------------------------

    def probes(self, now: float) -> list[str]:
        """Transports to probe now, each probe priced by what waking the radio costs.

        A stale RTT is refreshed only while the radio is still in its tail
        from real traffic.  An open breaker gets its trial probe while the
        radio is up, where waking it is cheap (``PROBE_WAKE_J``), or after
        ``BLIND_PROBE_S`` without one if a request in the last ``WANTED_S``
        would have offloaded over it were it up (a link that could not pay
        even at any speed is not worth a wake-up to learn it is back);
        otherwise the next request the policy finds worth offloading carries
        the trial (see :meth:`usable`).  On a
        cellular link a probe from idle costs a promotion and a whole tail
        (~13 J on LTE) to learn one RTT.
        """
        self._journal(("probes", now))
        out = []
        idle = self.radio.radio_idle_s(now)
        for name in self.transports:
            breaker, link = self.breakers[name], self.policy.links.get(name)
            warm = idle is not None and link is not None and idle < link.tail_s
            if breaker.state == "closed":
                if not warm or not self.est.link(name).stale(now, STALE_PROBE_S):
                    continue
            else:
                cheap = link is None or wake_energy_j(link) <= PROBE_WAKE_J
                blind = breaker.opened_at is None or now - breaker.opened_at >= BLIND_PROBE_S
                if blind and not cheap and not warm:
                    # Waking the radio for it only when a recent request would have
                    # used the link, had it been up (else the answer changes nothing).
                    blind = self._wanted(name, now)
                if not (warm or cheap or blind) or not breaker.allow(now):
                    continue
            out.append(name)
        return out

    def _wanted(self, transport: str, now: float) -> bool:
        """Whether a decision within ``WANTED_S`` would have offloaded over ``transport``
        were its link up, at any speed (its option's cost without the transfer time
        beats the choice): all a probe could find out."""
        for when, decision in self.recent.values():
            if now - when > WANTED_S:
                continue
            best = decision.choice
            for o in decision.options:
                if o.transport != transport:
                    continue
                if best is None or o is best or o.rate_bps <= 0.0:
                    return True
                if o.cost - o.cost_per_inv_bps / o.rate_bps < best.cost:
                    return True
        return False

    def measures_current_link(self, transport: str, sent_at: float) -> bool:
        """Whether something sent at ``sent_at`` measured the network ``transport`` is on
        now: not if the estimates restarted for a new one since.  A probe caught in an
        outage answers when the next network is up, seconds late: as that network's
        first RTT it would price every offload seconds slow, and with the radio left
        idle no later probe would come to correct it."""
        restarted = self._restarted.get(transport)
        return restarted is None or sent_at >= restarted

    def probe_done(self, transport: str, now: float, rtt_s: float) -> None:
        self._journal(("probe_done", transport, now, rtt_s))
        self.breakers[transport].record_success(now)
        self.radio.transfer_done(now)
        if self.measures_current_link(transport, now - rtt_s):
            self.est.link(transport).observe_probe(rtt_s, now)

    def probe_failed(self, transport: str, now: float) -> None:
        self._journal(("probe_failed", transport, now))
        breaker = self.breakers[transport]
        breaker.record_failure(now)
        if breaker.opened_at is not None and now - breaker.opened_at >= BLIND_PROBE_S:
            breaker.opened_at = now  # the next blind probe waits another while


def fresh_core(
    config: PolicyConfig,
    device: DeviceProfile,
    links: Mapping[str, LinkProfile],
    *,
    journal: int = JOURNAL_EVENTS,
    day: Callable[[float], str] | None = None,
) -> EdgeCore:
    """The core an agent with nothing learnt starts with: link priors from the profiles."""
    est = Estimators(config.deadline_quantile)
    for transport, link in links.items():
        est.set_link_prior(transport, link.up_mbps * 1e6, link.down_mbps * 1e6, link.rtt_ms / 1000)
    return EdgeCore(Policy(config, est, device, dict(links)), links, day=day, journal=journal)


def replay_journal(events: Iterable[tuple[Any, ...]], core: EdgeCore) -> list[DecisionRecord]:
    """Feed a journal of another core's events to ``core``; returns the decisions it makes.

    ``core`` must start from the state the journalled core started from.
    Every event goes through the same methods with the recorded ``now``,
    so equal decisions mean one flow, whatever drove the original.
    """
    if core.decisions is None:
        core.decisions = deque(maxlen=None)
    flows: dict[int, RequestFlow] = {}
    for event in events:
        kind = event[0]
        if kind == "begin":
            (_, fid, model, now, in_bytes, links, local_ok, deadline_ms, batch) = event[:9]
            backlog, battery, deferrable, mode, cloud_only, cancellable, *more = event[9:]
            flow = core.begin(
                model,
                now=now,
                in_bytes=in_bytes,
                connected=links,
                local_available=local_ok,
                deadline_ms=deadline_ms,
                batch=batch,
                local_backlog=backlog,
                battery=battery,
                deferrable=deferrable,
                mode=mode,
                cloud_only=cloud_only,
                local_cancellable=cancellable,
                versioned=bool(more and more[0]),
            )
            flows[fid] = flow
        elif kind == "start":
            flows[event[1]].start()
        elif kind == "local_done":
            flows[event[1]].local_done(event[2], event[3], event[4])
        elif kind == "offload_done":
            _, fid, now, sent, received, elapsed, queue_us, compute_us, *rest = event
            flows[fid].offload_done(
                now,
                sent=sent,
                received=received,
                elapsed_s=elapsed,
                queue_us=queue_us,
                compute_us=compute_us,
                resent=bool(rest and rest[0]),
            )
        elif kind == "offload_failed":
            flows[event[1]].offload_failed(event[2], error_from_code(event[3], event[4]))
        elif kind == "race_due":
            flows[event[1]].race_due(event[2])
        elif kind == "link":
            core.link_changed(event[1], event[2], event[3], event[4])
        elif kind == "warmed":
            core.warmed(event[1], event[2], event[3])
        elif kind == "serving":
            core.serving(event[1])
        elif kind == "probes":
            core.probes(event[1])
        elif kind == "probe_done":
            core.probe_done(event[1], event[2], event[3])
        elif kind == "probe_failed":
            core.probe_failed(event[1], event[2])
    return list(core.decisions)
