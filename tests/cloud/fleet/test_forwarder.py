"""The forwarder's replies: a request its host refused while draining goes to another."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from cloud.config import MqttConfig
from cloud.dataplane import DataPlane
from cloud.fleet import forwarder as forwarding
from cloud.fleet.forwarder import Forwarder
from cloud.fleet.view import FleetView
from cloud.mqtt_front import MqttFront
from shared.messages import InferRequest
from shared.mqtt import parse_broker_url
from shared.repository import ModelRepository
from shared.tensors import Limits, Tensor
from tests.support import Broker, linear_reference, write_linear_model


def _hosting(node: str, model: str) -> dict:
    return {
        "node": node,
        "state": "online",
        "uptime_s": 1.0,
        "models": [{"name": model, "requests": 0, "executions": 0, "compute_ns": 0}],
        "capacity": {"memory_bytes": 1 << 30, "backends": ["onnxruntime"], "cores": 2},
        "misses": {},
    }


async def _node(repo: Path, broker: Broker, name: str, model: str | None) -> MqttFront:
    dp = DataPlane(ModelRepository(repo), name)
    if model:
        await dp.load(model)
    front = MqttFront(dp, MqttConfig(broker=parse_broker_url(broker.url)), Limits(), name)
    await front.start()
    return front


async def test_a_request_its_host_refused_while_draining_is_answered_by_another(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that took a forwarded request after its drain began answers "shutting
    down": that 503 reached the client through a node that was not stopping, while
    another node served the model."""
    monkeypatch.setattr(forwarding, "HOST_SETTLE_S", 1.0)  # (room for the second host)
    w, b = write_linear_model(tmp_path / "repo" / "lin" / "1" / "model.onnx", seed=3)
    repo = tmp_path / "repo"
    draining = await _node(repo, broker, "n1", "lin")
    asking = await _node(repo, broker, "n2", None)
    view = FleetView()
    view.on_status("n1", _hosting("n1", "lin"), time.monotonic())
    view.on_status("n3", _hosting("n3", "lin"), time.monotonic())  # (it starts below)
    forwarder = Forwarder(asking, view, "n2", Limits())
    forwarder.start()
    healthy = None
    try:
        await asyncio.sleep(0.3)  # subscriptions in place
        draining.dataplane.begin_shutdown()  # (its intake still on: the race's window)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        request = InferRequest([Tensor("x", "FP32", x)], id="r1")
        answer = asyncio.create_task(
            forwarder.infer("lin", request, version=None, deadline=time.monotonic() + 20)
        )
        while not draining.received:
            await asyncio.sleep(0.01)
        draining.stop_intake()
        healthy = await _node(repo, broker, "n3", "lin")
        response = await answer
        np.testing.assert_allclose(response.outputs[0].data, linear_reference(x, w, b), rtol=1e-5)
        assert response.parameters["node"] == "n3" and forwarder.resent >= 1
    finally:
        for front in (draining, asking, healthy):
            if front is not None:
                await front.close()
                await front.dataplane.close()


async def test_a_draining_hosts_refusal_goes_back_at_once_where_no_other_host_serves(
    tmp_path: Path, broker: Broker
) -> None:
    """With no other host it waited for a new one until the forward deadline (a 504
    after 30 s) where the refusal was the answer."""
    from shared.errors import ShuttingDown

    write_linear_model(tmp_path / "repo" / "lin" / "1" / "model.onnx", seed=3)
    draining = await _node(tmp_path / "repo", broker, "n1", "lin")
    asking = await _node(tmp_path / "repo", broker, "n2", None)
    view = FleetView()
    view.on_status("n1", _hosting("n1", "lin"), time.monotonic())
    forwarder = Forwarder(asking, view, "n2", Limits())
    forwarder.start()
    try:
        await asyncio.sleep(0.3)
        draining.dataplane.begin_shutdown()
        request = InferRequest([Tensor("x", "FP32", np.ones((1, 4), np.float32))], id="r2")
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(
                forwarder.infer("lin", request, version=None, deadline=time.monotonic() + 30), 10
            )
    finally:
        for front in (draining, asking):
            await front.close()
            await front.dataplane.close()
