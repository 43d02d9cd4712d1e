"""One decision flow: the live agent and the replay decide every request alike.

A scripted sequence (requests on a good link, a few at once, an outage the
link emulator replays, the link back, probes) runs through the real agent,
a real cloud server and the live link emulator, with the agent's core
journalling every event it sees.  The journal then drives a fresh core, as
the replay evaluator builds one, on the recorded times: every decision
(where, why, the predicted latency) must come out the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from devices.profiles import load_device, load_link
from edge.agent import Agent
from edge.config import AgentConfig, load_agent_config
from edge.core.flow import LOCAL_RUNS_TO_CANCEL, fresh_core, replay_journal
from edge.netem.linkemu import LinkEmulator
from edge.netem.traces import from_phases, steady
from tests.edge.conftest import agent_toml
from tests.support import cloud_server

LIN = '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\n'


@contextlib.asynccontextmanager
async def _journalled_agent(
    tmp_path: Path, edge_repos, cloud, policy: str, extra: str, delay_ms: float = 2
) -> AsyncIterator[tuple[Agent, LinkEmulator, AgentConfig]]:
    """An agent with a journal, reaching the cloud through a live link emulator."""
    port = int(cloud.http_url.rsplit(":", 1)[1])
    emu = LinkEmulator(
        ("127.0.0.1", 0), ("127.0.0.1", port), steady(100, 60), steady(100, 60), delay_ms=delay_ms
    )
    await emu.start()
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=f"http://127.0.0.1:{emu.port}",
        models=LIN,
        policy=policy,
        extra=extra,
    )
    config = load_agent_config(cfg)
    try:
        async with Agent(config, journal=10_000) as agent:
            yield agent, emu, config
    finally:
        await emu.close()


def _replayed(config: AgentConfig, events: list) -> list:
    """The journal fed to a fresh core, as the replay evaluator builds one."""
    links = {t: load_link(config.links[t]) for t in ("http",)}
    replica = fresh_core(config.policy, load_device(config.device), links, journal=10_000)
    return replay_journal(events, replica)


@pytest.fixture(scope="module")
def cloud(edge_repos):
    proc = cloud_server(edge_repos[0], "--node", "equivalence").start()
    yield proc
    proc.terminate()


async def test_the_live_agent_and_the_replay_make_every_decision_alike(tmp_path, edge_repos, cloud):
    x = np.ones((1, 4), np.float32)
    journalled = _journalled_agent(
        tmp_path,
        edge_repos,
        cloud,
        "explore_after_s = 0.5\n",
        "[emulation]\nlocal_latency_ms = 300\n",
    )
    async with journalled as (agent, emu, config):

        async def ask(n: int = 1) -> list[str]:
            answers = await asyncio.gather(
                *(agent.infer("lin", {"x": x}, deadline_ms=2500) for _ in range(n))
            )
            return [a.parameters["where"] for a in answers]

        where = []
        for _ in range(5):
            where += await ask()
        where += await ask(3)  # three at once: they decide before any of them completes
        outage = from_phases([(5.0, 0.0), (60.0, 100.0)])
        emu.set_traces(outage, outage)
        for _ in range(6):
            where += await ask()
        await agent.dataplane.probe()
        await asyncio.sleep(max(5.5 - emu.elapsed_s, 0.0))  # the link is back
        await agent.dataplane.probe()
        for _ in range(5):
            where += await ask()
        core = agent.dataplane.core
        live, events = list(core.decisions), list(core.events)

    replayed = _replayed(config, events)
    assert len(live) == len(where)  # one decision per request, all journalled
    assert [(d.where, d.reason, d.predicted_s) for d in replayed] == [
        (d.where, d.reason, d.predicted_s) for d in live
    ]
    # the script exercised what matters: the cloud, local work, and failed offloads
    kinds = {e[0] for e in events}
    assert {"warmed", "begin", "local_done", "offload_done", "offload_failed"} <= kinds
    assert "local" in where and "cloud-http" in where


def _racing_agent(tmp_path: Path, edge_repos, cloud, delay_ms: float = 2):
    """A journalled agent whose 400 ms local run leaves a 700 ms deadline no room to
    fall back after an offload: its offloads race the local run."""
    return _journalled_agent(
        tmp_path,
        edge_repos,
        cloud,
        "explore_after_s = 0.3\n",
        "[emulation]\nlocal_latency_ms = 400\n",
        delay_ms=delay_ms,
    )


async def test_a_raced_offload_answers_first_and_the_replay_agrees(tmp_path, edge_repos, cloud):
    # A 400 ms local run and a 700 ms deadline: an unmeasured link leaves no room to
    # fall back after an offload, so the agent races it against a local run that
    # starts when it must for the deadline (or at once, hedged).
    x = np.ones((1, 4), np.float32)
    async with _racing_agent(tmp_path, edge_repos, cloud) as (agent, _, config):
        answers = []
        for _ in range(12):
            answers.append(await agent.infer("lin", {"x": x}, deadline_ms=700))
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)  # the hedges' slower halves end and are learnt from
        core = agent.dataplane.core
        live, events = list(core.decisions), list(core.events)

    params = [a.parameters for a in answers]
    raced = [p for p in params if p.get("hedged") or p.get("raced")]
    assert raced and any(p["where"] == "cloud-http" for p in raced)  # the cloud won a race
    assert all(p["latency_ms"] < 700 for p in params)  # the local run guarded every deadline
    kinds = [e[0] for e in events]
    assert kinds.count("begin") == 12 and kinds.count("start") == 12
    replayed = _replayed(config, events)
    assert [(d.where, d.reason, d.predicted_s) for d in replayed] == [
        (d.where, d.reason, d.predicted_s) for d in live
    ]


async def test_a_race_the_cloud_wins_late_stops_its_local_run_and_the_replay_agrees(
    tmp_path, edge_repos, cloud
):
    # A 400 ms local run, a 700 ms deadline and a ~300 ms round trip: no room to fall
    # back after an offload, so each offload races a local run that starts at ~240 ms;
    # the reply comes after it started, and the local run (ONNX Runtime, and the
    # emulated device's time after it) is stopped there, not run to its end.
    x = np.ones((1, 4), np.float32)
    async with _racing_agent(tmp_path, edge_repos, cloud, delay_ms=150) as (agent, _, config):
        core = agent.dataplane.core
        # a device that has run its model often: its latency rests on enough runs for a
        # race's local run to be stopped halfway (journalled, so the replay has them too)
        for _ in range(LOCAL_RUNS_TO_CANCEL):
            core.warmed("lin-local", 0.4, time.monotonic())
        answers = []
        for _ in range(8):
            answers.append(await agent.infer("lin", {"x": x}, deadline_ms=700))
        await asyncio.sleep(0.6)  # a stopped run would have ended by now
        live, events = list(core.decisions), list(core.events)
        local_runs = core.est.local("lin-local").count

    params = [a.parameters for a in answers]
    stopped = [p for p in params if p.get("local_cancelled")]
    assert stopped and all(p["where"] == "cloud-http" and p["hedged"] for p in stopped)
    assert all(p["latency_ms"] < 700 for p in params)
    # a stopped run teaches nothing of the local latency: only finished runs were learnt
    finished = sum(1 for e in events if e[0] in ("local_done", "warmed"))
    assert local_runs == finished
    replayed = _replayed(config, events)
    assert [(d.where, d.reason, d.predicted_s) for d in replayed] == [
        (d.where, d.reason, d.predicted_s) for d in live
    ]
