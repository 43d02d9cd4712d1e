"""Faults of the MQTT cluster: two nodes share the load through the shared subscription.

kill-node:      ``kill -9`` of one node while requests flow; it is started again later.
stop-node:      ``SIGSTOP`` of one node for three request deadlines, then ``SIGCONT``.
broker-restart: Mosquitto stopped and started again (1 s down) while requests flow;
                it keeps its sessions (``persistence true``, as examples/mosquitto.conf).
broker-restart-cold: the same with a broker that forgets its sessions (persistence off).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

from bench._faults.harness import (
    DEADLINE_MS,
    Record,
    Result,
    Stream,
    X,
    agent_toml,
    build_repositories,
    fmt_s,
    nodes_served,
)
from bench._faults.lab import Lab, drive
from edge.agent import Agent

MODELS = ["lin", "solo"]
LONG_DEADLINE_MS = 6000.0
INPUTS = {"lin": X, "solo": X}


async def _cluster(lab: Lab, persistence: bool = True) -> tuple[Path, Path, Path]:
    broker = await lab.start_broker(persistence=persistence)
    cloud, local = build_repositories(lab.workdir)
    await lab.start_node("node-a", cloud)
    await lab.start_node("node-b", cloud)
    config = agent_toml(lab.workdir / "agent", local, mqtt=broker.url)
    return cloud, local, config


def _outcomes(records: list[Record]) -> str:
    """``where`` or error code -> count, with how many fell back."""
    counts = Counter(
        (r.where + (" (fallback)" if r.fallback else ""))
        if r.outcome == "ok"
        else r.code or r.outcome
        for r in records
    )
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


def _both_serve(stream: Stream, since: float, notes: list[str]) -> None:
    served = nodes_served(stream, since)
    notes.append(
        "before the fault the nodes served "
        + ", ".join(f"{n}: {c}" for n, c in sorted(served.items()))
    )


async def kill_node(lab: Lab) -> Result:
    cloud, _, config = await _cluster(lab)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        pre = time.monotonic()
        await asyncio.sleep(lab.t(3.0, 1.5))
        _both_serve(stream, pre, notes)
        # A few extra requests just before the kill, so some are surely in node-a's hands.
        for model in MODELS * 4:
            stream.fire(model)
        await asyncio.sleep(0.03)
        lab.killed.add("node-a")
        lab.nodes["node-a"].kill()  # SIGKILL to its process group: no goodbye, no drain
        fault_end = time.monotonic()
        recovery = await stream.settle(fault_end, lab.t(10.0, 6.0))
        await asyncio.sleep(lab.t(2.0, 1.0))
        hit = [r for r in stream.records if fault_end - 1.0 <= r.sent < fault_end]
        notes.append(
            f"of the {len(hit)} requests sent in the last second before the kill: " + _outcomes(hit)
        )
        # node-a comes back under the same name: it must get its share again
        back = time.monotonic()
        await lab.start_node("node-a", cloud)
        deadline = time.monotonic() + lab.t(8.0, 5.0)
        while time.monotonic() < deadline and not nodes_served(stream, back)["node-a"]:
            await asyncio.sleep(0.1)
        await asyncio.sleep(lab.t(2.0, 1.0))
        served = nodes_served(stream, back)
        notes.append(
            f"node-a restarted {time.monotonic() - back:.1f} s ago: it served "
            f"{served['node-a']} requests since, node-b {served['node-b']}"
        )
        if not served["node-a"]:
            notes.append("node-a got no requests after its restart")
        return recovery

    return await drive(lab, "kill-node", config, MODELS, INPUTS, body)


async def stop_node(lab: Lab) -> Result:
    _, _, config = await _cluster(lab)
    stopped_s = lab.t(3.0, 2.0) * DEADLINE_MS / 1000.0

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        pre = time.monotonic()
        await asyncio.sleep(lab.t(3.0, 1.5))
        _both_serve(stream, pre, notes)
        pid = lab.nodes["node-a"].proc.pid  # type: ignore[union-attr]
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(stopped_s)
        finally:
            os.killpg(pid, signal.SIGCONT)
        fault_end = time.monotonic()
        notes.append(f"node-a stopped for {stopped_s:.1f} s (deadline {DEADLINE_MS:g} ms)")
        recovery = await stream.settle(fault_end, lab.t(12.0, 8.0))
        await asyncio.sleep(lab.t(3.0, 1.5))
        late = nodes_served(stream, fault_end)
        notes.append(f"after SIGCONT node-a served {late['node-a']}, node-b {late['node-b']}")
        return recovery

    return await drive(lab, "stop-node", config, MODELS, INPUTS, body)


async def broker_restart(lab: Lab) -> Result:
    return await _broker_restart(lab, "broker-restart", persistence=True)


async def broker_restart_cold(lab: Lab) -> Result:
    return await _broker_restart(lab, "broker-restart-cold", persistence=False)


async def _broker_restart(lab: Lab, name: str, *, persistence: bool) -> Result:
    _, _, config = await _cluster(lab, persistence)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        await asyncio.sleep(lab.t(3.0, 1.5))
        assert lab.broker is not None
        # A few requests with a long deadline, in flight when the broker goes: the agent
        # must publish them again after the reconnect and get their answers.
        long = [stream.fire(m, deadline_ms=LONG_DEADLINE_MS) for m in MODELS * 3]
        await asyncio.sleep(0.005)
        lab.broker_down = True
        down = time.monotonic()
        await asyncio.to_thread(lab.broker.restart, 1.0)
        lab.broker_down = False
        fault_end = time.monotonic()
        notes.append(f"broker down {fault_end - down:.1f} s (stop, 1 s, start)")
        recovery = await stream.settle(fault_end, lab.t(15.0, 10.0))
        await asyncio.sleep(lab.t(3.0, 1.5))
        while any(r.outcome == "pending" for r in long):
            await asyncio.sleep(0.1)
        mqtt = agent.transports["mqtt"]
        notes.append(
            f"{len(long)} requests with a {LONG_DEADLINE_MS:g} ms deadline sent 5 ms before the "
            f"broker stopped: {_outcomes(long)}; the agent republished "
            f"{getattr(mqtt, 'republished', '?')} request(s) after reconnecting"
        )
        late = nodes_served(stream, fault_end)
        notes.append(
            f"after the restart node-a served {late['node-a']}, node-b {late['node-b']}; "
            f"back to normal after {fmt_s(recovery)}"
        )
        return recovery

    return await drive(lab, name, config, MODELS, INPUTS, body)
