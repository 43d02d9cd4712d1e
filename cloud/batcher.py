"""Dynamic batcher: one per loaded model version (DESIGN.md section 5).

Requests wait in one FIFO per priority level; a single scheduler task on the
event loop forms batches whenever a session is idle and hands each batch to
that session's own thread (runtimes release the GIL; :mod:`cloud.workers`),
so no inference of any cost runs on the loop: only a lone request on an idle
model whose recent runs all took under ``inline_us`` runs in place
(:mod:`shared.runtimes.inline`).  Per request the cost is one future and one
deque append; per batch it is one queue put and one completion callback.

A model may have a *lone* session beside its instances, with an intra-op
thread per core: a lone request on an idle node runs there, at the runtime's
fastest batch-1 speed, while the instances (one thread each, say) serve load
at the best throughput.  It holds every instance while it runs, so it never
competes with them for the cores.

``max_queue_delay_us`` and preferred sizes are upper bounds, as in Triton,
but a model with no batch running dispatches what is queued at once: waiting
then adds latency and no company.  Batches form from the requests that
arrive while the previous one runs (TF Serving's and Clipper's behaviour).

Invariants:
- ``_depth`` counts queued requests that are still live (not dispatched,
  expired, cancelled or failed); dead entries are dropped lazily from the
  deques and the deadline heap, and ``req.done`` says which are dead.
- Every request gets exactly one result or one error; a future the client
  cancelled is skipped, never set.
- Only the scheduler task dispatches; completion callbacks return the session
  to ``_idle`` and wake it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from cloud.execute import BatchResult, Outcome, execute
from cloud.execute import QueuedRequest as _Request
from cloud.stats import BACKEND, CANCELED, REJECTED, ModelStats, failure_reason
from cloud.workers import NodeActivity
from shared.aio.threads import SessionThread
from shared.errors import (
    ConfigError,
    DeadlineExceeded,
    FerryError,
    InternalError,
    InvalidInput,
    ModelNotReady,
    Overloaded,
)
from shared.runtimes.base import Session
from shared.runtimes.inline import InlineGate, input_bytes

if TYPE_CHECKING:
    from shared.repository.config import DynamicBatching

__all__ = ["BatchResult", "DynamicBatcher"]

log = logging.getLogger(__name__)

_MIN_RETRY_AFTER_S = 0.05
_LONE = -1  # the index of the lone session in _dispatch/_finish
#: in-place runs of tiny models allowed in one turn of the event loop
IN_PLACE_PER_TURN = 4


class DynamicBatcher:
    """Queue, batch and run requests for one model version on ``sessions``.

    ``policy=None`` means the model has no ``[dynamic_batching]`` section: as
    in Triton, each request then runs on its own (no merging).  The queue is
    bounded by the policy's ``max_queue_size``, or by ``default_max_queue``
    (the node's ``[limits] max_queue_size``) when the model sets none; 0 in
    both means unbounded.
    """

    def __init__(
        self,
        *,
        model: str,
        version: int,
        sessions: Sequence[Session],
        max_batch_size: int,
        policy: DynamicBatching | None,
        stats: ModelStats,
        default_max_queue: int = 0,
        inline_us: float = 0.0,
        lone: Session | None = None,
        activity: NodeActivity | None = None,
        oversize_alone: bool = False,
        merge: bool = True,
    ) -> None:
        if not sessions:
            raise ConfigError(f"model {model!r} version {version}: no sessions to run batches on")
        self.model = model
        self.version = version
        self._sessions = list(sessions)
        self._max_bs = max(0, int(max_batch_size))
        self._stats = stats
        # merge: False where the outputs are not batch-major (cloud.loading.outputs_follow_batch)
        self._merge = merge and policy is not None and self._max_bs > 0
        # an inferred max_batch_size bounds merged batches only (ModelConfig)
        self._oversize_alone = oversize_alone
        self._delay_ns = int(policy.max_queue_delay_us) * 1000 if policy else 0
        self._preferred = sorted(
            {p for p in (policy.preferred_batch_sizes if policy else ()) if 0 < p <= self._max_bs},
            reverse=True,
        )
        own_limit = int(policy.max_queue_size) if policy else 0
        self._max_queue = own_limit or max(0, int(default_max_queue))
        levels = int(policy.priority_levels) if policy else 0
        self._priorities = levels > 1  # one level: a client's priority is ignored, as in Triton
        self._levels = max(1, levels)
        dpl = int(policy.default_priority_level) if policy else 0
        self._default_level = dpl if 1 <= dpl <= self._levels else self._levels
        self._timeout_ns = int(policy.default_timeout_us) * 1000 if policy else 0
        # preserve_ordering: (answer, release) per request in arrival order; an answer
        # leaves once every earlier request has its own (Triton holds responses alike)
        self._preserve = bool(policy.preserve_ordering) if policy else False
        self._order: deque[tuple[asyncio.Future[Any], asyncio.Future[None]]] = deque()

        # A lone request on an idle model that runs in under ``inline_us`` runs on the
        # loop: the hand-off to a worker and back would cost more than the run.
        self._gate = InlineGate(inline_us)
        self._lone = lone
        self._activity = activity or NodeActivity()
        self._threads: list[SessionThread] = []
        self._lone_thread: SessionThread | None = None
        self._held: list[int] = []  # instances held while the lone session runs
        self._in_place_runs = 0  # in this loop turn
        self.lone_runs = 0
        self._queues: list[deque[_Request]] = [deque() for _ in range(self._levels)]
        self._live = [0] * self._levels  # requests still queued, per level
        self._deadlines: list[tuple[int, int, _Request]] = []
        self._seq = itertools.count()
        self._depth = 0
        self._inflight = 0
        self._idle: list[int] = list(range(len(self._sessions)))
        self._batch_ns = 0.0  # EWMA of dispatch-to-completion time, for Retry-After
        self._accepting = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None

    @property
    def queue_depth(self) -> int:
        return self._depth

    @property
    def max_queue(self) -> int:
        """The queue bound in force (0: unbounded)."""
        return self._max_queue

    def retry_hint(self) -> float:
        """Seconds after which a refused client may try again (read from any thread)."""
        return self._retry_after()

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        prefix = f"ferry-{self.model}-v{self.version}"
        self._threads = [
            SessionThread(f"{prefix}-{i}", self._loop) for i in range(len(self._sessions))
        ]
        if self._lone is not None:
            self._lone_thread = SessionThread(f"{prefix}-lone", self._loop)
        self._accepting = True
        self._task = self._loop.create_task(
            self._run(), name=f"ferry-batcher-{self.model}-v{self.version}"
        )

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str] | None = None,
        *,
        deadline: float | None = None,
        priority: int | None = None,
    ) -> BatchResult:
        """Queue one request and wait for its slice of a batch.

        Raises InvalidInput, Overloaded (queue full, with ``retry_after``),
        DeadlineExceeded, ModelNotReady (stopping) or the session's own error.
        """
        arrival = time.monotonic_ns()
        try:
            req = self._admit(inputs, outputs, deadline, priority, arrival)
        except FerryError as exc:
            self._stats.record_failure(time.monotonic_ns() - arrival, failure_reason(exc))
            raise
        release = self._in_order(req.future) if self._preserve else None
        try:
            result = await req.future
        except asyncio.CancelledError:
            if not req.done:  # still queued: the client went away
                req.done = True
                self._left(req)
                self._stats.record_failure(time.monotonic_ns() - arrival, CANCELED)
            raise
        except BaseException:
            if release is not None:
                await asyncio.shield(release)
            raise
        if release is not None:
            await asyncio.shield(release)
        return result

    def _in_order(self, answer: asyncio.Future[Any]) -> asyncio.Future[None]:
        """The future that lets ``answer`` leave: set once every earlier one is done."""
        assert self._loop is not None
        release: asyncio.Future[None] = self._loop.create_future()
        self._order.append((answer, release))
        answer.add_done_callback(self._release_in_order)
        return release

    def _release_in_order(self, _: asyncio.Future[Any]) -> None:
        order = self._order
        while order and order[0][0].done():
            _, release = order.popleft()
            if not release.done():
                release.set_result(None)

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting; finish queued and in-flight work; sessions are idle on return.

        ``drain=False`` answers queued requests with ModelNotReady; running batches
        complete either way (a runtime call cannot be interrupted).
        """
        self._accepting = False
        if self._task is None:
            self._stop_threads()
            return
        if not drain:
            self._fail_queued(lambda: ModelNotReady(f"{self._name()} was unloaded"))
        self._closing = True
        assert self._wake is not None
        self._wake.set()
        await self._task
        self._activity.leave(self)
        self._stop_threads()

    def _admit(self, inputs, outputs, deadline, priority, arrival: int) -> _Request:
        if not self._accepting:
            raise ModelNotReady(f"{self._name()} is not ready (stopping or not started)")
        n, key = self._shape_key(inputs)
        level = self._level(priority)
        waiting = self._live[level]
        if self._max_queue and waiting >= self._max_queue:
            # each priority level has its own bound, as in Triton (one bound for all had
            # let low-priority traffic lock the high-priority requests out)
            raise Overloaded(
                f"{self._name()}: queue is full ({waiting} requests waiting"
                + (f" at priority level {level + 1})" if len(self._queues) > 1 else ")"),
                retry_after=self._retry_after(),
            )
        deadline_ns = None if deadline is None else int(deadline * 1e9)
        if self._timeout_ns:
            # the model's default timeout bounds every request: its own deadline may be
            # sooner, never later (Triton's allow_timeout_override lets a request shorten
            # it; one that extended it had escaped the operator's bound)
            limit = arrival + self._timeout_ns
            deadline_ns = limit if deadline_ns is None else min(deadline_ns, limit)
        if deadline_ns is not None and deadline_ns <= arrival:
            raise DeadlineExceeded(f"{self._name()}: request deadline passed before queueing")
        assert self._loop is not None and self._wake is not None
        req = _Request(inputs, outputs, n, key, arrival, deadline_ns, self._loop.create_future())
        req.level = level
        self._live[level] += 1
        self._queues[level].append(req)
        if deadline_ns is not None:
            heapq.heappush(self._deadlines, (deadline_ns, next(self._seq), req))
        self._set_depth(self._depth + 1)
        if (
            self._depth == 1
            and self._idle
            and not self._inflight
            and self._gate.allows(input_bytes(inputs))
        ):
            # A tiny model with nothing running or queued: run it here rather than a loop
            # turn later in the scheduler task (it answers before its caller suspends).
            # Other models wake the scheduler, which batches all of this turn's arrivals.
            self._schedule_now()
        elif self._idle or (
            # with every session busy only a new, earlier deadline needs the scheduler
            deadline_ns is not None and (self._timer_at is None or deadline_ns < self._timer_at)
        ):
            self._wake.set()
        return req

    def _schedule_now(self) -> None:
        try:
            wake_at = self._schedule()
        except Exception:  # as in _run: a bug here must not strand the queue
            log.exception("%s: scheduler error; failing queued requests", self._name())
            self._fail_queued(lambda: InternalError(f"{self._name()}: scheduler error"))
            return
        self._arm_timer(wake_at)

    def _shape_key(self, inputs: dict[str, np.ndarray]) -> tuple[int, tuple]:
        """Items in the request and what must match for requests to be concatenated."""
        if not self._max_bs:
            return 1, ()
        n = -1
        for name, arr in inputs.items():
            rows = arr.shape[0] if arr.ndim else 0
            if n >= 0 and rows != n:
                if self._oversize_alone:  # a guessed batch axis: the runtime decides
                    return max(a.shape[0] if a.ndim else 0 for a in inputs.values()), None
                raise InvalidInput(
                    f"{self._name()}: inputs disagree on the batch dimension "
                    f"({name!r} has {rows}, expected {n})"
                )
            n = rows
        if not 1 <= n <= self._max_bs:
            if self._oversize_alone and n >= 0:
                return n, None  # runs alone: a key no other request shares
            raise InvalidInput(
                f"{self._name()}: batch dimension {n} is outside 1..{self._max_bs} (max_batch_size)"
            )
        key = tuple((name, arr.shape[1:], arr.dtype) for name, arr in inputs.items())
        return n, key if len(key) == 1 else tuple(sorted(key))

    def _level(self, priority: int | None) -> int:
        if priority is not None and priority < 0:
            raise InvalidInput(f"{self._name()}: priority {priority} is negative (1 = highest)")
        if not self._priorities or not priority or priority > self._levels:
            # None, 0 or past the model's levels: the default level, as in Triton (a client
            # sends one priority to models with different numbers of levels)
            return self._default_level - 1
        return priority - 1

    def _retry_after(self) -> float:
        per_batch = max(1, self._max_bs) if self._merge else 1
        batches = -(-self._depth // per_batch)
        est = batches * self._batch_ns / 1e9 / len(self._sessions)
        return max(_MIN_RETRY_AFTER_S, round(est, 3))

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                wake_at = self._schedule()
            except Exception:  # a bug here must not strand the queue
                log.exception("%s: scheduler error; failing queued requests", self._name())
                self._fail_queued(lambda: InternalError(f"{self._name()}: scheduler error"))
                if not self._inflight:
                    self._activity.release(self)  # a turn taken and never used
                self._activity.leave(self)
                wake_at = None
            if self._closing and not self._depth and not self._inflight:
                break
            self._arm_timer(wake_at)
            await self._wake.wait()
        self._arm_timer(None)

    def _schedule(self) -> int | None:
        """Expire, then dispatch while sessions are idle; returns when to look again."""
        now = time.monotonic_ns()
        wake_at = self._expire(now)
        activity = self._activity
        while self._idle and self._depth:
            if not activity.take(self):
                break  # in line for the node's turn: woken when it comes
            members, hold_until = self._form_batch(now)
            if members is None:
                activity.release(self)
                if hold_until is not None:
                    wake_at = hold_until if wake_at is None else min(wake_at, hold_until)
                break
            self._dispatch(members, now)
        if not self._depth:
            activity.leave(self)
        return wake_at

    def wants_turn(self) -> bool:
        """Whether the node's next turn would find requests here (:mod:`cloud.workers`)."""
        return self._depth > 0 and self._task is not None and not self._task.done()

    def wake_for_turn(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _expire(self, now: int) -> int | None:
        heap = self._deadlines
        while heap and (heap[0][2].done or heap[0][0] <= now):
            _, _, req = heapq.heappop(heap)
            if not req.done:
                req.done = True
                self._left(req)
                self._fail(req, DeadlineExceeded(f"{self._name()}: deadline passed in queue"), now)
        if len(heap) > 4 * self._depth + 64:  # dispatched entries pile up behind a live head
            self._deadlines = heap = [e for e in heap if not e[2].done]
            heapq.heapify(heap)
        return heap[0][0] if heap else None

    def _form_batch(self, now: int) -> tuple[list[_Request] | None, int | None]:
        """Pick the next batch, or say until when to wait for a fuller one."""
        first: _Request | None = None
        members: list[_Request] = []
        items = 0
        full = False
        for q in self._queues:
            while q and q[0].done:
                q.popleft()
            for req in q:
                if req.done:
                    continue
                if first is None:
                    first = req
                    if not self._merge or req.key is None:
                        return [req], None
                elif req.key != first.key:
                    continue  # cannot be concatenated: waits for a later batch
                if items + req.n > self._max_bs:
                    full = True
                    break
                members.append(req)
                items += req.n
                if items == self._max_bs:
                    full = True
                    break
            if full:
                break
        if first is None:  # bookkeeping drifted; never spin on it
            log.error("%s: queue depth %d but no live request", self._name(), self._depth)
            self._set_depth(0)
            self._live = [0] * len(self._queues)
            return None, None
        if self._preferred:
            # the largest preferred size the queue reaches goes at once, even where more
            # would fit (as Triton's dynamic batcher: a full queue had sent max_batch_size)
            sizes, total = {}, 0
            for i, req in enumerate(members):
                total += req.n
                sizes[total] = i + 1
            for p in self._preferred:  # (largest first)
                if p in sizes:
                    return members[: sizes[p]], None
        if full or self._closing or not self._delay_ns:
            return members, None
        if not self._inflight:
            # Nothing running: waiting could only add latency, never a request (the
            # ones that arrive meanwhile form the next batch while this one runs).
            return members, None
        hold_until = min(r.arrival_ns for r in members) + self._delay_ns
        for r in members:  # start early enough to run before any member expires
            if r.deadline_ns is not None:
                guard = max(int(self._batch_ns), (r.deadline_ns - r.arrival_ns) // 10)
                hold_until = min(hold_until, r.deadline_ns - guard)
        if now >= hold_until:
            return members, None
        return None, hold_until

    def _dispatch(self, members: list[_Request], now: int) -> None:
        for req in members:
            req.done = True
            self._live[req.level] -= 1
        self._set_depth(self._depth - len(members))
        nbytes = sum(input_bytes(r.inputs) for r in members)
        lone_request = len(members) == 1 and not self._depth and not self._inflight
        if lone_request and self._gate.allows(nbytes) and self._in_place_turn():
            index = self._idle.pop()
            self._inflight += 1
            self._activity.running += 1
            try:  # tiny: runs in place, cheaper than any hand-off
                result, error = (
                    execute(self._sessions[index], members, self._stats, self._name()),
                    None,
                )
            except Exception as exc:
                result, error = None, exc
            self._finish(index, members, now, nbytes, result, error)
            return
        self._inflight += 1
        self._activity.running += 1
        # the hand-off of a lone request is what running it in place would save
        done = partial(self._finish, _LONE, members, now, nbytes, hopped=lone_request)
        if lone_request and self._lone_thread is not None and self._activity.running == 1:
            # nothing else runs on the node: every core for this one request
            self._held, self._idle = self._idle, []
            self.lone_runs += 1
            self._lone_thread.submit(
                execute, (self._lone, members, self._stats, self._name()), done
            )
            return
        index = self._idle.pop()
        done = partial(self._finish, index, members, now, nbytes, hopped=lone_request)
        self._threads[index].submit(
            execute, (self._sessions[index], members, self._stats, self._name()), done
        )

    def _in_place_turn(self) -> bool:
        """At most ``IN_PLACE_PER_TURN`` in-place runs per loop turn: a flood arriving at
        once must not hold the loop run after run (past it, requests batch on a worker)."""
        if self._in_place_runs >= IN_PLACE_PER_TURN:
            return False
        if not self._in_place_runs:
            assert self._loop is not None
            self._loop.call_soon(self._new_turn)
        self._in_place_runs += 1
        return True

    def _new_turn(self) -> None:
        self._in_place_runs = 0

    def _finish(
        self,
        index: int,
        members: list[_Request],
        dispatched: int,
        nbytes: int,
        result: list[Outcome] | None,
        error: BaseException | None,
        hopped: bool = False,
    ) -> None:
        """Completion on the loop: deliver each request's outcome.

        ``hopped``: a lone request that ran on a worker thread, so what the hand-off
        cost (the time from dispatch to here less the run's own) tells the inline
        gate what running it in place would have saved (under load, hand-offs also
        wait for a busy loop, which an in-place run does not save).
        """
        self._inflight -= 1
        self._activity.running -= 1
        self._activity.release(self)
        if index == _LONE:
            self._idle, self._held = self._held, []
        else:
            self._idle.append(index)
        assert self._wake is not None
        if self._depth or self._closing:  # else there is nothing for the scheduler to do
            self._wake.set()
        outcomes: list[Outcome]
        if error is not None or result is None:
            log.error("%s: batch worker failed: %r", self._name(), error)
            msg = f"{self._name()}: batch worker failed: {error!r}"
            outcomes = [(InternalError(msg), 0, r.n, 0, 0) for r in members]
        else:
            outcomes = result
        end = time.monotonic_ns()
        if outcomes and not isinstance(outcomes[0][0], FerryError):
            _, compute_ns, _, input_ns, output_ns = outcomes[0]
            self._gate.record(compute_ns, nbytes)
            if hopped:
                self._gate.record_hop(end - dispatched - compute_ns - input_ns - output_ns)
        self._batch_ns = 0.8 * (self._batch_ns or end - dispatched) + 0.2 * (end - dispatched)
        ok = request_sum = queue_sum = compute_sum = input_sum = output_sum = items = 0
        for req, (result_i, compute_ns, batch_size, input_ns, output_ns) in zip(
            members, outcomes, strict=True
        ):
            if isinstance(result_i, FerryError):
                self._fail(req, result_i, end, BACKEND)
                continue
            queue_ns = dispatched - req.arrival_ns
            ok += 1
            request_sum += end - req.arrival_ns
            queue_sum += queue_ns
            compute_sum += compute_ns
            input_sum += input_ns
            output_sum += output_ns
            items += req.n
            if not req.future.done():
                req.future.set_result(
                    BatchResult(result_i, queue_ns // 1000, compute_ns // 1000, batch_size)
                )
        self._stats.record_successes(
            ok, request_sum, queue_sum, compute_sum, items, input_sum, output_sum
        )

    def _fail(self, req: _Request, exc: FerryError, now: int, reason: str = REJECTED) -> None:
        self._stats.record_failure(now - req.arrival_ns, reason)
        if not req.future.done():
            req.future.set_exception(exc)

    def _fail_queued(self, make_error: Callable[[], FerryError]) -> None:
        now = time.monotonic_ns()
        for q in self._queues:
            while q:
                req = q.popleft()
                if not req.done:
                    req.done = True
                    self._fail(req, make_error(), now)
        self._deadlines.clear()
        self._set_depth(0)
        self._live = [0] * len(self._queues)

    def _left(self, req: _Request) -> None:
        """A queued request left the queue without running (cancelled or expired)."""
        self._live[req.level] -= 1
        self._set_depth(self._depth - 1)

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._stats.pending = depth

    def _arm_timer(self, wake_at: int | None) -> None:
        if wake_at == self._timer_at and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None
        if wake_at is not None:
            assert self._loop is not None
            delay = max(0.0, (wake_at - time.monotonic_ns()) / 1e9)
            self._timer = self._loop.call_later(delay, self._on_timer)
            self._timer_at = wake_at

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        assert self._wake is not None
        self._wake.set()

    def _stop_threads(self) -> None:
        for thread in self._threads:
            thread.stop()
        if self._lone_thread is not None:
            self._lone_thread.stop()

    def _name(self) -> str:
        return f"model {self.model!r} version {self.version}"
