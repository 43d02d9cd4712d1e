"""Deferrable requests survive kill -9 of the agent and are delivered once."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np

from shared import envelope, v2
from shared.messages import InferRequest
from shared.tensors import Tensor
from tests.edge.conftest import agent_toml
from tests.support import cloud_server, edge_agent, free_port

#: the model these tests defer: cloud-only, so no link means no answer now
CLOUD_ONLY = '[models.c]\ncloud = "cloudonly"\nmode = "cloud"\n'


def cloud_only_agent(folder, repo, http: str):
    """An agent.toml whose model ``c`` runs on the cloud at ``http`` only."""
    return agent_toml(folder, repo, http=http, models=CLOUD_ONLY)


async def _flushed(agent, request_id: str) -> dict:
    """The stored request's state once a flush delivered it (or five seconds on)."""
    for _ in range(50):
        await agent.flush_deferred()
        found = await agent.deferred_result(request_id)
        if found["status"] == "delivered":
            break
        await asyncio.sleep(0.1)
    return found


def _post(url: str, body: bytes, headers: dict) -> dict:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=20) as r:
        raw = r.read()
        hl = r.headers.get(v2.HEADER_LENGTH)
    return {"response": v2.decode_response(raw, int(hl) if hl else None)}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_deferred_requests_survive_kill_9_and_are_delivered_once(tmp_path, edge_repos):
    cloud_port = free_port()
    cloud_url = f"http://127.0.0.1:{cloud_port}"
    cfg = cloud_only_agent(tmp_path, edge_repos[1], cloud_url)
    agent = edge_agent(cfg).start()
    ids = []
    try:
        for i in range(5):
            req = InferRequest(
                inputs=[Tensor.from_array("x", np.full((1, 4), i, np.float32))],
                parameters={"deferrable": True},
            )
            chunks, hl = v2.encode_request(req)
            got = _post(
                agent.http_url + "/v2/models/c/infer", v2.join(chunks), {v2.HEADER_LENGTH: str(hl)}
            )
            params = got["response"].parameters
            assert params["where"] == "deferred" and params["deferred"] is True
            ids.append(params["request_id"])
        assert all(_get(f"{agent.http_url}/v2/deferred/{i}")["status"] == "pending" for i in ids)
    finally:
        agent.kill()  # SIGKILL: no chance to flush anything
    server = cloud_server(edge_repos[0], "--node", "late")
    server.args[server.args.index("0")] = str(cloud_port)
    server.start()
    agent2 = edge_agent(cfg).start()
    try:
        import time

        deadline = time.monotonic() + 30
        statuses = {}
        while time.monotonic() < deadline:
            statuses = {i: _get(f"{agent2.http_url}/v2/deferred/{i}") for i in ids}
            if all(s["status"] == "delivered" for s in statuses.values()):
                break
            time.sleep(0.3)
        assert all(s["status"] == "delivered" for s in statuses.values()), statuses
        for s in statuses.values():
            assert s["response"]["outputs"][0]["shape"] == [1, 3]
        stats = _get(server.http_url + "/v2/models/cloudonly/stats")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 5  # delivered once each
    finally:
        agent2.terminate()
        server.terminate()


def _write_expand_model(path):
    """y = ones(shape): a huge requested shape fails the cloud's allocator (a 500)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Expand", ["one", "shape"], ["y"])],
        "expand",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(np.array([1.0], np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


async def test_a_request_the_cloud_always_fails_does_not_block_the_ones_behind_it(tmp_path):
    import asyncio

    from edge.agent import Agent
    from edge.config import load_agent_config

    cloud_repo = tmp_path / "cloud"
    _write_expand_model(cloud_repo / "expand" / "1" / "model.onnx")
    (tmp_path / "local").mkdir()
    port = free_port()
    cfg = agent_toml(
        tmp_path,
        tmp_path / "local",
        http=f"http://127.0.0.1:{port}",
        models='[models.g]\ncloud = "expand"\nmode = "cloud"\n',
        extra="[store]\nmax_attempts = 2\n",
    )
    async with Agent(load_agent_config(cfg)) as agent:
        ids = []
        for n in (2**42, 3, 2):  # the first one is poison: 16 TB the cloud cannot allocate
            got = await agent.infer("g", {"shape": np.array([n], np.int64)}, deferrable=True)
            assert got.parameters["where"] == "deferred"
            ids.append(got.parameters["request_id"])
        server = cloud_server(cloud_repo, "--node", "poison")
        server.args[server.args.index("0")] = str(port)
        server.start()
        try:
            for _ in range(20):
                await agent.dataplane.probe()
                await agent.flush_deferred()
                states = [(await agent.deferred_result(i))["status"] for i in ids]
                if states == ["failed", "delivered", "delivered"]:
                    break
                await asyncio.sleep(0.2)
            assert states == ["failed", "delivered", "delivered"]
            poison = await agent.deferred_result(ids[0])
            assert poison["error"].startswith("internal")
            good = await agent.deferred_result(ids[1])
            np.testing.assert_array_equal(good["response"].outputs[0].data, [1, 1, 1])
        finally:
            server.terminate()


async def test_a_crash_between_the_clouds_answer_and_the_bookkeeping_does_not_run_it_twice(
    tmp_path, edge_repos
):
    from edge.agent import Agent
    from edge.config import load_agent_config

    server = cloud_server(edge_repos[0], "--node", "once").start()
    cfg = cloud_only_agent(tmp_path, edge_repos[1], server.http_url)
    try:
        x = np.full((1, 4), 2.0, np.float32)
        async with Agent(load_agent_config(cfg)) as agent:
            await agent.transports["http"].close()  # an outage: the request is stored
            receipt = await agent.infer("c", {"x": x}, deferrable=True)
            request_id = receipt.parameters["request_id"]
            await agent.transports["http"].start()  # the link returns...
            item = agent.store.pending()[0]
            agent.store.mark_sending(item.request_id)
            request = envelope.decode_request(item.payload)
            first = await agent.dataplane.send_deferred("c", request)
            # ...the cloud answered, and the agent dies before recording it.
        async with Agent(load_agent_config(cfg)) as again:  # the row is pending again
            found = await _flushed(again, request_id)
            assert found["status"] == "delivered"
            assert found["response"].parameters.get("duplicate") is True
            np.testing.assert_array_equal(found["response"].outputs[0].data, first.outputs[0].data)
        stats = _get(server.http_url + "/v2/models/cloudonly/stats")["model_stats"][0]
        assert stats["execution_count"] == 1  # answered twice, run once
    finally:
        server.terminate()


async def test_a_fetched_deferred_answer_carries_the_apps_own_id(tmp_path, edge_repos):
    """V2 answers echo the request's id; a deferred one fetched later carried the
    receipt's, so an app matching answers by its ids kept a map of receipts."""
    from edge.agent import Agent
    from edge.config import load_agent_config
    from shared.messages import InferRequest
    from shared.tensors import Tensor

    server = cloud_server(edge_repos[0], "--node", "ids").start()
    cfg = cloud_only_agent(tmp_path, edge_repos[1], server.http_url)
    try:
        x = np.full((1, 4), 3.0, np.float32)
        async with Agent(load_agent_config(cfg)) as agent:
            await agent.transports["http"].close()  # an outage: the request is stored
            request = InferRequest(inputs=[Tensor.from_array("x", x)], id="app-7")
            receipt = await agent.dataplane.infer("c", request, deferrable=True)
            assert receipt.id == "app-7" and receipt.parameters["where"] == "deferred"
            request_id = receipt.parameters["request_id"]
        async with Agent(load_agent_config(cfg)) as again:  # (kept across a restart)
            found = await _flushed(again, request_id)
            assert found["status"] == "delivered" and found["response"].id == "app-7"
    finally:
        server.terminate()


async def test_an_apps_idempotency_key_runs_a_retry_once_and_defers_it_once(tmp_path, edge_repos):
    import pytest

    from edge.agent import Agent
    from edge.config import load_agent_config
    from shared.errors import IdempotencyConflict, InvalidInput

    server = cloud_server(edge_repos[0], "--node", "keyed").start()
    cloud_url = server.http_url
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=cloud_url,
        models='[models.c]\ncloud = "cloudonly"\nmode = "cloud"\n'
        '[models.lin]\nlocal = "lin-local"\ncloud = "lin"\nmode = "cloud"\n',
    )
    x = np.full((1, 4), 2.0, np.float32)
    try:
        async with Agent(load_agent_config(cfg)) as agent:
            first = await agent.infer("c", {"x": x}, idempotency_key="app-1")
            again = await agent.infer("c", {"x": x}, idempotency_key="app-1")
            np.testing.assert_array_equal(first.outputs[0].data, again.outputs[0].data)
            stats = _get(server.http_url + "/v2/models/cloudonly/stats")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 1  # the retry ran once
            with pytest.raises(Exception, match="other inputs"):  # the cloud's 409
                await agent.infer("c", {"x": x + 1}, idempotency_key="app-1")
            # a model with a local variant too: the 409, not a local answer
            await agent.infer("lin", {"x": x}, idempotency_key="app-3")
            with pytest.raises(IdempotencyConflict):
                await agent.infer("lin", {"x": x + 1}, idempotency_key="app-3")
            with pytest.raises(InvalidInput, match="idempotency_key"):
                await agent.infer("c", {"x": x}, idempotency_key="k" * 129)
    finally:
        server.kill()
    async with Agent(load_agent_config(cfg)) as agent:  # the cloud is gone: deferrals
        receipts = [
            (await agent.infer("c", {"x": x}, deferrable=True, idempotency_key="app-2")).parameters
            for _ in range(2)
        ]
        assert receipts[0]["where"] == "deferred"
        assert receipts[0]["request_id"] == receipts[1]["request_id"]  # one stored request
        other = await agent.infer("c", {"x": x + 1}, deferrable=True, idempotency_key="app-2")
        assert other.parameters["request_id"] != receipts[0]["request_id"]  # its own
        assert agent.store.counts() == {"pending": 2}


async def test_apps_keys_and_deferrals_are_their_own_behind_one_agent(tmp_path, edge_repos):
    # The cloud sees one token, the agent's: two apps' equal keys were one key there (B
    # got A's answer, or a 409 for a key it never used), and any app could read another's
    # deferred answer by its receipt, a token scoped to other models too.
    import pytest

    from edge.agent import Agent
    from edge.config import load_agent_config
    from shared.errors import ModelNotFound

    def request(x: np.ndarray, key: str) -> InferRequest:
        r = InferRequest(inputs=[Tensor.from_array("x", x)])
        r.parameters["idempotency_key"] = key
        return r

    server = cloud_server(edge_repos[0], "--node", "apps").start()
    cfg = cloud_only_agent(tmp_path, edge_repos[1], server.http_url)
    x = np.full((1, 4), 2.0, np.float32)
    try:
        async with Agent(load_agent_config(cfg)) as agent:
            infer = agent.dataplane.infer
            await infer("c", request(x, "k"), principal="tok-a")
            same = await infer("c", request(x, "k"), principal="tok-b")
            assert not same.parameters.get("duplicate")  # not A's cached answer
            other = await infer("c", request(x + 1, "k"), principal="tok-c")  # no 409
            assert other.outputs[0].data.tolist() != []
            stats = _get(server.http_url + "/v2/models/cloudonly/stats")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 3
    finally:
        server.kill()
    async with Agent(load_agent_config(cfg)) as agent:  # the cloud is gone: deferrals
        infer = agent.dataplane.infer
        a = await infer("c", request(x, "d"), deferrable=True, principal="tok-a")
        b = await infer("c", request(x, "d"), deferrable=True, principal="tok-b")
        receipt = a.parameters["request_id"]
        assert b.parameters["request_id"] != receipt
        assert (await agent.deferred_result(receipt, "tok-a"))["status"] == "pending"
        with pytest.raises(ModelNotFound):
            await agent.deferred_result(receipt, "tok-b")
        with pytest.raises(ModelNotFound):  # A's token, no longer covering model "c"
            await agent.deferred_result(receipt, "tok-a", lambda model: model != "c")


async def test_over_the_local_api_a_receipt_answers_only_its_app(tmp_path, edge_repos):
    import aiohttp

    from edge.agent import Agent
    from edge.config import load_agent_config
    from edge.http_front import start_local_api
    from shared.tokens import parse_tokens

    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=f"http://127.0.0.1:{free_port()}",  # nothing there: the request is deferred
        models=CLOUD_ONLY,
    )
    tokens = parse_tokens("a infer\nb infer\nnarrow infer lin\n", "tokens.txt")
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
        "parameters": {"deferrable": True, "idempotency_key": "same"},
    }
    async with Agent(load_agent_config(cfg)) as agent:
        server = await start_local_api(agent, "127.0.0.1", 0, tokens=tokens)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as client:
                receipts = []
                for token in ("a", "b"):
                    sent = await client.post(
                        "/v2/models/c/infer",
                        json=body,
                        headers={"Authorization": f"Bearer {token}"},
                    )
                    assert sent.status == 200, await sent.text()
                    receipts.append((await sent.json())["parameters"]["request_id"])
                assert receipts[0] != receipts[1]  # one key, two apps: two deferrals
                for token, status in (("a", 200), ("b", 404), ("narrow", 404)):
                    got = await client.get(
                        f"/v2/deferred/{receipts[0]}", headers={"Authorization": f"Bearer {token}"}
                    )
                    assert got.status == status, (token, await got.text())
        finally:
            await server.close()


async def test_a_retry_after_its_deferral_failed_is_stored_again_not_handed_the_dead_receipt(
    tmp_path, edge_repos
):
    from edge.agent import Agent
    from edge.config import load_agent_config

    cfg = cloud_only_agent(tmp_path, edge_repos[1], f"http://127.0.0.1:{free_port()}")
    x = {"x": np.ones((1, 4), np.float32)}
    async with Agent(load_agent_config(cfg)) as agent:
        first = await agent.infer("c", x, deferrable=True, idempotency_key="k")
        receipt = first.parameters["request_id"]
        agent.store._db.execute("UPDATE deferred SET status = 'failed', error = 'x'")
        assert (await agent.deferred_result(receipt))["status"] == "failed"
        again = await agent.infer("c", x, deferrable=True, idempotency_key="k")
        assert again.parameters["request_id"] == receipt
        assert not again.parameters.get("duplicate")
        assert agent.store.counts() == {"pending": 1}  # stored afresh
