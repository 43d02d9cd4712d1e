"""Nodes following a placement published by hand (no controller): they load what it
gives them, answer for each other over HTTP and MQTT, and move a model without
an unanswered request."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from cloud.placement.types import Copy, Placement
from shared import envelope
from shared.messages import InferResponse
from shared.mqtt import PLACEMENT_TOPIC
from tests.fleet_lab import FleetWatch, start_node
from tests.support import Broker, linear_reference, mqtt_request, write_linear_model

pytestmark = pytest.mark.slow


def _copy(model: str, node: str) -> Copy:
    return Copy(model, node, "onnxruntime", 1.0, 1, 0.1, 0.1, 1 << 20)


def _publish_placement(broker: Broker, placement: Placement) -> None:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"placer-{time.monotonic_ns()}",
        protocol=mqtt.MQTTv5,
    )
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    info = client.publish(
        PLACEMENT_TOPIC, json.dumps(placement.to_dict()).encode(), qos=1, retain=True
    )
    info.wait_for_publish(5)
    client.loop_stop()
    client.disconnect()


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _infer_body(x: np.ndarray) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


@pytest.fixture
def repository(tmp_path: Path) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]]:
    weights = {}
    for i, name in enumerate(("alpha", "beta")):
        weights[name] = write_linear_model(tmp_path / "repo" / name / "1" / "model.onnx", seed=i)
    return tmp_path / "repo", weights


def test_nodes_load_their_share_answer_for_each_other_and_move_a_model(
    tmp_path: Path, broker: Broker, repository: tuple[Path, dict]
) -> None:
    repo, weights = repository
    _publish_placement(
        broker, Placement(copies=(_copy("alpha", "n1"), _copy("beta", "n2")), generation=1)
    )
    watch = FleetWatch(broker)
    nodes = {n: start_node(repo, broker, tmp_path, n) for n in ("n1", "n2")}
    try:
        watch.wait(
            "each node hosts its model",
            lambda: watch.view.hosts("alpha") == ["n1"] and watch.view.hosts("beta") == ["n2"],
            30,
        )
        watch.wait(
            "both nodes converged",
            lambda: all(watch.view.nodes[n].following == 1 for n in ("n1", "n2")),
            10,
        )
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        # HTTP to the node that does not host the model: forwarded over the broker
        for model, node in (("alpha", "n2"), ("beta", "n1")):
            url = nodes[node].http_url
            status, ready = _http(f"{url}/v2/models/{model}/ready")
            assert status == 200 and ready["ready"] is True
            status, meta = _http(f"{url}/v2/models/{model}")
            assert status == 200 and meta["inputs"][0]["name"] == "x"
            status, answer = _http(f"{url}/v2/models/{model}/infer", _infer_body(x))
            assert status == 200, answer
            y = np.array(answer["outputs"][0]["data"], np.float32).reshape(2, 3)
            np.testing.assert_allclose(y, linear_reference(x, *weights[model]), rtol=1e-5)
            assert answer["model_name"] == model
        # a model nobody hosts is still unknown everywhere
        status, _ = _http(f"{nodes['n1'].http_url}/v2/models/gamma/ready")
        assert status == 503
        status, error = _http(f"{nodes['n1'].http_url}/v2/models/gamma/infer", _infer_body(x))
        assert status == 404, error
        # over MQTT, as a device sends it
        from shared.messages import InferRequest
        from shared.tensors import Tensor

        payload = envelope.encode_request(InferRequest([Tensor("x", "FP32", x)], id="m1"))
        _, reply = envelope.decode_reply(mqtt_request(broker.url, "beta", payload, 20))
        assert isinstance(reply, InferResponse) and reply.parameters["node"] == "n2"

        # move alpha from n1 to n2 while a client keeps asking n1 for it over HTTP
        answered, failed = 0, []
        _publish_placement(
            broker, Placement(copies=(_copy("alpha", "n2"), _copy("beta", "n2")), generation=2)
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, answer = _http(f"{nodes['n1'].http_url}/v2/models/alpha/infer", _infer_body(x))
            if status == 200:
                answered += 1
            else:
                failed.append((status, answer))
            if watch.view.hosts("alpha") == ["n2"] and watch.view.nodes["n1"].following == 2:
                break
        assert watch.view.hosts("alpha") == ["n2"], "alpha did not move"
        assert failed == [] and answered > 0
        status, answer = _http(f"{nodes['n1'].http_url}/v2/models/alpha/infer", _infer_body(x))
        assert status == 200 and answer["model_name"] == "alpha"
    finally:
        for node in nodes.values():
            node.terminate()
        watch.close()
    for node in nodes.values():
        assert "Traceback" not in node.output(), node.output()[-3000:]


def test_an_answer_too_big_to_carry_back_is_an_error_saying_so_not_the_clients_fault(
    tmp_path: Path,
) -> None:
    # A forwarded 48 MB answer came back truncated and was a 400 "Input data was
    # truncated"; one over the broker's packet limit was never sent (the caller waited).
    from onnx import TensorProto, helper, numpy_helper, save

    from shared.messages import InferRequest
    from shared.tensors import Tensor

    v = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])],
        "tile",
        [v("x", TensorProto.FLOAT, ["N", "K"])],
        [v("y", TensorProto.FLOAT, ["N", None])],
        [numpy_helper.from_array(np.array([1, 4], np.int64), "repeats")],
    )
    (tmp_path / "repo" / "tile" / "1").mkdir(parents=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    save(model, str(tmp_path / "repo" / "tile" / "1" / "model.onnx"))
    broker = Broker(tmp_path / "broker")
    broker.conf.write_text(broker.conf.read_text() + "max_packet_size 1000000\n")
    broker.start()
    _publish_placement(broker, Placement(copies=(_copy("tile", "n2"),), generation=1))
    watch = FleetWatch(broker)
    small = "[limits]\nmax_body_bytes = 200000\n"
    nodes = {
        "n1": start_node(tmp_path / "repo", broker, tmp_path, "n1", extra=small),
        "n2": start_node(tmp_path / "repo", broker, tmp_path, "n2"),
    }
    try:
        watch.wait("n2 hosts tile", lambda: watch.view.hosts("tile") == ["n2"], 30)
        x = np.ones((1, 10_000), np.float32)  # 40 KB in, 160 KB out: n1 takes 200 KB
        status, answer = _http(f"{nodes['n1'].http_url}/v2/models/tile/infer", _infer_body(x))
        assert status == 200 and answer["outputs"][0]["shape"] == [1, 40_000]
        x = np.ones((1, 20_000), np.float32)  # 80 KB in (JSON ~200 KB), 320 KB out
        status, _ = _http(f"{nodes['n2'].http_url}/v2/models/tile/infer", _infer_body(x))
        assert status == 200  # asked of its host, the answer is fine
        body = {
            "inputs": [
                {"name": "x", "shape": [1, 20_000], "datatype": "FP32", "data": [1] * 20_000}
            ]
        }
        status, error = _http(f"{nodes['n1'].http_url}/v2/models/tile/infer", body)
        assert status == 500 and "over this node's body limit of 200000" in error["error"]
        # over the broker's 1 MB packet limit: the host says so instead of never answering
        x = np.ones((1, 80_000), np.float32)  # 320 KB in, 1.28 MB out
        payload = envelope.encode_request(InferRequest([Tensor("x", "FP32", x)], id="big"))
        _, reply = envelope.decode_reply(mqtt_request(broker.url, "tile", payload, 20))
        assert isinstance(reply, Exception) and "maximum packet size" in str(reply)
    finally:
        for node in nodes.values():
            node.terminate()
        watch.close()
        broker.stop()


def test_a_node_is_ready_once_it_holds_its_share_of_a_placement(
    tmp_path: Path, broker: Broker, repository: tuple[Path, dict]
) -> None:
    """An empty node was ready at once: Kubernetes, seeing it ready, took down the node
    that hosted every model (a rolling update), and each model's requests stalled."""
    repo, _ = repository
    node = start_node(repo, broker, tmp_path, "n1")
    watch = FleetWatch(broker)
    try:
        watch.wait("n1 reports", lambda: "n1" in watch.view.nodes, 30)
        assert _http(f"{node.http_url}/v2/health/live")[0] == 200
        assert _http(f"{node.http_url}/v2/health/ready")[0] == 503  # no placement yet
        _publish_placement(broker, Placement(copies=(_copy("alpha", "n1"),), generation=1))
        watch.wait("n1 hosts alpha", lambda: watch.view.hosts("alpha") == ["n1"], 30)
        assert _http(f"{node.http_url}/v2/health/ready")[0] == 200
    finally:
        node.terminate()
        watch.close()


def test_a_node_leaving_keeps_the_last_loaded_copy_until_its_new_home_has_it(
    tmp_path: Path, broker: Broker
) -> None:
    """A SIGTERM dropped a model's last loaded copy while its new home still loaded it:
    with min_copies = 2 a rolling update left a slow-loading model on no node."""
    import signal

    from tests.support import write_slow_model

    repo = tmp_path / "repo"
    write_slow_model(repo / "slow" / "1" / "model.onnx")  # (seconds to load and warm)
    (repo / "slow" / "config.toml").write_text("[runtime]\nthreads = 1\n")
    _publish_placement(broker, Placement(copies=(_copy("slow", "n1"),), generation=1))
    watch = FleetWatch(broker)
    nodes = {n: start_node(repo, broker, tmp_path, n) for n in ("n1", "n2")}
    try:
        watch.wait("n1 hosts slow", lambda: watch.view.hosts("slow") == ["n1"], 60)
        nodes["n1"].proc.send_signal(signal.SIGTERM)
        _publish_placement(broker, Placement(copies=(_copy("slow", "n2"),), generation=2))
        try:
            code = nodes["n1"].proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, nodes["n1"].output()[-3000:]
        # n1 went only once n2 had the model loaded (it had gone at once, the load under way)
        assert "placed slow here" in nodes["n2"].output()
    finally:
        for node in nodes.values():
            node.terminate()
        watch.close()


def test_a_node_stopped_while_loading_its_share_exits_without_waiting_for_the_load(
    tmp_path: Path, broker: Broker
) -> None:
    """A load cannot be interrupted, and the stopped process lived on until it ended
    (17 s after "stopped"; past an orchestrator's grace, a SIGKILL)."""
    import signal

    import onnx
    from onnx import TensorProto, helper

    nodes, name = [], "x"
    for i in range(20_000):  # a graph ONNX Runtime takes seconds to build a session of
        nodes.append(helper.make_node("Add", [name, "one"], [f"a{i}"]))
        name = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "long",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    repo = tmp_path / "repo"
    (repo / "long" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "long" / "1" / "model.onnx"))
    _publish_placement(broker, Placement(copies=(_copy("long", "n1"),), generation=1))
    node = start_node(repo, broker, tmp_path, "n1")
    try:
        # its follower is loading the model (a fixed wait had been too short on a busy
        # machine: stopped before the load began, it rightly had nothing to leave)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            index = _http(f"{node.http_url}/v2/repository/index", {})[1]
            if any(e.get("state") == "LOADING" for e in index):
                break
            time.sleep(0.05)
        time.sleep(0.2)  # (from the file's fingerprint into the session's build)
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(60) == 0
        said = node.output()
        assert "leaving a model load under way at shutdown" in said
        assert "placed long here" not in said  # (it went before the load ended)
    finally:
        node.terminate()


def test_a_placed_model_that_cannot_load_is_reported_and_forgotten_once_placed_elsewhere(
    tmp_path: Path, broker: Broker, repository: tuple[Path, dict]
) -> None:
    repo, _ = repository
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    _publish_placement(
        broker, Placement(copies=(_copy("alpha", "n1"), _copy("broken", "n1")), generation=1)
    )
    watch = FleetWatch(broker)
    node = start_node(repo, broker, tmp_path, "n1")
    try:
        watch.wait(
            "n1 reports the failed load",
            lambda: "n1" in watch.view.nodes and "broken" in watch.view.nodes["n1"].load_failures,
            30,
        )
        assert _http(f"{node.http_url}/v2/health/ready")[0] == 503  # strict readiness
        _publish_placement(broker, Placement(copies=(_copy("alpha", "n1"),), generation=2))
        watch.wait(
            "n1 follows the placement without it",
            lambda: (
                watch.view.nodes["n1"].following == 2 and not watch.view.nodes["n1"].load_failures
            ),
            30,
        )
        assert _http(f"{node.http_url}/v2/health/ready")[0] == 200
    finally:
        node.terminate()
        watch.close()


def test_a_repository_model_the_placement_leaves_on_no_node_is_unavailable_not_unknown(
    tmp_path: Path, broker: Broker, repository: tuple[Path, dict]
) -> None:
    """It answered 404 "unknown model" while the controller had it unplaced for lack of
    room: a client (and an operator) must see it is there but not served, and why."""
    repo, _ = repository
    placement = Placement(
        copies=(_copy("alpha", "n1"),), generation=1, unplaced={"beta": "no room on 1 node"}
    )
    _publish_placement(broker, placement)
    watch = FleetWatch(broker)
    node = start_node(repo, broker, tmp_path, "n1")
    try:
        watch.wait(
            "n1 follows the placement",
            lambda: "n1" in watch.view.nodes and watch.view.nodes["n1"].following == 1,
            30,
        )
        x = np.ones((1, 4), dtype=np.float32)
        status, body = _http(f"{node.http_url}/v2/models/beta/infer", _infer_body(x))
        assert status == 503 and "placed on no node" in body["error"], (status, body)
        assert "no room on 1 node" in body["error"]
        status, body = _http(f"{node.http_url}/v2/models/nosuch/infer", _infer_body(x))
        assert status == 404 and body["code"] == "not_found", (status, body)
    finally:
        node.terminate()
        watch.close()


def test_a_forwarded_keyed_request_keeps_its_senders_scope(
    tmp_path: Path, broker: Broker, repository: tuple[Path, dict]
) -> None:
    # Forwarded, every sender of the forwarding node shared one scope at the host: a
    # second token's "order-1" got the first token's cached answer (or its 409).
    repo, _ = repository
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("tok-a infer\ntok-b infer\n")
    tokens.chmod(0o600)
    _publish_placement(broker, Placement(copies=(_copy("alpha", "n1"),), generation=1))
    watch = FleetWatch(broker)
    nodes = {"n1": start_node(repo, broker, tmp_path, "n1")}
    nodes["n2"] = start_node(
        repo, broker, tmp_path, "n2", extra=f'[http]\ntokens_file = "{tokens}"\n'
    )

    def keyed(token: str, x: np.ndarray, key: str | None = "order-1") -> tuple[int, dict]:
        body = {**_infer_body(x), "parameters": {"idempotency_key": key}}
        request = urllib.request.Request(
            f"{nodes['n2'].http_url}/v2/models/alpha/infer",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    try:
        watch.wait("n1 hosts alpha", lambda: watch.view.hosts("alpha") == ["n1"], 30)
        x = np.ones((1, 4), np.float32)
        first = keyed("tok-a", x)
        assert first[0] == 200 and not first[1].get("parameters", {}).get("duplicate")
        other = keyed("tok-b", x)  # same key, another sender: its own run
        assert other[0] == 200 and not other[1].get("parameters", {}).get("duplicate")
        assert keyed("tok-b", x + 1)[0] == 409  # (its own key, other inputs)
        again = keyed("tok-a", x)
        assert again[0] == 200 and again[1]["parameters"]["duplicate"] is True
        # a null key is no key, forwarded too (scoped, every such request had been a
        # retry of the first: 409 for other inputs, or its cached answer)
        for value in (x, x + 1, x):
            status, answer = keyed("tok-a", value, None)
            assert status == 200 and "duplicate" not in answer.get("parameters", {}), answer
    finally:
        for node in nodes.values():
            node.terminate()
        watch.close()
