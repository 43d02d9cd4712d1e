"""Quick start: serve the example repository and ask it real questions.

Starts ``ferry-cloud serve`` on ``examples/repository`` as its own process
(HTTP on a free port, no broker), sends V2 binary inferences of rendered
document images to each model variant, prints each answer beside the truth,
then shuts the server down with SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge.transports.http import HttpTransport  # noqa: E402
from shared.messages import InferRequest  # noqa: E402
from shared.modeltools.samples import orientation_samples  # noqa: E402
from shared.tensors import Tensor  # noqa: E402

ANGLES = ["0", "90", "180", "270"]


def start_server(repository: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cloud.cli",
            "serve",
            "--repository",
            str(repository),
            "--http-port",
            "0",
            "--node",
            "quickstart",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        print(f"  [server] {line.rstrip()}")
        match = re.search(r"http=(\S+)", line)
        if line.startswith("ferry-cloud ready") and match:
            return proc, match.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("quickstart: the server did not start")


async def ask(url: str, n: int) -> None:
    images, labels = orientation_samples(n, seed=7)
    transport = HttpTransport(url)
    await transport.start()
    try:
        for model in ("orientation", "orientation-int8", "orientation-ov"):
            correct = 0
            t0 = time.monotonic()
            for i in range(n):
                request = InferRequest(inputs=[Tensor.from_array("x", images[i : i + 1])])
                result = await transport.infer(model, request, time.monotonic() + 10)
                probs = result.response.outputs[0].data[0]
                correct += int(np.argmax(probs) == labels[i])
                if i < 2:
                    print(
                        f"  {model:<17} image {i}: true {ANGLES[labels[i]]:>3} deg -> "
                        f"predicted {ANGLES[int(np.argmax(probs))]:>3} deg "
                        f"(p={float(np.max(probs)):.2f}, queue {result.response.parameters['queue_us']} us, "
                        f"compute {result.response.parameters['compute_us']} us)"
                    )
            ms = (time.monotonic() - t0) / n * 1000
            print(f"  {model:<17} {correct}/{n} correct, {ms:.1f} ms per request over HTTP\n")
    finally:
        await transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "examples" / "repository")
    parser.add_argument("-n", type=int, default=8, help="images per model")
    args = parser.parse_args(argv)
    print(f"starting ferry-cloud on {args.repository} ...")
    proc, url = start_server(args.repository)
    try:
        print(f"server at {url}; sending {args.n} rendered document images to each model\n")
        asyncio.run(ask(url, args.n))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        for line in out.splitlines():
            print(f"  [server] {line}")
    print(
        "done: server shut down cleanly"
        if proc.returncode == 0
        else f"server exited {proc.returncode}"
    )
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
