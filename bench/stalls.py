"""Does one big request stall a node?  Probe latency while it is processed, measured.

    python bench/stalls.py [--mib N]

A node (and an agent's local API) is started as a real process; a prober in
its own process asks ``/v2/health/live`` every 2 ms on its own kept-alive
connection while one big request is sent on another connection, and the
longest probe wait during that request is reported.  Cases, each at the
default body limit (16 MiB; ``--mib N`` measures another size, on a node
whose limits are raised to it):

* binary FP32 and BYTES bodies for a model that does not exist (refused
  before the body is read);
* BYTES at the element bound (65,535 elements filling the body) to a BYTES
  identity model: decode, the runtime's own conversion, encode;
* BYTES past the element bound (refused before parsing);
* the largest JSON part (4 MiB of numbers) to an FP32 identity model;
* binary FP32 filling the body through the same model and back;
* over MQTT: BYTES to the BYTES model, and FP32 to the FP32 model;
* the agent's local API: the BYTES body to its local BYTES model;
* fuzzing: 1,000 mutated V2 bodies (the live fuzzer's, tests/fuzz), four at
  a time, to a node serving the test repository's models.

Target (issue 11): no probe waits more than 50 ms.  Exit status 1 when a case
misses it (or a request is not answered as expected), printing which.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared import envelope, v2  # noqa: E402
from shared.messages import InferRequest  # noqa: E402
from shared.tensors import Limits, Tensor  # noqa: E402
from tests.support import (  # noqa: E402
    Broker,
    cloud_server,
    edge_agent,
    mqtt_request,
    unbatched_identity_config,
    write_identity_model,
)

TARGET_MS = 50.0


def _probe(host: str, port: int, stop: mp.Event, ready: mp.Event, out: mp.Queue) -> None:
    """Runs in its own process: its waits are the node's, not this script's GIL."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    waits: list[tuple[float, float]] = []
    ready.set()
    while not stop.is_set():
        start = time.monotonic()
        conn.request("GET", "/v2/health/live")
        conn.getresponse().read()
        waits.append((start, time.monotonic() - start))
        time.sleep(0.002)
    out.put(waits)


class Prober:
    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.stop, self.ready, self.out = mp.Event(), mp.Event(), mp.Queue()
        self.proc = mp.Process(target=_probe, args=(host, int(port), self.stop, self.ready, self.out))

    def __enter__(self) -> Prober:
        self.proc.start()
        self.ready.wait(30)
        time.sleep(0.1)
        return self

    def finish(self, since: float, until: float) -> tuple[float, int]:
        """Longest wait (ms) of the probes that started while the request ran."""
        self.stop.set()
        waits = self.out.get(timeout=60)
        self.proc.join(30)
        during = [w for start, w in waits if since - 0.01 <= start <= until]
        return (max(during) * 1000 if during else 0.0), len(during)

    def __exit__(self, *exc: object) -> None:
        if self.proc.is_alive():
            self.proc.kill()


def _post(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    return response.status, response.read()


def _bytes_tensor(elements: int, size: int) -> np.ndarray:
    out = np.empty(elements, dtype=object)
    rng = np.random.default_rng(3)
    # UTF-8 text (ONNX Runtime's string tensors refuse anything else)
    pool = [bytes(rng.integers(97, 123, size + k, dtype=np.uint8)) for k in range(3)]
    out[:] = [pool[k % 3] for k in range(elements)]
    return out.reshape(-1, 3)


def _binary(tensor: Tensor) -> tuple[bytes, dict[str, str]]:
    chunks, header_length = v2.encode_request(InferRequest(inputs=[tensor]))
    return v2.join(chunks), {v2.HEADER_LENGTH: str(header_length)}


def http_cases(body: int) -> list[tuple[str, str, bytes, dict[str, str], int]]:
    """Each body just under ``body`` bytes (the JSON part under a quarter of it)."""
    fill = body - 4096  # room for the JSON header
    fp32 = Tensor("x", "FP32", np.ones((fill // 12, 3), np.float32))
    big_bytes = Tensor("x", "BYTES", _bytes_tensor(65_535, fill // 65_535 - 4))
    many_bytes = Tensor("x", "BYTES", _bytes_tensor(min(3_000_000, fill // 6) // 3 * 3, 1))
    n_json = (body // 4 - 4096) // 8 // 3 * 3
    doc = {"name": "x", "datatype": "FP32", "shape": [n_json // 3, 3], "data": [0.1234] * n_json}
    json_body = json.dumps({"inputs": [doc]}).encode()
    cases = []
    body, headers = _binary(fp32)
    cases.append(("binary FP32 to an unknown model", "/v2/models/nope/infer", body, headers, 404))
    cases.append(("binary FP32 through the FP32 model", "/v2/models/big_fp32/infer", body, headers, 200))
    body, headers = _binary(big_bytes)
    cases.append(("BYTES to an unknown model", "/v2/models/nope/infer", body, headers, 404))
    cases.append(("BYTES at the element bound", "/v2/models/big_bytes/infer", body, headers, 200))
    body, headers = _binary(many_bytes)
    cases.append(("BYTES past the element bound", "/v2/models/big_bytes/infer", body, headers, 413))
    cases.append(("largest JSON part", "/v2/models/big_fp32/infer", json_body,
                  {"Content-Type": "application/json"}, 200))  # fmt: skip
    return cases


def _fuzz_row(tmp: Path) -> tuple[str, float, int, str]:
    """Probe waits while a thousand mutated bodies hit a node (four in flight)."""
    import random
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    from tests.cloud.conftest import build_test_repository
    from tests.fuzz.test_live_fuzz import _http_cases

    repo = build_test_repository(tmp / "fuzz-repo")
    node = cloud_server(repo, "--node", "fuzz").start()
    try:
        cases = _http_cases(random.Random(7), 1000)
        statuses: Counter[int] = Counter()

        def send(case: tuple[str, bytes, dict[str, str]]) -> None:
            path, data, headers = case
            statuses[_post(node.http_url, path, data, headers)[0]] += 1

        with Prober(node.http_url) as prober:
            since = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(send, cases))
            worst, probes = prober.finish(since, time.monotonic())
    finally:
        node.terminate()
    answer = " ".join(f"{k}x{v}" for k, v in sorted(statuses.items()))
    return ("cloud HTTP: 1,000 fuzzed bodies, 4 in flight", worst, probes, answer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=16, help="body size (default: the limit)")
    args = parser.parse_args()
    body = args.mib << 20
    rows: list[tuple[str, float, int, str]] = []
    misses: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        from onnx import TensorProto

        repo = Path(tmp) / "repo"
        for name, onnx_type, t in (
            ("big_bytes", TensorProto.STRING, "BYTES"),
            ("big_fp32", TensorProto.FLOAT, "FP32"),
        ):
            write_identity_model(repo / name / "1" / "model.onnx", onnx_type)
            (repo / name / "config.toml").write_text(unbatched_identity_config(t))
        broker = Broker(Path(tmp) / "broker")
        broker.start()
        config = Path(tmp) / "cloud.toml"
        config.write_text(
            f'repository = "{repo}"\n[limits]\nmax_body_bytes = {max(body, 16 << 20)}\n'
            f"max_json_body_bytes = {max(body // 4, 4 << 20)}\n"
        )
        node = cloud_server(
            repo, "--config", str(config), "--node", "stalls", "--mqtt", broker.url
        ).start()
        try:
            for label, path, data, headers, expect in http_cases(body):
                with Prober(node.http_url) as prober:
                    since = time.monotonic()
                    status, answer = _post(node.http_url, path, data, headers)
                    worst, probes = prober.finish(since, time.monotonic())
                ok = status == expect
                rows.append((f"cloud HTTP: {label} ({len(data) / 2**20:.1f} MiB)", worst, probes,
                             f"{status}" + ("" if ok else f" (expected {expect})")))  # fmt: skip
                if not ok:
                    misses.append(f"{label}: answered {status}, expected {expect}")
            fill = body - 4096
            big = envelope.encode_request(
                InferRequest(
                    inputs=[Tensor("x", "BYTES", _bytes_tensor(65_535, fill // 65_535 - 4))],
                    id="big",
                )
            )
            ones = np.ones((fill // 12, 3), np.float32)
            fp32 = envelope.encode_request(InferRequest(inputs=[Tensor("x", "FP32", ones)], id="f"))
            # (a node subscribes to the models it hosts only: an unknown model's
            # requests never reach it over MQTT)
            for label, model, expect, payload in (
                ("BYTES at the element bound", "big_bytes", None, big),
                ("FP32 through the FP32 model", "big_fp32", None, fp32),
            ):
                with Prober(node.http_url) as prober:
                    since = time.monotonic()
                    raw = mqtt_request(broker.url, model, payload, timeout=300)
                    _, reply = envelope.decode_reply(raw, Limits(max_body_bytes=2 * body))
                    worst, probes = prober.finish(since, time.monotonic())
                got = getattr(getattr(reply, "code", None), "value", "result")
                ok = got == (expect or "result")
                rows.append((f"cloud MQTT: {label} ({len(payload) / 2**20:.1f} MiB)", worst, probes, got))
                if not ok:
                    misses.append(f"MQTT {label}: answered {got}")
        except Exception:
            print(node.output()[-3000:], file=sys.stderr)
            log = Path(tmp) / "broker" / "mosquitto.log"
            text = log.read_text() if log.exists() else ""
            print("\n".join(x for x in text.splitlines() if "database" not in x and "Permission" not in x), file=sys.stderr)
            raise
        finally:
            node.terminate()
            broker.stop()
        agent_dir = Path(tmp) / "agent"
        agent_dir.mkdir()
        config = agent_dir / "agent.toml"
        config.write_text(
            f'repository = "{repo}"\nstate_dir = "{agent_dir / "state"}"\n'
            'device = "x86-laptop"\n[api]\nport = 0\n[policy]\ndeadline_ms = 60000\n'
            '[models.big_bytes]\nlocal = "big_bytes"\nmode = "local"\n'
        )
        fill = min(body, 16 << 20) - 4096  # the agent's API keeps the default limit
        agent = edge_agent(config).start()
        try:
            data, headers = _binary(
                Tensor("x", "BYTES", _bytes_tensor(65_535, fill // 65_535 - 4))
            )
            with Prober(agent.http_url) as prober:
                since = time.monotonic()
                status, _ = _post(agent.http_url, "/v2/models/big_bytes/infer", data, headers)
                worst, probes = prober.finish(since, time.monotonic())
            rows.append((f"agent API: BYTES at the element bound ({len(data) / 2**20:.1f} MiB)",
                         worst, probes, str(status)))  # fmt: skip
            if status != 200:
                misses.append(f"agent BYTES: answered {status}")
        finally:
            agent.terminate()
        row = _fuzz_row(Path(tmp))
        rows.append(row)
        if "500x" in row[3] or "502x" in row[3] or "503x" in row[3]:
            misses.append(f"fuzzing: a 5xx answer ({row[3]})")
    print(f"{'case':66} {'worst probe':>12} {'probes':>7}  answer")
    for label, worst, probes, answer in rows:
        flag = "" if worst <= TARGET_MS else "  MISS"
        print(f"{label:66} {worst:9.1f} ms {probes:7d}  {answer}{flag}")
        if worst > TARGET_MS:
            misses.append(f"{label}: a probe waited {worst:.1f} ms (target <= {TARGET_MS:.0f})")
    if misses:
        print("\nMISSED:\n  " + "\n  ".join(misses))
        return 1
    print(f"\nevery probe answered within {TARGET_MS:.0f} ms: PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
