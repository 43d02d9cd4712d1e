"""Deferrable requests survive kill -9 of the agent and are delivered once."""

from __future__ import annotations

import json
import urllib.request

import numpy as np

from shared import v2
from shared.messages import InferRequest
from shared.tensors import Tensor
from tests.edge.conftest import agent_toml
from tests.support import cloud_server, edge_agent, free_port


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
    cfg = agent_toml(
        tmp_path,
        edge_repos[1],
        http=cloud_url,
        models='[models.c]\ncloud = "cloudonly"\nmode = "cloud"\n',
    )
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
