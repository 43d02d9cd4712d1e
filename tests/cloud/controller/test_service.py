"""The controller's shell on a real broker: one controller places, the others stand by."""

from __future__ import annotations

import asyncio
import json
import time

from cloud.controller.core import ControllerCore, ControllerSettings
from cloud.controller.service import ControllerOptions, ControllerService
from shared.mqtt import CONTROLLER_TOPIC, parse_broker_url
from tests.support import Broker


def _service(broker: Broker, name: str) -> ControllerService:
    core = ControllerCore({}, {}, ControllerSettings(settle_s=0.2))
    options = ControllerOptions(parse_broker_url(broker.url), client_id=name, http_port=None)
    return ControllerService(core, options)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _retained_status(broker: Broker) -> dict:
    from cloud.mqtt_front import new_client

    got: list[dict] = []
    client = new_client(
        parse_broker_url(broker.url),
        f"reader-{time.monotonic_ns()}",
        on_message=lambda m: got.append(json.loads(m.payload)),
    )
    client.on_connect = lambda: client.subscribe(CONTROLLER_TOPIC)
    await client.start(5.0)
    try:
        await _until(lambda: bool(got))
    finally:
        await client.close()
    return got[-1]


async def test_a_second_controller_stands_by_until_the_first_is_gone(broker: Broker) -> None:
    # Both used the client id "ferry-controller": the broker closed one for the other
    # every few seconds and they published placements by turns.
    first, second = _service(broker, "ctl-a"), _service(broker, "ctl-b")
    await first.start()
    await _until(lambda: first.connected)
    await second.start()
    try:
        await _until(lambda: not second.active)
        assert first.active and first.connected and second.connected
        await asyncio.sleep(0.5)  # settled: nobody flaps
        assert first.active and not second.active
        status = await _retained_status(broker)
        assert (status["state"], status["id"]) == ("online", "ctl-a")
        await first.close()  # its goodbye (a crash's last will says the same)
        await _until(lambda: second.active)
        status = await _retained_status(broker)
        assert (status["state"], status["id"]) == ("online", "ctl-b")
    finally:
        await second.close()
        await first.close()
