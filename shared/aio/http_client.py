"""A small keep-alive HTTP/1.1 client: what the agent needs to reach a V2 server.

One request at a time per connection, a pool of idle connections per
client, TLS through ``ssl``, and nothing else (no redirects, cookies or
proxies: a V2 endpoint needs none).  Bodies go out as the caller's buffers
(a head plus the tensors, no join) and the answer's body is read by the
kernel into one buffer of its declared length (:mod:`shared.http.wire`).

A kept-alive connection can be closed by the server just as a request is
sent on it; such a request, which got no byte of an answer, is sent once
more on a fresh connection.  Ferry's offloads carry an idempotency key, so
a server that did run it answers the second copy from its cache.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from shared.buffered import tail_for
from shared.errors import EndpointUnavailable, InternalError
from shared.http.wire import Head, HttpError, ResponseParser, request_head

#: an idle pooled connection is dropped after this (servers close theirs at 60-75 s)
IDLE_S = 15.0
#: what a fresh connection keeps of what the server says before it is asked (an answer)
_EARLY_BYTES = 64 * 1024


class ClientResponse:
    __slots__ = ("body", "head")

    def __init__(self, head: Head, body: bytearray) -> None:
        self.head = head
        self.body = body

    @property
    def status(self) -> int:
        return self.head.status

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.head.headers.get(name.lower(), default)


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, max_body: int) -> None:
        self.parser = ResponseParser(max_body=max_body, tail=tail_for(asyncio.get_running_loop()))
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[ClientResponse] | None = None
        self.head: Head | None = None
        self.closed = False
        self.got_bytes = False
        self.idle_since = time.monotonic()
        self.error: Exception | None = None  # why it failed while no request waited
        self.used = False  # it has carried a request (a fresh one may hold an early answer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.got_bytes = True
        if self.waiter is None or self.waiter.done():
            # Bytes while no request waits answer nothing this client asked: a server
            # that kept sending into an idle pooled connection had it buffer them all
            # (100 MiB held with no traffic).  The connection is dropped at once.  A fresh
            # one keeps a little: a server at its cap answers 503 before it is asked,
            # which is the first request's answer (read by _exchange).
            if self.used or self.parser.buffered + nbytes > _EARLY_BYTES:
                self._fail(InternalError("the server sent bytes no request asked for"))
                return
            try:
                self.parser.buffer_updated(nbytes)  # (paused: kept for the request)
            except HttpError as exc:
                self._fail(InternalError(f"unreadable HTTP answer: {exc.message}"))
            return
        try:
            self.parser.buffer_updated(nbytes)
        except HttpError as exc:
            self._fail(InternalError(f"unreadable HTTP answer: {exc.message}"))
            return
        self._deliver()

    def eof_received(self) -> bool:
        self.parser.end_of_stream()
        self._deliver()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionResetError("the server closed the connection"))

    def _deliver(self) -> None:
        events = self.parser.events
        while events:
            item = events.popleft()
            if isinstance(item, Head):
                self.head = item
            elif self.waiter is not None and not self.waiter.done():
                assert self.head is not None
                self.waiter.set_result(ClientResponse(self.head, item))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        elif self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.close()
        self.closed = True


def _reusable(head: Head) -> bool:
    """Whether the connection may carry another request after this answer: not where
    its framing was doubtful (a 204 or 304 that declares a body, whose bytes came late
    and were handed to the next request as its answer; both Transfer-Encoding and
    Content-Length, which RFC 9112 6.3 calls an error)."""
    if not head.keep_alive:
        return False
    headers = head.headers
    te, length = headers.get("transfer-encoding"), headers.get("content-length")
    if te is not None and length is not None:
        return False
    if head.status in (204, 304) and (te is not None or (length or "0").strip() != "0"):
        return False
    return True


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer before the deadline"))


class HttpClient:
    """Requests to one base URL (``http://host:port`` or ``https://...``)."""

    def __init__(
        self,
        base_url: str,
        *,
        tls_context: ssl.SSLContext | None = None,
        headers: Sequence[tuple[str, str]] = (),
        max_idle: int = 16,
        max_body: int = 64 * 1024 * 1024,
        max_connections: int = 128,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.authority = parts.netloc.rpartition("@")[2]
        self.tls = (
            (tls_context or ssl.create_default_context()) if parts.scheme == "https" else None
        )
        self.headers = list(headers)
        self.max_idle = max_idle
        self.max_body = max_body
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self.closed = False
        # Requests under way at once (one connection each): past it a request waits for
        # one to end, within its deadline.  300 concurrent offloads had opened 300 sockets.
        self._slots = asyncio.Semaphore(max_connections) if max_connections > 0 else None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Sequence[tuple[str, str]] = (),
        *,
        deadline: float | None = None,
    ) -> ClientResponse:
        """Send one request and read its whole answer (any status).

        ``deadline`` (loop time, ``time.monotonic()``) bounds the wait for the
        answer: past it, TimeoutError and the connection is dropped.  One timer
        per request, cheaper than an ``asyncio.timeout`` block around the call.
        Raises OSError when the server cannot be reached.
        """
        if self.closed:
            raise EndpointUnavailable("HTTP client closed")
        slots = self._slots
        if slots is None:
            return await self._request(method, path, body, headers, deadline)
        if slots.locked():  # (all in use: wait for one, within the deadline)
            if deadline is None:
                await slots.acquire()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("deadline passed before the request was sent")
                await asyncio.wait_for(slots.acquire(), remaining)
        else:
            await slots.acquire()  # (free: returns at once, no loop turn)
        try:
            return await self._request(method, path, body, headers, deadline)
        finally:
            slots.release()

    async def _request(
        self,
        method: str,
        path: str,
        body: Any,
        headers: Sequence[tuple[str, str]],
        deadline: float | None,
    ) -> ClientResponse:
        chunks = [] if body is None else list(body) if isinstance(body, (list, tuple)) else [body]
        size = sum(c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks)
        head = request_head(
            method,
            self.prefix + path,
            self.authority,
            [*self.headers, *headers],
            size if (chunks or method in ("POST", "PUT")) else None,
        )
        for attempt in (0, 1):
            # (the retry goes on a fresh connection: another pooled one the server had
            # closed too had failed it again while the server was up)
            conn = self._idle_connection() if not attempt else None
            if conn is not None:  # the usual case: no task, no timer, no loop turn
                reused = True
            elif deadline is None:
                conn, reused = await self._connection(fresh=bool(attempt))
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("deadline passed before the request was sent")
                conn, reused = await asyncio.wait_for(
                    self._connection(fresh=bool(attempt)), remaining
                )
            try:
                return await self._exchange(conn, method, head, chunks, size, deadline)
            except ConnectionResetError:
                if not reused or conn.got_bytes or attempt:
                    raise
                # a kept-alive connection the server had just closed: once more, afresh
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(
        self,
        conn: _Connection,
        method: str,
        head: bytes,
        chunks: list[Any],
        size: int,
        deadline: float | None,
    ) -> ClientResponse:
        if conn.closed and not conn.parser.buffered:
            # (a fresh connection the server spoke on first, or closed, before this request)
            self._drop(conn)
            raise conn.error or ConnectionResetError("the server closed the connection")
        conn.used = True
        loop = asyncio.get_running_loop()
        conn.waiter = waiter = loop.create_future()
        timer = None
        if deadline is not None:
            # the loop's clock is time.monotonic(), the clock Ferry's deadlines use
            timer = loop.call_at(deadline, _expire, waiter)
        conn.got_bytes = False
        conn.head = None
        conn.parser.expect_no_body = method == "HEAD"
        try:
            try:
                # (what the server sent before this request, a greeting of some other
                # protocol, is parsed here: its error is the request's, typed)
                conn.parser.resume()
                if conn.parser.eof:  # (it ended before it was read: an answer read to the end)
                    conn.parser.end_of_stream()
            except HttpError as exc:
                raise InternalError(f"unreadable HTTP answer: {exc.message}") from None
            conn._deliver()  # (an answer it gave before it was asked: this request's)
            if conn.closed and not waiter.done():  # (and then went: no more will come)
                waiter.set_exception(conn.error or ConnectionResetError("connection closed"))
            assert conn.transport is not None
            if waiter.done() or conn.transport.is_closing():
                pass  # answered already, or gone: nothing to send it on
            elif size < 64 * 1024:
                conn.transport.write(head + b"".join(chunks))
            else:
                conn.transport.write(head)
                for chunk in chunks:
                    conn.transport.write(chunk)
            response = await waiter
        except BaseException:
            self._drop(conn)  # cancelled, failed or timed out halfway: the stream is unusable
            raise
        finally:
            if timer is not None:
                timer.cancel()
        conn.waiter = None
        # Bytes past this answer (a second answer to one request) mean the stream no
        # longer pairs answers with requests: the next request would be handed this
        # stale one (another caller's), so the connection goes, never to the pool.
        desynced = conn.parser.buffered > 0
        if (
            conn.closed
            or desynced
            or not _reusable(response.head)
            or len(self._idle) >= self.max_idle
        ):
            self._drop(conn)
        else:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        return response

    def _idle_connection(self) -> _Connection | None:
        """A kept-alive connection still fresh enough to reuse, if one is idle."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            # (bytes that came while it sat idle answer nothing this client asked)
            if not conn.closed and not conn.parser.buffered and now - conn.idle_since < IDLE_S:
                return conn
            self._drop(conn)
        return None

    async def _connection(self, fresh: bool = False) -> tuple[_Connection, bool]:
        conn = None if fresh else self._idle_connection()
        if conn is not None:
            return conn, True
        loop = asyncio.get_running_loop()
        conn = _Connection(self.max_body)
        await loop.create_connection(
            lambda: conn,
            self.host,
            self.port,
            ssl=self.tls,
            server_hostname=self.host if self.tls else None,
        )
        self._all.add(conn)
        return conn, False

    def _drop(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn.transport is not None:
            conn.transport.close()
        conn.closed = True

    async def close(self) -> None:
        self.closed = True
        for conn in list(self._all):
            self._drop(conn)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing
