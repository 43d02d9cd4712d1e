"""The agent end to end: real cloud server process, real local runtime."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as triton

from edge.agent import Agent
from edge.config import load_agent_config
from shared.errors import ConfigError, InvalidInput, ModelNotFound
from tests.edge.conftest import PRICED_ENERGY, agent_toml
from tests.support import (
    cloud_server,
    edge_agent,
    free_port,
    linear_reference,
    write_linear_model,
)

LIN = '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\n'
LIN_CLOUD = LIN.replace('cloud = "lin"', 'cloud = "lin"\nmode = "cloud"')
SOFT = '[models.soft]\nlocal = "soft-local"\ncloud = "soft"\nmode = "cascade"\ncascade_threshold = 0.6\n'


def _lin_cloud(tmp_path, edge_repos, cloud):
    """An agent config that offloads ``lin`` over HTTP to ``cloud`` (its local variant the fallback)."""
    return agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN_CLOUD)


@pytest.fixture(scope="module")
def cloud(edge_repos):
    proc = cloud_server(edge_repos[0], "--node", "cloud-e2e").start()
    yield proc
    proc.terminate()


async def test_local_and_cloud_answers_agree_and_carry_provenance(tmp_path, edge_repos, cloud):
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=cloud.http_url,
        models=LIN.replace('cloud = "lin"', 'cloud = "lin"\nmode = "local"'),
    )
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        local = await agent.infer("lin", {"x": x})
        agent.dataplane.policy = type(agent.dataplane.policy)(
            agent.dataplane.policy.config.__class__(models={}),
            agent.estimators,
            agent.device,
            agent.links,
        )
    w, b = write_linear_model(tmp_path / "ref.onnx", seed=4)
    np.testing.assert_allclose(
        local.outputs[0].data, linear_reference(x, w, b), rtol=1e-5, atol=1e-5
    )
    p = local.parameters
    assert (
        p["where"] == "local" and p["bytes_sent"] == 0 and p["energy_j"] > 0 and p["latency_ms"] > 0
    )

    cfg = _lin_cloud(tmp_path, edge_repos, cloud)
    async with Agent(load_agent_config(cfg)) as agent:
        remote = await agent.infer("lin", {"x": x})
    np.testing.assert_allclose(remote.outputs[0].data, local.outputs[0].data, rtol=1e-5, atol=1e-5)
    p = remote.parameters
    assert p["where"] == "cloud-http" and p["node"] == "cloud-e2e"
    assert p["bytes_sent"] > x.nbytes and p["bytes_received"] > 0
    assert "predicted_latency_ms" in p and p["energy_j"] > 0


async def test_slow_local_device_offloads_and_an_outage_moves_work_back_local(
    tmp_path, edge_repos, cloud
):
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=cloud.http_url,
        models=LIN,
        policy=PRICED_ENERGY,
        extra="[emulation]\nlocal_latency_ms = 500\n",
    )
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        wheres = [(await agent.infer("lin", {"x": x})).parameters["where"] for _ in range(6)]
        assert wheres[-1] == "cloud-http", wheres  # the emulated device is slow, the link is good
        agent.dataplane.breakers["http"].record_failure(time.monotonic())  # not enough to open
        assert agent.dataplane.breakers["http"].state == "closed"
        # Link lost: the transport is closed under the agent's feet.
        await agent.transports["http"].close()
        answers = [await agent.infer("lin", {"x": x}, deadline_ms=5000) for _ in range(4)]
    assert all(a.parameters["where"] == "local" for a in answers)
    assert all(a.outputs[0].data.shape == (1, 3) for a in answers)


async def test_cascade_offloads_exactly_the_low_confidence_requests(tmp_path, edge_repos, cloud):
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=SOFT)
    sure = np.array([[6.0, 0, 0, 0]], np.float32)  # softmax top-1 ~0.99
    unsure = np.array([[0.2, 0.1, 0, 0]], np.float32)  # ~0.28
    async with Agent(load_agent_config(cfg)) as agent:
        seq = [sure, unsure, sure, unsure, unsure, sure]
        got = [await agent.infer("soft", {"x": x}) for x in seq]
    wheres = [g.parameters["where"] for g in got]
    assert wheres == ["local", "cloud-http", "local", "cloud-http", "cloud-http", "local"]
    assert all(g.parameters["confidence"] < 0.6 for g in got if g.parameters["where"] != "local")


async def test_a_cascade_reads_its_confidence_from_the_scores_under_a_classification(
    tmp_path, edge_repos, cloud
):
    # With class_count the local answer is top-k strings: every request was a 400, after
    # its local run ("holds no scores"), though cascade_output named the score output.
    from shared.messages import InferRequest, RequestedOutput
    from shared.tensors import Tensor

    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=SOFT)
    sure = np.array([[6.0, 0, 0, 0]], np.float32)
    unsure = np.array([[0.2, 0.1, 0, 0]], np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        wheres = []
        for x in (sure, unsure):
            request = InferRequest(
                inputs=[Tensor.from_array("x", x)],
                outputs=[RequestedOutput("probs", parameters={"classification": 2})],
            )
            answer = await agent.dataplane.infer("soft", request)
            assert answer.outputs[0].datatype == "BYTES"  # top-k strings, wherever it ran
            wheres.append(answer.parameters["where"])
    assert wheres == ["local", "cloud-http"]


@pytest.mark.parametrize(
    "cloud, models",
    [
        (None, '[models.c]\ncloud = "cloudonly"\nmode = "cloud"\n'),
        # a transport [cloud] does not name, or none: taken, "ready", and 503 every time
        ("http", '[models.c]\ncloud = "cloudonly"\nmode = "cloud"\ntransports = ["mqtt"]\n'),
        ("http", '[models.c]\ncloud = "cloudonly"\ntransports = []\n'),
        # mode "cloud" beside a local variant ran locally, as a fallback, every time
        (
            "http",
            '[models.c]\nlocal = "lin-local"\ncloud = "lin"\nmode = "cloud"\n'
            'transports = ["mqtt"]\n',
        ),
    ],
)
def test_a_model_that_needs_a_transport_without_an_endpoint_is_refused_at_load(
    tmp_path, edge_repos, cloud, models
):
    http = f"http://127.0.0.1:{free_port()}" if cloud else None
    cfg = agent_toml(tmp_path, edge_repos[1], http=http, models=models)
    with pytest.raises(ConfigError, match=r"key 'models.c.transports': .* has no endpoint"):
        load_agent_config(cfg)
    # a model that may do without the cloud (a local variant, mode cost) is taken
    ok = agent_toml(
        tmp_path,
        edge_repos[1],
        http=http,
        models='[models.c]\nlocal = "lin-local"\ncloud = "lin"\ntransports = ["mqtt"]\n',
    )
    load_agent_config(ok)


def test_tritonclient_against_the_local_api(tmp_path, edge_repos, cloud):
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    agent = edge_agent(cfg).start()
    try:
        client = triton.InferenceServerClient(agent.http_url.removeprefix("http://"))
        assert client.is_server_live() and client.is_model_ready("lin")
        meta = client.get_model_metadata("lin")
        assert meta["inputs"][0]["shape"] == [-1, 4]
        x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
        inp = triton.InferInput("x", [3, 4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("lin", [inp], parameters={"deadline_ms": 3000})
        w, b = write_linear_model(tmp_path / "ref.onnx", seed=4)
        np.testing.assert_allclose(
            result.as_numpy("y"), linear_reference(x, w, b), rtol=1e-5, atol=1e-5
        )
        assert result.get_response()["parameters"]["where"] in ("local", "cloud-http")
        with urllib.request.urlopen(agent.http_url + "/v2/agent/status", timeout=5) as r:
            status = json.loads(r.read())
        assert (
            status["local_models"] == ["lin-local", "soft-local"]
            or "lin-local" in status["local_models"]
        )
    finally:
        agent.terminate()


async def test_killed_cloud_every_request_answered_locally_and_breaker_recovers(
    tmp_path, edge_repos
):
    server = cloud_server(edge_repos[0], "--node", "doomed").start()
    port = server.http_url.rsplit(":", 1)[1]
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=server.http_url,
        models=LIN,
        policy=PRICED_ENERGY,
        extra="[emulation]\nlocal_latency_ms = 500\n",
    )
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        for _ in range(5):
            await agent.infer("lin", {"x": x})
        assert (await agent.infer("lin", {"x": x})).parameters["where"] == "cloud-http"
        server.kill()
        answers = []
        for _ in range(8):
            t = time.monotonic()
            a = await agent.infer("lin", {"x": x}, deadline_ms=3000)
            answers.append((a, time.monotonic() - t))
        assert all(a.parameters["where"] == "local" for a, _ in answers)
        assert all(elapsed < 3.0 for _, elapsed in answers)
        # the dead cloud was tried first (a fallback) or beside the local run (hedged:
        # on a link this fast that costs a few ms of a run that can be stopped)
        assert any(a.parameters["fallback"] or a.parameters.get("hedged") for a, _ in answers)
        # known down: a refused connection reads as no link for a while, so most
        # requests do not try it at all (each did until the breaker opened)
        http = agent.transports["http"]
        tried = [a for a, _ in answers if a.parameters["fallback"] or a.parameters.get("hedged")]
        assert len(tried) <= 4
        # Cloud back on the same port: the probe closes the breaker, work returns.
        server2 = cloud_server(edge_repos[0], "--node", "reborn")
        server2.args[server2.args.index("0")] = port
        server2.start()
        try:
            for _ in range(60):
                await agent.dataplane.probe()
                if agent.dataplane.breakers["http"].state == "closed" and http.connected:
                    break
                await asyncio.sleep(0.25)
            assert agent.dataplane.breakers["http"].state == "closed"
            back = [(await agent.infer("lin", {"x": x})).parameters for _ in range(4)]
            assert back[-1]["where"] == "cloud-http" and back[-1]["node"] == "reborn"
        finally:
            server2.terminate()


def test_the_local_api_answers_triton_config_stats_and_index_like_the_cloud(
    tmp_path, edge_repos, cloud
):
    models = LIN + '[models.c]\ncloud = "cloudonly"\nmode = "cloud"\n'
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=models)
    agent = edge_agent(cfg).start()
    try:
        client = triton.InferenceServerClient(agent.http_url.removeprefix("http://"))
        assert client.is_server_ready()
        config = client.get_model_config("lin")
        assert config["name"] == "lin" and config["input"][0]["name"] == "x"
        remote = client.get_model_config("c")  # cloud-only: read from the cloud's own API
        assert remote["name"] == "c" and remote["output"][0]["name"] == "y"
        assert client.get_model_metadata("c")["inputs"][0]["shape"] == [-1, 4]
        inp = triton.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        for _ in range(3):
            client.infer("lin", [inp])
        five = triton.InferInput("x", [5, 4], "FP32")
        five.set_data_from_numpy(np.ones((5, 4), np.float32))
        client.infer("lin", [five])
        stats = client.get_inference_statistics("lin")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 4
        assert sum(stats["where"].values()) == 4
        # batch items, as Triton counts them (it had counted requests), and the version
        assert stats["inference_count"] == 8 and stats["version"] == "1"
        index = {e["name"]: e["state"] for e in client.get_model_repository_index()}
        # (a local variant answers under its own name too: it is listed)
        assert index == {"lin": "READY", "c": "READY", "lin-local": "READY"}
        with pytest.raises(triton.InferenceServerException, match=r"no (loaded )?version 7"):
            client.infer("lin", [inp], model_version="7")
        assert not client.is_model_ready("lin", "7")
    finally:
        agent.terminate()


async def test_a_network_change_swaps_the_link_profile_and_its_energy_model(
    tmp_path, edge_repos, cloud
):
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        assert agent.links["http"].name == "wifi"
        wifi = agent.dataplane.decide("lin", _request(x), 2.0, mode="cloud").choice
        agent.estimators.link("http").observe(60_000, 1_000, 0.05, 0.0, time.monotonic())
        agent.set_link("http", "lte")
        assert agent.links["http"].name == "lte"
        assert agent.estimators.link("http").samples == 0  # a new network: learnt afresh
        assert agent.estimators.link("http").prior_up_bps == agent.links["http"].up_mbps * 1e6
        lte = agent.dataplane.decide("lin", _request(x), 2.0, mode="cloud").choice
        assert lte.energy_j > wifi.energy_j  # LTE's promotion and tail
        with pytest.raises(InvalidInput) as info:
            agent.set_link("http", "smoke-signals")
        # the endpoint takes names only: no advice to give it a file's path
        assert "path" not in info.value.message and "lte" in info.value.message
        with pytest.raises(InvalidInput):
            agent.set_link("carrier", "lte")


def _request(x):
    from shared.messages import InferRequest
    from shared.tensors import Tensor

    return InferRequest(inputs=[Tensor.from_array("x", x)])


async def test_the_daily_data_used_survives_a_restart(tmp_path, edge_repos, cloud):
    cfg = _lin_cloud(tmp_path, edge_repos, cloud)
    x = np.ones((32, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        for _ in range(3):
            await agent.infer("lin", {"x": x})
        used = agent.dataplane.usage.today()
    assert used > 3 * x.nbytes / 1e6
    async with Agent(load_agent_config(cfg)) as again:
        assert again.dataplane.usage.today() == pytest.approx(used)


async def test_a_reply_quicker_than_the_radio_promotion_still_teaches_the_link(
    tmp_path, edge_repos, cloud
):
    cfg = _lin_cloud(tmp_path, edge_repos, cloud)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        assert agent.links["http"].promotion_s > 0.05  # WiFi's: more than a loopback round trip
        reply = await agent.infer("lin", {"x": x})
        assert reply.parameters["latency_ms"] < 50
        link = agent.estimators.link("http")
        assert link.samples == 1  # learnt from, though shorter than the promotion it predicted


async def test_the_link_endpoint_takes_a_signal_reading_and_refuses_a_bad_one(
    tmp_path, edge_repos, cloud
):
    import aiohttp

    from edge.http_front import start_local_api

    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    async with Agent(load_agent_config(cfg)) as agent:
        server = await start_local_api(agent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}/v2/agent/link"
        try:
            async with aiohttp.ClientSession() as s:
                ok = await s.post(
                    url, json={"transport": "http", "link": "lte", "signal_dbm": -115}
                )
                assert ok.status == 200 and (await ok.json())["signal_dbm"] == -115
                weak = agent.estimators.link("http").prior_up_bps
                assert weak == pytest.approx(agent.links["http"].up_mbps * 1e6 / 4)
                for bad in (
                    {"transport": "http", "link": "lte", "signal_dbm": "loud"},
                    {"transport": "http", "link": "lte", "signal_dbm": 12},
                    {"transport": "http", "link": "lte", "signal_dbm": True},
                ):
                    r = await s.post(url, json=bad)
                    assert r.status == 400 and "signal" in (await r.json())["error"]
                # a profile name, never a file a caller points at
                for path in ("../../etc/passwd", "/etc/hostname", "lte.toml"):
                    r = await s.post(url, json={"transport": "http", "link": path})
                    assert r.status == 400 and "profile name" in (await r.json())["error"]
        finally:
            await server.close()


async def test_the_python_api_answers_metadata_config_readiness_and_index_as_the_http_api(
    tmp_path, edge_repos, cloud
):
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    async with Agent(load_agent_config(cfg)) as agent:
        meta = await agent.model_metadata("lin")
        assert meta["name"] == "lin" and meta["inputs"][0]["name"] == "x"
        assert (await agent.model_config("lin"))["name"] == "lin"
        assert await agent.model_ready("lin") and not await agent.model_ready("lin", "99")
        assert [e["name"] for e in agent.repository_index()] == ["lin", "lin-local"]
        with pytest.raises(InvalidInput, match="model 'lin' has no input 'q'"):
            await agent.infer("lin", {"q": np.ones((1, 4), np.float32)}, deadline_ms=2000)
        with pytest.raises(ModelNotFound):
            await agent.model_metadata("lin", "99")


async def test_every_offload_carries_the_request_id_as_idempotency_key(tmp_path, edge_repos, cloud):
    """What the agent sends is what a resend after a crash would send: the same key."""
    cfg = _lin_cloud(tmp_path, edge_repos, cloud)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        transport = agent.transports["http"]
        sent = []
        real_infer = transport.infer

        async def recording(model, request, give_up_at):
            sent.append((request.id, dict(request.parameters)))
            return await real_infer(model, request, give_up_at)

        transport.infer = recording
        for _ in range(2):
            answer = await agent.infer("lin", {"x": x})
            assert answer.parameters["where"] == "cloud-http"
    assert len(sent) == 2 and sent[0][0] != sent[1][0]
    for request_id, parameters in sent:
        assert parameters["idempotency_key"] == request_id


@pytest.mark.parametrize("runs", [1, 5])
async def test_the_warm_up_seeds_the_local_estimate_with_the_configured_runs(
    tmp_path, edge_repos, runs
):
    # One run pays first-call costs; the next ``warm_up_runs`` are timed and learnt, so
    # a race may stop its local run from the first request (LOCAL_RUNS_TO_CANCEL).
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http="http://127.0.0.1:9",  # a cloud to weigh the local run against (never reached)
        models=LIN.replace('cloud = "lin"', 'cloud = "lin"\nmode = "local"'),
        policy=f"warm_up_runs = {runs}",
    )
    async with Agent(load_agent_config(cfg)) as agent:
        assert agent.config.policy.warm_up_runs == runs
        assert agent.estimators.local_known("lin-local", 1).count == runs


async def test_an_agent_without_a_cloud_only_pays_the_first_call_before_it_is_ready(
    tmp_path, edge_repos
):
    # Nothing is ever weighed against a local run: timing more of them would only
    # delay the first answer.  The first real run teaches the estimate all the same.
    cfg = agent_toml(tmp_path, edge_repos[1], models=LIN, policy="warm_up_runs = 5")
    async with Agent(load_agent_config(cfg)) as agent:
        assert not agent.transports
        assert agent.estimators.local_known("lin-local", 1) is None
        x = np.zeros((1, 4), np.float32)
        answer = await agent.infer("lin", {"x": x})
        assert answer.parameters["where"] == "local"
        assert agent.estimators.local_known("lin-local", 1).count == 1


async def test_a_first_request_reads_its_rate_from_the_wait_since_the_agent_started(
    tmp_path, edge_repos
):
    # One request in the time since the agent began serving: the only measure of the
    # rate until a second one comes (EdgeCore.serving at start).
    cfg = agent_toml(tmp_path, edge_repos[1], models=LIN)
    async with Agent(load_agent_config(cfg)) as agent:
        core = agent.dataplane.core
        assert core.rate_per_s("lin") is None
        await asyncio.sleep(0.2)
        await agent.infer("lin", {"x": np.zeros((1, 4), np.float32)})
        waited = time.monotonic() - agent.started_at
        assert 1.0 / waited <= core.rate_per_s("lin") <= 1.0 / 0.2


def test_a_state_dir_that_cannot_be_a_folder_is_a_config_error_naming_the_key(
    tmp_path, example_repository
) -> None:
    from shared.errors import ConfigError

    cfg = agent_toml(tmp_path, example_repository)
    (tmp_path / "state").write_text("a file where the folder should be")
    with pytest.raises(ConfigError, match="key 'state_dir'"):
        Agent(load_agent_config(cfg))


def test_a_repository_that_is_not_a_folder_is_a_config_error_naming_the_key(
    tmp_path, example_repository
) -> None:
    from shared.errors import ConfigError

    cfg = agent_toml(tmp_path, tmp_path / "nope")
    with pytest.raises(ConfigError, match="key 'repository'"):
        Agent(load_agent_config(cfg))


async def test_stop_lets_the_offloads_in_flight_finish_and_refuses_new_ones(
    tmp_path, edge_repos, cloud
):
    from shared.errors import ShuttingDown

    cfg = _lin_cloud(tmp_path, edge_repos, cloud)
    x = np.ones((1, 4), np.float32)
    agent = Agent(load_agent_config(cfg))
    await agent.start()
    calls = [asyncio.create_task(agent.infer("lin", {"x": x})) for _ in range(60)]
    await asyncio.sleep(0)  # taken: each is on its way to the cloud
    started = time.monotonic()
    # the transport closes only once they are answered; a second stop waits for the first
    await asyncio.gather(agent.stop(), agent.stop())
    assert time.monotonic() - started < 9  # neither waited out the 10 s drain limit
    answers = await asyncio.gather(*calls, return_exceptions=True)
    assert [a for a in answers if isinstance(a, Exception)] == []
    assert all(a.parameters["where"] == "cloud-http" for a in answers)
    with pytest.raises(ShuttingDown):
        await agent.infer("lin", {"x": x})


async def test_a_nan_deadline_is_refused_like_a_negative_one(tmp_path, edge_repos, cloud):
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    async with Agent(load_agent_config(cfg)) as agent:
        for bad in (float("nan"), float("inf"), -5.0, 0.0):
            with pytest.raises(InvalidInput, match="deadline_ms"):
                await agent.infer("lin", {"x": np.ones((1, 4), np.float32)}, deadline_ms=bad)


async def test_a_version_the_cloud_serves_is_routed_there_through_the_local_api(tmp_path):
    # A version in the URL was checked against the local variant only: a cloud-only
    # model's advertised versions were all a 404, and other versions of a mapped one too.
    import aiohttp

    from edge.http_front import start_local_api

    cloud_repo, local_repo = tmp_path / "cloud", tmp_path / "local"
    weights = {
        seed: write_linear_model(cloud_repo / "two" / str(version) / "model.onnx", seed=seed)
        for version, seed in ((1, 4), (2, 9))
    }
    (cloud_repo / "two" / "config.toml").write_text("[version_policy]\nall = true\n")
    write_linear_model(local_repo / "two-local" / "1" / "model.onnx", seed=4)
    models = (
        '[models.only]\ncloud = "two"\nmode = "cloud"\n'
        '[models.mixed]\nlocal = "two-local"\ncloud = "two"\n'
    )
    node = cloud_server(cloud_repo).start()
    try:
        cfg = agent_toml(tmp_path, local_repo, http=node.http_url, models=models)
        async with Agent(load_agent_config(cfg)) as agent:
            server = await start_local_api(agent, "127.0.0.1", 0)
            x = np.ones((1, 4), np.float32)
            body = {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x.ravel().tolist()}
                ]
            }
            try:
                async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as s:
                    for model, version, seed in (("only", 1, 4), ("only", 2, 9), ("mixed", 2, 9)):
                        at = f"/v2/models/{model}/versions/{version}"
                        assert (await s.get(f"{at}/ready")).status == 200
                        meta = await (await s.get(at)).json()
                        assert meta["name"] == model and meta["inputs"][0]["name"] == "x"
                        r = await s.post(f"{at}/infer", json=body)
                        doc = await r.json()
                        assert r.status == 200, doc
                        assert doc["model_version"] == str(version)
                        assert doc["parameters"]["where"].startswith("cloud")
                        got = np.array(doc["outputs"][0]["data"], np.float32)
                        want = linear_reference(x, *weights[seed]).ravel()
                        np.testing.assert_allclose(got, want, rtol=1e-5)
                    # the local variant's own version may run anywhere; one nobody has is not ready
                    assert (
                        await s.post("/v2/models/mixed/versions/1/infer", json=body)
                    ).status == 200
                    assert (await s.get("/v2/models/only/versions/7/ready")).status == 503
                    r = await s.post("/v2/models/only/versions/7/infer", json=body)
                    assert r.status == 404, await r.text()
                    # ... and says nothing of the model: two such 404s had made the agent
                    # skip the cloud for every app's requests for 30 s ("no link")
                    r = await s.post("/v2/models/only/versions/8/infer", json=body)
                    assert r.status == 404, await r.text()
                    r = await s.post("/v2/models/only/infer", json=body)
                    assert r.status == 200, await r.text()
            finally:
                await server.close()
    finally:
        node.terminate()


def test_sighup_rereads_the_config_and_the_agent_and_the_cloud_stay_up(tmp_path, edge_repos):
    # SIGHUP's default killed either process at once, requests in flight and all.
    import signal

    node = cloud_server(edge_repos[0]).start()
    try:
        cfg = agent_toml(tmp_path, edge_repos[1], http=node.http_url, models=LIN)
        agent = edge_agent(cfg).start()
        try:
            cfg.write_text(cfg.read_text().replace("deadline_ms = 2000", "deadline_ms = 750"))
            for proc in (agent, node):
                proc.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "agent config reloaded" not in agent.output() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "SIGHUP: re-reading" in agent.output()
            assert "agent config reloaded" in agent.output()
            for proc in (agent, node):
                assert proc.proc.poll() is None
                with urllib.request.urlopen(f"{proc.http_url}/v2/health/live", timeout=5) as r:
                    assert r.status == 200
            deadline = time.monotonic() + 10
            while "rescanned the repository" not in node.output():
                assert time.monotonic() < deadline, node.output()
                time.sleep(0.05)
            assert "rescanned the repository: nothing changed" in node.output()
        finally:
            agent.terminate()
    finally:
        node.terminate()


async def test_numpy_scalars_and_ints_are_taken_where_the_python_api_takes_numbers(
    tmp_path, edge_repos, cloud
):
    """The compiled core checks its argument types: a numpy deadline, an int flag or a
    numpy signal reading raised TypeError there (and left the link unchanged)."""
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        for deadline in (np.float32(3000), np.int64(3000), 3000):
            reply = await agent.infer("lin", {"x": x}, deadline_ms=deadline, deferrable=1)
            assert reply.outputs
        agent.set_link("http", "lte", np.float32(-90))
        assert agent.links["http"].name == "lte"
        agent.set_link("http", "wifi", np.int64(-60))
        assert agent.links["http"].name == "wifi"


async def test_a_cloud_model_is_ready_only_while_a_transport_it_may_take_is_up(
    tmp_path, edge_repos, cloud
):
    # readiness asked every transport: a model allowed MQTT only read ready through HTTP,
    # and each of its requests got 503
    models = (
        '[models.viamqtt]\ncloud = "lin"\nmode = "cloud"\ntransports = ["mqtt"]\n'
        '[models.viahttp]\ncloud = "lin"\nmode = "cloud"\ntransports = ["http"]\n'
    )
    broker = f"mqtt://127.0.0.1:{free_port()}"  # no broker there
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, mqtt=broker, models=models)
    async with Agent(load_agent_config(cfg)) as agent:
        deadline = time.monotonic() + 10
        while not await agent.model_ready("viahttp") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await agent.model_ready("viahttp")
        assert not await agent.model_ready("viamqtt")


async def test_a_request_past_its_deadline_is_refused_wherever_it_would_run(
    tmp_path, edge_repos, cloud
):
    # Run locally it was a 504; offloaded (no option meets the deadline: the fastest) the
    # same request went out anyway and came back a late 200
    from shared.errors import DeadlineExceeded

    models = LIN.replace("[models.lin]", '[models.lin]\nmode = "local"') + (
        '[models.c]\ncloud = "lin"\nmode = "cloud"\n'
    )
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=models)
    x = {"x": np.ones((1, 4), np.float32)}
    async with Agent(load_agent_config(cfg)) as agent:
        for model in ("lin", "c"):
            with pytest.raises(DeadlineExceeded):
                await agent.infer(model, x, deadline_ms=1e-6)
        answered = await agent.infer("c", x, deadline_ms=5000)  # the cloud is there
        assert answered.parameters["where"] == "cloud-http"


async def test_a_key_reused_with_other_inputs_is_a_409_and_a_retry_one_answer_where_it_runs(
    tmp_path, edge_repos
):
    # A local run took no notice of the key: the same key with other inputs was answered
    # (200) where an offload got the cloud's 409, and a retry ran the model again
    from shared.errors import IdempotencyConflict

    models = LIN.replace("[models.lin]", '[models.lin]\nmode = "local"')
    cfg = agent_toml(tmp_path, edge_repos[1], models=models)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        first = await agent.infer("lin", {"x": x}, idempotency_key="k")
        assert first.parameters["where"] == "local" and "duplicate" not in first.parameters
        with pytest.raises(IdempotencyConflict):
            await agent.infer("lin", {"x": x + 1}, idempotency_key="k")
        again = await agent.infer("lin", {"x": x}, idempotency_key="k")
        assert again.parameters["duplicate"] is True
        np.testing.assert_array_equal(again.outputs[0].data, first.outputs[0].data)


async def test_a_keyed_retry_joining_a_run_keeps_its_own_deadline(tmp_path, edge_repos):
    # A retry with a short deadline that joined a longer-lived run got a late 200; one
    # with a long deadline that joined a run about to miss its own short one got 504.
    from shared.errors import DeadlineExceeded

    models = LIN.replace("[models.lin]", '[models.lin]\nmode = "local"')
    extra = "[emulation]\nlocal_latency_ms = 300\n"
    cfg = agent_toml(tmp_path, edge_repos[1], models=models, extra=extra)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        first = asyncio.ensure_future(
            agent.infer("lin", {"x": x}, deadline_ms=5000, idempotency_key="k1")
        )
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):  # (its own deadline: not the run's 300 ms)
            await agent.infer("lin", {"x": x}, deadline_ms=60, idempotency_key="k1")
        assert time.monotonic() - started < 0.2
        assert (await first).parameters["where"] == "local"
        # a busy device: the keyed request's own short deadline passes in the queue; the
        # retry beside it, with time to spare, is answered (afresh)
        busy = [asyncio.ensure_future(agent.infer("lin", {"x": x + i})) for i in range(2)]
        await asyncio.sleep(0.05)
        short = asyncio.ensure_future(
            agent.infer("lin", {"x": x}, deadline_ms=100, idempotency_key="k2")
        )
        await asyncio.sleep(0.01)
        retry = await agent.infer("lin", {"x": x}, deadline_ms=5000, idempotency_key="k2")
        assert retry.outputs[0].data.shape == (1, 3)
        with pytest.raises(DeadlineExceeded):
            await short
        await asyncio.gather(*busy)


async def test_a_local_model_missing_from_the_repository_names_the_file_and_key(
    tmp_path, edge_repos
):
    cfg = agent_toml(tmp_path, edge_repos[1], models='[models.m]\nlocal = "nosuch"\n')
    with pytest.raises(ConfigError, match=r"agent.toml: key 'models.m.local': .*'nosuch'"):
        async with Agent(load_agent_config(cfg)):
            pass


def test_an_unreadable_tokens_file_names_the_key(tmp_path, edge_repos):
    import subprocess
    import sys

    from tests.support import ROOT

    cfg = agent_toml(
        tmp_path, edge_repos[1], models=LIN, extra=f'[api]\ntokens_file = "{tmp_path / "no"}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "edge.cli", "run", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "agent.toml: key 'api.tokens_file':" in done.stderr and "cannot read" in done.stderr


def test_the_agents_api_follows_its_tokens_file_without_a_restart(tmp_path, edge_repos):
    # The agent read [api] tokens_file once: a revoked app token kept working and a new
    # one was refused until a restart, and nothing said so.
    import time
    import urllib.error
    import urllib.request

    from tests.support import ServerProcess

    tokens = tmp_path / "api-tokens.txt"
    tokens.write_text("apptok-1 infer\n")
    tokens.chmod(0o600)
    cfg = agent_toml(
        tmp_path, edge_repos[1], models=LIN, extra=f'[api]\ntokens_file = "{tokens}"\n'
    )
    agent = ServerProcess(
        ["-m", "edge.cli", "run", "--config", str(cfg), "--api-port", "0"], "ferry-edge ready"
    ).start()

    def status(token: str) -> int:
        req = urllib.request.Request(
            agent.http_url + "/v2/models/lin", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        assert status("apptok-1") == 200 and status("apptok-2") == 401
        aside = tmp_path / "api-tokens.new"
        aside.write_text("apptok-2 infer\n")
        aside.chmod(0o600)
        aside.replace(tokens)
        end = time.monotonic() + 15
        while status("apptok-1") != 401 and time.monotonic() < end:
            time.sleep(0.1)
        assert status("apptok-1") == 401 and status("apptok-2") == 200
        assert "tokens file changed" in agent.output()
    finally:
        agent.terminate()


async def test_a_cloud_refusing_the_agents_token_shows_in_status_and_the_log(
    tmp_path, edge_repos, caplog
):
    # A rotated cloud token left the agent's HTTP transport "connected, breaker closed"
    # in status while every offload failed with 401, logged only at INFO.
    from tests.support import cloud_server

    tokens = tmp_path / "cloud-tokens.txt"
    tokens.write_text("the-new-one infer\n")
    tokens.chmod(0o600)
    node = cloud_server(edge_repos[0], "--models", "lin", "--tokens-file", str(tokens)).start()
    stale = tmp_path / "token.txt"
    stale.write_text("the-old-one\n")
    stale.chmod(0o600)
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=node.http_url,
        models=LIN.replace('cloud = "lin"', 'cloud = "lin"\nmode = "cloud"'),
    )
    cfg.write_text(cfg.read_text().replace("[cloud]\n", f'[cloud]\ntoken_file = "{stale}"\n'))
    try:
        async with Agent(load_agent_config(cfg)) as agent:
            for _ in range(2):  # (answered locally: the fallback)
                answer = await agent.infer("lin", {"x": np.ones((1, 4), np.float32)})
                assert answer.parameters["where"] == "local" and answer.parameters["fallback"]
            http = (await agent.status())["transports"]["http"]
            assert "refused this agent's token (HTTP 401)" in http["error"]
            assert caplog.text.count("refused this agent's token") == 1  # once, a warning
    finally:
        node.terminate()


async def test_drain_waits_for_a_keyed_run_its_caller_left(tmp_path, edge_repos, monkeypatch):
    # The keyed run goes on for the app's retry when its caller leaves; drain counted
    # only callers and reported nothing in flight while the model still ran
    models = LIN.replace("[models.lin]", '[models.lin]\nmode = "local"')
    cfg = agent_toml(tmp_path, edge_repos[1], models=models)
    async with Agent(load_agent_config(cfg)) as agent:
        dataplane, ran = agent.dataplane, []
        real = dataplane._local

        async def slow(*args, **kwargs):
            await asyncio.sleep(0.5)
            ran.append(1)
            return await real(*args, **kwargs)

        monkeypatch.setattr(dataplane, "_local", slow)
        x = {"x": np.ones((1, 4), np.float32)}
        caller = asyncio.create_task(agent.infer("lin", x, idempotency_key="k"))
        await asyncio.sleep(0.1)
        caller.cancel()
        assert not await dataplane.drain(0.05)  # the run is still going
        assert await dataplane.drain(5.0)
        assert ran == [1]


async def test_a_second_start_is_a_no_op_and_a_stopped_agent_answers_with_typed_errors(
    tmp_path, edge_repos
):
    # A second start had doubled the background loops, which then outlived stop (still
    # probing, saving, reloading); after stop the store's calls raised raw RuntimeErrors.
    from shared.errors import ShuttingDown

    cfg = agent_toml(tmp_path, edge_repos[1], models=LIN)
    agent = Agent(load_agent_config(cfg))
    await agent.start()
    loops = list(agent._tasks)
    await agent.start()
    assert agent._tasks == loops
    await agent.stop()
    assert all(t.done() for t in loops)
    with pytest.raises(ShuttingDown):
        await agent.deferred_result("nope")
    with pytest.raises(ShuttingDown):
        await agent.start()


def test_sigterm_lets_a_request_in_flight_finish_and_answers_it(tmp_path, edge_repos):
    # The CLI drained its HTTP front for 5 s and then cut every connection still running
    # a request: no answer at all, though the agent drains for 10 s.
    import signal
    import threading

    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        models='[models.lin]\nlocal = "lin-local"\nmode = "local"\n',
        extra="[emulation]\nlocal_latency_ms = 6500\n",
        policy="warm_up_runs = 1",
    )
    agent = edge_agent(cfg).start()
    body = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "parameters": {"deadline_ms": 20000},
        }
    ).encode()
    got: list = []

    def ask() -> None:
        request = urllib.request.Request(
            f"{agent.http_url}/v2/models/lin/infer", data=body, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                got.append(r.status)
        except Exception as exc:  # (what came back is what is asserted)
            got.append(exc)

    try:
        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        agent.proc.send_signal(signal.SIGTERM)
        asker.join(30)
        assert got == [200], got
        assert agent.proc.wait(30) == 0
    finally:
        agent.terminate()


LIN_LOCAL = LIN.replace('cloud = "lin"', 'cloud = "lin"\nmode = "local"')


async def test_misuse_of_the_python_api_is_a_typed_error_not_a_python_one(
    tmp_path, edge_repos, cloud
):
    """Each of these had raised a bare TypeError or AttributeError (no code), and a bad
    priority was refused offloaded but taken when run locally."""
    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN_LOCAL)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        for call in (
            lambda: agent.infer("lin", {"x": x}, deadline_ms="100"),
            lambda: agent.infer("lin", {"x": x}, priority="hi"),
            lambda: agent.infer("lin", {"x": x}, priority=-5),
            lambda: agent.infer("lin", {"x": x}, deferrable="no"),
            lambda: agent.infer("lin", None),
            lambda: agent.infer("lin", (x,)),
            lambda: agent.infer("lin", [x]),
            lambda: agent.infer("lin", {"x": None}),
            lambda: agent.infer("lin", {"x": x}, outputs=[3]),
        ):
            with pytest.raises(InvalidInput):
                await call()
        with pytest.raises(InvalidInput):
            agent.set_link("http", "lte", "-80")
        name = (await agent.model_metadata("lin"))["outputs"][0]["name"]
        reply = await agent.infer("lin", {"x": x}, outputs=name)  # one name, not its letters
        assert [o.name for o in reply.outputs] == [name]
        status = await agent.status()  # nothing left counted as under way
        assert status["inflight"] == 0 and set(status["local_backlog"].values()) == {0}


async def test_an_agent_used_from_another_loop_says_so(tmp_path, edge_repos, cloud):
    """A local run failed with "attached to a different loop" (no code) while offloads
    quietly shared the transport across loops."""
    import threading

    cfg = agent_toml(tmp_path, edge_repos[1], http=cloud.http_url, models=LIN_LOCAL)
    x = np.ones((1, 4), np.float32)
    async with Agent(load_agent_config(cfg)) as agent:
        seen: list[BaseException] = []

        def other_loop() -> None:
            try:
                asyncio.run(agent.infer("lin", {"x": x}))
            except BaseException as exc:
                seen.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert len(seen) == 1 and isinstance(seen[0], InvalidInput), seen
        assert "run_coroutine_threadsafe" in str(seen[0])
        assert (await agent.infer("lin", {"x": x})).outputs  # its own loop still works


async def test_one_state_folder_holds_one_agent_at_a_time(tmp_path, edge_repos):
    """Two agents on one state folder shared the deferred store and overwrote each
    other's estimates, silently."""
    cfg = agent_toml(tmp_path, edge_repos[1], models=LIN_LOCAL.replace('cloud = "lin"\n', ""))
    first = Agent(load_agent_config(cfg))
    await first.start()
    try:
        with pytest.raises(ConfigError, match="in use by another agent"):
            Agent(load_agent_config(cfg))
    finally:
        await first.stop()
    second = Agent(load_agent_config(cfg))  # free again once the first stopped
    await second.start()
    await second.stop()
    # an agent whose construction failed after the lock lets the folder go too
    (tmp_path / "bad.pem").write_text("not a certificate")
    broken = cfg.read_text() + '[cloud]\nmqtt = "mqtts://127.0.0.1:8883"\nca_file = "bad.pem"\n'
    (tmp_path / "broken.toml").write_text(broken)
    with pytest.raises(ConfigError):
        Agent(load_agent_config(tmp_path / "broken.toml"))
    third = Agent(load_agent_config(cfg))
    await third.start()
    await third.stop()
