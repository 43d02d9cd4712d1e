"""A live run: agent -> link emulator -> cloud server, replaying a trace with an outage."""

from __future__ import annotations

import numpy as np
import pytest

from edge.agent import Agent
from edge.config import load_agent_config
from edge.netem.linkemu import LinkEmulator
from edge.netem.traces import from_phases, steady
from tests.edge.conftest import agent_toml
from tests.support import cloud_server

LIN = '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\n'
GOOD_S, OUTAGE_S = 2.0, 12.0  # the replayed trace: good, a tunnel, good again
DEADLINE_MS = 3000
BREAKER_FAILURES = 3  # CircuitBreaker() opens after this many failures in a row


@pytest.fixture(scope="module")
def cloud(edge_repos):
    proc = cloud_server(edge_repos[0], "--node", "far").start()
    yield proc
    proc.terminate()


async def test_outage_moves_work_local_within_a_few_requests_and_back_after(
    tmp_path, edge_repos, cloud
):
    port = int(cloud.http_url.rsplit(":", 1)[1])
    emu = LinkEmulator(
        ("127.0.0.1", 0), ("127.0.0.1", port), steady(100, 60), steady(100, 60), delay_ms=2
    )
    await emu.start()
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=f"http://127.0.0.1:{emu.port}",
        models=LIN,
        policy="explore_after_s = 0.5\n",
        # a fixed emulated device time: every local run takes 500 ms, whatever the host's load
        extra="[emulation]\nlocal_latency_ms = 500\n",
    )
    x = np.ones((1, 4), np.float32)

    async def ask(agent: Agent) -> tuple[float, str, bool, float]:
        at = emu.elapsed_s
        p = (await agent.infer("lin", {"x": x}, deadline_ms=DEADLINE_MS)).parameters
        return at, p["where"], p["fallback"], p["latency_ms"]

    try:
        async with Agent(load_agent_config(cfg)) as agent:
            good = [(await ask(agent))[1] for _ in range(8)]
            assert good[-3:] == ["cloud-http"] * 3, good

            # Replay a trace that drops out and comes back, from its start, in both directions.
            trace = from_phases([(GOOD_S, 100.0), (OUTAGE_S, 0.0), (120.0, 100.0)])
            emu.set_traces(trace, trace)
            outage, after = [], []
            while emu.elapsed_s < GOOD_S + OUTAGE_S:
                at, where, fallback, ms = await ask(agent)
                if at >= GOOD_S + 0.05:  # (the link owes a sender its last 10 ms)
                    outage.append((where, fallback, ms))
            for _ in range(40):  # the link is back: bounded by requests, not by seconds
                after.append((await ask(agent))[1])
                if after[-3:] == ["cloud-http"] * 3:
                    break
    finally:
        await emu.close()

    assert len(outage) >= BREAKER_FAILURES + 2, outage
    assert all(where == "local" for where, _, _ in outage), outage  # every one answered
    assert all(ms < DEADLINE_MS for _, _, ms in outage), outage  # the fallback plan held
    tried = [i for i, (_, fallback, _) in enumerate(outage) if fallback]
    # at most the breaker's threshold of timed-out tries, then straight to local
    assert len(tried) <= BREAKER_FAILURES, outage
    settled = tried[-1] + 1 if tried else 0
    assert all(not fallback for _, fallback, _ in outage[settled:]), outage
    assert after[-3:] == ["cloud-http"] * 3, after
    assert len(after) <= 30, after  # back on the cloud within a bounded number of requests
