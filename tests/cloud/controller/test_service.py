"""The controller's shell on a real broker: one controller places, the others stand by."""

from __future__ import annotations

import asyncio
import json
import time

from cloud.controller.core import ControllerCore, ControllerSettings
from cloud.controller.service import ControllerOptions, ControllerService
from shared.mqtt import CONTROLLER_TOPIC, parse_broker_url
from tests.support import Broker


def _service(broker: Broker, name: str, **options) -> ControllerService:
    core = ControllerCore({}, {}, ControllerSettings(settle_s=0.2))
    return ControllerService(
        core,
        ControllerOptions(parse_broker_url(broker.url), client_id=name, http_port=None, **options),
    )


class _Running:
    """Controllers started with their loop (ticks, heartbeats), stopped at the end."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.services: list[ControllerService] = []

    async def start(self, service: ControllerService) -> ControllerService:
        await service.start()
        await _until(lambda: service.connected)
        self.services.append(service)
        self.tasks.append(asyncio.create_task(service.run(self.stop)))
        return service

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for service in self.services:
            await service.close()


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _retained_status(broker: Broker, topic: str = CONTROLLER_TOPIC) -> dict:
    """The document retained on ``topic`` (the controllers' status by default)."""
    from cloud.mqtt_front import new_client

    got: list[dict] = []
    client = new_client(
        parse_broker_url(broker.url),
        f"reader-{time.monotonic_ns()}",
        on_message=lambda m: got.append(json.loads(m.payload)),
    )
    client.on_connect = lambda: client.subscribe(topic)
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


async def _publish(broker: Broker, topic: str, document: dict) -> None:
    from cloud.mqtt_front import new_client

    client = new_client(parse_broker_url(broker.url), f"writer-{time.monotonic_ns()}")
    await client.start(5.0)
    try:
        acked = client.publish(topic, json.dumps(document).encode(), retain=True)
        if acked is not None:
            await asyncio.wait_for(acked, 5.0)
    finally:
        await client.close()


async def test_a_standby_takes_over_when_the_active_controller_falls_silent(broker) -> None:
    # A controller that died while the broker was down left no will: its retained
    # "online" stayed, and the standby stood behind it for good.
    running = _Running()
    try:
        first = await running.start(_service(broker, "ctl-a", heartbeat_s=0.2))
        second = await running.start(_service(broker, "ctl-b", heartbeat_s=0.2))
        await _until(lambda: not second.active)
        await asyncio.sleep(1.0)  # heartbeats keep it standing by
        assert first.active and not second.active
        running.tasks[0].cancel()  # ctl-a goes silent: no goodbye, no will
        assert first._client is not None
        await first._client.close()  # (a clean DISCONNECT: the broker sends no will)
        first.active = False  # (so its close() at the end says nothing either)
        await _until(lambda: second.active, 5.0)
        assert (await _retained_status(broker))["id"] == "ctl-b"
    finally:
        await running.close()


async def test_only_the_controller_stood_behind_going_offline_hands_over(broker) -> None:
    # Three controllers: a standby's last will ("ctl-b offline") made the third take
    # over while the first was alive and placing.
    running = _Running()
    try:
        a = await running.start(_service(broker, "ctl-a"))
        b = await running.start(_service(broker, "ctl-b"))
        c = await running.start(_service(broker, "ctl-c"))
        await _until(lambda: not b.active and not c.active)
        await _publish(
            broker, CONTROLLER_TOPIC, {"state": "offline", "id": "ctl-b", "since": b.since}
        )
        await asyncio.sleep(0.5)
        assert a.active and not c.active
        # ... and the active one says again that it is there (the will overwrote it)
        status = await _retained_status(broker)
        assert (status["state"], status["id"]) == ("online", "ctl-a")
    finally:
        await running.close()


async def test_a_rescan_unplaces_a_model_only_when_two_scans_agree_and_never_all(broker) -> None:
    from cloud.controller.catalogue import ModelEntry
    from shared.repository import PlacementPolicy

    def entry(name: str) -> ModelEntry:
        return ModelEntry(name, PlacementPolicy(), ("onnxruntime",), 1 << 20, 8)

    scans: list[tuple[dict, dict]] = []
    service = _service(broker, "ctl-scan", rescan=lambda: scans.pop(0))
    service.core.catalogue = {"a": entry("a"), "b": entry("b")}
    scans.append(({"a": entry("a")}, {"b": "config.toml: half written"}))  # broken: kept
    await service._rescan()
    assert set(service.core.catalogue) == {"a", "b"}
    for _ in range(2):  # gone: kept after one scan, unplaced after the second
        scans.append(({"a": entry("a")}, {}))
        await service._rescan()
    assert set(service.core.catalogue) == {"a"}
    for _ in range(3):  # an empty read (an unmounted volume) never unplaces everything
        scans.append(({}, {}))
        await service._rescan()
    assert set(service.core.catalogue) == {"a"}
    scans.append(({"a": entry("a"), "c": entry("c")}, {}))
    await service._rescan()
    assert set(service.core.catalogue) == {"a", "c"}


async def test_a_controller_back_from_a_broker_restart_never_puts_back_an_older_placement(
    broker,
) -> None:
    # It re-published its own placement on every connect, over a newer one another
    # controller had placed meanwhile: a node restarting then followed the old one.
    from cloud.placement.types import Copy, Placement
    from shared.mqtt import PLACEMENT_TOPIC

    def placement(generation: int) -> Placement:
        copy = Copy("m", "n1", "onnxruntime", 1.0, 1, 0.1, 0.1, 1 << 20)
        return Placement(copies=(copy,), generation=generation)

    await _publish(broker, PLACEMENT_TOPIC, placement(7).to_dict())
    running = _Running()
    try:
        service = _service(broker, "ctl-old")
        service.core.current = placement(5)
        await running.start(service)
        await asyncio.sleep(1.5)  # past the wait for the retained one
        assert service.core.current is not None and service.core.current.generation == 7
        assert (await _retained_status(broker, PLACEMENT_TOPIC))["generation"] == 7
    finally:
        await running.close()


def test_a_controller_whose_http_port_is_taken_exits_with_the_error(broker, tmp_path) -> None:
    # It printed nothing and hung for good, deaf to SIGTERM: the bind failed just as its
    # MQTT connection came up, and Python 3.11's wait_for lost asyncio.run's cancel.
    import socket
    import subprocess
    import sys

    from tests.support import ROOT, write_linear_model

    write_linear_model(tmp_path / "repo" / "linear" / "1" / "model.onnx")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for bad in (str(port), "70000"):
            done = subprocess.run(
                [
                    *(sys.executable, "-m", "cloud.cli", "controller", "--broker", broker.url),
                    *("--repository", str(tmp_path / "repo"), "--http-port", bad),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 2, done.stderr
            assert "error [invalid_config]: cannot listen on 127.0.0.1" in done.stderr
    finally:
        taken.close()


def test_sighup_reads_the_repository_again_and_a_second_sigterm_is_said(broker, tmp_path):
    # SIGHUP killed the controller on the spot (exit 129, its will "offline"), and a
    # second signal during a stop was swallowed without a word.
    import signal
    import subprocess
    import sys
    import time

    from tests.support import ROOT, write_linear_model

    write_linear_model(tmp_path / "repo" / "linear" / "1" / "model.onnx")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "cloud.cli", "controller", "--broker", broker.url),
            *("--repository", str(tmp_path / "repo"), "--http-port", "0"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "ready" in proc.stdout.readline()
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)  # (a second SIGTERM may merge with the first)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "SIGHUP: reading the repository again" in err
    assert ": already stopping" in err  # (either signal may be taken first)
