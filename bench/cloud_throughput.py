"""Cloud tier throughput and latency beside the raw runtime, measured in one run.

    python bench/cloud_throughput.py [--seconds 5] [--model orientation] [--no-pin]

Each target is measured where its claim matters:

- **Throughput** (issue 13: HTTP served / raw best batch >= 0.90, MQTT >= 0.85):
  ``ferry-cloud serve`` pinned to one core, the load generator and the broker
  pinned to the other, against (a) the raw ONNX Runtime session at its best
  batch size *on that same core*.  So the ratio is the server's own
  efficiency: in production the clients and the broker are other machines,
  and here they would otherwise take the server's CPU.  (b) dynamic batching
  under a closed loop of 1, 4, 16 and 64 V2 binary HTTP clients
  (1x3x224x224 FP32 each), (c) the same with batching off, (d) the same load
  as (b) over MQTT through a local Mosquitto.  The machine's speed drifts
  by tens of percent within a minute, so the sweep at the start only picks
  the raw layout: it is measured again right before and after each served
  point (the same session, the same core, the server idle), and each
  target is the median of eight short served runs at that transport's best
  load, each run between two raw runs (paired, as bench/edge_overhead.py
  pairs its calls).
- **Latency at concurrency 1** (issue 13: p50 / raw batch-1 <= 1.5): an idle,
  unpinned node with every core, against the fastest a raw batch-1 call can
  be (a session with an intra-op thread per core), paired the same way:
  the median of four short runs, each between two raw timings.

With ``--no-pin`` (or a single core) everything shares the cores.  Prints
throughput, p50 and p99 per point, the CPU each side spent per request, and
the ratios; exit status 1 on any missed target.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge.transports.mqtt import MqttTransport  # noqa: E402
from shared import v2  # noqa: E402
from shared.messages import InferRequest, InferResponse  # noqa: E402
from shared.mqtt import parse_broker_url  # noqa: E402
from shared.repository import ModelRepository  # noqa: E402
from shared.runtimes import RuntimeOptions, load_session  # noqa: E402
from shared.runtimes.base import available_cpus  # noqa: E402
from shared.tensors import Tensor  # noqa: E402
from tests.support import Broker, cloud_server  # noqa: E402

CONCURRENCY = (1, 4, 16, 64)


def _parallel_throughput(pool: list, name: str, x: np.ndarray, seconds: float) -> float:
    """Items per second with every session driven by its own thread."""
    counts = [0] * len(pool)
    stop_at = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop_at:
            pool[i].run({name: x})
            counts[i] += len(x)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(pool))]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - start)


def raw_runtime(model_file: Path, seconds: float, rounds: int = 3) -> dict[tuple[int, int], float]:
    """Images per second of bare sessions for each layout and batch size.

    Layouts: one session with an intra-op thread per core, and one
    single-threaded session per core driven from its own thread.  The
    limit is the best of all, so the server is held to the fastest way the
    runtime alone can use this machine.  Each point is the median of
    ``rounds`` passes over the batch sizes: on a noisy machine the best of
    single short runs would hold the server to a lucky outlier.
    """
    cores = available_cpus()
    samples: dict[tuple[int, int], list[float]] = {}
    batches = (1, 2, 4, 8, 16, 32)
    for sessions, threads in ((1, cores), (cores, 1)):
        pool = [
            load_session("onnxruntime", model_file, RuntimeOptions(threads=threads))
            for _ in range(sessions)
        ]
        name = pool[0].inputs[0].name
        feeds = {
            b: np.random.default_rng(0).random((b, 3, 224, 224), dtype=np.float32) for b in batches
        }
        for x in feeds.values():
            for s in pool:
                s.run({name: x})
        for _ in range(rounds):
            for batch, x in feeds.items():
                ips = _parallel_throughput(pool, name, x, seconds / (4 * rounds) * 2)
                samples.setdefault((sessions, batch), []).append(ips)
        for s in pool:
            s.close()
    return {key: float(np.median(v)) for key, v in samples.items()}


class RawProbe:
    """The best raw layout, kept loaded, re-measured beside each served point.

    On this machine the same raw loop runs 10-30% apart a minute later, so a
    served point is compared with raw runs made just before and after it,
    on the server's core while the server is idle, not with the sweep at
    the start.
    """

    def __init__(self, model_file: Path, layout: tuple[int, int], cpus: set[int] | None) -> None:
        sessions, batch = layout
        self.cpus = cpus
        with _Affinity(cpus):  # ONNX Runtime's threads inherit the core they start on
            threads = max(1, available_cpus() // sessions)
            self.pool = [
                load_session("onnxruntime", model_file, RuntimeOptions(threads=threads))
                for _ in range(sessions)
            ]
        self.name = self.pool[0].inputs[0].name
        self.x = np.random.default_rng(0).random((batch, 3, 224, 224), dtype=np.float32)
        for s in self.pool:
            s.run({self.name: self.x})

    def __call__(self, seconds: float) -> float:
        with _Affinity(self.cpus):
            return _parallel_throughput(self.pool, self.name, self.x, seconds)

    def close(self) -> None:
        for s in self.pool:
            s.close()


def batch1_latency_ms(model_file: Path, repeat: int = 40) -> float:
    """The fastest a raw batch-1 call can be here: every core, back to back, the
    better of spinning on and off (spinning is ~15% faster on this CNN)."""
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    best = float("inf")
    for spinning in (False, True):
        session = load_session("onnxruntime", model_file, RuntimeOptions(allow_spinning=spinning))
        samples = []
        for _ in range(repeat + 5):
            t = time.perf_counter()
            session.run({session.inputs[0].name: x})
            samples.append((time.perf_counter() - t) * 1000)
        session.close()
        best = min(best, statistics.median(samples[5:]))
    return best


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that reads exactly one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need: int | None = None
        self.head: bytes = b""
        self.waiter: asyncio.Future[tuple[bytes, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = bytes(self.buf[:end])
            length = 0
            for line in self.head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            del self.buf[: end + 4]
            self.need = length
        if len(self.buf) >= self.need and self.waiter is not None and not self.waiter.done():
            body = bytes(self.buf[: self.need])
            del self.buf[: self.need]
            self.need = None
            self.waiter.set_result((self.head, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))


class LeanHttpLoad:
    """A load generator's V2 binary client: one socket per client, no client framework.

    The server and the load share this machine's 2 cores, so every CPU-ms
    the client spends is taken from the server under test; aiohttp's client
    costs ~0.6 ms a request, this one a fraction of that.  It still encodes
    each request and decodes each reply with Ferry's codec (a non-200 or a
    malformed reply is an error), so only the client framework is left out.
    """

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self._idle: list[_Conn] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()

    async def infer(self, model: str, request: InferRequest, deadline: float) -> InferResponse:
        loop = asyncio.get_running_loop()
        if self._idle:
            conn = self._idle.pop()
        else:
            _, conn = await loop.create_connection(_Conn, self.host, self.port)
            conn.transport.get_extra_info("socket").setsockopt(  # type: ignore[union-attr]
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        chunks, header_length = v2.encode_request(request)
        size = sum(len(c) for c in chunks)
        head = (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n"
            f"{v2.HEADER_LENGTH}: {header_length}\r\n\r\n"
        ).encode()
        conn.waiter = loop.create_future()
        assert conn.transport is not None
        for chunk in (head, *chunks):  # writelines() would join them into one copy (3.11)
            conn.transport.write(chunk)
        head_bytes, body = await asyncio.wait_for(conn.waiter, deadline - time.monotonic())
        self._idle.append(conn)
        status = head_bytes.split(b" ", 2)[1]
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {body[:200]!r}")
        hl = None
        for line in head_bytes.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == v2.HEADER_LENGTH.lower().encode():
                hl = int(value)
        return v2.decode_response(body, hl)


async def closed_loop(transport, model: str, clients: int, seconds: float) -> dict[str, float]:
    x = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            request = InferRequest(inputs=[Tensor("x", "FP32", x)])
            t = time.perf_counter()
            try:
                await transport.infer(model, request, time.monotonic() + 30)
                latencies.append((time.perf_counter() - t) * 1000)
            except Exception:
                errors += 1

    # warm-up
    await asyncio.gather(
        *[
            transport.infer(
                model, InferRequest(inputs=[Tensor("x", "FP32", x)]), time.monotonic() + 30
            )
            for _ in range(clients)
        ]
    )
    start = time.monotonic()
    await asyncio.gather(*[client() for _ in range(clients)])
    elapsed = time.monotonic() - start
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "throughput": len(latencies) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "errors": errors,
    }


PAIRS = 8  # served runs, each between two raw runs, in the paired ratio


async def paired_ratio(
    transport, model: str, clients: int, probe: RawProbe, seconds: float, pairs: int = PAIRS
) -> dict[str, Any]:
    """Served throughput over the raw limit, run by run, each served run between two
    raw runs on the same core: the median of those ratios (drift hits both alike)."""
    await transport.start()
    ratios, errors = [], 0
    try:
        before = probe(seconds / 2)
        for _ in range(pairs):
            run = await closed_loop(transport, model, clients, seconds)
            errors += run["errors"]
            after = probe(seconds / 2)
            ratios.append(run["throughput"] / ((before + after) / 2))
            before = after
    finally:
        await transport.close()
    return {
        "median": float(np.median(ratios)),
        "ratios": ratios,
        "clients": clients,
        "errors": errors,
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_repository(source: Path, model: str, folder: Path) -> tuple[Path, int]:
    """``bench`` (the example's batching config) and ``bench-nobatch`` (no dynamic batching)."""
    src = source / model
    repo = folder / "repo"
    text = (src / "config.toml").read_text()
    for name, config in (("bench", text), ("bench-nobatch", _without_batching(text))):
        shutil.copytree(src / "1", repo / name / "1", symlinks=True)
        (repo / name / "config.toml").write_text(config)
    cfg = ModelRepository(repo).read_config("bench")
    delay = cfg.dynamic_batching.max_queue_delay_us if cfg.dynamic_batching else 0
    return repo, delay


def _without_batching(text: str) -> str:
    out, skip = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skip = line.strip() == "[dynamic_batching]"
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def _spread(pairs: dict[str, Any]) -> str:
    return f"runs {min(pairs['ratios']):.2f}-{max(pairs['ratios']):.2f}"


def _row(label: str, r: dict[str, float]) -> str:
    errors = f"   errors={int(r['errors'])}" if r["errors"] else ""
    raw = f" {r['raw']:>10.1f} {r['throughput'] / r['raw']:>6.2f}" if "raw" in r else ""
    return (
        f"  {label:<34} {r['throughput']:>9.1f} {r['p50']:>9.1f} {r['p99']:>9.1f}"
        f" {r.get('server_cpu_ms', float('nan')):>18.2f} {r.get('client_cpu_ms', float('nan')):>18.2f}"
        f"{raw}{errors}"
    )


async def run_points(
    transport,
    model: str,
    seconds: float,
    server_pid: int,
    concurrency=CONCURRENCY,
    probe: RawProbe | None = None,
) -> dict[int, dict[str, float]]:
    """Closed-loop points; each also records server and client CPU per request, and
    with ``probe`` the raw limit measured right before and after it (``raw``)."""
    await transport.start()
    out = {}
    try:
        for c in concurrency:
            before = probe(seconds / 3) if probe is not None else None
            server0, client0 = process_cpu_s(server_pid), self_cpu_s()
            point = await closed_loop(transport, model, c, seconds)
            served = max(point["throughput"] * seconds, 1.0)
            point["server_cpu_ms"] = (process_cpu_s(server_pid) - server0) / served * 1000
            point["client_cpu_ms"] = (self_cpu_s() - client0) / served * 1000
            if probe is not None and before is not None:
                point["raw"] = (before + probe(seconds / 3)) / 2
            out[c] = point
    finally:
        await transport.close()
    return out


class _Affinity:
    """Run a block on ``cpus`` (this process), then go back."""

    def __init__(self, cpus: set[int] | None) -> None:
        self.cpus = cpus
        self.before: set[int] = set()

    def __enter__(self) -> None:
        self.before = os.sched_getaffinity(0)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def __exit__(self, *exc: object) -> None:
        os.sched_setaffinity(0, self.before)


def _points(
    url: str,
    model: str,
    seconds: float,
    pid: int,
    *,
    mqtt: str | None = None,
    probe: RawProbe | None = None,
) -> dict:
    transport = MqttTransport(parse_broker_url(mqtt)) if mqtt else LeanHttpLoad(url)
    return asyncio.run(run_points(transport, model, seconds, pid, probe=probe))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "examples" / "repository")
    parser.add_argument("--model", default="orientation")
    parser.add_argument("--seconds", type=float, default=5.0, help="per load point")
    parser.add_argument("--no-mqtt", action="store_true")
    parser.add_argument("--no-pin", action="store_true", help="let everything share the cores")
    args = parser.parse_args(argv)

    _, model_file = ModelRepository(args.repository).model_file(args.model, 1)
    print(f"model {args.model}: {model_file}")
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2 and not args.no_pin
    server_cpus, load_cpus = ({cpus[-1]}, {cpus[0]}) if pin else (None, None)
    where = (
        f"server on CPU {cpus[-1]}, load generator and broker on CPU {cpus[0]}"
        if pin
        else f"server, load generator and broker sharing {len(cpus)} CPU(s)"
    )
    with _Affinity(server_cpus):
        raw = raw_runtime(model_file, args.seconds)
    best_batch = max(raw, key=raw.get)
    b1 = batch1_latency_ms(model_file)  # every core: the fastest a lone call can be
    print("\n(a) raw ONNX Runtime on the server's CPU(s) (images/s by layout and batch size)")
    n = len(server_cpus or cpus)
    for (sessions, batch), ips in raw.items():
        layout = f"{sessions} session x {max(1, n // sessions)} thread(s)"
        mark = "   <- best" if (sessions, batch) == best_batch else ""
        print(f"  {layout:<24} batch {batch:>3}: {ips:8.1f}/s{mark}")
    print(f"  batch-1 latency p50 with {len(cpus)} intra-op thread(s): {b1:.2f} ms")

    with tempfile.TemporaryDirectory() as tmp:
        repo, delay_us = make_repository(args.repository, args.model, Path(tmp))
        # 1. an idle node with every core: one request at a time
        server = cloud_server(repo, "--node", "bench").start()
        try:
            c1 = asyncio.run(
                run_points(
                    LeanHttpLoad(server.http_url), "bench", args.seconds, server.proc.pid, (1,)
                )
            )[1]
            # The target: short runs of the lone client, each between two raw batch-1
            # timings (the same drift for both), the median of their ratios.
            lone_ratios, before = [], batch1_latency_ms(model_file)
            for _ in range(PAIRS // 2):
                point = asyncio.run(
                    run_points(
                        LeanHttpLoad(server.http_url),
                        "bench",
                        max(args.seconds / 3, 0.5),
                        server.proc.pid,
                        (1,),
                    )
                )[1]
                after = batch1_latency_ms(model_file)
                lone_ratios.append(point["p50"] / ((before + after) / 2))
                before = after
        finally:
            server.terminate()
        # 2. a saturated node on its own core
        broker = None
        extra: list[str] = []
        if not args.no_mqtt:
            broker = Broker(Path(tmp) / "broker", cpus=load_cpus)
            broker.start()
            extra = ["--mqtt", broker.url]
        server = cloud_server(repo, "--node", "bench", *extra, cpus=server_cpus).start()
        probe = RawProbe(model_file, best_batch, server_cpus)
        try:
            pid = server.proc.pid
            with _Affinity(load_cpus):
                batched = _points(server.http_url, "bench", args.seconds, pid, probe=probe)
                unbatched = _points(
                    server.http_url, "bench-nobatch", args.seconds, pid, probe=probe
                )
                mqtt = (
                    _points("", "bench", args.seconds, pid, mqtt=broker.url, probe=probe)
                    if broker
                    else None
                )
                # The targets: at each transport's best load, served runs paired with raw ones.
                pair_s = max(args.seconds / 3, 0.5)
                best_c = max(batched, key=lambda c: batched[c]["throughput"])
                http_pairs = asyncio.run(
                    paired_ratio(LeanHttpLoad(server.http_url), "bench", best_c, probe, pair_s)
                )
                mqtt_pairs = None
                if mqtt and broker:
                    best_m = max(mqtt, key=lambda c: mqtt[c]["throughput"])
                    transport = MqttTransport(parse_broker_url(broker.url))
                    mqtt_pairs = asyncio.run(
                        paired_ratio(transport, "bench", best_m, probe, pair_s)
                    )
        finally:
            probe.close()
            server.terminate()
            if broker:
                broker.stop()

    header = f"  {'':<34} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'server CPU ms/req':>18} {'client CPU ms/req':>18}"
    header += f" {'raw beside':>10} {'ratio':>6}"
    print(f"\n(b) server, dynamic batching, HTTP closed loop ({where})\n" + header)
    for c, r in batched.items():
        print(_row(f"{c} clients", r))
    print("\n(c) server, batching off, HTTP closed loop\n" + header)
    for c, r in unbatched.items():
        print(_row(f"{c} clients", r))
    if mqtt:
        print("\n(d) server, dynamic batching, MQTT closed loop\n" + header)
        for c, r in mqtt.items():
            print(_row(f"{c} clients", r))
    print(f"\n(e) one client, an idle node with all {len(cpus)} CPU(s)\n" + header)
    print(_row("1 client", c1))

    ratio = http_pairs["median"]
    missed: list[str] = []

    def verdict(ok: bool, what: str) -> str:
        if not ok:
            missed.append(what)
        return "meets" if ok else "MISSES"

    print("\nsummary")
    print(
        f"  (b)/(a) HTTP served / raw best batch at {best_c} clients: {ratio:.2f}, the median "
        f"of {PAIRS} served runs each between two raw runs ({_spread(http_pairs)}; the sweep's "
        f"point against the sweep at the start: {batched[best_c]['throughput'] / raw[best_batch]:.2f})"
        f"  (target >= 0.90: {verdict(ratio >= 0.90, 'HTTP served / raw best batch < 0.90')})"
    )
    if mqtt and mqtt_pairs:
        best_m = mqtt_pairs["clients"]
        m_ratio = mqtt_pairs["median"]
        print(
            f"  (d)/(a) MQTT served / raw best batch at {best_m} clients: {m_ratio:.2f}, paired "
            f"the same way ({_spread(mqtt_pairs)}; the sweep's point against the sweep at the "
            f"start: {mqtt[best_m]['throughput'] / raw[best_batch]:.2f})"
            f"  (target >= 0.85: {verdict(m_ratio >= 0.85, 'MQTT served / raw best batch < 0.85')})"
        )
    lat = float(np.median(lone_ratios))
    print(
        f"  (e) p50 at 1 client / raw batch-1: {lat:.2f}, the median of {len(lone_ratios)} "
        f"short runs each between two raw timings (runs {min(lone_ratios):.2f}-"
        f"{max(lone_ratios):.2f}; the run above, {c1['p50']:.2f} ms, against the timing at the "
        f"start, {b1:.2f} ms: {c1['p50'] / b1:.2f})"
        f"  (target <= 1.5: {verdict(lat <= 1.5, 'p50 at one client > 1.5x the raw batch-1 call')})"
    )
    print(
        f"  batching gain (b)/(c) at {best_c} clients: "
        f"{batched[best_c]['throughput'] / max(unbatched[best_c]['throughput'], 1e-9):.2f}x"
    )
    raw_cpu_ms = 1000 * len(server_cpus or cpus) / batched[best_c]["raw"]
    server_cpu = batched[best_c]["server_cpu_ms"]
    print(
        f"  CPU accounting at {best_c} clients: the raw runtime costs {raw_cpu_ms:.2f} CPU-ms per "
        f"image; the server spends {server_cpu:.2f} CPU-ms per request (efficiency "
        f"{raw_cpu_ms / server_cpu:.2f}); the load generator {batched[best_c]['client_cpu_ms']:.2f}"
    )
    floor_16 = 16 / raw[best_batch] * 1000
    print(
        f"  p99 at 16 clients {batched[16]['p99']:.1f} ms; Little's law puts the mean of 16 "
        f"closed-loop clients on a saturated server at >= 16 / raw limit = {floor_16:.1f} ms "
        f"(batch-1 {b1:.1f} ms, queue delay {delay_us / 1000:.1f} ms)"
    )
    # A request that failed is a miss whatever the throughput (a fast error is no answer).
    failed = {f"{c} clients (b)": r["errors"] for c, r in batched.items() if r["errors"]}
    failed |= {f"{c} clients (c)": r["errors"] for c, r in unbatched.items() if r["errors"]}
    if mqtt:
        failed |= {f"{c} clients (d)": r["errors"] for c, r in mqtt.items() if r["errors"]}
    if c1["errors"]:
        failed["1 client (e)"] = c1["errors"]
    for pairs_run, label in ((http_pairs, "HTTP pairs"), (mqtt_pairs, "MQTT pairs")):
        if pairs_run and pairs_run["errors"]:
            failed[label] = pairs_run["errors"]
    if failed:
        missed.append(f"requests failed: {failed}")
    for line in missed:
        print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
