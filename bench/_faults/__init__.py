"""Fault-injection scenarios for ``bench/faults.py`` and ``tests/test_faults.py``.

Each scenario is ``async def scenario(lab) -> Result``: real processes, a
real broker, a steady request stream through a real agent, bounded in time.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._faults.cloud_side import bad_model, memory_budget
from bench._faults.cluster import broker_restart, broker_restart_cold, kill_node, stop_node
from bench._faults.disk import disk_full, disk_full_flush
from bench._faults.harness import Result
from bench._faults.lab import Lab, Skip
from bench._faults.link import link_outage

Scenario = Callable[[Lab], Awaitable[Result]]

#: name -> (scenario, what it does), in the order they run
SCENARIOS: dict[str, tuple[Scenario, str]] = {
    "kill-node": (
        kill_node,
        "two nodes share the MQTT load (shared subscription); `kill -9` of one while "
        "requests flow, then it is started again",
    ),
    "stop-node": (
        stop_node,
        "`SIGSTOP` of one of the two nodes for three request deadlines, then `SIGCONT`",
    ),
    "broker-restart": (
        broker_restart,
        "Mosquitto (persistence on, as `examples/mosquitto.conf`) stopped and started again "
        "(1 s down) under the stream; nodes and agent reconnect by themselves; 6 requests "
        "with a 6 s deadline are in flight when it stops",
    ),
    "broker-restart-cold": (
        broker_restart_cold,
        "the same with a broker that forgets its sessions and subscriptions (persistence "
        "off, or its state lost)",
    ),
    "link-outage": (
        link_outage,
        "HTTP through the live link emulator (`edge/netem/linkemu.py`), which replays a "
        "trace with an outage (0 Mbit/s both ways), then a good link",
    ),
    "disk-full": (
        disk_full,
        "deferrable requests with no link go to the store-and-forward store, whose "
        "`state_dir` is a 16 MiB tmpfs; a filler file takes its last byte for a few seconds, "
        "then is deleted; then a node comes up and every receipt must be delivered",
    ),
    "disk-full-flush": (
        disk_full_flush,
        "a backlog of stored deferrable requests; the disk fills, then the link comes back "
        "while it is full but for a page or a few, so the flusher runs into it; then the "
        "disk is freed and the whole backlog must be delivered (time to normal: until it is)",
    ),
    "bad-model": (
        bad_model,
        "a node starts with a corrupt `model.onnx` next to good models; a corrupt new "
        "version of a serving model is hot-loaded; then the broken model is fixed and loaded",
    ),
    "memory-budget": (
        memory_budget,
        "a node with `[limits] max_inflight_bytes = 384 KiB` (room for two requests) takes "
        "bursts of 12 concurrent 128 KiB requests every 0.25 s over MQTT",
    ),
}


async def run_scenario(name: str, *, quick: bool, workdir: Path | None = None) -> Result:
    """Run one scenario in ``workdir`` (a fresh temporary folder by default)."""
    scenario, _ = SCENARIOS[name]
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix=f"ferry-fault-{name}-")) if own else workdir
    assert folder is not None
    lab = Lab(folder, quick)
    started = time.monotonic()
    try:
        result = await scenario(lab)
    except Skip as exc:
        result = Result(name, skipped=str(exc))
    except Exception as exc:
        result = Result(name, problems=[f"scenario crashed: {exc!r}\n{traceback.format_exc()}"])
    finally:
        await lab.close()
        if own:
            await asyncio.to_thread(shutil.rmtree, folder, True)
    result.wall_s = time.monotonic() - started
    return result
