"""Exactly-once answers for retried requests (``parameters.idempotency_key``).

The edge agent's store-and-forward may send a request again after a crash
between the cloud's answer and its own bookkeeping.  Per model, the first
request with a key runs; a duplicate that arrives while it runs awaits the
same result, and one that arrives later (within ``ttl_s`` of completion) gets
the cached response without the model running again.  Errors are not cached:
duplicates already waiting see the same error, later ones run afresh.

The run is a task of its own, so a first client that goes away does not
cancel it: its result still serves the retry.  The cache is an LRU bounded to
``max_entries`` keys; a key evicted early only means a late duplicate runs
again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.errors import InvalidInput

T = TypeVar("T")

MAX_KEY_LENGTH = 128
PARAMETER = "idempotency_key"


def idempotency_key(parameters: dict) -> str | None:
    """The request's key, checked (None when it has none)."""
    key = parameters.get(PARAMETER)
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidInput(
            f"parameter {PARAMETER!r} must be a string of 1 to {MAX_KEY_LENGTH} characters"
        )
    return key


@dataclass
class _Entry(Generic[T]):
    task: asyncio.Future[T]
    expires: float | None = None  # set once the run succeeded


class IdempotencyCache(Generic[T]):
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = float(ttl_s)
        self.max_entries = max(1, int(max_entries))
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, key: str, factory: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """``(result, duplicate)``: run ``factory`` once per key, or share its result."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.expires is None or entry.expires > time.monotonic():
                self._entries.move_to_end(key)
                return await asyncio.shield(entry.task), True
            del self._entries[key]
        task = asyncio.ensure_future(factory())
        entry = _Entry(task)
        self._entries[key] = entry
        task.add_done_callback(lambda t: self._settle(key, entry, t))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return await asyncio.shield(task), False

    def _settle(self, key: str, entry: _Entry[T], task: asyncio.Future[T]) -> None:
        failed = task.cancelled() or task.exception() is not None  # also marks it retrieved
        if self._entries.get(key) is not entry:
            return  # evicted meanwhile
        if failed:
            del self._entries[key]
        else:
            entry.expires = time.monotonic() + self.ttl_s
