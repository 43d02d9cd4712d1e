"""A request's deadline bounds its answer: 504 then, the work under way finishing in the
background (stats, drain, keyed retries and cascades as before)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import numpy as np
import pytest

from edge.agent import Agent
from edge.config import load_agent_config
from shared.errors import DeadlineExceeded, InternalError
from tests.edge.conftest import agent_toml
from tests.edge.test_agent_failures import BlackHole

X = np.ones((1, 4), np.float32)
SLOW = "[emulation]\nlocal_latency_ms = 400\n"
LOCAL = '[models.l]\nlocal = "lin-local"\nmode = "local"\n'


def _count_local(agent):
    dp = agent.dataplane
    calls = []
    orig = dp._local

    async def counted(flow, request):
        calls.append(time.monotonic())
        return await orig(flow, request)

    dp._local = counted
    return calls


async def test_a_keyed_retry_after_its_504_joins_the_run_still_going(tmp_path, edge_repos):
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        calls = _count_local(agent)
        with pytest.raises(DeadlineExceeded):
            await agent.infer("l", {"x": X}, deadline_ms=100, idempotency_key="k1")
        # the app retries at once with the same key and a longer deadline
        again = await agent.infer("l", {"x": X}, deadline_ms=5000, idempotency_key="k1")
        assert again.parameters["where"] == "local"
        assert len(calls) == 1, f"{len(calls)} local runs for one keyed request"


async def test_a_504_at_the_deadline_is_counted_once_and_its_background_run_drains(
    tmp_path, edge_repos
):
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        with pytest.raises(DeadlineExceeded):
            await agent.infer("l", {"x": X}, deadline_ms=100)
        await asyncio.sleep(0.8)
        s = agent.dataplane.stats._get("l")
        assert (s.success, s.fail) == (0, 1)
        assert agent.dataplane.inflight == 0


async def test_a_caller_that_goes_away_stops_its_work(tmp_path, edge_repos):
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        t = asyncio.ensure_future(agent.infer("l", {"x": X}, deadline_ms=5000))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.6)
        assert agent.dataplane.inflight == 0


async def test_a_stop_with_work_in_the_background_logs_no_error(tmp_path, edge_repos, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    agent = Agent(load_agent_config(cfg))
    await agent.__aenter__()
    with pytest.raises(DeadlineExceeded):
        await agent.infer("l", {"x": X}, deadline_ms=100)
    await agent.__aexit__(None, None, None)
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad


SOFT = '[models.soft]\nlocal = "soft-local"\ncloud = "soft"\nmode = "cascade"\ncascade_threshold = 0.6\n'
UNSURE = np.array([[0.2, 0.1, 0, 0]], np.float32)


async def test_an_unsure_cascade_whose_cloud_hangs_still_answers_locally_by_its_deadline(
    tmp_path, edge_repos
):
    hole = BlackHole()
    try:
        cfg = agent_toml(tmp_path, edge_repos[1], http=f"http://127.0.0.1:{hole.port}", models=SOFT)
        async with Agent(load_agent_config(cfg)) as agent:
            results = []
            for _ in range(5):
                t = time.monotonic()
                try:
                    r = await agent.infer("soft", {"x": UNSURE}, deadline_ms=800)
                    results.append(
                        (
                            r.parameters["where"],
                            r.parameters.get("cascade"),
                            round(time.monotonic() - t, 3),
                        )
                    )
                except Exception as exc:
                    results.append(
                        (type(exc).__name__, str(exc)[:120], round(time.monotonic() - t, 3))
                    )
            assert all(r[0] == "local" for r in results), results
    finally:
        hole.close()


def _failing_local(agent, after_s=0.3):
    dp = agent.dataplane
    calls = []

    async def failing(flow, request, cancel=None):
        calls.append(time.monotonic())
        await asyncio.sleep(after_s)
        raise InternalError("boom after the caller's deadline")

    dp._local = failing
    return calls


def _errors(caplog):
    gc.collect()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_cancelled_keyed_duplicate_leaves_no_task_unretrieved(tmp_path, edge_repos, caplog):
    """A duplicate keyed caller that goes away: its keyed wrapper goes on waiting until its
    deadline and then fails with nobody to retrieve it."""
    caplog.set_level(logging.DEBUG)
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        first = asyncio.ensure_future(
            agent.infer("l", {"x": X}, deadline_ms=5000, idempotency_key="k")
        )
        await asyncio.sleep(0.02)
        dup = asyncio.ensure_future(
            agent.infer("l", {"x": X}, deadline_ms=100, idempotency_key="k")
        )
        await asyncio.sleep(0.03)
        dup.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dup
        await first
        await asyncio.sleep(0.3)
        bad = _errors(caplog)
        assert not bad


async def test_a_cancelled_first_keyed_caller_whose_run_fails_leaves_no_error(
    tmp_path, edge_repos, caplog
):
    caplog.set_level(logging.DEBUG)
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        _failing_local(agent)
        t = asyncio.ensure_future(
            agent.infer("l", {"x": X}, deadline_ms=5000, idempotency_key="k2")
        )
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.5)
        bad = _errors(caplog)
        assert agent.dataplane.inflight == 0
        assert not bad


async def test_a_keyed_run_that_fails_after_its_504_is_dropped_and_a_retry_runs_afresh(
    tmp_path, edge_repos, caplog
):
    caplog.set_level(logging.DEBUG)
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        calls = _failing_local(agent)
        with pytest.raises(DeadlineExceeded):
            await agent.infer("l", {"x": X}, deadline_ms=100, idempotency_key="k3")
        await asyncio.sleep(0.5)
        assert len(agent.dataplane._answers) == 0
        with pytest.raises(InternalError):
            await agent.infer("l", {"x": X}, deadline_ms=5000, idempotency_key="k3")
        assert len(calls) == 2
        assert agent.dataplane.inflight == 0
        assert not _errors(caplog)


async def test_a_caller_cancelled_about_its_deadline_leaves_no_work_uncounted(
    tmp_path, edge_repos, caplog
):
    """Unkeyed: the caller goes away just after its deadline (a grace wait had sat in the
    timeout's handler, where a cancel skipped the work's own cancel)."""
    caplog.set_level(logging.DEBUG)
    cfg = agent_toml(tmp_path, edge_repos[1], models=LOCAL, extra=SLOW)
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        calls = _failing_local(agent, 0.3)
        t = asyncio.ensure_future(agent.infer("l", {"x": X}, deadline_ms=100))
        await asyncio.sleep(0.110)  # (just after the deadline)
        t.cancel()
        with pytest.raises((asyncio.CancelledError, DeadlineExceeded)):
            await t
        await asyncio.sleep(0.4)
        assert len(calls) == 1 and agent.dataplane.inflight == 0
        assert not _errors(caplog)


async def test_a_run_that_ends_just_after_its_deadline_is_a_504_at_the_deadline(
    tmp_path, edge_repos
):
    # A 20 ms grace after every deadline had turned runs ending within it into late 200s.
    cfg = agent_toml(
        tmp_path, edge_repos[1], models=LOCAL, extra="[emulation]\nlocal_latency_ms = 300\n"
    )
    async with Agent(load_agent_config(cfg)) as agent:
        await agent.infer("l", {"x": X}, deadline_ms=5000)  # warm
        for deadline_ms in (285, 295):
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await agent.infer("l", {"x": X}, deadline_ms=deadline_ms)
            assert time.monotonic() - started < 0.3  # at its deadline, not the run's end
            await asyncio.sleep(0.35)  # (the run ends in the background)


async def test_an_offload_the_agent_gives_up_on_is_not_run_by_the_cloud_after(tmp_path):
    # The cloud had no word of the agent's deadline over HTTP: a request queued behind
    # a slow run was run in full after the agent's 504.
    import json
    import urllib.request

    from edge.transports.http import HttpTransport
    from shared.messages import InferRequest
    from shared.tensors import Tensor
    from tests.support import cloud_server, write_slow_model

    repo = tmp_path / "cloud"
    write_slow_model(repo / "slow" / "1" / "model.onnx", layers=60)
    (repo / "slow" / "config.toml").write_text("max_batch_size = 0\n[instance_group]\ncount = 1\n")
    server = cloud_server(repo, "--node", "deadlines").start()
    transport = HttpTransport(server.http_url)
    try:
        await transport.start()

        def request() -> InferRequest:
            return InferRequest(inputs=[Tensor.from_array("x", np.ones((1, 4), np.float32))])

        await transport.infer("slow", request(), time.monotonic() + 30)  # (warm)
        started = time.monotonic()
        await transport.infer("slow", request(), time.monotonic() + 30)
        run_s = time.monotonic() - started
        first = asyncio.ensure_future(transport.infer("slow", request(), time.monotonic() + 30))
        await asyncio.sleep(run_s * 0.2)  # the first is running: the next one queues
        with pytest.raises(DeadlineExceeded):
            await transport.infer("slow", request(), time.monotonic() + run_s * 0.3)
        await first
        await asyncio.sleep(run_s * 1.5)  # (time enough to run it, had the cloud)

        def stats() -> dict:
            with urllib.request.urlopen(f"{server.http_url}/v2/models/slow/stats") as r:
                return json.load(r)["model_stats"][0]

        doc = await asyncio.to_thread(stats)
        assert doc["execution_count"] == 3, doc  # the one given up on never ran
    finally:
        await transport.close()
        server.terminate()
