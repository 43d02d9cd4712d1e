"""The HTTP front against real V2 clients (tritonclient.http and raw requests)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.cloud.conftest import IDENTITY_TYPES
from tests.support import cloud_server, linear_reference, write_linear_model, write_slow_model


def _host(server) -> str:
    return server.http_url.removeprefix("http://")


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def _sample(datatype: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    if datatype == "BYTES":
        return np.array([[b"a", b"\x00bin\x01", "h\u00e9".encode()]] * 2, dtype=object)
    if datatype == "BOOL":
        return rng.random((2, 3)) > 0.5
    if datatype == "BF16":
        from ml_dtypes import bfloat16

        return rng.standard_normal((2, 3)).astype(bfloat16)
    dtype = triton.triton_to_np_dtype(datatype)
    return (rng.random((2, 3)) * 100).astype(dtype)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", sorted(IDENTITY_TYPES))
def test_tritonclient_round_trips_every_datatype(server, datatype, binary):
    if datatype == "BF16" and not binary:
        pytest.skip("tritonclient sends BF16 only as binary data")
    if datatype == "BYTES" and not binary:
        data = np.array([[b"a", b"bc", "h\u00e9".encode()]] * 2, dtype=object)
    else:
        data = _sample(datatype)
    client = triton.InferenceServerClient(_host(server))
    inp = triton.InferInput("x", list(data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=binary)
    out = triton.InferRequestedOutput("y", binary_data=binary)
    result = client.infer(f"echo_{datatype.lower()}", [inp], outputs=[out])
    got = result.as_numpy("y")
    if datatype == "BF16":
        assert got.tobytes() == data.tobytes()
    elif datatype == "BYTES" and not binary:  # tritonclient hands JSON strings back as str
        assert [g.encode() for g in got.reshape(-1)] == list(data.reshape(-1))
    else:
        np.testing.assert_array_equal(got, data)


def test_tritonclient_metadata_config_ready_and_stats(server):
    client = triton.InferenceServerClient(_host(server))
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"] and "model_repository" in meta["extensions"]
    model = client.get_model_metadata("linear")
    assert model["versions"] == ["1", "2"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    config = client.get_model_config("linear")
    assert config["max_batch_size"] == 16
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert client.is_model_ready("linear", "2")
    auto = client.get_model_config("auto")  # only 1/model.onnx: completed from the file
    assert [i["name"] for i in auto["input"]] == ["x"] and auto["max_batch_size"] > 0
    x = np.ones((2, 4), np.float32)
    inp = triton.InferInput("x", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    client.infer("linear", [inp], model_version="1")
    stats = client.get_inference_statistics("linear", "1")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["inference_count"] >= 2


def test_versions_serve_their_own_weights(server, tmp_path):
    w1, b1 = write_linear_model(tmp_path / "a.onnx", seed=1)
    w2, b2 = write_linear_model(tmp_path / "b.onnx", seed=2)
    client = triton.InferenceServerClient(_host(server))
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    inp = triton.InferInput("x", [3, 4], "FP32")
    inp.set_data_from_numpy(x)
    for version, (w, b) in {"1": (w1, b1), "2": (w2, b2)}.items():
        got = client.infer("linear", [inp], model_version=version).as_numpy("y")
        np.testing.assert_allclose(got, linear_reference(x, w, b), rtol=1e-5, atol=1e-5)
    latest = client.infer("linear", [inp]).get_response()
    assert latest["model_version"] == "2"


def test_concurrent_clients_queued_behind_a_run_are_merged_into_batches(tmp_path):
    """Asserted from the statistics extension, not from timing.

    A tiny model answers a lone request in place, so batches only form from
    requests that arrive while a run is going: the model here takes ~100 ms a
    run, long enough that 16 concurrent clients must queue behind it.
    """
    write_slow_model(tmp_path / "slow" / "1" / "model.onnx")
    (tmp_path / "slow" / "config.toml").write_text(
        "max_batch_size = 16\n[dynamic_batching]\nmax_queue_delay_us = 1000\n"
        "[runtime]\nthreads = 1\n"
    )
    proc = cloud_server(tmp_path, "--node", "batching").start()
    try:
        host = _host(proc)

        def one(i: int) -> np.ndarray:
            client = triton.InferenceServerClient(host, network_timeout=60)
            inp = triton.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(np.full((1, 4), i, np.float32))
            return client.infer("slow", [inp]).as_numpy("y")

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(32)))
        stats = triton.InferenceServerClient(host).get_inference_statistics("slow")
        model = stats["model_stats"][0]
    finally:
        proc.terminate()
    for i, y in enumerate(answers):
        np.testing.assert_allclose(y, np.full((1, 4), i, np.float32), rtol=1e-3, atol=1e-6)
    assert model["inference_stats"]["success"]["count"] == 32
    assert model["execution_count"] < 32
    assert any(b["batch_size"] > 1 for b in model["batch_stats"])


def test_repository_load_unload_while_another_model_serves(server, test_repository):
    host = _host(server)
    client = triton.InferenceServerClient(host)
    write_linear_model(test_repository / "hot" / "1" / "model.onnx", seed=9)
    stop = False
    errors: list[Exception] = []

    def keep_serving() -> int:
        c = triton.InferenceServerClient(host)
        inp = triton.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        n = 0
        while not stop:
            try:
                c.infer("auto", [inp])
                n += 1
            except Exception as exc:
                errors.append(exc)
        return n

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(keep_serving)
        client.load_model("hot")
        assert client.is_model_ready("hot")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["hot"]["state"] == "READY"
        client.unload_model("hot")
        assert not client.is_model_ready("hot")
        client.load_model("linear")  # hot reload of a loaded model
        stop = True
        served = fut.result()
    assert served > 0 and errors == []
    with pytest.raises(InferenceServerException):
        inp = triton.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), np.float32))
        client.infer("hot", [inp])


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v2/models/linear/infer", b"{bad json", 400, "invalid_argument"),
        (
            "/v2/models/linear/infer",
            json.dumps(
                {"inputs": [{"name": "x", "shape": [1, 5], "datatype": "FP32", "data": [0] * 5}]}
            ).encode(),
            400,
            "invalid_argument",
        ),
        (
            "/v2/models/linear/infer",
            json.dumps(
                {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP64", "data": [0] * 4}]}
            ).encode(),
            400,
            "invalid_argument",
        ),
        (
            "/v2/models/linear/infer",
            json.dumps(
                {"inputs": [{"name": "x", "shape": [99, 4], "datatype": "FP32", "data": [0] * 396}]}
            ).encode(),
            400,
            "invalid_argument",
        ),
        (
            "/v2/models/nope/infer",
            json.dumps(
                {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
            ).encode(),
            404,
            "not_found",
        ),
        (
            "/v2/models/linear/versions/7/infer",
            json.dumps(
                {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
            ).encode(),
            404,
            "not_found",
        ),
        ("/v2/repository/models/..%2F..%2Fetc/load", b"", 400, "invalid_argument"),
        ("/v2/repository/models/missing/load", b"", 404, "not_found"),
    ],
    ids=[
        "bad-json",
        "bad-shape",
        "bad-dtype",
        "batch-too-big",
        "unknown-model",
        "unknown-version",
        "traversal",
        "missing-model",
    ],
)
def test_malformed_requests_get_a_clear_4xx_and_the_server_stays_up(
    server, path, body, status, code
):
    got_status, _, doc = _post(server.http_url + path, body)
    assert got_status == status
    assert doc["code"] == code and doc["error"]
    assert _get(server.http_url + "/v2/health/live")[0] == 200


def test_binary_header_length_past_the_body_is_rejected(server):
    status, _, doc = _post(
        server.http_url + "/v2/models/linear/infer",
        b'{"inputs": []}',
        {"Inference-Header-Content-Length": "999"},
    )
    assert status == 400 and "Inference-Header-Content-Length" in doc["error"]


def test_metrics_use_triton_names(server):
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_pending_request_count",
        "ferry_inference_batch_size",
    ):
        assert f"\n{name}" in text or text.startswith(name), name
    assert 'model="linear"' in text
    # reported either way, with or without an NVIDIA driver, and never a crash
    assert re.search(r"^ferry_gpu_available [01]\.0$", text, re.M)


def test_server_metadata_advertises_only_implemented_extensions_under_triton_names(server):
    meta = triton.InferenceServerClient(_host(server)).get_server_metadata()
    assert sorted(meta["extensions"]) == sorted(
        [
            "classification",
            "binary_tensor_data",
            "model_repository",
            "model_configuration",
            "statistics",
            "schedule_policy",
        ]
    )


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_class_count_returns_triton_classification_strings(server, binary):
    x = np.array([[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 0.5, 4.0]], np.float32)
    probs = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    client = triton.InferenceServerClient(_host(server))
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = triton.InferRequestedOutput("probs", binary_data=binary, class_count=3)
    got = client.infer("softmax", [inp], outputs=[out]).as_numpy("probs")
    assert got.shape == (2, 3)
    rows = [[v.decode() if isinstance(v, bytes) else v for v in row] for row in got]
    for row, p in zip(rows, probs, strict=True):
        order = np.argsort(-p)[:3]
        assert row == [f"{p[i]:f}:{i}" for i in order]


def test_load_with_a_config_override_and_its_errors(server, test_repository):
    client = triton.InferenceServerClient(_host(server))
    write_linear_model(test_repository / "override" / "1" / "model.onnx", seed=6)
    config = {
        "max_batch_size": 4,
        "dynamic_batching": {"max_queue_delay_us": 500, "max_queue_size": 9},
        "instance_group": {"count": 2},
    }
    client.load_model("override", config=json.dumps(config))
    served = client.get_model_config("override")
    assert served["max_batch_size"] == 4
    assert served["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert served["instance_group"][0]["count"] == 2
    with pytest.raises(InferenceServerException, match=r"'instance_group\.cores'"):
        client.load_model("override", config=json.dumps({"instance_group": {"cores": 3}}))
    with pytest.raises(InferenceServerException, match="not supported"):
        client.load_model("override", config=json.dumps(config), files={"file:1/model.onnx": b"x"})
    status, _, doc = _post(
        server.http_url + "/v2/repository/models/override/load",
        json.dumps({"parameters": {"priority": 1}}).encode(),
    )
    assert status == 400 and "not supported" in doc["error"]
    client.load_model("override")  # the repository's config (none) again
    assert client.get_model_config("override")["max_batch_size"] == 32
    assert client.is_model_ready("override")
    client.unload_model("override")


def test_load_takes_tritons_own_config_json_as_triton_clients_send_it(server, test_repository):
    """Only Ferry's config.toml keys had been taken: Triton's JSON, even what Ferry's own
    config endpoint answers, was a 400 (get, change, load back is how tools use it)."""
    client = triton.InferenceServerClient(_host(server))
    write_linear_model(test_repository / "tri" / "1" / "model.onnx", seed=7)
    write_linear_model(test_repository / "tri" / "2" / "model.onnx", seed=8)
    client.load_model("tri")
    served = client.get_model_config("tri")
    served["max_batch_size"] = 4
    served["instance_group"] = [{"count": 2, "kind": "KIND_CPU"}]
    client.load_model("tri", config=json.dumps(served))
    again = client.get_model_config("tri")
    assert again["max_batch_size"] == 4 and again["instance_group"][0]["count"] == 2
    camel = {  # protobuf's JSON: lowerCamelCase names, int64 as strings
        "platform": "onnxruntime_onnx",
        "maxBatchSize": "2",
        "versionPolicy": {"specific": {"versions": ["1"]}},
        "dynamicBatching": {"maxQueueDelayMicroseconds": "300"},
    }
    client.load_model("tri", config=json.dumps(camel))
    again = client.get_model_config("tri")
    assert again["max_batch_size"] == 2
    assert again["dynamic_batching"]["max_queue_delay_microseconds"] == 300
    assert client.get_model_metadata("tri")["versions"] == ["1"]
    with pytest.raises(InferenceServerException, match=r"sequence batching"):
        client.load_model("tri", config=json.dumps({"sequence_batching": {}}))
    client.unload_model("tri")


def test_every_loaded_model_reports_its_memory(server):
    stats = triton.InferenceServerClient(_host(server)).get_inference_statistics()
    assert stats["model_stats"]
    for entry in stats["model_stats"]:
        (usage,) = entry["memory_usage"]
        assert usage["type"] == "CPU" and usage["byte_size"] > 0, entry["name"]


def test_json_bodies_over_a_megabyte_round_trip(server, test_repository):
    """Decoded and encoded in a worker thread: the answer is the same as on the loop."""
    from onnx import TensorProto

    from tests.support import write_identity_model

    write_identity_model(test_repository / "bigjson" / "1" / "model.onnx", TensorProto.FLOAT)
    (test_repository / "bigjson" / "config.toml").write_text("max_batch_size = 0\n")
    client = triton.InferenceServerClient(_host(server), network_timeout=120)
    client.load_model("bigjson")
    x = np.random.default_rng(2).standard_normal((50_000, 3)).astype(np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=False)  # ~2.5 MB of JSON numbers
    out = triton.InferRequestedOutput("y", binary_data=False)
    got = client.infer("bigjson", [inp], outputs=[out]).as_numpy("y")
    np.testing.assert_array_equal(got, x)
    client.unload_model("bigjson")


def test_a_model_whose_file_gives_no_shape_serves_every_rank(server, test_repository):
    """ONNX Runtime runs such a model on any rank: so does the server, not only scalars."""
    from onnx import TensorProto

    from tests.support import write_identity_model

    write_identity_model(
        test_repository / "anyrank" / "1" / "model.onnx", TensorProto.FLOAT, dims=None
    )
    client = triton.InferenceServerClient(_host(server))
    client.load_model("anyrank")
    meta = client.get_model_metadata("anyrank")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    for shape in [(), (4,), (2, 3, 2)]:
        x = np.asarray(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 2)
        inp = triton.InferInput("x", list(shape), "FP32")
        inp.set_data_from_numpy(x)
        got = client.infer("anyrank", [inp]).as_numpy("y")
        assert got.shape == shape
        np.testing.assert_array_equal(got, x)
    client.unload_model("anyrank")


@pytest.mark.parametrize(
    "config, key",
    [
        ({"instance_group": {"count": 1000000}}, "instance_group.count"),
        ({"runtime": {"threads": 100000}}, "runtime.threads"),
        ({"max_batch_size": 1 << 40}, "max_batch_size"),
        ({"dynamic_batching": {"max_queue_size": 1 << 40}}, "dynamic_batching.max_queue_size"),
        (
            {"dynamic_batching": {"priority_levels": 1 << 30, "default_priority_level": 1}},
            "dynamic_batching.priority_levels",
        ),
        (
            {
                "max_batch_size": 8,
                "input": [{"name": "x", "datatype": "FP32", "dims": [1 << 30, 4]}],
            },
            "input[0].dims",
        ),
    ],
)
def test_a_load_whose_sizes_exceed_the_node_is_refused_naming_the_key(
    server, test_repository, config, key
):
    write_linear_model(test_repository / "greedy" / "1" / "model.onnx", seed=7)
    status, _, doc = _post(
        server.http_url + "/v2/repository/models/greedy/load",
        json.dumps({"parameters": {"config": json.dumps(config)}}).encode(),
    )
    assert status == 400 and doc["code"] == "invalid_config", doc
    assert repr(key) in doc["error"], doc
    live, _, _ = _post(server.http_url + "/v2/repository/index", b"{}")
    assert live == 200  # still up, nothing built


@pytest.mark.parametrize("version", ["01", "%2B1", "1_0", "%D9%A1"])
def test_a_version_in_the_url_that_only_int_would_take_is_refused(server, version):
    status, _, doc = _post(
        server.http_url + f"/v2/models/linear/versions/{version}/infer", b'{"inputs": []}'
    )
    assert status == 400 and "plain non-negative integer" in doc["error"], doc


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_compressed_requests_are_inflated(server, algorithm, binary):
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    client = triton.InferenceServerClient(_host(server))
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    plain = client.infer("linear", [inp]).as_numpy("y")
    packed = client.infer("linear", [inp], request_compression_algorithm=algorithm)
    np.testing.assert_array_equal(packed.as_numpy("y"), plain)


def test_an_unknown_content_encoding_is_415_and_a_bomb_is_413(server):
    import zlib

    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    ).encode()
    url = server.http_url + "/v2/models/linear/infer"
    status, _, doc = _post(url, body, {"Content-Encoding": "br"})
    assert status == 415 and doc["code"] == "unsupported_media_type" and "'br'" in doc["error"]
    bomb = zlib.compress(b" " * (64 * 1024 * 1024), 9)  # 64 MiB of spaces in ~64 KiB
    status, _, doc = _post(url, bomb, {"Content-Encoding": "deflate"})
    assert status == 413 and doc["code"] == "payload_too_large"
    status, _, doc = _post(url, b"not gzip at all", {"Content-Encoding": "gzip"})
    assert status == 400 and "gzip" in doc["error"]
    assert _post(url, zlib.compress(body), {"Content-Encoding": "deflate"})[0] == 200


def test_json_inputs_may_hold_the_bare_nan_and_infinity_pythons_json_writes(server):
    # tritonclient's JSON mode serialises with json.dumps: bare NaN / Infinity tokens
    x = np.array([[np.inf, -np.inf, np.nan]], np.float32)
    client = triton.InferenceServerClient(_host(server))
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    out = triton.InferRequestedOutput("y", binary_data=True)
    got = client.infer("echo_fp32", [inp], outputs=[out]).as_numpy("y")
    np.testing.assert_array_equal(got, x)
    status, _, doc = _post(
        server.http_url + "/v2/models/echo_fp32/infer",
        b'{"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1e300, 1, 2]}]}',
    )
    assert status == 400 and "out of range" in doc["error"]  # overflow is still refused
