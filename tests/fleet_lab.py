"""A real fleet on this machine: Mosquitto, a controller, nodes following it, and
clients that behave like real ones (shared by the scale-out tests and
``bench/packing.py``'s live part).

Clients: HTTP requests go to any live node (as a Kubernetes Service would send
them) and are retried on another node when a connection breaks or a node
answers 503, like any load balancer's client; MQTT requests go to the model's
topic with a deadline and are re-sent with the same id when no reply comes,
like the edge agent does.  Every request ends answered or counted as lost.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cloud.tuning.apply import dumps
from tests.support import Broker, ServerProcess, write_linear_model

#: the models of the lab: (name, source folder in the example repository or None for
#: the tiny linear model, declared rate, min copies)
LAB_MODELS: tuple[tuple[str, str | None, float, int], ...] = (
    ("orientation", "orientation", 8.0, 1),
    ("orientation-int8", "orientation-int8", 4.0, 3),
    ("orientation-ov", "orientation-ov", 2.0, 1),
    ("linear", None, 20.0, 1),
)


def build_lab_repository(root: Path, example: Path, slo_ms: float = 1000.0) -> Path:
    """Real models (the example repository's orientation classifiers and a tiny linear
    model), one session of one thread each (three nodes share two cores here)."""
    for name, source, rate, min_copies in LAB_MODELS:
        folder = root / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        if source is None:
            write_linear_model(folder / "1" / "model.onnx", seed=7)
            backend, io = "onnxruntime", "max_batch_size = 8\n"
        else:
            for f in (example / source / "1").iterdir():
                shutil.copy(f, folder / "1" / f.name)
            backend = "openvino" if source.endswith("-ov") else "onnxruntime"
            # the example's own tensor declarations, with a smaller batch bound
            declared = tomllib.loads((example / source / "config.toml").read_text())
            io = dumps(
                {"max_batch_size": 8, "input": declared["input"], "output": declared["output"]}
            )
        (folder / "config.toml").write_text(
            f'backend = "{backend}"\n{io}'
            "[dynamic_batching]\nmax_queue_delay_us = 2000\n"
            "[instance_group]\ncount = 1\n[runtime]\nthreads = 1\n"
            f"[placement]\nlatency_objective_ms = {slo_ms}\nrate = {rate}\n"
            f"min_copies = {min_copies}\n"
        )
    return root


def lab_input(model: str) -> tuple[str, list[int], np.ndarray]:
    if model == "linear":
        return "x", [1, 4], np.ones((1, 4), np.float32)
    rng = np.random.default_rng(0)
    return "x", [1, 3, 224, 224], rng.random((1, 3, 224, 224), dtype=np.float32)


def node_config(folder: Path, name: str, status_interval_s: float = 0.5, extra: str = "") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(
        f"[mqtt]\nstatus_interval_s = {status_interval_s}\n"
        "[fleet]\nmemory_bytes = 1073741824\nhandover_timeout_s = 10\n" + extra
    )
    return path


def start_node(
    repository: Path, broker: Broker, folder: Path, name: str, extra: str = ""
) -> ServerProcess:
    return ServerProcess(
        [
            "-m",
            "cloud.cli",
            "serve",
            "--repository",
            str(repository),
            "--config",
            str(node_config(folder, name, extra=extra)),
            "--node",
            name,
            "--mqtt",
            broker.url,
            "--controller",
            "--http-port",
            "0",
        ],
        "ferry-cloud ready",
    ).start()


def start_controller(repository: Path, broker: Broker, *extra: str) -> ServerProcess:
    return ServerProcess(
        [
            "-m",
            "cloud.cli",
            "controller",
            "--broker",
            broker.url,
            "--repository",
            str(repository),
            "--interval-s",
            "2",
            "--http-port",
            "0",
            *extra,
        ],
        "ferry-controller ready",
    ).start()


class FleetWatch:
    """Retained fleet state, read from the broker as ``ferry-cloud fleet`` reads it."""

    def __init__(self, broker: Broker) -> None:
        import paho.mqtt.client as mqtt

        from cloud.fleet.view import FleetView
        from shared.mqtt import PLACEMENT_TOPIC
        from shared.mqtt.documents import decode_document

        self.view = FleetView()
        self.lock = threading.Lock()
        self.placements: list[int] = []
        self.statuses: dict[str, Any] = {}  # the last status document of each node

        def on_message(client: Any, userdata: Any, message: Any) -> None:
            document = decode_document(message.payload)
            with self.lock:
                if message.topic == PLACEMENT_TOPIC:
                    placement = self.view.on_placement(document)
                    if placement is not None:
                        self.placements.append(placement.generation)
                else:
                    node = message.topic.split("/")[3]
                    self.view.on_status(node, document)
                    self.statuses[node] = document

        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"watch-{time.monotonic_ns()}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_message = on_message
        self.client.on_connect = lambda c, *a: c.subscribe(
            [("ferry/v1/nodes/+/status", 1), (PLACEMENT_TOPIC, 1)]
        )
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()

    def hosts(self, model: str) -> list[str]:
        with self.lock:
            return self.view.hosts(model)

    def generation(self) -> int | None:
        with self.lock:
            return self.view.placement.generation if self.view.placement else None

    def wait(self, what: str, check: Any, timeout: float) -> float:
        """Seconds until ``check()`` holds; AssertionError naming ``what`` after ``timeout``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            with self.lock:
                if check():
                    return time.monotonic() - start
            time.sleep(0.1)
        raise AssertionError(f"{what}: not within {timeout:g} s")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@dataclass
class ClientStats:
    sent: int = 0
    answered: int = 0
    lost: int = 0
    retries: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def within(self, slo_s: float) -> float:
        values = [v for vs in self.latencies.values() for v in vs]
        return sum(v <= slo_s for v in values) / len(values) if values else 0.0


class HttpClient(threading.Thread):
    """V2 binary requests, round robin over the live nodes; retried elsewhere on a
    broken connection or a 503 (what a load balancer's client does)."""

    def __init__(self, nodes: dict[str, ServerProcess], models: list[str], period_s: float) -> None:
        super().__init__(daemon=True)
        self.nodes = nodes
        self.models = models
        self.period_s = period_s
        self.stats = ClientStats()
        self.stop = threading.Event()
        self.down: set[str] = set()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            model = self.models[i % len(self.models)]
            i += 1
            self.stats.sent += 1
            started = time.monotonic()
            if self._one(model, i):
                self.stats.answered += 1
                self.stats.latencies.setdefault(model, []).append(time.monotonic() - started)
            else:
                self.stats.lost += 1
            self.stop.wait(self.period_s)

    def _one(self, model: str, i: int, deadline_s: float = 30.0) -> bool:
        name, shape, x = lab_input(model)
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": name,
                        "shape": shape,
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": x.nbytes},
                    }
                ]
            }
        ).encode()
        body = header + x.tobytes()
        until = time.monotonic() + deadline_s
        attempt = 0
        while time.monotonic() < until:
            live = [n for n in sorted(self.nodes) if n not in self.down]
            node = live[(i + attempt) % len(live)]
            attempt += 1
            url = self.nodes[node].http_url.removeprefix("http://")
            host, port = url.split(":")
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=10)
                conn.request(
                    "POST",
                    f"/v2/models/{model}/infer",
                    body=body,
                    headers={"Inference-Header-Content-Length": str(len(header))},
                )
                response = conn.getresponse()
                payload = response.read()
                conn.close()
            except OSError:
                self.stats.retries += 1
                time.sleep(0.05)
                continue
            if response.status == 200:
                return True
            if response.status in (503, 504):
                self.stats.retries += 1
                time.sleep(0.1)
                continue
            self.stats.errors.append(f"{model} via {node}: {response.status} {payload[:200]!r}")
            return False
        self.stats.errors.append(f"{model}: no answer in {deadline_s} s")
        return False


class MqttClient(threading.Thread):
    """Requests on the models' topics with a Response Topic; re-sent with the same id
    when no reply comes in ``resend_s`` (the edge agent's idempotent resend)."""

    def __init__(self, broker: Broker, models: list[str], period_s: float, resend_s: float = 3.0):
        super().__init__(daemon=True)
        import paho.mqtt.client as mqtt

        self.broker = broker
        self.models = models
        self.period_s = period_s
        self.resend_s = resend_s
        self.stats = ClientStats()
        self.stop = threading.Event()
        self.client_id = f"lab-{time.monotonic_ns()}"
        self.topic = f"ferry/v1/replies/{self.client_id}"
        self._replies: dict[bytes, bytes] = {}
        self._got = threading.Condition()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
        )
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", broker.port)
        self.client.subscribe(self.topic, qos=1)
        self.client.loop_start()
        if not subscribed.wait(10):
            raise RuntimeError("reply subscription not confirmed")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        correlation = bytes(message.properties.CorrelationData)
        with self._got:
            self._replies.setdefault(correlation, message.payload)
            self._got.notify_all()

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                model = self.models[i % len(self.models)]
                i += 1
                self.stats.sent += 1
                started = time.monotonic()
                if self._one(model, f"r{i}"):
                    self.stats.answered += 1
                    self.stats.latencies.setdefault(model, []).append(time.monotonic() - started)
                else:
                    self.stats.lost += 1
                self.stop.wait(self.period_s)
        finally:
            self.client.loop_stop()
            self.client.disconnect()

    def _one(self, model: str, request_id: str, deadline_s: float = 30.0) -> bool:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        from shared import envelope
        from shared.messages import InferRequest, InferResponse
        from shared.tensors import Tensor

        name, _, x = lab_input(model)
        payload = envelope.encode_request(
            InferRequest(
                inputs=[Tensor(name, "FP32", x)],
                id=request_id,
                parameters={"idempotency_key": request_id},
            )
        )
        correlation = request_id.encode()
        until = time.monotonic() + deadline_s
        while time.monotonic() < until:
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = self.topic
            props.CorrelationData = correlation
            props.MessageExpiryInterval = 10
            self.client.publish(f"ferry/v1/models/{model}/infer", payload, qos=1, properties=props)
            wait_until = min(until, time.monotonic() + self.resend_s)
            with self._got:
                while correlation not in self._replies and time.monotonic() < wait_until:
                    self._got.wait(0.05)
                reply = self._replies.pop(correlation, None)
            if reply is None:
                self.stats.retries += 1
                continue
            _, result = envelope.decode_reply(reply)
            if isinstance(result, InferResponse):
                return True
            if result.retry_after is not None or result.code.value in (
                "unavailable",
                "model_not_ready",
                "shutting_down",
            ):
                self.stats.retries += 1
                time.sleep(result.retry_after or 0.1)
                continue
            self.stats.errors.append(f"{model}: {result.code.value}: {result.message}")
            return False
        self.stats.errors.append(f"{model}: no MQTT answer in {deadline_s} s")
        return False
