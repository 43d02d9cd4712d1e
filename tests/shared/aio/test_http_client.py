"""The agent's HTTP client on real sockets: keep-alive, a stale connection, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from shared.aio.http_client import HttpClient
from shared.aio.http_server import HttpServer, Request, Response, ServerOptions


class Echo:
    def __init__(self) -> None:
        self.connections: set[int] = set()

    def admit(self, request: Request) -> Response | None:
        return None

    async def handle(self, request: Request) -> Response:
        return Response(200, bytes(request.body) + b"!")

    def finished(self, request: Request) -> None:
        return None


async def test_requests_reuse_one_kept_alive_connection_and_bodies_come_back_whole() -> None:
    server = HttpServer(Echo())
    port = await server.start("127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}")
    try:
        for size in (0, 5, 700_000):
            body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            answer = await client.request("POST", "/echo", [body[: size // 2], body[size // 2 :]])
            assert answer.status == 200 and bytes(answer.body) == body + b"!"
        assert server.open_connections == 1
    finally:
        await client.close()
        await server.close()


async def test_a_connection_the_server_closed_while_idle_is_replaced_transparently() -> None:
    server = HttpServer(Echo(), ServerOptions(idle_timeout_s=0.2))
    port = await server.start("127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}")
    try:
        assert (await client.request("POST", "/echo", b"a")).status == 200
        await asyncio.sleep(0.8)  # the server reaps the idle kept-alive connection
        answer = await client.request("POST", "/echo", b"b")
        assert answer.status == 200 and bytes(answer.body) == b"b!"
    finally:
        await client.close()
        await server.close()


async def test_the_deadline_ends_the_wait_for_a_server_that_never_answers() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    client = HttpClient(f"http://127.0.0.1:{silent.getsockname()[1]}")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.request("GET", "/", deadline=started + 0.3)
        assert time.monotonic() - started < 2
    finally:
        await client.close()
        silent.close()


async def test_an_answer_past_the_one_asked_for_never_reaches_the_next_request() -> None:
    """A server that answered one request twice left the second answer in a pooled
    connection, and the next caller (another app's request) was handed it."""
    answered = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        while await reader.readuntil(b"\r\n\r\n"):
            answered += 1
            body = str(answered).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            if answered == 1:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}")
    try:
        assert bytes((await client.request("GET", "/a", b"")).body) == b"1"
        await asyncio.sleep(0.1)  # the stale answer is in
        assert bytes((await client.request("GET", "/b", b"")).body) == b"2"
    finally:
        await client.close()
        server.close()


def test_a_request_target_or_header_that_would_break_its_line_is_never_sent() -> None:
    from shared.errors import InvalidInput
    from shared.http.wire import request_head

    for target in ("/v2/x/1 HTTP/1.1\r\nHost: y\r\n\r\nPOST /z", "/a b", "/a\x00"):
        with pytest.raises(InvalidInput, match="unsafe characters"):
            request_head("GET", target, "h", [], None)
    with pytest.raises(InvalidInput, match="unsafe characters"):
        request_head("GET", "/a", "h", [("X-Id", "1\r\nX-Admin: yes")], None)
    assert request_head("GET", "/a?b=c%20d", "h", [("X", "a\tb")], 0).startswith(b"GET /a?b=c%20d ")


@contextlib.asynccontextmanager
async def _client_of(serve, **options):
    """A client of a raw asyncio server running ``serve`` on a free port."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", **options)
    try:
        yield client
    finally:
        await client.close()
        server.close()


async def test_bytes_sent_into_an_idle_pooled_connection_drop_it_at_once() -> None:
    # A server that kept sending after its answer had the idle connection buffer it all.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nfine")
        await writer.drain()
        await asyncio.sleep(0.1)
        try:
            for _ in range(64):
                writer.write(b"x" * 65536)
                await writer.drain()
        except ConnectionError:
            pass  # dropped, as it should be

    async with _client_of(serve) as client:
        assert bytes((await client.request("GET", "/a")).body) == b"fine"
        (conn,) = client._idle
        await asyncio.sleep(0.3)
        assert conn.closed and conn.parser.buffered < 1 << 20


async def test_a_server_that_speaks_first_is_a_typed_error_and_its_connection_goes() -> None:
    from shared.errors import FerryError

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 smtp ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with _client_of(serve) as client:
        conn, _ = await client._connection()
        client._idle.append(conn)
        await asyncio.sleep(0.1)  # its greeting came while the connection sat idle
        with pytest.raises(FerryError):
            await client.request("GET", "/a", deadline=time.monotonic() + 2)
        assert not client._all  # not leaked


async def test_the_retry_after_a_stale_connection_goes_on_a_fresh_one() -> None:
    # Two pooled connections the server had both closed: the retry took the second.
    served: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                n += 1
                if n == 2:  # a kept-alive connection's second request: closed, unanswered
                    writer.transport.abort()
                    return
                await asyncio.sleep(0.05)
                served.append(n)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async with _client_of(serve) as client:
        await asyncio.gather(client.request("GET", "/a"), client.request("GET", "/b"))
        assert len(client._idle) == 2
        answer = await client.request("GET", "/c", deadline=time.monotonic() + 5)
        assert bytes(answer.body) == b"ok"


async def test_a_204_that_declares_a_body_leaves_its_connection_out_of_the_pool() -> None:
    # Its body came late and was handed to the next request as that one's answer.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                late = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE"
                writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: %d\r\n\r\n" % len(late))
                await writer.drain()
                await asyncio.sleep(0.02)
                writer.write(late)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async with _client_of(serve) as client:
        assert (await client.request("GET", "/a")).status == 204
        # at once, before the late body comes: on the same connection it was /b's answer
        assert (await client.request("GET", "/b")).status == 204  # not the stale 200


async def test_requests_past_the_connection_cap_wait_for_one_within_their_deadline() -> None:
    opened = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async with _client_of(serve, max_connections=4) as client:
        deadline = time.monotonic() + 10
        answers = await asyncio.gather(
            *(client.request("GET", f"/{i}", deadline=deadline) for i in range(40))
        )
        assert all(bytes(a.body) == b"ok" for a in answers) and opened <= 4
        with pytest.raises(TimeoutError):  # waiting for a connection counts against it
            await asyncio.gather(
                *(client.request("GET", "/x", deadline=time.monotonic() + 0.08) for _ in range(9))
            )


async def test_an_answer_given_before_the_request_and_read_to_the_end_is_its_answer() -> None:
    # A 503 without a length, sent on accept and then closed, had read as a reset.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nbusy")
        await writer.drain()
        writer.close()

    async with _client_of(serve) as client:
        from shared.http.wire import request_head

        conn, _ = await client._connection()
        await asyncio.sleep(0.1)  # its answer and its end came before the request went
        head = request_head("GET", "/a", "h", [], None)
        answer = await client._exchange(conn, "GET", head, [], 0, time.monotonic() + 2)
        assert answer.status == 503 and bytes(answer.body) == b"busy"
