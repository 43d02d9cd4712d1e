"""The HTTP/1.1 server both tiers' fronts run on: asyncio over :mod:`shared.http.wire`.

Why not aiohttp's server: per request it builds a request object, a stream
reader, a middleware chain and a response object, and joins the body; on a
602 KB tensor that was 0.3-0.4 ms of Python and three copies for a few
microseconds of work, and importing it costs an agent ~13 MiB.  Here a
connection is one ``asyncio.BufferedProtocol``: the head is parsed from a
scratch buffer, the body is read by the kernel straight into its own buffer
(grown as its bytes come: :mod:`shared.http.wire`), and the answer goes out as
a head plus the caller's buffers.

What an application provides (:class:`HttpApp`):

- ``admit(request)``, called with the head before the body is read: a
  :class:`Response` refuses the request (an unknown model, a missing token, a
  body the byte budget cannot take), and its body is then read and dropped
  (or the connection closed) instead of being stored;
- ``receiving(request, received)``, only for a request whose ``allowance``
  ``admit`` set: called as its body arrives past that many bytes, to take
  more from a budget (and raise ``allowance``) or refuse it halfway with a
  :class:`Response`; a budget is charged for bytes that came, never for a
  length a client declared and then trickles (a few stalled uploads had
  held a node's whole budget for a minute);
- ``handle(request)``, the coroutine that answers it;
- ``finished(request)``, called once the answer is written or the
  connection is gone, to give back what ``admit`` took.

The server owns the rest of the connection's life: keep-alive, ``Expect:
100-continue``, a cap on connections (503 and close past it), header, body
and idle timeouts (one reaper for all connections), pipelined requests
answered in order, and a graceful stop (listening socket closed, answers
carry ``Connection: close``, idle connections closed, running handlers
awaited until a deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

from shared.aio.eager import eager_future
from shared.buffered import tail_for
from shared.errors import ConfigError, FerryError, ShuttingDown
from shared.http.wire import CONTINUE, BodyPool, Head, HttpError, RequestParser, response_head

log = logging.getLogger(__name__)

JSON = "application/json"
_JOIN_BELOW = 64 * 1024  # answers smaller than this leave in one write (one syscall)
_PAUSE_ABOVE = 1 << 20  # pipelined bytes buffered before reading pauses
#: a refused newcomer's 503 is read out for this long at most, by this many at once
REFUSED_LINGER_S = 1.0
REFUSING_MAX = 64
#: how long requests cut off at the end of a shutdown's grace have to send that answer
CUT_ANSWER_S = 0.5


class Request:
    """One request: its head, its body (a bytearray) once read, and routing results."""

    __slots__ = (
        "allowance",
        "body",
        "head",
        "method",
        "params",
        "path",
        "query",
        "remote",
        "route",
        "state",
    )

    def __init__(self, head: Head, remote: str | None) -> None:
        self.head = head
        self.method = head.method
        target = head.target
        if target[:8].lower().startswith(("http://", "https://")):  # absolute form (a proxy)
            slash = target.find("/", target.find("//") + 2)
            target = target[slash:] if slash >= 0 else "/"
        path, _, self.query = target.partition("?")
        self.path = path
        self.remote = remote
        self.body: bytearray = bytearray()
        self.route: Any = None
        self.params: dict[str, str] = {}
        self.state: dict[str, Any] = {}
        #: body bytes the app has taken into account (None: it does not count them)
        self.allowance: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        return self.head.headers

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.head.headers.get(name, default)

    @property
    def content_length(self) -> int | None:
        raw = self.head.headers.get("content-length")
        return int(raw) if raw is not None else None  # the parser checked it is digits

    @property
    def has_body(self) -> bool:
        return bool(self.content_length) or "transfer-encoding" in self.head.headers


class Response:
    """An answer: ``body`` is one buffer or a sequence of them (written in order, no join)."""

    __slots__ = ("body", "close", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: Any = b"",
        *,
        content_type: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
        close: bool = False,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = list(headers)
        if content_type is not None:
            self.headers.insert(0, ("Content-Type", content_type))
        self.close = close


def json_response(
    data: Any, status: int = 200, headers: Sequence[tuple[str, str]] = ()
) -> Response:
    return Response(status, json.dumps(data).encode(), content_type=JSON, headers=headers)


def error_response(status: int, message: str, code: str) -> Response:
    return json_response({"error": message, "code": code}, status)


def ferry_error_response(exc: FerryError) -> Response:
    """A Ferry error as both tiers answer it: its status, ``Retry-After``, a JSON body."""
    status, headers, body = exc.http_error()
    return Response(status, body.encode(), content_type=JSON, headers=list(headers.items()))


def http_error_response(exc: HttpError) -> Response:
    return error_response(exc.status, exc.message, _CODES.get(exc.status, "invalid_argument"))


class HttpApp(Protocol):
    def admit(self, request: Request) -> Response | None: ...

    def handle(self, request: Request) -> Awaitable[Response]: ...

    def finished(self, request: Request) -> None: ...

    # (only called for a request whose ``allowance`` admit set)
    def receiving(self, request: Request, received: int) -> Response | None: ...


def default_max_connections() -> int:
    """Connections a server accepts by default: room below the descriptor limit for
    model files, the broker and the runtimes' own (past the limit, accept() fails
    in a loop: the agent took 100% CPU and logged megabytes a second, deaf)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 128))


@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = 64 * 1024
    max_header_fields: int = 100
    #: a connection that sends part of a request head and stops, or a new one that sends
    #: nothing, is closed after this
    header_timeout_s: float = 10.0
    #: a request body not fully received in this long gets 504 and is closed
    body_timeout_s: float = 60.0
    #: and one arriving slower than this on average, past the grace, gets 408 (Kestrel's
    #: MinRequestBodyDataRate): 4,000 uploads of a byte each had held every connection
    #: slot, health checks refused, for the whole body timeout
    min_body_bytes_per_s: float = 240.0
    min_body_rate_grace_s: float = 5.0
    #: a kept-alive connection with no request for this long is closed
    idle_timeout_s: float = 75.0
    #: open connections before new ones get 503 and are closed (0: no cap)
    max_connections: int = 0
    #: how long the body of a refused request is read and dropped before closing instead
    linger_s: float = 5.0
    #: bodies kept for reuse (BodyPool): CPU for memory; 0 on a device that counts MiB
    body_pool_bytes: int = 64 * 1024 * 1024


_IDLE, _HEAD, _BODY, _HANDLING, _LINGER = range(5)
_EMPTY = bytearray()
_CODES = {400: "invalid_argument", 404: "not_found", 405: "invalid_argument",
          408: "deadline_exceeded", 413: "payload_too_large", 431: "invalid_argument",
          501: "invalid_argument", 504: "deadline_exceeded", 505: "invalid_argument"}  # fmt: skip


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        o = server.options
        self.parser = RequestParser(
            max_head=o.max_head_bytes,
            max_fields=o.max_header_fields,
            max_body=o.max_body_bytes,
            pool=server.bodies,
            tail=tail_for(asyncio.get_running_loop()),
        )
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.request: Request | None = None
        self.task: asyncio.Task[None] | None = None
        self._eager = False  # a handler is running in place, in this turn of the loop
        self.state = _IDLE
        self.since = time.monotonic()
        #: nothing sent yet: held no longer than a head may take (not the idle timeout
        #: of a connection that has been used: thousands of silent ones had held the cap)
        self.fresh = True
        self.closing = False
        self.paused_reading = False
        self.failure: tuple[int, str] | None = None  # a bad request behind a running one
        #: answered and closing: what the client still sends is read and dropped first, so
        #: it sees the answer instead of a reset (a lingering close)
        self.discarding = False
        self._write_ok = asyncio.Event()
        self._write_ok.set()
        self._write_paused = False  # reading paused while answers back up

    # ---- asyncio.BufferedProtocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) and peer else None
        if not self.server._opened(self):
            body = b'{"error": "too many connections", "code": "overloaded"}'
            head = response_head(
                503, [("Content-Type", JSON), ("Retry-After", "1")], len(body), close=True
            )
            transport.write(head + body)  # type: ignore[attr-defined]
            # What it sends is read and dropped until it closes (or linger_s), so that it
            # sees the 503: closed at once, its unread request made the kernel reset it.
            # A short linger, and a bounded number of them: each holds a descriptor, and
            # the cap is there to keep the server below the descriptor limit.
            refusing = self.server._refusing
            if len(refusing) >= REFUSING_MAX or not transport.can_write_eof():  # type: ignore[attr-defined]
                self.closing = True
                transport.close()
                return
            self.discarding = True
            refusing.add(self)
            transport.write_eof()  # type: ignore[attr-defined]  # (done: it may close now)
            loop = asyncio.get_running_loop()
            loop.call_later(min(self.server.options.linger_s, REFUSED_LINGER_S), self._end)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.discarding and not self.parser.skipping:
            return self.parser._view
        return self.parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self.discarding:
            if self.parser.skipping:
                self.parser.buffer_updated(nbytes)
                if not self.parser.skipping:
                    self._end()  # the refused body is read: the answer is safe to leave
            return
        if self.state == _IDLE:
            self.state, self.since = _HEAD, time.monotonic()
            self.fresh = False
        try:
            self.parser.buffer_updated(nbytes)
            request = self.request
            if self.state == _BODY and request is not None and request.allowance is not None:
                received = self.parser.body_received  # (0 once whole: _events counts it)
                if received > request.allowance and self._refused_halfway(request, received):
                    return
            self._events()
        except HttpError as exc:
            self._fail(exc.status, exc.message)

    def _refused_halfway(self, request: Request, received: int) -> bool:
        try:
            refusal = self.server.app.receiving(request, received)
        except Exception:
            log.exception("receiving %s %s failed", request.method, request.path)
            refusal = error_response(500, "internal server error", "internal")
        if refusal is None:
            return False
        self._refuse(request, refusal)
        return True

    def eof_received(self) -> bool:
        self.parser.end_of_stream()
        if self.task is None:  # nothing to answer: close our side too
            return False
        return True  # half-closed: the answer still goes out, then we close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._write_ok.set()
        self.server._closed(self)
        self.server._refusing.discard(self)
        if self.task is None and self.request is not None:
            self._finish(self.request)

    def pause_writing(self) -> None:
        # Answers back up (a client that does not read): take no more requests until
        # they drain.  Refusals too (a pipelined 404 answered from its head had gone on
        # reading: 40 MB of unread answers), not only the answers of handled requests.
        self._write_ok.clear()
        if self.transport is not None and not self._write_paused:
            self._write_paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_ok.set()
        if self._write_paused:
            self._write_paused = False
            if not self.paused_reading and self.transport is not None:
                self.transport.resume_reading()

    # ---- requests ------------------------------------------------------------------------------
    def _events(self) -> None:
        events = self.parser.events
        while events and not self.closing:
            item = events.popleft()
            if isinstance(item, Head):
                self._head(item)
                continue
            request = self.request
            assert request is not None
            if request.allowance is not None and len(item) > request.allowance:
                events.appendleft(item)  # (where _refuse looks for a body read already)
                if self._refused_halfway(request, len(item)):
                    continue
                events.popleft()
            request.body = item
            del item  # (held here, a body answered in place never went back to the pool)
            self.state, self.since = _HANDLING, time.monotonic()
            loop = asyncio.get_running_loop()
            if self._eager:  # a pipelined request, reached from the end of the one before
                self.task = loop.create_task(self._run(request))
                continue
            self._eager = True
            try:
                # Most handlers answer without waiting (an idle model runs a lone
                # request in place): no task and no extra loop turn for those.
                task = eager_future(loop, self._run(request))
            finally:
                self._eager = False
            if not task.done():  # it waits; had it ended, its end may have set the next task
                self.task = task
            else:
                task.result()  # (_run answers every error itself: nothing is raised here)
        if (
            self.parser.paused
            and self.parser.buffered > _PAUSE_ABOVE
            and not self.paused_reading
            and self.transport is not None
        ):
            self.paused_reading = True
            self.transport.pause_reading()  # a pipelining client waits its turn

    def _head(self, head: Head) -> None:
        request = Request(head, self.remote)
        self.request = request
        self.state, self.since = _BODY, time.monotonic()
        try:
            refusal = self.server.app.admit(request)
        except Exception:
            log.exception("admitting %s %s failed", head.method, head.target)
            refusal = error_response(500, "internal server error", "internal")
        if refusal is not None:
            self._refuse(request, refusal)
            return
        if (
            head.headers.get("expect", "").lower() == "100-continue"
            and head.version == "1.1"
            and not self.parser.events  # the body is still to come
            and request.has_body
        ):
            self._write([CONTINUE])

    def _refuse(self, request: Request, response: Response) -> None:
        """Answer from the head; the body is dropped as it arrives, or the connection ends."""
        events = self.parser.events
        read_already = bool(events) and isinstance(events[0], bytearray)
        if read_already:
            events.popleft()
            kept = True
        else:
            kept = self.parser.skip_body()
        response.close = not kept or not request.head.keep_alive or self.server.closing
        self._send(response, head_only=request.method == "HEAD")
        self._finish(request)
        if read_already and not response.close:
            self.parser.resume()  # the next request may be buffered behind it already
        if not response.close:
            state = _LINGER if self.parser.skipping else _IDLE  # dropping the refused body
            self.state, self.since = state, time.monotonic()
        elif kept and not self.parser.skipping:
            self._end()
        else:  # drop what is still on its way (until it ends, or linger_s), then close
            self.discarding = True
            self.state, self.since = _LINGER, time.monotonic()

    async def _run(self, request: Request) -> None:
        try:
            try:
                response = await self.server.app.handle(request)
            except asyncio.CancelledError:
                if not self.server.cut or self.closing:
                    raise
                # the shutdown's grace ran out with this one unanswered: say so, not a reset
                response = ferry_error_response(
                    ShuttingDown(
                        "the server stopped before this request's answer (its shutdown "
                        "grace ran out): send it again, to another server"
                    )
                )
            except Exception:
                log.exception("unhandled error on %s %s", request.method, request.path)
                response = error_response(500, "internal server error", "internal")
            if self.closing:
                return
            # a half-closed peer is still answered every request it sent before its EOF
            # (pipelined ones behind this had been dropped with the connection)
            ended = self.parser.eof and not self.parser.buffered and not self.parser.events
            if self.server.closing or not request.head.keep_alive or ended:
                response.close = True
            if request.head.version == "1.0" and not response.close:
                # (an HTTP/1.0 client closes unless told the connection is kept)
                response.headers = [*response.headers, ("Connection", "keep-alive")]
            self._send(response, head_only=request.method == "HEAD")
            if not self._write_ok.is_set():
                # Its answer is backed up: let it drain before the next.  A client that
                # pipelines and never reads had every answer buffered here (small ones
                # too: 33 MiB/s of /v2/models/stats for 35-byte requests).
                await self._write_ok.wait()
        finally:
            self.task = None
            self._finish(request)
        if self.closing:
            return
        if self.failure is not None:
            self._fail(*self.failure)
            return
        if response.close:
            self._end()
            return
        self.state, self.since = _IDLE, time.monotonic()
        if self.paused_reading and self.transport is not None:
            self.paused_reading = False
            if not self._write_paused:
                self.transport.resume_reading()
        try:
            self.parser.resume()  # a pipelined request may be waiting
            self._events()
        except HttpError as exc:
            self._fail(exc.status, exc.message)
            return
        if self.parser.eof and self.task is None and not self.closing:
            self._end()  # half-closed, nothing more to answer (a partial request never ends)

    def _finish(self, request: Request) -> None:
        if self.request is request:
            self.request = None
        if not request.state.get("_finished"):
            request.state["_finished"] = True
            try:
                self.server.app.finished(request)
            except Exception:
                log.exception("finishing %s %s failed", request.method, request.path)
            body, request.body = request.body, _EMPTY
            self.server.bodies.give(body)  # reused unless a view of it outlives the request

    # ---- writing -------------------------------------------------------------------------------
    def _send(self, response: Response, *, head_only: bool = False) -> None:
        body = response.body
        chunks = list(body) if isinstance(body, (list, tuple)) else [body]
        size = sum(c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks)
        head = response_head(response.status, response.headers, size, close=response.close)
        if head_only:
            self._write([head])
        elif size < _JOIN_BELOW:
            self._write([head + b"".join(chunks)])
        else:
            self._write([head, *chunks])

    def _write(self, chunks: list[Any]) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            for chunk in chunks:
                transport.write(chunk)

    def _fail(self, status: int, message: str) -> None:
        """A request that cannot be read: answer why, then close (the stream is lost)."""
        if self.task is not None:
            self.failure = (status, message)  # answered after the request being handled
            self.parser.paused = True
            return
        self.failure = None
        body = json.dumps({"error": message, "code": _CODES.get(status, "internal")}).encode()
        self._send(Response(status, body, content_type=JSON, close=True))
        if self.request is not None:
            self._finish(self.request)
        self._end()

    def _stopped(self) -> None:
        """A request whose body is still coming when the server's grace ends."""
        request = self.request
        message = (
            "the server stopped before this request arrived whole (its shutdown grace ran out)"
        )
        response = ferry_error_response(ShuttingDown(message))
        response.close = True
        self._send(response)
        if request is not None:
            self._finish(request)
        self._end()

    def _end(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    # ---- timeouts (the server's reaper) ----------------------------------------------------------
    def expired(self, now: float, options: ServerOptions) -> bool:
        age = now - self.since
        if self.state == _IDLE:
            limit = options.header_timeout_s if self.fresh else options.idle_timeout_s
            if age > limit or (self.server.closing and not self.parser.buffered):
                self._end()
                return True
        elif self.state == _HEAD:
            if age > options.header_timeout_s:
                self._end()
                return True
        elif self.state == _BODY:
            if age > options.body_timeout_s:
                self._fail(504, f"request body not received within {options.body_timeout_s:g} s")
                return True
            rate = options.min_body_bytes_per_s
            if rate and age > options.min_body_rate_grace_s:
                if self.parser.body_received < rate * age:
                    self._fail(408, f"request body arriving slower than {rate:g} bytes/s")
                    return True
        elif self.state == _LINGER and age > options.linger_s:
            self._end()
            return True
        return False


def check_listen(host: str, port: int) -> None:
    """ConfigError now if ``host:port`` cannot be listened on (taken, not this host's):
    a node loads its models before it listens, and had said so only after loading
    every one of them.  Probes what ``loop.create_server`` binds: every address the
    host resolves to ("" for all of them), IPv6 ones as IPv6 only.  (Port 0 always
    can.)  Blocking (a name lookup): call it off the loop."""
    import socket

    if port == 0:
        return
    if not 0 < port <= 65535:  # (getaddrinfo would wrap 70000 round to 4464)
        raise ConfigError(f"cannot listen on {host}:{port}: port must be 0-65535")
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in {(i[0], i[1], i[2], "", i[4]) for i in infos}:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None


class HttpServer:
    """Serves an :class:`HttpApp` on one listening socket (see the module docstring)."""

    def __init__(self, app: HttpApp, options: ServerOptions | None = None) -> None:
        self.app = app
        self.options = options or ServerOptions()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.bodies = BodyPool(max_bytes=self.options.body_pool_bytes)
        self.closing = False
        self.cut = False  # a drain's grace ran out: requests still going are answered 503
        self.refused = 0
        self.reaped = 0
        self.evicted = 0  # idle connections closed to make room at the cap
        self._refusing: set[_Connection] = set()  # refused newcomers reading out their 503

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), host, port, reuse_address=True
            )
        except (OSError, OverflowError) as exc:  # in use, not this host's, out of range
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None
        self._reaper = asyncio.create_task(self._reap_forever())
        return self.port

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return self._server.sockets[0].getsockname()[1]

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @property
    def active_requests(self) -> int:
        return sum(1 for c in self._connections if c.task is not None)

    def stop_listening(self) -> None:
        """New connections are refused; open ones stay, and their answers say close."""
        self.closing = True
        if self._server is not None:
            self._server.close()

    async def drain(self, deadline: float, linger_s: float = 0.0) -> None:
        """Let connections that carry a request finish until ``deadline``; idle ones get
        ``linger_s`` (a request already on its way is answered, with close)."""
        self.stop_listening()
        linger_until = min(deadline, time.monotonic() + linger_s)
        while self._connections and time.monotonic() < deadline:
            now = time.monotonic()
            busy = [c for c in self._connections if c.task is not None or c.state in (_HEAD, _BODY)]
            if not busy and now >= linger_until:
                break
            await asyncio.sleep(0.01)
        # The grace is over: a request still running or still arriving is answered that
        # the server stops (503 shutting_down), not cut off without a word.
        self.cut = True
        tasks = []
        for conn in list(self._connections):
            if conn.task is not None:
                conn.task.cancel()
                tasks.append(conn.task)
            elif conn.state in (_HEAD, _BODY) and conn.request is not None:
                conn._stopped()
        if tasks:
            await asyncio.wait(tasks, timeout=CUT_ANSWER_S)
        for conn in list(self._connections):
            conn._end()

    async def close(self) -> None:
        self.stop_listening()
        if self._reaper is not None:
            self._reaper.cancel()
        for conn in [*self._connections, *self._refusing]:
            conn._end()
        if self._server is not None:
            await self._server.wait_closed()

    # ---- connections -----------------------------------------------------------------------------
    def _opened(self, conn: _Connection) -> bool:
        cap = self.options.max_connections
        if self.closing:
            self.refused += 1
            return False
        if cap and len(self._connections) >= cap:
            # At the cap, the connection idle longest makes room (as nginx does): idle
            # kept-alive ones had refused every new client, health checks too, for the
            # whole idle timeout, renewed by whoever held them.  Only when every one is
            # busy is the newcomer refused.
            # (not a fresh one: its first request may be in its socket, unread)
            idle = [
                c for c in self._connections if c.state == _IDLE and c.task is None and not c.fresh
            ]
            if not idle:
                self.refused += 1
                return False
            oldest = min(idle, key=lambda c: c.since)
            oldest._end()
            self._connections.discard(oldest)
            self.evicted += 1
        self._connections.add(conn)
        return True

    def _closed(self, conn: _Connection) -> None:
        self._connections.discard(conn)

    def reap(self, now: float | None = None) -> int:
        """Close connections past their header, body or idle timeout; returns how many."""
        now = time.monotonic() if now is None else now
        reaped = sum(1 for c in list(self._connections) if c.expired(now, self.options))
        self.reaped += reaped
        return reaped

    async def _reap_forever(self) -> None:
        o = self.options
        period = max(0.05, min(o.header_timeout_s, o.idle_timeout_s, o.body_timeout_s) / 4)
        while True:
            await asyncio.sleep(period)
            self.reap()


# ---- routing ------------------------------------------------------------------------------------
Handler = Callable[[Request], Awaitable[Response]]


class RoutedApp:
    """An :class:`HttpApp` over a :class:`Router`: ``admit`` resolves the route (and
    calls :meth:`check`, where a subclass refuses from the head), ``handle`` runs it
    and turns a Ferry error into its answer.  Both tiers' V2 fronts are one."""

    router: Router

    def admit(self, request: Request) -> Response | None:
        try:
            request.route, request.params = self.router.resolve(request.method, request.path)
            # the path as routed, for every check after: "//v2/repository/..." or a
            # trailing slash resolved to the admin route while the fronts' scope test
            # read the raw text as an inference path (any infer token, or a remote
            # caller, reached the control plane)
            request.path = "/" + request.path.strip("/")
            return self.check(request)
        except HttpError as exc:
            return http_error_response(exc)
        except FerryError as exc:
            return ferry_error_response(exc)

    def check(self, request: Request) -> Response | None:
        """What may be refused from the head, once routed (raise or return a refusal)."""
        return None

    async def handle(self, request: Request) -> Response:
        try:
            return await request.route(request)
        except FerryError as exc:
            return ferry_error_response(exc)

    def finished(self, request: Request) -> None:
        return None

    def receiving(self, request: Request, received: int) -> Response | None:
        """More of a counted body came (see :class:`HttpApp`); None lets it go on."""
        request.allowance = None
        return None


def add_model_routes(router: Router, handlers: dict[str, Any]) -> None:
    """The V2 per-model routes, with and without a version: ``""`` (metadata), ``ready``,
    ``config``, ``stats`` and ``infer`` (POST), each where ``handlers`` has one."""
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        for suffix, handler in handlers.items():
            method = "POST" if suffix == "infer" else "GET"
            router.add(method, f"{base}/{suffix}" if suffix else base, handler)


def add_v2_routes(router: Router, front: Any) -> None:
    """The V2 routes both tiers serve, to ``front``'s methods of the same names.

    Server metadata, health, the repository index, statistics and the
    per-model routes (:func:`add_model_routes`); each front adds its own.
    """
    router.add("GET", "/v2", front.server_metadata)
    router.add("GET", "/v2/health/live", front.live)
    router.add("GET", "/v2/health/ready", front.ready)
    router.add("POST", "/v2/repository/index", front.repository_index)
    router.add("GET", "/v2/models/stats", front.stats)
    add_model_routes(
        router,
        {
            "": front.model_metadata,
            "ready": front.model_ready,
            "config": front.model_config,
            "stats": front.stats,
            "infer": front.infer,
        },
    )


class Router:
    """Paths like ``/v2/models/{model}/versions/{version}/infer`` to handlers, by method.

    Segments are percent-decoded after the split, so ``%2F`` stays inside its
    segment (and the name's own validation refuses it).
    """

    def __init__(self) -> None:
        self._routes: dict[int, list[tuple[tuple[str, ...], dict[str, Any]]]] = {}

    def add(self, method: str, pattern: str, handler: Any) -> None:
        parts = tuple(pattern.strip("/").split("/"))
        bucket = self._routes.setdefault(len(parts), [])
        for existing, methods in bucket:
            if existing == parts:
                methods[method] = handler
                return
        bucket.append((parts, {method: handler}))

    def resolve(self, method: str, path: str) -> tuple[Any, dict[str, str]]:
        """The handler and the path's parameters; HttpError 404 or 405 when none fits."""
        segments = path.strip("/").split("/")
        for parts, methods in self._routes.get(len(segments), ()):
            params: dict[str, str] = {}
            for part, seg in zip(parts, segments, strict=True):
                if part[0] == "{":
                    value = unquote(seg) if "%" in seg else seg
                    if not value:
                        break
                    params[part[1:-1]] = value
                elif part != seg:
                    break
            else:
                handler = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
                if handler is None:
                    raise HttpError(405, f"{method} is not allowed on {path}")
                return handler, params
        raise HttpError(404, f"no route for {path}")
