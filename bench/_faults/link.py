"""A link outage: HTTP through the live link emulator, which replays a trace that
drops to 0 Mbit/s both ways for a few seconds, then comes back."""

from __future__ import annotations

import asyncio
import time

from bench._faults.harness import (
    Result,
    Stream,
    X,
    agent_toml,
    build_repositories,
)
from bench._faults.lab import Lab, drive
from edge.agent import Agent
from edge.netem.linkemu import LinkEmulator
from edge.netem.traces import from_phases, steady

MODELS = ["lin", "solo"]
INPUTS = {"lin": X, "solo": X}


async def link_outage(lab: Lab) -> Result:
    cloud, local = build_repositories(lab.workdir)
    node = await lab.start_node("far", cloud)  # no broker: HTTP only
    port = int(node.http_url.rsplit(":", 1)[1])
    good = steady(100, 60)
    emu = LinkEmulator(("127.0.0.1", 0), ("127.0.0.1", port), good, good, delay_ms=2)
    await emu.start()
    config = agent_toml(lab.workdir / "agent", local, http=f"http://127.0.0.1:{emu.port}")
    outage_s = lab.t(5.0, 3.0)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        await asyncio.sleep(lab.t(3.0, 1.5))
        trace = from_phases([(outage_s, 0.0), (600.0, 100.0)])
        emu.set_traces(trace, trace)  # from now: outage_s of nothing, then a good link
        began = time.monotonic()
        await asyncio.sleep(outage_s)
        fault_end = time.monotonic()
        during = [r for r in stream.records if began <= r.sent < fault_end]
        notes.append(
            f"outage of {outage_s:g} s: {len(during)} requests sent during it, "
            f"{sum(r.where == 'local' for r in during)} answered locally"
        )
        recovery = await stream.settle(fault_end, lab.t(15.0, 10.0))
        await asyncio.sleep(lab.t(3.0, 1.5))
        return recovery

    try:
        return await drive(lab, "link-outage", config, MODELS, INPUTS, body)
    finally:
        await emu.close()
