"""Store-and-forward for ``deferrable`` requests.

A request that cannot run now is written to the sqlite store (WAL, durable
when ``defer`` returns) and answered with a receipt; the flusher sends stored
requests when a link is usable and keeps each answer in the store for the
app to fetch.  Requests left mid-send by a crash go back to pending when the
store reopens, so nothing is lost across ``kill -9``; the sender passes the
request id as the cloud's idempotency key, so a resend after such a crash is
answered from the cloud's cache instead of running twice, where the node that
ran it still holds the answer (its ``idempotency_ttl_s``, 10 minutes by default,
in memory: an agent down longer, a restarted node or another node of an MQTT
fleet runs it again, once).

Every store call runs on one dedicated thread: a durable commit is an fsync,
which must not stall the event loop, and one sqlite connection must not be
used from two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from edge.store import DeferredItem, DeferredResult, DeferredStore, StoreFailed, db_error
from shared import envelope
from shared.errors import (
    DeadlineExceeded,
    EndpointUnavailable,
    FerryError,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    PermissionDenied,
    ShuttingDown,
    Unauthenticated,
)
from shared.messages import InferRequest, InferResponse
from shared.recurring import Recurring
from shared.wallclock import Step, WallClock

log = logging.getLogger(__name__)

Sender = Callable[[str, InferRequest], Awaitable[InferResponse]]
T = TypeVar("T")

# The link or the endpoint is down (or refuses us): keep the request, stop this flush.
#: answers kept in memory while the store cannot write them
MAX_UNSAVED = 1000
MAX_UNSAVED_BYTES = 64 << 20

#: a model whose stored requests are refused (an ACL, a token's scope) waits this long,
#: doubling to the most, before they are tried again
REFUSED_FIRST_WAIT_S = 2.0
REFUSED_MAX_WAIT_S = 300.0

#: batches of stored requests one flush sends at most
ROUNDS = 20

_RETRY_LATER = (
    EndpointUnavailable,
    ModelNotReady,
    DeadlineExceeded,
    Overloaded,
    Unauthenticated,
    PermissionDenied,  # (a broker's ACL or a token's scope: the operator's to fix, then sent)
)


class Deferrer:
    def __init__(
        self,
        store: DeferredStore,
        *,
        ttl_s: float = 24 * 3600.0,
        keep_results_s: float = 7 * 24 * 3600.0,
        max_attempts: int = 5,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.keep_results_s = keep_results_s
        self.max_attempts = max_attempts
        #: model -> (monotonic time before which it is not tried, the wait after that):
        #: a refusal by the broker's ACL or a token's scope waits longer each time (it
        #: had been tried, and logged, every second for the whole ttl)
        self._refused: dict[str, tuple[float, float]] = {}
        self.delivered = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ferry-store")
        # Answers the store could not write (disk full): kept here, bounded, served
        # to result() and written at the next flush.  After a crash they are gone, but
        # their rows are still "sending", go back to pending on reopen and are resent
        # with the same idempotency key, which the cloud answers from its cache.
        self._unsaved: dict[str, tuple[bytes | None, str | None]] = {}
        self._unsaved_bytes = 0
        self._flushing = asyncio.Lock()  # one flush at a time: "sending" rows are its own
        self._closed = False
        # A store that fails (a full or read-only disk) is said once, then once a minute,
        # and its recovery once: a flush a second had logged a line a second.
        self._store_trouble = Recurring(log, f"the deferred store {store.path}")
        self._clock = WallClock()
        self._unshifted: list[Step] = []  # clock steps the store has yet to apply
        self._shifting = asyncio.Lock()
        self._resumed = False  # the clock mark the store was left with has been read

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:  # (a call queued behind close would reopen the store, and leak it)
            raise ShuttingDown("the agent is stopping: its deferred store is closed")
        return await self._io_call(fn, *args, **kwargs)

    async def _io_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, partial(fn, *args, **kwargs))

    async def defer(
        self,
        model: str,
        request: InferRequest,
        *,
        deadline_ms: float | None,
        reason: str,
        owner: str = "",
        app_id: str | None = None,
    ) -> InferResponse:
        """Store ``request``; ``owner`` (the app's principal, "" where the agent has no
        tokens) is the only one :meth:`result` answers about it."""
        assert request.id is not None
        try:
            now = await self._wall()
            await self._put(model, request, now, owner, app_id)
        except StoreFailed as exc:
            self._store_trouble.failed(
                f"{exc.message} (requests that would wait for a link are refused until it "
                "can write: free room on its disk, or fix the state_dir)",
                logging.ERROR,
            )
            raise
        self._store_trouble.ok()
        return InferResponse(
            model_name=model,
            outputs=[],
            id=request.id,
            parameters={
                "where": "deferred",
                "deferred": True,
                "request_id": request.id,
                "decision": reason,
            },
        )

    async def _wall(self) -> float:
        """The wall clock now; a step of it (NTP, once a clock-less device is online)
        moves the stamps taken before it, so what was deferred keeps its ttl."""
        if not self._resumed:
            await self._resume()
        now, step = self._clock.read()
        if step is not None:
            if len(self._unshifted) >= 64:  # (a store failing that long: the oldest is lost)
                self._unshifted.pop(0)
            self._unshifted.append(step)
        if not self._unshifted:
            return now
        # One shifter at a time: a deferral and a flush that both read the step (the
        # step comes as the network does, and with it both) had each moved the rows.
        async with self._shifting:
            while self._unshifted:  # in order: each step's stamps are in the clock before it
                step = self._unshifted[0]
                # (the clock the stamps are in now, with the last step: written with it)
                mark = self._clock.mark() if len(self._unshifted) == 1 else None
                try:
                    moved = await self._call(self.store.shift, step.delta_s, step.since, mark)
                except db_error() as exc:  # (tried again at the next read)
                    self._store_trouble.failed(f"it cannot move its stamps by a clock step ({exc})")
                    break
                self._unshifted.pop(0)
                log.warning(
                    "the wall clock was stepped by %+.1f s: %d deferred requests keep their ttl",
                    step.delta_s,
                    moved,
                )
        return now

    async def _resume(self) -> None:
        """Carry on from the clock the store's stamps were left in: a step between the
        last process and this one (an agent restarted offline, then NTP) is applied
        like one seen here; they had kept the old clock's time, and expired at once."""
        async with self._shifting:
            if self._resumed:
                return
            try:
                mark = await self._call(self.store.clock_mark)
                step = self._clock.resume(mark) if mark is not None else None
                if step is None:  # (with a step, the shift writes the mark)
                    await self._call(self.store.set_clock_mark, self._clock.mark())
            except db_error() as exc:  # (tried again at the next read)
                self._store_trouble.failed(f"it cannot read or write its clock ({exc})")
                return
            self._resumed = True
            if step is not None:
                self._unshifted.insert(0, step)

    async def _put(
        self, model: str, request: InferRequest, now: float, owner: str, app_id: str | None
    ) -> None:
        await self._call(
            self.store.put,
            model,
            envelope.encode_request(request),
            request_id=request.id,
            created_wall=now,
            expires_wall=now + self.ttl_s,
            priority=int(request.parameters.get("priority", 0) or 0),
            owner=owner,
            app_id=app_id,
        )

    async def flush(
        self, send: Sender, can_send: Callable[[str | None], bool], limit: int = 50
    ) -> int:
        """Expire what waited too long, then send what is stored while a link is usable
        (``can_send(model)``: a transport could take that model now; ``None``: any);
        returns how many were answered.

        Expiry runs with no link too: that is when requests wait, and a dead
        one must not hold the store's room (nor stay "pending" past its ttl).
        A request the cloud refuses for its own reasons (bad input, unknown
        model, an internal error on it) fails alone, after ``max_attempts``
        for the transient kinds; one the link lets down stays stored; neither
        blocks the queue behind it, and a model no transport takes now is not
        tried (nor marked, nor logged) until one does.
        """
        async with self._flushing:
            try:
                sent = await self._flush(send, can_send, limit)
            except db_error() as exc:  # the store failed its own bookkeeping
                self._store_trouble.failed(f"stored requests wait: it failed ({exc})")
                return 0
            if self._unsaved:  # (answers it could not write wait in memory)
                self._store_trouble.failed(
                    f"it cannot write the answers of {len(self._unsaved)} delivered requests "
                    "(kept in memory until it can)"
                )
            else:
                self._store_trouble.ok()
            return sent

    async def _flush(self, send: Sender, can_send: Callable[[str | None], bool], limit: int) -> int:
        if not self.store.opened:
            return 0  # nothing was ever deferred here
        now = await self._wall()
        if not await self._save_unsaved():
            return 0  # the store still cannot write: nothing more to do now
        # rows left "sending" by a flush whose bookkeeping failed are this flush's again
        await self._call(self.store.requeue_sending)
        for request_id in await self._call(self.store.expire, now):
            log.warning("deferred request %s expired before a link returned", request_id)
        await self._call(self.store.purge, now - self.ttl_s - self.keep_results_s)
        done = 0
        # A backlog drains up to ROUNDS batches a tick (50 a tick, a full store of 10,000
        # took minutes after the link came back), one request at a time: sent side by
        # side they split the uplink, each timed out on a slow link, and their transfers
        # taught the link estimate a fraction of its rate.  Within a flush a request is
        # tried once (a transient error must not use every attempt in milliseconds), and
        # a model no transport takes now is passed over (its rows wait, untouched).
        put_back: set[str] = set()  # tried in this flush and still pending
        skip: set[str] = set()
        for _ in range(ROUNDS):
            if not can_send(None):
                break
            items = await self._call(
                self.store.pending,
                limit=limit,
                now_wall=await self._wall(),  # (a long flush must not send what expired)
                skip=frozenset(skip),
                skip_ids=frozenset(put_back),
            )
            tried = answered = 0
            for item in items:
                if not can_send(None):
                    return done
                if item.model in skip or not can_send(item.model) or self._waiting(item.model):
                    skip.add(item.model)
                    continue
                tried += 1
                if await self._send_one(item, send):
                    answered += 1
                else:
                    put_back.add(item.request_id)
            done += answered
            if len(items) < limit or (tried and not answered):
                # all sent, or nothing of a batch got an answer (the link, or a node that
                # fails every request): the next tick tries again, not the whole backlog
                break
        return done

    async def _send_one(self, item: DeferredItem, send: Sender) -> int:
        """Send one stored request; 1 when it got its final answer (result or error)."""
        try:
            request = envelope.decode_request(item.payload)
        except FerryError as exc:  # a corrupt row fails alone; the rest still flush
            log.error("deferred %s cannot be read back: %s", item.request_id, exc.message)
            await self._call(self.store.mark_sending, item.request_id)
            return await self._failed(item, f"internal: stored request unreadable: {exc}", True)
        await self._call(self.store.mark_sending, item.request_id)
        try:
            response = await send(item.model, request)
        except _RETRY_LATER as exc:
            # The link or endpoint let this one down: keep it, try the next one
            # (can_send() ends the flush once the breaker opens).
            if isinstance(exc, PermissionDenied | Unauthenticated):
                self._refuse(item.model, exc)
            else:
                log.info("deferred %s not sent yet: %s", item.request_id, exc.message)
            await self._call(self.store.mark_pending, item.request_id)
            return 0
        except FerryError as exc:
            final = isinstance(exc, ModelNotFound) or exc.http_status < 500
            return await self._failed(item, f"{exc.code.value}: {exc.message}", final)
        except Exception as exc:  # a bug must not strand the row in "sending"
            log.exception("deferred %s: sending failed", item.request_id)
            return await self._failed(item, f"internal: {exc!r}", False)
        self._refused.pop(item.model, None)
        # the app's own id, as every other answer carries it (V2 echoes the request's
        # id; the fetched answer had carried the receipt's)
        response.id = item.app_id if item.app_id is not None else item.request_id
        await self._finish(item.request_id, envelope.encode_reply(response), None)
        self.delivered += 1
        return 1

    def _waiting(self, model: str) -> bool:
        held = self._refused.get(model)
        return held is not None and time.monotonic() < held[0]

    def _refuse(self, model: str, exc: FerryError) -> None:
        """Hold ``model``'s stored requests back, twice as long as the last time."""
        _, wait = self._refused.get(model, (0.0, REFUSED_FIRST_WAIT_S / 2))
        wait = min(wait * 2, REFUSED_MAX_WAIT_S)
        self._refused[model] = (time.monotonic() + wait, wait)
        log.warning(
            "deferred requests for %s refused (%s): kept, tried again in %.0f s",
            model,
            exc.message,
            wait,
        )

    async def _finish(self, request_id: str, reply: bytes | None, error: str | None) -> None:
        """Record an answer; one the store cannot write is kept in memory instead."""
        try:
            # (stamped by a read that applies a step first: a stamp taken in the new clock
            # before the step was seen had been moved by it again, kept days too long)
            now = await self._wall()
            await self._call(self.store.mark_delivered, request_id, reply, error, now)
        except db_error() as exc:
            log.warning("deferred %s answered but not saved (%s): kept in memory", request_id, exc)
            size = len(reply or b"")
            if len(self._unsaved) >= MAX_UNSAVED or self._unsaved_bytes + size > MAX_UNSAVED_BYTES:
                # past the bound the answer is dropped here; the row stays "sending" and
                # is resent after a restart, answered from the cloud's idempotency cache
                log.error("deferred %s: answer dropped, memory bound reached", request_id)
                return
            self._unsaved[request_id] = (reply, error)
            self._unsaved_bytes += size

    async def _save_unsaved(self, call: Callable[..., Any] | None = None) -> bool:
        """Write the answers kept in memory; False while the store still refuses."""
        call = call or self._call
        for request_id, (reply, error) in list(self._unsaved.items()):
            try:
                await call(self.store.mark_delivered, request_id, reply, error)
            except db_error():
                return False
            self._unsaved.pop(request_id, None)
            self._unsaved_bytes -= len(reply or b"")
        return True

    async def _failed(self, item: DeferredItem, error: str, final: bool) -> int:
        """Fail the row for good when ``final`` or out of attempts, else put it back."""
        if final or item.attempts + 1 >= self.max_attempts:
            await self._finish(item.request_id, None, error)
            return 1
        await self._call(self.store.mark_pending, item.request_id, attempt=True)
        return 0

    async def result(
        self, request_id: str, owner: str = "", allows: Callable[[str], bool] | None = None
    ) -> dict[str, Any]:
        """Status of a deferred request and, once answered, its response or error.

        Only for the app that deferred it (``owner``), and a token that covers its
        model (``allows``): any token read any app's answers, a model-scoped one too.
        Another's receipt is a 404, as an unknown one (its existence is no one's
        business)."""
        unsaved = self._unsaved.get(request_id)
        try:
            found = await self._call(self.store.result, request_id)
        except db_error():
            if unsaved is None:
                raise
            found = None  # (the store that could not take the answer cannot be read)
        missing = ModelNotFound(f"no deferred request {request_id!r}")
        if found is None and (unsaved is None or owner):
            raise missing  # (whose an answer the store lost the row of is, none can say)
        if found is not None and (
            (found.owner and found.owner != owner)
            or (allows is not None and not allows(found.model))
        ):
            raise missing
        if unsaved is not None:
            reply, error = unsaved
            model = found.model if found is not None else ""
            found = DeferredResult("delivered" if error is None else "failed", reply, error, model)
        assert found is not None
        out: dict[str, Any] = {"request_id": request_id, "status": found.status}
        if found.error:
            out["error"] = found.error
        if found.result:
            _, response = envelope.decode_reply(found.result)
            out["response"] = response
        return out

    async def counts(self) -> dict[str, int]:
        """Rows by status, with the answers kept in memory (the store refused them)
        counted as what they are, not as the ``sending`` their rows still say."""
        counts = await self._call(self.store.counts)
        for _reply, error in self._unsaved.values():
            counts["sending"] = counts.get("sending", 0) - 1
            status = "delivered" if error is None else "failed"
            counts[status] = counts.get(status, 0) + 1
        if counts.get("sending", 0) <= 0:
            counts.pop("sending", None)
        return counts

    async def close(self) -> None:
        """Close the store; a request a clean stop interrupted mid-send goes back to
        pending without counting an attempt (only a crash counts one: see the store).
        From its first step no other call reaches the store (ShuttingDown)."""
        self._closed = True
        try:
            await self._save_unsaved(self._io_call)
            await self._io_call(self.store.requeue_sending)
        except db_error() as exc:
            log.warning("deferred store not tidied at stop (%s)", exc)
        await self._io_call(self.store.close)
        self._io.shutdown(wait=True)
