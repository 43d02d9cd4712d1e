"""A live run: agent -> link emulator -> cloud server, through an outage and back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge.agent import Agent
from edge.config import load_agent_config
from edge.linkemu import LinkEmulator
from edge.traces import steady
from tests.edge.conftest import agent_toml
from tests.support import cloud_server

LIN = '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\n'


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
        extra="[emulation]\nlocal_latency_ms = 500\n",
    )
    x = np.ones((1, 4), np.float32)
    try:
        async with Agent(load_agent_config(cfg)) as agent:
            good = [
                (await agent.infer("lin", {"x": x}, deadline_ms=3000)).parameters["where"]
                for _ in range(8)
            ]
            assert good[-3:] == ["cloud-http"] * 3, good

            emu.set_traces(steady(0.0, 60), steady(0.0, 60))  # the link drops out
            outage = []
            for _ in range(12):
                p = (await agent.infer("lin", {"x": x}, deadline_ms=3000)).parameters
                outage.append((p["where"], p["fallback"], p["latency_ms"]))
            assert all(where == "local" for where, _, _ in outage)  # every one answered locally
            assert all(ms < 3000 for _, _, ms in outage)  # inside the deadline
            settled = next(i for i, (_, fb, _) in enumerate(outage) if not fb)
            assert settled <= 4, (
                outage
            )  # after a bounded number of timed-out tries, straight to local

            emu.set_traces(steady(100, 60), steady(100, 60))  # the link returns
            back = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                back.append(
                    (await agent.infer("lin", {"x": x}, deadline_ms=3000)).parameters["where"]
                )
                if back[-3:] == ["cloud-http"] * 3:
                    break
                await agent.dataplane.probe()
            assert back[-3:] == ["cloud-http"] * 3, back
    finally:
        await emu.close()
