"""A GPU node's NVML figures on ``/metrics`` beside ``nvidia-smi``, idle, under load and after.

    python bench/gpu_metrics.py [--load-s 8]

Needs an NVIDIA driver (``nvidia-smi`` and NVML); CI has none, so this runs
where a GPU is lent (``scripts/gpu_check.sh`` runs it with the GPU tests).
A ``ferry-cloud serve`` node with one tiny model is started as a real
process; each moment scrapes its ``/metrics`` and reads ``nvidia-smi
--query-gpu`` right after.  The load is a half-precision matrix product on the
first board, in another process (PyTorch, else CuPy; without either the load
rows are skipped and said so), so the node's figures must follow a GPU it
does not use itself.

Checks, per board and moment: utilization within 0.15 of nvidia-smi's (the
node caches a read for a second and NVML's rate is over its own sample
period), used memory within 64 MiB, power within 10% (or 10 W) where the
board reports it; under load the node must report a board busy.  Exit status 1 on any miss, printing
which; 2 where there is no NVIDIA driver to read.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import cloud_server, write_linear_model  # noqa: E402

MIB = 1 << 20
UTIL_TOL = 0.15
MEM_TOL = 64 * MIB
POWER_TOL = 0.10

LOAD = """
import sys, time
try:
    import torch
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
except ImportError:
    import cupy
    x = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32).astype(cupy.float16)
    sync = cupy.cuda.runtime.deviceSynchronize
# the load's time counts from here: starting CUDA can take seconds on a fresh machine
end = time.monotonic() + float(sys.argv[1])
print("load ready", flush=True)
while time.monotonic() < end:
    for _ in range(20):
        y = x @ x
    sync()
"""


def smi() -> dict[str, dict[str, float]]:
    """nvidia-smi's reading per board: utilization (0..1), used bytes, watts."""
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=uuid,utilization.gpu,memory.used,power.draw",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    boards = {}
    for line in out.strip().splitlines():
        uuid, util, used, power = (f.strip() for f in line.split(","))
        boards[uuid] = {
            "util": float(util) / 100.0,
            "used": float(used) * MIB,
            "power": float(power) if power not in ("[N/A]", "N/A") else float("nan"),
        }
    return boards


def scrape(url: str) -> dict[str, dict[str, float]]:
    """The node's ``nv_gpu_*`` gauges per board."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = {
        "nv_gpu_utilization": "util",
        "nv_gpu_memory_used_bytes": "used",
        "nv_gpu_power_usage": "power",
    }
    boards: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                boards.setdefault(s.labels["gpu_uuid"], {})[names[s.name]] = s.value
    return boards


def compare(moment: str, node: dict, ref: dict, busy: bool, missed: list[str]) -> None:
    nan = float("nan")
    if busy and max((g.get("util", 0.0) for g in node.values()), default=0.0) < 0.5:
        missed.append(f"{moment}: the node reports no board busy under load")
    for uuid, want in ref.items():
        got = node.get(uuid)
        if got is None:
            missed.append(f"{moment}: board {uuid} missing from /metrics")
            continue
        print(
            f"  {moment:<10} {uuid[:12]}  util {got['util']:.2f} / smi {want['util']:.2f}   "
            f"used {got['used'] / 2**30:6.2f} / {want['used'] / 2**30:6.2f} GiB   "
            f"power {got.get('power', nan):6.1f} / {want['power']:6.1f} W"
        )
        if abs(got["util"] - want["util"]) > UTIL_TOL:
            missed.append(
                f"{moment}: utilization {got['util']:.2f} vs nvidia-smi {want['util']:.2f}"
            )
        if abs(got["used"] - want["used"]) > MEM_TOL:
            missed.append(
                f"{moment}: used memory {got['used'] / MIB:.0f} MiB vs "
                f"nvidia-smi {want['used'] / MIB:.0f} MiB"
            )
        power = got.get("power", nan)
        if want["power"] == want["power"] and not (
            abs(power - want["power"]) <= max(10.0, POWER_TOL * want["power"])
        ):  # (a board nvidia-smi reads power of, but the node does not, is a miss too)
            missed.append(f"{moment}: power {power:.1f} W vs nvidia-smi {want['power']:.1f} W")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-s", type=float, default=8.0)
    args = parser.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print("no NVIDIA driver here (nvidia-smi not found): nothing to compare")
        return 2
    missed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        write_linear_model(repo / "linear" / "1" / "model.onnx")
        server = cloud_server(repo).start()
        try:
            time.sleep(1.5)  # past the monitor's one-second cache
            print("moment      board         node / nvidia-smi")
            compare("idle", scrape(server.http_url), smi(), False, missed)
            load = subprocess.Popen(
                [sys.executable, "-c", LOAD, str(args.load_s)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert load.stdout is not None
            if "load ready" not in load.stdout.readline():
                load.wait()
                print("  load rows skipped: neither PyTorch nor CuPy could start a GPU load")
            else:
                since = 0.0
                for at in (2.0, min(5.0, args.load_s - 1.0)):
                    time.sleep(at - since)
                    since = at
                    compare(f"load {at:.0f}s", scrape(server.http_url), smi(), True, missed)
                load.wait()
                time.sleep(1.5)
                compare("after", scrape(server.http_url), smi(), False, missed)
        finally:
            server.terminate()
    for line in missed:
        print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
