"""The HTTP/1.1 server shell on real sockets: keep-alive, refusals, timeouts, stopping."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from shared.aio.http_server import (
    HttpServer,
    Request,
    Response,
    Router,
    ServerOptions,
    error_response,
    json_response,
)
from shared.http.wire import HttpError


class Echo:
    """Echoes bodies; refuses ``/refuse`` from its head; ``/slow`` takes its time."""

    def __init__(self) -> None:
        self.admitted = self.finished_count = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def admit(self, request: Request) -> Response | None:
        self.admitted += 1
        if request.path == "/refuse":
            return error_response(404, "no such thing", "not_found")
        return None

    async def handle(self, request: Request) -> Response:
        if request.path == "/slow":
            await self.gate.wait()
        if request.path == "/stats":  # a small request, a bigger answer, in one bytes
            return Response(200, b"s" * 2048, content_type="application/octet-stream")
        return Response(200, [bytes(request.body), b"!"], content_type="application/octet-stream")

    def finished(self, request: Request) -> None:
        self.finished_count += 1


async def serve(app: Echo, **options) -> HttpServer:
    server = HttpServer(app, ServerOptions(**options))
    await server.start("127.0.0.1", 0)
    return server


async def exchange(port: int, data: bytes, read_until: bytes = b"", timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    try:
        async with asyncio.timeout(timeout):
            while read_until not in out or not read_until:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


async def test_a_kept_alive_connection_serves_pipelined_requests_in_order() -> None:
    app = Echo()
    server = await serve(app)
    try:
        data = b"".join(
            f"POST /{i} HTTP/1.1\r\nContent-Length: 2\r\n\r\n{i:02d}".encode() for i in range(5)
        )
        out = await exchange(server.port, data, b"04!")
        bodies = [part.split(b"\r\n\r\n", 1)[1][:3] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
        assert bodies == [b"00!", b"01!", b"02!", b"03!", b"04!"]
        assert app.finished_count == 5
    finally:
        await server.close()


async def test_aiohttp_as_a_client_works_with_bodies_large_and_small() -> None:
    server = await serve(Echo())
    try:
        async with aiohttp.ClientSession() as session:
            for size in (0, 10, 602_112, 5_000_000):
                body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                async with session.post(f"http://127.0.0.1:{server.port}/e", data=body) as r:
                    assert r.status == 200 and await r.read() == body + b"!"
    finally:
        await server.close()


async def test_expect_100_continue_gets_continue_or_the_refusal() -> None:
    app = Echo()
    server = await serve(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /ok HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(4) == b"abc!"
        writer.write(b"POST /refuse HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404")  # no 100: the body need not be sent
        writer.close()
    finally:
        await server.close()


async def test_a_refused_upload_is_answered_from_its_head_and_the_connection_goes_on() -> None:
    app = Echo()
    server = await serve(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        big = b"z" * 3_000_000
        writer.write(b"POST /refuse HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(big))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert b"no such thing" in await reader.readexactly(length)
        writer.write(big + b"POST /after HTTP/1.1\r\nContent-Length: 1\r\n\r\nk")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"k!"
        writer.close()
        assert app.finished_count == 2
    finally:
        await server.close()


async def test_a_small_refused_request_leaves_its_connection_serving_the_next() -> None:
    server = await serve(Echo())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for _ in range(3):  # each refused body arrives with its head, in one read
            writer.write(b"POST /refuse HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 404") and b"close" not in head
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.write(b"POST /ok HTTP/1.1\r\nContent-Length: 1\r\n\r\nk")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"k!"
        writer.close()
    finally:
        await server.close()


async def test_a_malformed_request_gets_its_status_and_the_server_stays_up() -> None:
    server = await serve(Echo())
    try:
        out = await exchange(server.port, b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and b"Connection: close" in out
        out = await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n", b"!")
        assert out.startswith(b"HTTP/1.1 200")
    finally:
        await server.close()


async def test_connections_past_the_cap_get_503_and_are_closed() -> None:
    server = await serve(Echo(), max_connections=2)
    try:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        for _, w in held:  # each busy: half a head sent
            w.write(b"GET / HTTP/1.1\r\nHost")
        await asyncio.sleep(0.05)
        for _ in range(5):  # the 503 arrives whole (a close at once had sent a reset)
            out = await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 503") and b"Retry-After" in out
        assert server.refused == 5
        for _, w in held:
            w.close()
    finally:
        await server.close()


async def test_at_the_cap_the_connection_idle_longest_makes_room() -> None:
    # Idle kept-alive connections had refused every new client (health checks too)
    # for the whole idle timeout.
    server = await serve(Echo(), max_connections=2)
    one = b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\n!"
    try:
        first = await asyncio.open_connection("127.0.0.1", server.port)
        second = await asyncio.open_connection("127.0.0.1", server.port)
        for reader, writer in (first, second):  # each used once, then idle, kept alive
            writer.write(one)
            assert (await asyncio.wait_for(reader.readuntil(b"!!"), 5)).startswith(b"HTTP")
            await asyncio.sleep(0.02)
        request = b"POST / HTTP/1.1\r\nContent-Length: 1\r\nConnection: close\r\n\r\n!"
        out = await exchange(server.port, request)
        assert out.startswith(b"HTTP/1.1 200") and server.evicted == 1
        assert await asyncio.wait_for(first[0].read(), 5) == b""  # the oldest: closed
        second[1].write(one)
        assert (await asyncio.wait_for(second[0].read(12), 5)).startswith(b"HTTP/1.1 200")
        for _, w in (first, second):
            w.close()
    finally:
        await server.close()


@pytest.mark.parametrize(
    "data, expect",
    [
        (b"", b""),  # idle: closed quietly
        (b"GET / HTTP/1.1\r\nHost", b""),  # half a head: closed
        (b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", b"HTTP/1.1 504"),  # half a body
    ],
)
async def test_stalled_connections_are_reaped(data: bytes, expect: bytes) -> None:
    server = await serve(Echo(), header_timeout_s=0.3, idle_timeout_s=0.3, body_timeout_s=0.3)
    try:
        started = time.monotonic()
        out = await exchange(server.port, data, timeout=5)
        assert out.startswith(expect) and time.monotonic() - started < 3
        assert server.open_connections == 0
    finally:
        await server.close()


async def test_a_body_that_trickles_below_the_minimum_rate_is_closed_before_the_body_timeout():
    """4,000 uploads of one byte each had held every connection slot (health refused)
    for the whole body timeout."""
    server = await serve(
        Echo(), body_timeout_s=60, min_body_bytes_per_s=100.0, min_body_rate_grace_s=0.3
    )
    try:
        out = await exchange(
            server.port, b"POST / HTTP/1.1\r\nContent-Length: 100000\r\n\r\nabc", timeout=20
        )
        assert out.startswith(b"HTTP/1.1 408") and b"slower than 100 bytes/s" in out
        assert server.open_connections == 0
    finally:
        await server.close()


async def test_a_new_connection_that_sends_nothing_is_closed_after_the_head_timeout() -> None:
    server = await serve(Echo(), header_timeout_s=0.3, idle_timeout_s=60)
    try:
        started = time.monotonic()
        assert await exchange(server.port, b"", timeout=10) == b""
        assert time.monotonic() - started < 5  # not the 60 s of a used connection
    finally:
        await server.close()


class Counted(Echo):
    """Takes at most ``room`` body bytes: past them, a 503 halfway through the body."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.heard: list[int] = []

    def admit(self, request: Request) -> Response | None:
        request.allowance = 10
        return super().admit(request)

    def receiving(self, request: Request, received: int) -> Response | None:
        self.heard.append(received)
        if received > self.room:
            return error_response(503, "full", "overloaded")
        request.allowance = received
        return None


@pytest.mark.parametrize("split", [False, True])
async def test_a_counted_body_is_refused_halfway_and_the_connection_goes_on(split: bool) -> None:
    app = Counted(room=50)
    server = await serve(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        head = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        if split:  # the body comes after its head: refused as it arrives
            writer.write(head + b"x" * 20)
            await asyncio.sleep(0.1)
            writer.write(b"x" * 40)
            await asyncio.sleep(0.1)
            writer.write(b"x" * 40)
        else:  # head and body in one read
            writer.write(head + b"x" * 100)
        writer.write(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        out = b""
        async with asyncio.timeout(5):
            while b"hello!" not in out:
                chunk = await reader.read(65536)
                assert chunk, out
                out += chunk
        assert out.startswith(b"HTTP/1.1 503") and out.count(b"HTTP/1.1 200") == 1
        assert app.heard and app.heard[-1] > 50
        assert app.finished_count == 2  # the refused request was finished too
        writer.close()
    finally:
        await server.close()


async def test_bodies_declared_large_and_trickled_hold_only_what_came() -> None:
    from shared.http.wire import FIRST_BODY_BYTES

    server = await serve(Echo())
    held = []
    try:
        for _ in range(20):  # 320 MB declared
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 16000000\r\n\r\nx")
            held.append(writer)
        await asyncio.sleep(0.3)
        buffers = [len(c.parser._body or b"") for c in server._connections]
        assert len(buffers) == 20 and max(buffers) <= FIRST_BODY_BYTES
    finally:
        for writer in held:
            writer.close()
        await server.close()


async def test_a_body_answered_in_place_goes_back_to_the_pool() -> None:
    # The parser's loop kept a reference to each body while its handler ran in place,
    # so the pool never took one back: every large body was a new zero-filled buffer.
    server = await serve(Echo())
    try:
        body = b"x" * 602_112
        async with aiohttp.ClientSession() as session:
            for _ in range(6):
                async with session.post(f"http://127.0.0.1:{server.port}/a", data=body) as r:
                    assert r.status == 200 and len(await r.read()) == len(body) + 1
        assert server.bodies.reused >= 4
    finally:
        await server.close()


async def test_a_stop_finishes_running_requests_and_refuses_new_connections() -> None:
    app = Echo()
    app.gate.clear()
    server = await serve(app)
    port = server.port
    slow = asyncio.create_task(
        exchange(port, b"POST /slow HTTP/1.1\r\nContent-Length: 1\r\n\r\ns", b"s!")
    )
    await asyncio.sleep(0.1)
    drain = asyncio.create_task(server.drain(time.monotonic() + 5))
    await asyncio.sleep(0.1)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    app.gate.set()
    out = await slow
    await drain
    assert out.startswith(b"HTTP/1.1 200") and b"Connection: close" in out and out.endswith(b"s!")
    await server.close()


async def test_requests_still_going_when_the_grace_ends_are_answered_503_not_cut() -> None:
    # At the drain's deadline a running request and one still sending its body had
    # their connections closed without a word: the client saw a bare disconnect.
    app = Echo()
    app.gate.clear()  # never answers by itself
    server = await serve(app)
    port = server.port
    running = asyncio.create_task(
        exchange(port, b"POST /slow HTTP/1.1\r\nContent-Length: 1\r\n\r\ns", b"}")
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nhalf")
    await asyncio.sleep(0.2)
    await server.drain(time.monotonic() + 0.3)
    out = await asyncio.wait_for(running, 5)
    assert out.startswith(b"HTTP/1.1 503") and b'"code": "shutting_down"' in out.replace(
        b'":"', b'": "'
    )
    stalled = await asyncio.wait_for(reader.read(), 5)
    assert stalled.startswith(b"HTTP/1.1 503") and b"shutting_down" in stalled
    writer.close()
    await server.close()


def test_the_router_matches_templates_decodes_segments_and_says_405() -> None:
    router = Router()
    router.add("GET", "/v2/models/{model}", "meta")
    router.add("POST", "/v2/models/{model}/versions/{version}/infer", "infer")
    assert router.resolve("GET", "/v2/models/a%20b") == ("meta", {"model": "a b"})
    assert router.resolve("HEAD", "/v2/models/x") == ("meta", {"model": "x"})
    assert router.resolve("POST", "/v2/models/m/versions/2/infer") == (
        "infer",
        {"model": "m", "version": "2"},
    )
    with pytest.raises(HttpError) as info:
        router.resolve("POST", "/v2/models/m")
    assert info.value.status == 405
    with pytest.raises(HttpError) as info:
        router.resolve("GET", "/v2/nothing/here")
    assert info.value.status == 404


def test_json_response_sets_its_content_type() -> None:
    response = json_response({"a": 1}, 201)
    assert response.status == 201 and ("Content-Type", "application/json") in response.headers


async def test_a_port_in_use_or_out_of_range_is_a_config_error_not_a_traceback() -> None:
    from shared.aio.http_server import check_listen
    from shared.errors import ConfigError

    first = await serve(Echo())
    try:
        for port in (first.port, 70000):
            with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1"):
                await HttpServer(Echo(), ServerOptions()).start("127.0.0.1", port)
            with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1"):
                check_listen("127.0.0.1", port)  # (the same answer before anything loads)
        check_listen("127.0.0.1", 0)
    finally:
        await first.close()


async def test_a_half_closed_peer_gets_every_pipelined_answer_then_the_close() -> None:
    # Four requests, then the client's FIN: one answer came back and three were dropped
    # with the connection (the agent's and the node's fronts alike).
    app = Echo()
    app.gate.clear()  # the first request runs while the rest and the FIN arrive
    server = await serve(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        one = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
        writer.write(one * 4 + b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nhalf")
        writer.write_eof()
        await asyncio.sleep(0.2)
        app.gate.set()
        got = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
    finally:
        await server.close()
    assert got.count(b"HTTP/1.1 200") == 4  # (the fifth never ended: not answered)
    assert got.count(b"Connection: close") <= 1


def _unreading_client(server: HttpServer):
    """A connected, non-blocking socket with a tiny receive buffer (it will not read)."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    return sock


async def test_a_client_that_pipelines_and_never_reads_holds_a_bounded_write_buffer() -> None:
    # Every answer had been buffered: 33 MiB/s on a node for 35-byte requests.
    server = await serve(Echo())
    sock = _unreading_client(server)
    request = b"GET /stats HTTP/1.1\r\n\r\n"
    loop = asyncio.get_running_loop()
    sent = 0
    try:
        while sent < 8 << 20:  # it stops taking them once its answers back up
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, request * 512), 1.0)
            except TimeoutError:
                break
            sent += len(request) * 512
        await asyncio.sleep(0.2)
        (conn,) = server._connections
        assert conn.transport is not None
        assert conn.transport.get_write_buffer_size() < 1 << 20, sent
        assert conn.parser.buffered < 2 << 20  # reading paused: the rest waits in sockets
    finally:
        sock.close()
        await server.close()


async def test_an_http_1_0_client_asking_to_keep_alive_is_told_it_is_kept() -> None:
    server = await serve(Echo())
    try:
        kept = b"POST / HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n!"
        last = b"POST / HTTP/1.0\r\nContent-Length: 1\r\n\r\n!"
        out = await exchange(server.port, kept + last)  # (closed after the last)
        assert out.count(b"HTTP/1.1 200") == 2 and out.count(b"Connection: keep-alive\r\n") == 1
    finally:
        await server.close()


async def test_a_fresh_connection_is_not_evicted_for_a_newcomer() -> None:
    # Its first request may sit unread in its socket: cut, it had no answer at all.
    server = await serve(Echo(), max_connections=2)
    try:
        busy = await asyncio.open_connection("127.0.0.1", server.port)
        busy[1].write(b"GET / HTTP/1.1\r\nHost")
        fresh = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.sleep(0.05)
        out = await exchange(server.port, b"GET / HTTP/1.1\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 503") and server.evicted == 0
        fresh[1].write(b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\n!")
        assert (await asyncio.wait_for(fresh[0].read(12), 5)).startswith(b"HTTP/1.1 200")
        for _, w in (busy, fresh):
            w.close()
    finally:
        await server.close()


async def test_refusals_pipelined_by_a_client_that_never_reads_hold_a_bounded_buffer() -> None:
    server = await serve(Echo())
    sock = _unreading_client(server)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(400):
            try:
                await asyncio.wait_for(
                    loop.sock_sendall(sock, b"GET /refuse HTTP/1.1\r\n\r\n" * 512), 1
                )
            except TimeoutError:
                break
        await asyncio.sleep(0.2)
        (conn,) = server._connections
        assert conn.transport is not None and conn.transport.get_write_buffer_size() < 8 << 20
    finally:
        sock.close()
        await server.close()


async def test_a_head_request_refused_from_its_head_gets_no_body() -> None:
    server = await serve(Echo())
    try:
        out = await exchange(server.port, b"HEAD /refuse HTTP/1.1\r\nConnection: close\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404") and body == b""
    finally:
        await server.close()
