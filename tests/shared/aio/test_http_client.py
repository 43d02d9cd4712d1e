"""The agent's HTTP client on real sockets: keep-alive, a stale connection, deadlines."""

from __future__ import annotations

import asyncio
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
