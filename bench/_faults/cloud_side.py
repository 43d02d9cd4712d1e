"""Faults inside a cloud node.

bad-model:     a node starts with a corrupt ``model.onnx`` next to good models; a
               corrupt new version of a serving model is hot-loaded; then the
               broken model is fixed and loaded through the repository API.
memory-budget: a node whose ``[limits] max_inflight_bytes`` holds two big
               requests takes bursts of many concurrent ones over MQTT.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench._faults.harness import MODELS as AGENT_MODELS
from bench._faults.harness import (
    SLOW,
    Result,
    Stream,
    X,
    agent_toml,
    build_repositories,
    fmt_s,
)
from bench._faults.lab import Lab, ScenarioError, drive
from edge.agent import Agent
from tests.support import write_slow_model

CORRUPT = b"\x08\x07this is not an ONNX model\n" * 64


async def _load(http_url: str, model: str) -> tuple[int, str]:
    """``POST /v2/repository/models/{model}/load`` (loopback: no token needed);
    returns the status and the error code, if any."""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{http_url}/v2/repository/models/{model}/load",
            json={},
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            text = await resp.text()
    try:
        code = str(json.loads(text).get("code", "")) if resp.status != 200 else ""
    except (ValueError, AttributeError):
        code = text[:80]
    return resp.status, code


async def bad_model(lab: Lab) -> Result:
    broker = await lab.start_broker()
    cloud, local = build_repositories(lab.workdir)
    broken = cloud / "broken" / "1" / "model.onnx"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(CORRUPT)
    node = await lab.start_node("n1", cloud)
    models = AGENT_MODELS + '[models.broken]\ncloud = "broken"\n'
    config = agent_toml(lab.workdir / "agent", local, mqtt=broker.url, models=models)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        notes.append(f"node started: {node.ready_line.split('models=')[1].split()[0]} loaded")
        await asyncio.sleep(lab.t(2.0, 1.0))
        # A corrupt version 2 of a model that serves: the hot reload fails, v1 keeps serving.
        (cloud / "lin" / "2").mkdir()
        (cloud / "lin" / "2" / "model.onnx").write_bytes(CORRUPT)
        reload_at = time.monotonic()
        status, text = await _load(node.http_url, "lin")
        notes.append(f"hot load of a corrupt lin v2: HTTP {status} {text}, v1 kept serving")
        kept = await stream.settle(reload_at, lab.t(8.0, 5.0), ["lin", "solo"])
        if kept is None:
            raise ScenarioError("lin and solo did not serve normally after the failed hot load")
        notes.append(f"lin and solo served normally {fmt_s(kept)} after the failed hot load")
        await asyncio.sleep(lab.t(2.0, 1.0))
        # The fix: a good model file, loaded through the repository API.
        write_slow_model(broken, **SLOW)
        status, text = await _load(node.http_url, "broken")
        fault_end = time.monotonic()
        notes.append(f"load of the fixed model: HTTP {status}")
        recovery = await stream.settle(fault_end, lab.t(15.0, 12.0))
        await asyncio.sleep(lab.t(2.0, 1.0))
        return recovery

    return await drive(
        lab, "bad-model", config, ["lin", "solo", "broken"],
        {"lin": X, "solo": X, "broken": X}, body,
        rate_hz=15.0, warm_models=["lin", "solo"],
    )  # fmt: skip


# ---- memory budget ----------------------------------------------------------------------

BIG_ROWS, BIG_WIDTH = 2, 16384  # 128 KiB of float32 per request
BUDGET = 384 << 10  # two such requests in flight, not three


def _cloud_toml(folder: Path, repository: Path) -> Path:
    path = folder / "cloud.toml"
    path.write_text(f'repository = "{repository}"\n[limits]\nmax_inflight_bytes = {BUDGET}\n')
    return path


async def memory_budget(lab: Lab) -> Result:
    broker = await lab.start_broker()
    cloud, local = build_repositories(lab.workdir)
    write_slow_model(cloud / "big" / "1" / "model.onnx", n=BIG_WIDTH, **SLOW)
    await lab.start_node("tight", cloud, "--config", str(_cloud_toml(lab.workdir, cloud)))
    models = AGENT_MODELS + '[models.big]\ncloud = "big"\n'
    config = agent_toml(lab.workdir / "agent", local, mqtt=broker.url, models=models)
    big = {"x": np.ones((BIG_ROWS, BIG_WIDTH), np.float32)}
    burst_s, every_s, size = lab.t(5.0, 3.0), 0.25, 12

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        await asyncio.sleep(lab.t(3.0, 1.5))
        began = time.monotonic()
        burst = []
        while time.monotonic() - began < burst_s:
            burst += [stream.fire("big", big) for _ in range(size)]
            await asyncio.sleep(every_s)
        fault_end = time.monotonic()
        recovery = await stream.settle(fault_end, lab.t(15.0, 10.0))
        await asyncio.sleep(lab.t(2.0, 1.0))
        await asyncio.sleep(0)
        while any(r.outcome == "pending" for r in burst):
            await asyncio.sleep(0.1)
        outcomes: dict[str, int] = {}
        for r in burst:
            key = r.where if r.outcome == "ok" else (r.code or r.outcome)
            outcomes[key] = outcomes.get(key, 0) + 1
        notes.append(
            f"bursts of {size} x {BIG_ROWS * BIG_WIDTH * 4 >> 10} KiB every {every_s:g} s for "
            f"{burst_s:g} s against a {BUDGET >> 10} KiB budget: {len(burst)} requests, "
            + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
        )
        return recovery

    return await drive(
        lab, "memory-budget", config, ["lin", "big"], {"lin": X, "big": big}, body, rate_hz=10.0
    )
