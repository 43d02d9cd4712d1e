"""Exactly-once answers for retried requests (``parameters.idempotency_key``), on both
tiers: a cloud node's requests, and an app's at its edge agent, wherever the agent
answers them (a local run took no notice of the key, so whether a reused key was a
409 hung on where the policy sent it).

The edge agent's store-and-forward may send a request again after a crash
between the cloud's answer and its own bookkeeping.  Per model, the first
request with a key runs; a duplicate that arrives while it runs awaits the
same result, and one that arrives later (within ``ttl_s`` of completion) gets
the cached response without the model running again.  Errors are not cached:
duplicates already waiting see the same error, later ones run afresh (but a
duplicate waits only within its own deadline, and one whose run missed that
run's shorter deadline, with time of its own left, runs afresh).

The run is a task of its own, so a first client that goes away does not
cancel it: its result still serves the retry.  The cache is an LRU bounded to
``max_entries`` keys and ``max_bytes`` of cached answers; a key evicted early
only means a late duplicate runs again.

A key is scoped by who sent it (the token's principal over HTTP, the reply
topic over MQTT) and bound to a fingerprint of what was sent: a key reused
with other inputs is a 409 conflict, never another request's answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.aio.eager import eager_future
from shared.errors import DeadlineExceeded, IdempotencyConflict
from shared.idempotency import PARAMETER
from shared.messages import InferResponse
from shared.tensors import Tensor

T = TypeVar("T")

Key = Hashable


#: bytes an entry holds beyond its answer's tensors (measured: ~3.5 KB of RSS a keyed
#: request on a node, the response, its parameters and the allocator's share)
ENTRY_OVERHEAD = 3584


@dataclass
class _Entry(Generic[T]):
    task: asyncio.Future[T]
    fingerprint: bytes
    #: the settled result as the cache keeps it (``compact``ed); the run's own task is
    #: let go then, so nothing it held (a batch's whole output) outlives the first answer
    kept: Any = None
    settled: bool = False
    expires: float | None = None  # set once the run succeeded
    size: int = 0
    keep: Callable[[T], bool] | None = None  # which results a later duplicate may share


class IdempotencyCache(Generic[T]):
    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        max_bytes: int = 64 << 20,
        sizeof: Callable[[T], int] = lambda _result: 0,
        compact: Callable[[T], T] = lambda result: result,
    ) -> None:
        self.ttl_s = float(ttl_s)
        self.compact = compact
        self.max_entries = max(1, int(max_entries))
        self.max_bytes = max(0, int(max_bytes))
        self.sizeof = sizeof
        self.bytes = 0
        self._entries: OrderedDict[Key, _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        key: Key,
        factory: Callable[[], Coroutine[Any, Any, T]],
        fingerprint: bytes = b"",
        keep: Callable[[T], bool] | None = None,
        deadline: float | None = None,
    ) -> tuple[T, bool]:
        """``(result, duplicate)``: run ``factory`` once per key, or share its result.

        A result ``keep`` rejects is shared with the duplicates already waiting and
        then forgotten, as an error is (the agent's deferral receipts: the store
        knows a deferral by its key, and a retry after it failed must store it
        afresh, not be handed the dead receipt).  ``deadline`` (monotonic) is this
        caller's: a duplicate that joins a run still going waits for it until then
        (DeadlineExceeded: not a late answer), and where the run failed on its own,
        earlier deadline, one with time left runs afresh."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.expires is None or entry.expires > time.monotonic():
                if entry.fingerprint != fingerprint:
                    raise IdempotencyConflict(
                        f"{PARAMETER} was already used for a request with other inputs or requested outputs"
                    )
                self._entries.move_to_end(key)
                if entry.settled:
                    return entry.kept, True
                if entry.task.done():
                    return await asyncio.shield(entry.task), True
                try:
                    if deadline is None:
                        return await asyncio.shield(entry.task), True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    return await asyncio.wait_for(asyncio.shield(entry.task), left), True
                except TimeoutError:
                    raise DeadlineExceeded(
                        "the deadline passed while waiting for the run of an earlier request "
                        f"with this {PARAMETER}"
                    ) from None
                except DeadlineExceeded:
                    out_of_time = deadline is not None and deadline - time.monotonic() <= 0
                    if out_of_time or self._entries.get(key) is entry:
                        raise
                    # (that run's own deadline was shorter: this one's may still be met)
                    return await self.run(key, factory, fingerprint, keep, deadline)
            self._drop(key)
        # Started in place: a request that runs without waiting (a lone one on an
        # idle model) is answered without a task, a shield or a loop turn.
        task = eager_future(asyncio.get_running_loop(), factory())
        entry = _Entry(task, fingerprint, keep=keep)
        self._entries[key] = entry
        if task.done():
            self._settle(key, entry, task)
            return task.result(), False
        task.add_done_callback(lambda t: self._settle(key, entry, t))
        self._trim()
        return await asyncio.shield(task), False

    def forget(self, keep: Callable[[Key], bool]) -> None:
        """Drop every finished or running entry whose key ``keep`` rejects."""
        for key in [k for k in self._entries if not keep(k)]:
            self._drop(key)

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size

    def _trim(self) -> None:
        entries = self._entries
        while len(entries) > self.max_entries or (self.bytes > self.max_bytes and entries):
            _, entry = entries.popitem(last=False)
            self.bytes -= entry.size
        # Expired ones at the old end go too: the ttl had bounded nothing (a node held
        # max_entries answers whatever the ttl, growing for as long as it took to fill)
        now = time.monotonic()
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.expires is None or entry.expires > now:
                break
            self._drop(key)

    def _settle(self, key: Key, entry: _Entry[T], task: asyncio.Future[T]) -> None:
        failed = task.cancelled() or task.exception() is not None  # also marks it retrieved
        if self._entries.get(key) is not entry:
            return  # evicted meanwhile
        if failed or (entry.keep is not None and not entry.keep(task.result())):
            self._drop(key)
            return
        entry.expires = time.monotonic() + self.ttl_s
        entry.kept, entry.settled = self.compact(task.result()), True
        entry.task = _settled(entry.task)
        # (what an entry costs beside its answer's tensors: the key, the entry, the
        # response object; counted, or small answers' entries passed the byte bound)
        entry.size = self.sizeof(entry.kept) + ENTRY_OVERHEAD
        self.bytes += entry.size
        if entry.size > self.max_bytes:
            self._drop(key)  # bigger than the whole cache: a late duplicate runs again
        self._trim()


def _settled(task: asyncio.Future[T]) -> asyncio.Future[T]:
    """A done future in the run's place, holding nothing: the entry answers from ``kept``."""
    done: asyncio.Future[T] = task.get_loop().create_future()
    done.set_result(None)  # type: ignore[arg-type]
    return done


def owned_response(response: InferResponse) -> InferResponse:
    """``response`` with every output owning its memory, as a cache must keep it.

    A batched run hands each request a view of the batch's output, and a decoded reply
    views its whole body: cached as they are, a keyed answer of 1 MiB had pinned the
    batch's 8 MiB, and the byte bound counted the 1 MiB."""
    if all(t.data.base is None for t in response.outputs):
        return response
    outputs = [
        t if t.data.base is None else Tensor(t.name, t.datatype, t.data.copy(), t.parameters)
        for t in response.outputs
    ]
    return InferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id,
        outputs=outputs,
        parameters=response.parameters,
    )


def as_duplicate(response: InferResponse) -> InferResponse:
    """A shared answer as a retry gets it: the same outputs, marked ``duplicate``."""
    return InferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id,
        outputs=response.outputs,
        parameters={**response.parameters, "duplicate": True},
    )


def response_bytes(response: InferResponse) -> int:
    """What a cached response holds (BYTES elements by their lengths)."""
    total = 0
    for tensor in response.outputs:
        if tensor.datatype == "BYTES":
            total += sum(len(x) for x in tensor.data.reshape(-1).tolist()) + 8 * tensor.data.size
        else:
            total += tensor.data.nbytes
    return total
