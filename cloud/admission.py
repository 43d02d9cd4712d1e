"""What a node lets in: request bytes in flight, connections, and how long they may dawdle.

Two bounds that no single request can see:

* :class:`ByteBudget`: the bytes of every request received but not yet
  answered, HTTP and MQTT together.  A request past it is refused before its
  body is read (HTTP) or decoded (MQTT), with "overloaded" + Retry-After, so
  forty clients sending 60 MB each cannot take the node's memory.
* :class:`ConnectionGuard`: a cap on open HTTP connections, and reaping of
  connections that send half a request header and stop (``header_timeout_s``)
  or sit idle between requests (``idle_timeout_s``).  It wraps aiohttp's
  protocol objects instead of patching them, and reaps from a timer that the
  server drives (:meth:`ConnectionGuard.reap` takes the time), so the rules
  are testable without sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from shared.errors import DeadlineExceeded, Overloaded, PayloadTooLarge
from shared.httpbody import read_into

#: Retry-After for a request refused by the byte budget (bodies drain in about this long)
BUDGET_RETRY_S = 1.0


class ByteBudget:
    """A thread-safe count of request bytes in flight, against a fixed bound (0: none)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def used(self) -> int:
        return self._used

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self.limit and self._used + n > self.limit and self._used > 0:
                self.refused += 1
                return False
            self._used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used = max(0, self._used - n)

    def overloaded(self, n: int) -> Overloaded:
        return Overloaded(
            f"node has {self._used} bytes of requests in flight; {n} more would pass its "
            f"budget of {self.limit}",
            retry_after=BUDGET_RETRY_S,
        )


async def read_body(
    request: web.Request, budget: ByteBudget, *, timeout_s: float, max_bytes: int
) -> tuple[bytearray, int]:
    """Read a request body within the budget, the size limit and the body timeout.

    Returns (body, bytes taken from the budget); the caller gives them back
    once answered.  A declared Content-Length is checked and taken before a
    byte is read; a chunked body, whose size nobody knows yet, takes the
    body limit.
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    taken = declared if declared is not None else max_bytes
    if not budget.try_take(taken):
        raise budget.overloaded(taken)
    try:
        async with asyncio.timeout(timeout_s):
            body = await read_into(request, max_bytes)
    except TimeoutError:
        budget.give(taken)
        raise DeadlineExceeded(f"request body not received within {timeout_s:g} s") from None
    except BaseException:
        budget.give(taken)
        raise
    return body, taken


_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)


def default_max_connections() -> int:
    """Connections a node accepts by default: room below the descriptor limit for
    model files, the broker and the runtimes' own."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 128))


class _Entry:
    __slots__ = ("active", "pending_since", "quiet_since", "transport")

    def __init__(self, transport: Any, now: float) -> None:
        self.transport = transport
        self.active = 0  # requests whose handler runs
        self.quiet_since = now  # no request running since
        self.pending_since: float | None = None  # bytes of a request not yet handled since


class ConnectionGuard:
    def __init__(
        self,
        *,
        max_connections: int,
        header_timeout_s: float,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._entries: dict[Any, _Entry] = {}
        self.refused = 0
        self.reaped_header = 0
        self.reaped_idle = 0

    @property
    def open_connections(self) -> int:
        return len(self._entries)

    @property
    def active_requests(self) -> int:
        return sum(entry.active for entry in self._entries.values())

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(self, factory)

    # ---- called by the protocol wrapper and the request middleware ------------------------
    def _opened(self, transport: Any) -> bool:
        if self.max_connections and len(self._entries) >= self.max_connections:
            self.refused += 1
            body = b'{"error": "too many connections", "code": "overloaded"}'
            transport.write(_REFUSAL % (len(body), body))
            transport.close()
            return False
        self._entries[transport] = _Entry(transport, self.clock())
        return True

    def _closed(self, transport: Any) -> None:
        self._entries.pop(transport, None)

    def _data(self, transport: Any) -> None:
        entry = self._entries.get(transport)
        if entry is not None and entry.active == 0 and entry.pending_since is None:
            entry.pending_since = self.clock()

    def begin_request(self, transport: Any) -> None:
        entry = self._entries.get(transport)
        if entry is not None:
            entry.active += 1
            entry.pending_since = None

    def end_request(self, transport: Any) -> None:
        entry = self._entries.get(transport)
        if entry is not None:
            entry.active = max(0, entry.active - 1)
            if entry.active == 0:
                entry.quiet_since = self.clock()

    def reap(self, now: float | None = None) -> int:
        """Close connections past their header or idle timeout; returns how many."""
        now = self.clock() if now is None else now
        doomed = []
        for entry in self._entries.values():
            if entry.active or _still_writing(entry.transport):
                continue
            if entry.pending_since is not None:
                if now - entry.pending_since > self.header_timeout_s:
                    doomed.append(entry)
                    self.reaped_header += 1
            elif now - entry.quiet_since > self.idle_timeout_s:
                doomed.append(entry)
                self.reaped_idle += 1
        for entry in doomed:
            self._entries.pop(entry.transport, None)
            entry.transport.close()
        return len(doomed)

    def middleware(self) -> Any:
        guard = self

        @web.middleware
        async def track(request: web.Request, handler: Any) -> web.StreamResponse:
            transport = request.transport
            guard.begin_request(transport)
            try:
                return await handler(request)
            finally:
                guard.end_request(transport)

        return track


def _still_writing(transport: Any) -> bool:
    try:
        return bool(transport.get_write_buffer_size())
    except (AttributeError, RuntimeError):
        return False


class _GuardedProtocol(asyncio.Protocol):
    """Passes every event to aiohttp's handler, telling the guard what happened."""

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._factory = factory
        self._inner: Any = None
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        if not self._guard._opened(transport):
            return
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard._closed(self._transport)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._guard._data(self._transport)
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class GuardedSite(web.TCPSite):
    """aiohttp's TCP site with its protocols wrapped by a :class:`ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port)
        self.guard = guard
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            self.guard.wrap(server), self._host, self._port, reuse_address=True
        )
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        period = max(0.05, min(self.guard.header_timeout_s, self.guard.idle_timeout_s) / 4)
        while True:
            await asyncio.sleep(period)
            self.guard.reap()

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await super().stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]
