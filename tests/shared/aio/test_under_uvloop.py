"""The HTTP and MQTT stacks inside an application that runs uvloop (uvicorn's default).

The agent is a library: its Python API runs on whatever loop its host
application runs.  uvloop keeps the buffer a ``BufferedProtocol`` hands it
exported until ``buffer_updated`` returns, where asyncio lets go first; a
large body finished in that call used to fail to be handed on (BufferError,
connection dropped) on every body past the scratch buffer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from shared.aio.http_client import HttpClient
from shared.aio.http_server import HttpServer, Request, Response
from shared.aio.mqtt import MqttClient
from shared.buffered import TAIL, tail_for
from shared.mqtt import parse_broker_url
from shared.mqtt.codec import Publish
from tests.support import Broker

uvloop = pytest.importorskip("uvloop")  # a dev dependency: present wherever the suite runs

SIZES = (0, 5, 16 * 1024 - 1, 16 * 1024 + 1, 70_000, 602_112, 3_000_001)


def body_of(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + b"z" * (size % 256)


def on_uvloop(coro: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)
        assert isinstance(runner.get_loop(), uvloop.Loop)


class Echo:
    def admit(self, request: Request) -> Response | None:
        return None

    async def handle(self, request: Request) -> Response:
        return Response(200, [bytes(request.body), b"!"])

    def finished(self, request: Request) -> None:
        return None


def test_http_server_and_client_carry_bodies_of_every_size_both_ways_on_uvloop() -> None:
    async def main() -> None:
        server = HttpServer(Echo())
        port = await server.start("127.0.0.1", 0)
        client = HttpClient(f"http://127.0.0.1:{port}")
        try:
            for size in SIZES:
                body = body_of(size)
                answer = await client.request("POST", "/echo", [body])
                assert answer.status == 200 and bytes(answer.body) == body + b"!", size
            assert server.open_connections == 1  # no connection was dropped on the way
        finally:
            await client.close()
            await server.close()

    on_uvloop(main())


def test_mqtt_client_sends_and_receives_messages_of_every_size_on_uvloop(broker: Broker) -> None:
    async def main() -> None:
        got: list[Publish] = []
        url = parse_broker_url(broker.url)
        ours = MqttClient(url, "uv-sub", on_message=got.append, max_packet_bytes=8 << 20)
        sender = MqttClient(url, "uv-pub", max_packet_bytes=8 << 20)
        assert await ours.start() and await sender.start()
        try:
            await ours.subscribe("uv/#")
            for i, size in enumerate(SIZES):
                assert await sender.publish(f"uv/{i}", body_of(size)) == 0
            deadline = time.monotonic() + 30
            while len(got) < len(SIZES):
                assert time.monotonic() < deadline, f"{len(got)} of {len(SIZES)} arrived"
                await asyncio.sleep(0.01)
            assert [(m.topic, bytes(m.payload)) for m in got] == [
                (f"uv/{i}", body_of(size)) for i, size in enumerate(SIZES)
            ]
        finally:
            await sender.close()
            await ours.close()

    on_uvloop(main())


def test_a_large_body_ends_through_scratch_only_on_a_loop_that_holds_its_buffer() -> None:
    async def which() -> int:
        return tail_for(asyncio.get_running_loop())

    assert asyncio.run(which()) == 0  # asyncio's loop lets go first: one read fewer
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(which()) == TAIL
