"""A py-spy flame graph of the cloud node's hot path under a closed loop.

    python bench/flame.py --out cloud.svg [--size 1k|602k] [--clients 1] [--seconds 6]

Starts ``ferry-cloud serve`` on an identity model (so the graph shows
Ferry's own work, not the runtime's), drives it with the lean V2 binary
HTTP client of bench/cloud_throughput.py and records the server process
with py-spy (dev extra) at 250 Hz.  Prints the request rate and p50 seen
while it recorded.  docs/performance.md shows the graphs before and after
the data-path work; run this file from an older checkout to redo "before".
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cloud_throughput import LeanHttpLoad  # noqa: E402
from edge_overhead import write_echo_repo  # noqa: E402

from shared.messages import InferRequest  # noqa: E402
from shared.tensors import Tensor  # noqa: E402
from tests.support import cloud_server  # noqa: E402

SHAPES = {"1k": ("echo1k", (1, 256)), "602k": ("echo602k", (1, 3, 224, 224))}


async def drive(url: str, model: str, shape: tuple, clients: int, seconds: float) -> list[float]:
    load = LeanHttpLoad(url)
    await load.start()
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            await load.infer(model, InferRequest(inputs=[Tensor("x", "FP32", x)]), stop_at + 30)
            latencies.append(time.perf_counter() - t)

    try:
        await asyncio.gather(*(client() for _ in range(clients)))
    finally:
        await load.close()
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="SVG flame graph to write")
    parser.add_argument("--size", choices=sorted(SHAPES), default="1k")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy is not installed (pip install -e '.[dev]')")
        return 1
    model, shape = SHAPES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        write_echo_repo(Path(tmp))
        server = cloud_server(Path(tmp), "--node", "flame").start()
        try:
            asyncio.run(drive(server.http_url, model, shape, args.clients, 1.0))  # warm-up
            recorder = subprocess.Popen(
                [spy, "record", "-p", str(server.proc.pid), "-d", str(int(args.seconds)),
                 "-r", "250", "-f", "flamegraph", "-o", str(args.out), "--nonblocking"],
            )  # fmt: skip
            time.sleep(0.5)
            latencies = asyncio.run(
                drive(server.http_url, model, shape, args.clients, args.seconds - 1.0)
            )
            recorder.wait(timeout=60)
        finally:
            server.terminate()
    rate = len(latencies) / (args.seconds - 1.0)
    print(
        f"{args.size} identity model, {args.clients} client(s): {rate:.0f} req/s, "
        f"p50 {statistics.median(latencies) * 1000:.3f} ms; flame graph in {args.out}"
    )
    return 0 if recorder.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
