"""Quick-start demo: an edge agent offloading through a link that changes.

Starts ``ferry-cloud serve`` and ``ferry-edge run`` as separate processes on
the example repository.  The agent reaches the cloud through a live link
emulator (a TCP proxy that shapes real bytes to a rate and a delay), and the
demo scripts the link: good WiFi, weak LTE, an outage, LTE, WiFi again.  A
workload of rendered document pages goes to the agent's local V2 API; per
phase the demo prints where requests ran, p50/p99 latency, energy and bytes,
so the policy's switching is visible.  At each change of network the demo
tells the agent the new link's kind and signal strength (``POST
/v2/agent/link``), as a device's connectivity manager would, so LTE phases
are priced with LTE's radio model (promotion and tail) and the signal sets
the link's prior; bandwidth and RTT the agent still learns by itself.
HTTP by default (no broker needed);
``--mqtt`` starts a local Mosquitto and offloads over MQTT instead.

The example device is a Raspberry Pi 4B: this machine is several times
faster, so the agent emulates the Pi's speed (``[emulation]
local_latency_ms``: each local run takes at least the Pi's time), the way
the link emulator stands in for a radio.  A fixed device time, not a
factor over this machine's own time, keeps the demo's load the same on a
machine whose speed varies several-fold from one hour to the next.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge.netem.linkemu import LinkEmulator  # noqa: E402
from edge.netem.traces import steady  # noqa: E402
from edge.transports.http import HttpTransport  # noqa: E402
from shared.messages import InferRequest  # noqa: E402
from shared.modeltools.samples import orientation_jpegs  # noqa: E402
from shared.tensors import Tensor  # noqa: E402

#: (name, seconds, uplink Mbps, downlink Mbps, one-way delay ms, link kind); 0 Mbps = outage
# name, seconds, up Mbps, down Mbps, delay ms, link kind, signal dBm (WiFi RSSI, LTE RSRP)
# as a connectivity manager reports them at each change
PHASES = [
    ("good WiFi", 10, 300.0, 300.0, 2.0, "wifi", -45.0),
    ("weak LTE", 10, 2.0, 8.0, 35.0, "lte", -112.0),
    ("outage", 8, 0.0, 0.0, 35.0, "lte", -125.0),
    ("LTE", 10, 12.0, 30.0, 25.0, "lte", -90.0),
    ("good WiFi", 12, 300.0, 300.0, 2.0, "wifi", -45.0),
]


class Proc:
    def __init__(self, args: list[str], ready: str, label: str) -> None:
        self.label = label
        self.p = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        assert self.p.stdout is not None
        self.line = ""
        deadline = time.monotonic() + 120
        for line in self.p.stdout:
            if line.startswith(ready):
                self.line = line.strip()
                print(f"  [{label}] {self.line}")
                break
            if time.monotonic() > deadline:
                break
        if not self.line:
            self.stop()
            raise SystemExit(f"demo: {label} did not start")

    def field(self, key: str) -> str:
        return re.search(rf"{key}=(\S+)", self.line).group(1)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()


@dataclass
class PhaseStats:
    where: list[str] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    energy_j: list[float] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    fallbacks: int = 0
    errors: int = 0
    error_kinds: dict[str, None] = field(default_factory=dict)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(folder: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o777)
    conf = folder / "mosquitto.conf"
    conf.write_text(
        (ROOT / "examples" / "mosquitto.conf").read_text()
        + f"\nlistener {port} 127.0.0.1\npersistence_location {folder}/\n"
    )
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    proc = subprocess.Popen(
        [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(0.5)
    return proc, port


async def tell_link(api_url: str, transport: str, link: str, signal_dbm: float) -> None:
    """The network changed: what a connectivity manager would tell the agent."""
    import aiohttp

    body = {"transport": transport, "link": link, "signal_dbm": signal_dbm}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{api_url}/v2/agent/link", json=body) as resp:
            resp.raise_for_status()


async def drive(
    api_url: str, emulators: list[LinkEmulator], rate: float, deadline_ms: float, transport: str
) -> list[tuple[str, PhaseStats]]:
    # JPEG pages as a phone app sends them (63-142 KB); the model folders' [[preprocess]]
    # makes the tensor on whichever tier runs the request
    pages, _ = orientation_jpegs(16, seed=3, quality=70)
    client = HttpTransport(api_url)
    await client.start()
    results: list[tuple[str, PhaseStats]] = []
    current: tuple[str, float] | None = None
    try:
        for name, seconds, up, down, delay, kind, signal in PHASES:
            for emu in emulators:
                emu.set_traces(steady(up, 60, name=name), steady(down, 60, name=name))
                emu.delay_s = delay / 1000.0
            if (kind, signal) != current:
                await tell_link(api_url, transport, kind, signal)
                current = (kind, signal)
            stats = PhaseStats()
            results.append((name, stats))
            print(f"  phase {name:<10} {up:>6.1f} Mbps up, {delay:>4.0f} ms delay ...", flush=True)
            end = time.monotonic() + seconds
            pending: set[asyncio.Task[None]] = set()
            i = 0

            async def one(k: int, st: PhaseStats = stats) -> None:
                request = InferRequest(
                    inputs=[Tensor("image", "BYTES", np.array([[pages[k % 16]]], dtype=object))],
                    parameters={"deadline_ms": deadline_ms},
                )
                try:
                    r = await client.infer("orientation", request, time.monotonic() + 30)
                except Exception as exc:
                    st.errors += 1
                    st.error_kinds[type(exc).__name__ + ": " + str(exc)[:160]] = None
                    return
                p = r.response.parameters
                st.where.append(p.get("where", "?"))
                st.latency_ms.append(float(p.get("latency_ms", 0.0)))
                st.energy_j.append(float(p.get("energy_j", 0.0)))
                st.sent += int(p.get("bytes_sent", 0))
                st.received += int(p.get("bytes_received", 0))
                st.fallbacks += bool(p.get("fallback"))

            while time.monotonic() < end:
                task = asyncio.create_task(one(i))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                await asyncio.sleep(1.0 / rate)
            if pending:
                await asyncio.wait(pending)
    finally:
        await client.close()
    return results


def report(results: list[tuple[str, PhaseStats]]) -> int:
    """Print the phase table; returns the number of requests answered with an error."""
    print(
        f"\n  {'phase':<11}{'requests':>9}  {'where (local / cloud)':<24}{'fallback':>9}"
        f"{'errors':>7}{'p50 ms':>9}{'p99 ms':>9}{'MB sent':>9}{'MB recv':>9}{'mJ/req*':>9}"
    )
    errors = 0
    for name, s in results:
        n = len(s.where)
        local = s.where.count("local")
        cloud = sum(w.startswith("cloud") for w in s.where)
        lat = np.array(s.latency_ms) if s.latency_ms else np.array([np.nan])
        errors += s.errors
        print(
            f"  {name:<11}{n + s.errors:>9}  {f'{local} / {cloud}':<24}{s.fallbacks:>9}"
            f"{s.errors:>7}{np.percentile(lat, 50):>9.1f}{np.percentile(lat, 99):>9.1f}"
            f"{s.sent / 1e6:>9.1f}{s.received / 1e6:>9.2f}"
            f"{(np.mean(s.energy_j) * 1000 if s.energy_j else 0):>9.0f}"
        )
        for kind in list(s.error_kinds)[:3]:
            print(f"      error: {kind}")
    offloaded = sum(sum(w.startswith("cloud") for w in s.where) for _, s in results)
    if offloaded:
        per = sum(s.sent for _, s in results) / offloaded
        print(
            f"\n  Each offload sent {per / 1e3:.0f} KB: the page's JPEG (the agent forwards the\n"
            f"  encoded bytes); as a 3x224x224 FP32 tensor it would be 602 KB "
            f"({602_112 / per:.1f}x more)."
        )
    print(
        "\n  Measured on this run: where each request ran, fallbacks, errors, latency (the\n"
        "  agent's answer time through the emulated link) and bytes on the wire.\n"
        "  * mJ/req is the agent's energy model (device and link profiles, Huang et al.'s\n"
        "    LTE/WiFi radio model), not a meter reading: this machine is not a Pi on LTE."
    )
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "examples" / "repository")
    parser.add_argument(
        "--mqtt", action="store_true", help="offload over MQTT through a local Mosquitto"
    )
    parser.add_argument(
        "--rate", type=float, default=3.0, help="requests per second (the emulated Pi serves ~5/s)"
    )
    parser.add_argument("--deadline-ms", type=float, default=1500.0)
    parser.add_argument(
        "--device-ms",
        type=float,
        default=200.0,
        help="the emulated device's time for one local run (at least this machine's own)",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="or emulate the device as this many times slower than this machine",
    )
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="ferry-demo-"))
    broker = None
    cloud = agent = None
    emulators: list[LinkEmulator] = []
    print("Ferry demo: edge agent + cloud node + a link that changes\n")
    try:
        cloud_args = [
            "-m",
            "cloud.cli",
            "serve",
            "--repository",
            str(args.repository),
            "--models",
            "orientation-jpeg",
            "--http-port",
            "0",
            "--node",
            "cloud-1",
        ]
        if args.mqtt:
            broker, broker_port = start_broker(tmp / "broker")
            cloud_args += ["--mqtt", f"mqtt://127.0.0.1:{broker_port}"]
        cloud = Proc(cloud_args, "ferry-cloud ready", "cloud")
        cloud_port = int(cloud.field("http").rsplit(":", 1)[1])
        target = ("127.0.0.1", broker_port if args.mqtt else cloud_port)

        async def run() -> list[tuple[str, PhaseStats]]:
            nonlocal agent
            emu = LinkEmulator(
                ("127.0.0.1", 0), target, steady(300, 60), steady(300, 60), delay_ms=2.0
            )
            await emu.start()
            emulators.append(emu)
            scheme = "mqtt" if args.mqtt else "http"
            cfg = tmp / "agent.toml"
            cfg.write_text(
                f'repository = "{args.repository}"\nstate_dir = "{tmp / "state"}"\n'
                f'device = "raspberry-pi-4b"\nprobe_interval_s = 1.0\n'
                f"[emulation]\nlocal_slowdown = {args.slowdown}\n"
                f"local_latency_ms = {args.device_ms}\n"
                f'[cloud]\n{scheme} = "{scheme}://127.0.0.1:{emu.port}"\n'
                f'[links]\n{scheme} = "wifi"\n'
                f"[policy]\ndeadline_ms = {args.deadline_ms}\nexplore_after_s = 3.0\n"
                "[policy.weights]\nlatency_s = 1.0\nenergy_j = 0.05\ndata_mb = 0.0\n"
                '[models.orientation]\nlocal = "orientation-int8-jpeg"\ncloud = "orientation-jpeg"\n'
            )
            agent = await asyncio.to_thread(
                Proc,
                ["-m", "edge.cli", "run", "--config", str(cfg), "--api-port", "0"],
                "ferry-edge ready",
                "edge",
            )
            print(
                f"  [link] emulator on 127.0.0.1:{emu.port} -> {target[0]}:{target[1]} ({scheme})\n"
            )
            try:
                return await drive(
                    agent.field("http"), emulators, args.rate, args.deadline_ms, scheme
                )
            finally:
                await emu.close()

        results = asyncio.run(run())
        errors = report(results)
        print(
            "\nWhere each request ran is the agent's own decision: it learns the link's bandwidth and"
        )
        print(
            "RTT from every transfer, falls back locally when the cloud goes quiet, and probes back."
        )
        if errors:
            print(f"\n{errors} request(s) were answered with an error (see above)")
            return 1
    finally:
        for proc in (agent, cloud):
            if proc is not None:
                proc.stop()
        if broker is not None:
            broker.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
