"""Many agents against one node: throughput, p99, overload answers, peak RSS, recovery.

    python bench/load.py [--agents 500] [--steady-s 10] [--burst-s 5] [--kb 64]

Half the simulated agents speak HTTP (one kept-alive connection each), half
MQTT (one paho client each, its own reply topic), all against one real
``ferry-cloud serve`` process and a real Mosquitto.  Three phases, one run:

* steady: each agent sends a request, waits for the answer, thinks ~1 s
  (exponential), again;
* burst: no thinking: every agent sends back to back, far past what the node
  serves, so its queues, its byte budget and its MQTT in-flight bound answer
  "overloaded" (503 + Retry-After over HTTP, an error reply over MQTT);
* recovery: thinking again; the time until overload answers stop and p99
  is back under twice its steady value.

Requests carry ``--kb`` KB of FP32 (default 64 KB, a JPEG-sized body).  The
node runs with ``max_inflight_bytes`` of 32 MiB so the budget matters.

Targets (issue 11): no request lost (every one answered: a result or a typed
error), every overload answered explicitly, the node's peak RSS growth within
its byte budget (x2 for the decoded copies) + 64 MiB, recovery within 10 s.
Exit 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from shared import envelope, v2  # noqa: E402
from shared.messages import InferRequest  # noqa: E402
from shared.tensors import Tensor  # noqa: E402
from tests.support import Broker, cloud_server  # noqa: E402

BUDGET = 32 << 20
TIMEOUT_S = 30.0
CONFIG = """
max_batch_size = 32
[[input]]
name = "x"
datatype = "FP32"
dims = [-1]
[[output]]
name = "y"
datatype = "FP32"
dims = [-1]
[dynamic_batching]
max_queue_delay_us = 2000
max_queue_size = 64
"""


class Tally:
    """Every request's fate, by phase."""

    def __init__(self) -> None:
        self.phase = "steady"
        self.latency: dict[str, list[float]] = {}
        self.codes: dict[str, Counter[str]] = {}
        self.lost = 0
        self.sent = 0
        self.overload_times: list[float] = []
        self.ok_times: list[tuple[float, float]] = []

    def record(self, code: str, seconds: float) -> None:
        self.codes.setdefault(self.phase, Counter())[code] += 1
        if code == "ok":
            self.latency.setdefault(self.phase, []).append(seconds)
            self.ok_times.append((time.monotonic(), seconds))
        elif code == "overloaded":
            self.overload_times.append(time.monotonic())


def _think(phase: str) -> float:
    return 0.0 if phase == "burst" else random.expovariate(1.0)


async def http_agent(url: str, body: bytes, headers: dict[str, str], tally: Tally,
                     stop: asyncio.Event) -> None:  # fmt: skip
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while not stop.is_set():
            tally.sent += 1
            start = time.monotonic()
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    payload = await response.read()
                    if response.status == 200:
                        code = "ok"
                    else:
                        try:
                            code = (await _json(payload))["code"]
                        except (ValueError, KeyError, TypeError):
                            code = f"http-{response.status}"
            except TimeoutError:
                tally.lost += 1
                continue
            except aiohttp.ClientError:
                code = "connection"
            tally.record(code, time.monotonic() - start)
            await asyncio.sleep(_think(tally.phase))


async def _json(payload: bytes) -> dict:
    import json

    return json.loads(payload)


class MqttAgent:
    """One device: its own client id and reply topic; callbacks on paho's thread."""

    def __init__(self, index: int, broker_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client_id = f"load-{index}-{random.getrandbits(32):08x}"
        self.topic = f"ferry/v1/replies/{self.client_id}"
        self.waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
        )
        self.client.on_message = self._on_message
        self.ready = threading.Event()
        self.client.on_subscribe = lambda *a: self.ready.set()
        self.client.on_connect = lambda c, *a: c.subscribe(self.topic, qos=1)
        host, port = broker_url.removeprefix("mqtt://").split(":")
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        correlation = bytes(message.properties.CorrelationData)
        future = self.waiting.get(correlation)
        if future is not None:
            self.loop.call_soon_threadsafe(_settle, future, message.payload)

    async def run(self, payload: bytes, tally: Tally, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            correlation = f"{self.client_id}-{n}".encode()
            future: asyncio.Future[bytes] = self.loop.create_future()
            self.waiting[correlation] = future
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = self.topic
            props.CorrelationData = correlation
            props.MessageExpiryInterval = int(TIMEOUT_S)
            tally.sent += 1
            start = time.monotonic()
            self.client.publish("ferry/v1/models/ident/infer", payload, qos=1, properties=props)
            try:
                reply = await asyncio.wait_for(future, TIMEOUT_S)
            except TimeoutError:
                tally.lost += 1
                continue
            finally:
                self.waiting.pop(correlation, None)
            _, result = envelope.decode_reply(reply)
            code = getattr(getattr(result, "code", None), "value", "ok")
            tally.record(code, time.monotonic() - start)
            await asyncio.sleep(_think(tally.phase))

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _settle(future: asyncio.Future[bytes], payload: bytes) -> None:
    if not future.done():
        future.set_result(payload)


def write_model(path: Path) -> None:
    """y = x for FP32 [batch, n] (a real ONNX model; the node's own work is the point)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "ident",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "M"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "M"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _p99_ms(samples: list[float]) -> float:
    if not samples:
        return float("nan")
    return float(np.percentile(samples, 99)) * 1000


async def drive(args: argparse.Namespace, node_url: str, broker_url: str, pid: int) -> int:
    loop = asyncio.get_running_loop()
    elements = args.kb * 1024 // 4
    data = np.ones((1, elements), np.float32)
    request = InferRequest(inputs=[Tensor("x", "FP32", data)], id="r")
    chunks, header_length = v2.encode_request(request)
    body, headers = v2.join(chunks), {v2.HEADER_LENGTH: str(header_length)}
    payload = envelope.encode_request(request)
    n_http = args.agents // 2
    n_mqtt = args.agents - n_http
    mqtt_agents = [MqttAgent(i, broker_url, loop) for i in range(n_mqtt)]
    for agent in mqtt_agents:
        await asyncio.to_thread(agent.ready.wait, 10)
    tally = Tally()
    stop = asyncio.Event()
    rss_base = _rss_kib(pid, "VmRSS")
    url = node_url + "/v2/models/ident/infer"
    tasks = [asyncio.create_task(http_agent(url, body, headers, tally, stop)) for _ in range(n_http)]
    tasks += [asyncio.create_task(a.run(payload, tally, stop)) for a in mqtt_agents]
    phases = [("steady", args.steady_s), ("burst", args.burst_s), ("recovery", args.steady_s)]
    started: dict[str, float] = {}
    for phase, seconds in phases:
        tally.phase = phase
        started[phase] = time.monotonic()
        await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait(tasks, timeout=TIMEOUT_S + 5)
    peak_kib = _rss_kib(pid, "VmHWM")
    for agent in mqtt_agents:
        agent.close()

    steady_p99 = _p99_ms(tally.latency.get("steady", []))
    recovery_start = started["recovery"]
    last_overload = max((t for t in tally.overload_times if t >= recovery_start), default=None)
    settled = recovery_start
    for when, seconds in tally.ok_times:
        if when >= recovery_start and seconds * 1000 > 2 * steady_p99:
            settled = max(settled, when)
    recovered_s = max(settled, last_overload or recovery_start) - recovery_start
    print(f"{args.agents} agents ({n_http} HTTP, {n_mqtt} MQTT), {args.kb} KB requests, "
          f"node budget {BUDGET >> 20} MiB")  # fmt: skip
    print(f"{'phase':10} {'answered/s':>10} {'p50 ms':>8} {'p99 ms':>8}  answers")
    for phase, seconds in phases:
        codes = tally.codes.get(phase, Counter())
        lat = tally.latency.get(phase, [])
        p50 = statistics.median(lat) * 1000 if lat else float("nan")
        print(f"{phase:10} {sum(codes.values()) / seconds:10.0f} {p50:8.1f} "
              f"{_p99_ms(lat):8.1f}  {dict(codes)}")  # fmt: skip
    growth = (peak_kib - rss_base) / 1024
    bound = 2 * BUDGET / 2**20 + 64
    print(f"sent {tally.sent}, lost {tally.lost}; node RSS {rss_base / 1024:.0f} MiB at start, "
          f"peak {peak_kib / 1024:.0f} MiB (growth {growth:.0f} MiB, bound {bound:.0f}); "
          f"back to normal {recovered_s:.1f} s into the recovery phase")  # fmt: skip
    misses = []
    if tally.lost:
        misses.append(f"{tally.lost} requests got no answer within {TIMEOUT_S:.0f} s")
    burst = tally.codes.get("burst", Counter())
    unexplained = {c: n for c, n in burst.items() if c not in ("ok", "overloaded")}
    if unexplained:
        misses.append(f"burst answers other than ok/overloaded: {unexplained}")
    if growth > bound:
        misses.append(f"node RSS grew {growth:.0f} MiB, past its budget bound {bound:.0f} MiB")
    if recovered_s > 10:
        misses.append(f"recovery took {recovered_s:.1f} s (target <= 10 s)")
    if misses:
        print("MISSED:\n  " + "\n  ".join(misses))
        return 1
    print("PASS: nothing lost, every overload answered, memory within the budget, recovered")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=500)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--burst-s", type=float, default=5.0)
    parser.add_argument("--kb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_model(repo / "ident" / "1" / "model.onnx")
        (repo / "ident" / "config.toml").write_text(CONFIG)
        config = Path(tmp) / "cloud.toml"
        config.write_text(
            f'repository = "{repo}"\n[limits]\nmax_inflight_bytes = {BUDGET}\n'
            "max_inflight_mqtt = 256\n[http]\nmax_connections = 4096\n"
        )
        broker = Broker(Path(tmp) / "broker")
        broker.start()
        node = cloud_server(repo, "--config", str(config), "--mqtt", broker.url,
                            "--node", "load").start()  # fmt: skip
        try:
            assert node.proc is not None
            return asyncio.run(drive(args, node.http_url, broker.url, node.proc.pid))
        finally:
            node.terminate()
            broker.stop()


if __name__ == "__main__":
    raise SystemExit(main())
