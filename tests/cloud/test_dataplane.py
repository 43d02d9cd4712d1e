"""The dataplane in-process over real repositories and real ONNX Runtime sessions:
thread budget, readiness, default queue bound, config overrides, classification,
idempotency and statistics of refused requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from cloud.dataplane import DataPlane
from shared.errors import ConfigError, FerryError, InvalidInput, ModelNotReady, ShuttingDown
from shared.messages import InferRequest, RequestedOutput
from shared.repository import ModelRepository, parse_config_json
from shared.tensors import Tensor
from tests.cloud.conftest import build_slow_repository
from tests.support import linear_reference, write_linear_model, write_softmax_model


def _threads(dp: DataPlane, name: str) -> list[int]:
    model = dp.get(name)
    return [s.session_options.intra_op_num_threads for s in model.sessions]


def _request(x: np.ndarray, **parameters) -> InferRequest:
    return InferRequest(inputs=[Tensor.from_array("x", x)], parameters=parameters)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_linear_model(tmp_path / "a" / "1" / "model.onnx", seed=1)  # no config at all
    write_linear_model(tmp_path / "b" / "1" / "model.onnx", seed=2)
    (tmp_path / "b" / "config.toml").write_text("[instance_group]\ncount = 2\n")
    write_linear_model(tmp_path / "c" / "1" / "model.onnx", seed=3)
    (tmp_path / "c" / "config.toml").write_text("[runtime]\nthreads = 3\n")
    return tmp_path


async def test_sessions_without_a_thread_setting_share_the_cores_of_the_node(repo):
    dp = DataPlane(ModelRepository(repo), "n", cores=8)
    dp.plan(["a", "b", "c"])  # 1 + 2 + 1 sessions planned at start-up
    for name in ("a", "b", "c"):
        await dp.load(name)
    dp.end_plan()
    assert _threads(dp, "a") == [2] and _threads(dp, "b") == [2, 2]
    assert _threads(dp, "c") == [3]  # its own [runtime] threads wins
    await dp.close()


async def test_a_later_load_is_budgeted_against_the_sessions_already_loaded(repo):
    dp = DataPlane(ModelRepository(repo), "n", cores=8)
    await dp.load("a")
    assert _threads(dp, "a") == [8]  # alone on the node
    await dp.load("b")
    assert _threads(dp, "b") == [2, 2]  # 8 cores // (1 loaded + 2 new)
    await dp.load("a")  # a reload counts the others, not its own old sessions
    assert _threads(dp, "a") == [2]
    await dp.close()


async def test_models_without_a_queue_bound_get_the_node_default(repo, tmp_path):
    dp = DataPlane(ModelRepository(repo), "n", default_max_queue=7)
    await dp.load("a")  # a bare 1/model.onnx
    assert dp.get("a").batcher.max_queue == 7
    (repo / "d" / "1").mkdir(parents=True)
    write_linear_model(repo / "d" / "1" / "model.onnx")
    (repo / "d" / "config.toml").write_text("[dynamic_batching]\nmax_queue_size = 2\n")
    await dp.load("d")
    assert dp.get("d").batcher.max_queue == 2  # the model's own bound wins
    # and /config says the bound applied, not Triton's 0 ("unbounded")
    queue = "default_queue_policy"
    (repo / "e" / "1").mkdir(parents=True)
    write_linear_model(repo / "e" / "1" / "model.onnx")
    (repo / "e" / "config.toml").write_text("[dynamic_batching]\nmax_queue_delay_us = 100\n")
    await dp.load("e")
    assert dp.model_config("e")["dynamic_batching"][queue]["max_queue_size"] == 7
    assert dp.model_config("d")["dynamic_batching"][queue]["max_queue_size"] == 2
    await dp.close()


async def test_memory_is_estimated_per_loaded_model_version(repo):
    dp = DataPlane(ModelRepository(repo), "n", cores=2)
    for name in ("a", "b", "c"):
        await dp.load(name)
    for entry in dp.statistics()["model_stats"]:
        assert entry["memory_usage"][0]["byte_size"] > 0, entry["name"]
    await dp.close()


async def test_strict_readiness_follows_failed_loads(tmp_path):
    root = build_slow_repository(tmp_path, broken=True)
    strict = DataPlane(ModelRepository(root), "n")
    lenient = DataPlane(ModelRepository(root), "n", strict_readiness=False)
    for dp in (strict, lenient):
        await dp.load("slow")
        with pytest.raises(ConfigError, match="nope"):
            await dp.load("broken")
    assert not strict.is_ready() and lenient.is_ready()
    with pytest.raises(ModelNotReady, match="nope"):
        strict.get("broken")
    await strict.unload("broken")  # unloading the failed model clears the failure
    assert strict.is_ready()
    # a load request for a model that does not exist is a 404, not a failed model
    with pytest.raises(Exception, match="not in the repository"):
        await strict.load("missing")
    assert strict.is_ready()
    strict.begin_shutdown()
    assert not strict.is_ready()
    with pytest.raises(ShuttingDown, match="shutting down"):
        await strict.infer("slow", _request(np.ones((1, 4), np.float32)))
    await strict.close()
    await lenient.close()


async def test_a_config_override_replaces_the_repository_config_for_one_load(repo):
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("b")
    assert len(dp.get("b").sessions) == 2
    override = parse_config_json(
        json.dumps({"max_batch_size": 4, "instance_group": {"count": 1}}), "b"
    )
    await dp.load("b", override)
    config = dp.model_config("b")
    assert config["max_batch_size"] == 4 and len(dp.get("b").sessions) == 1
    await dp.load("b")  # without an override the repository's config is read again
    assert len(dp.get("b").sessions) == 2
    await dp.close()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"max_batch_size": -1}', "'max_batch_size': expected a non-negative integer"),
        ('{"instance_group": {"count": 2, "cores": 1}}', "unknown key 'instance_group.cores'"),
        ('{"input": [{"name": "x", "data_type": "TYPE_FP32"}]}', "'input[0].data_type'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_config_override_errors_name_the_key(text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config_json(text, "m")


async def test_classification_returns_top_k_value_index_strings(tmp_path):
    write_softmax_model(tmp_path / "sm" / "1" / "model.onnx")
    dp = DataPlane(ModelRepository(tmp_path), "n")
    await dp.load("sm")
    x = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, 0.0, 1.0]], np.float32)
    probs = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    req = _request(x)
    req.outputs = [RequestedOutput("probs", parameters={"classification": 2})]
    response = await dp.infer("sm", req)
    out = response.outputs[0]
    assert out.datatype == "BYTES" and out.shape == (2, 2)
    assert out.data.tolist() == [
        [f"{probs[0, 1]:f}:1".encode(), f"{probs[0, 3]:f}:3".encode()],
        [f"{probs[1, 0]:f}:0".encode(), f"{probs[1, 1]:f}:1".encode()],  # tie: lower index first
    ]
    req.outputs = [RequestedOutput("probs", parameters={"classification": 9})]
    assert (await dp.infer("sm", req)).outputs[0].shape == (2, 4)  # k past the classes: all
    req.outputs = [RequestedOutput("probs", parameters={"classification": -1})]
    with pytest.raises(InvalidInput, match="classification"):
        await dp.infer("sm", req)
    await dp.close()


async def test_duplicates_of_a_keyed_request_share_one_execution(repo):
    dp = DataPlane(ModelRepository(repo), "n", idempotency_ttl_s=60)
    await dp.load("a")
    stats = dp.get("a").stats
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    first, second = await asyncio.gather(
        dp.infer("a", _request(x, idempotency_key="k1")),
        dp.infer("a", _request(x, idempotency_key="k1")),
    )
    third = await dp.infer("a", _request(x, idempotency_key="k1"))
    other = await dp.infer("a", _request(x, idempotency_key="k2"))
    assert stats.snapshot().execution_count == 2  # k1 once, k2 once
    for r in (second, third, other):
        np.testing.assert_array_equal(r.outputs[0].data, first.outputs[0].data)
    assert "duplicate" not in first.parameters and "duplicate" not in other.parameters
    assert second.parameters["duplicate"] is True and third.parameters["duplicate"] is True
    with pytest.raises(InvalidInput, match="idempotency_key"):
        await dp.infer("a", _request(x, idempotency_key="k" * 129))
    await dp.close()


async def test_a_keyed_retry_joining_a_run_is_held_to_its_own_timeout(tmp_path):
    # The retry took the first request's outcome: a late 200 past its own 3 ms timeout.
    from shared.errors import DeadlineExceeded

    root = build_slow_repository(tmp_path)
    dp = DataPlane(ModelRepository(root), "n", idempotency_ttl_s=60)
    await dp.load("slow")
    x = np.ones((1, 4), np.float32)
    busy = [asyncio.ensure_future(dp.infer("slow", _request(x + i))) for i in range(3)]
    await asyncio.sleep(0.01)
    first = asyncio.ensure_future(dp.infer("slow", _request(x, idempotency_key="k")))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded, match="earlier request with this"):
        await dp.infer("slow", _request(x, idempotency_key="k", timeout=3000))
    assert "duplicate" not in (await first).parameters
    await asyncio.gather(*busy)
    await dp.close()


async def test_refused_requests_are_counted_with_reason_other(repo):
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("a")
    for bad in (
        _request(np.ones((1, 5), np.float32)),
        _request(np.ones((1, 4), np.float64)),
        _request(np.ones((1, 4), np.float32), priority="high"),
        _request(np.ones((1, 4), np.float32), timeout=-5),
    ):
        with pytest.raises(InvalidInput):
            await dp.infer("a", bad)
    snap = dp.get("a").stats.snapshot()
    assert snap.fail_count == 4 and snap.fail_reasons["OTHER"] == 4
    ok = await dp.infer("a", _request(np.ones((1, 4), np.float32)))  # still serving
    assert ok.outputs[0].shape == (1, 3) and dp.get("a").stats.snapshot().success_count == 1
    await dp.close()


async def test_status_shows_instances_per_model(repo):
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("b")
    (entry,) = dp.status()["models"]
    assert entry["name"] == "b" and entry["instances"] == 2
    await dp.close()


async def test_linear_results_are_unchanged_by_the_warm_up(repo):
    w, b = write_linear_model(repo / "e" / "1" / "model.onnx", seed=5)
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("e")
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    got = (await dp.infer("e", _request(x))).outputs[0].data
    np.testing.assert_allclose(got, linear_reference(x, w, b), rtol=1e-5, atol=1e-5)
    await dp.close()


async def test_instances_that_would_not_fit_in_memory_are_refused_before_loading(repo):
    from shared.repository.capacity import NodeCapacity, check_capacity

    config = parse_config_json(json.dumps({"instance_group": {"count": 8}}), "b")
    small = NodeCapacity(cores=2, memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"'instance_group.count'.*MiB"):
        check_capacity(config, small, "b/config.toml", versions=1, model_bytes=1 << 18)
    check_capacity(config, NodeCapacity(cores=2, memory_bytes=1 << 30), "b", model_bytes=1 << 18)


async def test_a_repository_config_past_the_node_bounds_fails_its_load_only(repo):
    (repo / "b" / "config.toml").write_text("[instance_group]\ncount = 100000\n")
    dp = DataPlane(ModelRepository(repo), "n")
    with pytest.raises(ConfigError, match=r"config.toml: key 'instance_group.count'"):
        await dp.load("b")
    await dp.load("a")
    assert dp.model_ready("a")
    await dp.close()


async def test_a_failed_hot_reload_keeps_the_old_version_serving_and_the_node_ready(repo):
    dp = DataPlane(ModelRepository(repo), "n", strict_readiness=True)
    await dp.load("b")
    (repo / "b" / "config.toml").write_text(
        '[[input]]\nname = "nope"\ndatatype = "FP32"\ndims = [4]\n'
    )
    with pytest.raises(ConfigError):
        await dp.load("b")
    assert dp.is_ready() and dp.model_ready("b")
    response = await dp.infer("b", _request(np.ones((1, 4), np.float32)))
    assert response.outputs[0].data.shape == (1, 3)
    await dp.close()


async def test_an_inferred_batch_limit_bounds_merged_batches_not_requests(tmp_path):
    # A [?, 4] input with no config: the first dim may be time steps, not a batch, and
    # ONNX Runtime takes any length; a declared max_batch_size is a limit on requests.
    w, b = write_linear_model(tmp_path / "bare" / "1" / "model.onnx", seed=5)
    write_linear_model(tmp_path / "merged" / "1" / "model.onnx", seed=5)
    (tmp_path / "merged" / "config.toml").write_text(
        "[dynamic_batching]\nmax_queue_delay_us = 20000\npreferred_batch_sizes = [4]\n"
    )
    write_linear_model(tmp_path / "declared" / "1" / "model.onnx", seed=5)
    (tmp_path / "declared" / "config.toml").write_text("max_batch_size = 8\n")
    dp = DataPlane(ModelRepository(tmp_path), "n")
    for name in ("bare", "merged", "declared"):
        await dp.load(name)
    assert dp.get("bare").config.max_batch_size == 32
    x = np.random.default_rng(0).random((40, 4), dtype=np.float32)
    for name in ("bare", "merged"):
        out = await dp.infer(name, _request(x))
        np.testing.assert_allclose(out.outputs[0].data, linear_reference(x, w, b), rtol=1e-5)
    empty = await dp.infer("bare", _request(np.ones((0, 4), np.float32)))
    assert empty.outputs[0].shape == (0, 3)
    # with dynamic batching the long request runs alone; the short ones still merge
    small = [np.full((1, 4), i, np.float32) for i in range(6)]
    results = await asyncio.gather(
        *(dp.infer("merged", _request(s)) for s in small), dp.infer("merged", _request(x))
    )
    for s, r in zip(small, results, strict=False):
        np.testing.assert_allclose(r.outputs[0].data, linear_reference(s, w, b), rtol=1e-5)
    assert results[-1].outputs[0].shape == (40, 3)
    with pytest.raises(InvalidInput, match=r"batch dimension must be 1\.\.8"):
        await dp.infer("declared", _request(x))
    await dp.close()


async def test_inputs_that_broadcast_run_when_the_batch_limit_is_only_inferred(tmp_path):
    # y = a + b for a [N, K], b [M, K]: ONNX Runtime takes [2, 3] + [1, 3] (broadcast);
    # the dims are dynamic, not a declared batch axis, so Ferry must not refuse them.
    from onnx import TensorProto, helper, save

    v = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "add",
        [v("a", TensorProto.FLOAT, ["N", "K"]), v("b", TensorProto.FLOAT, ["M", "K"])],
        [v("y", TensorProto.FLOAT, [None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    for name in ("add", "merged", "declared"):
        (tmp_path / name / "1").mkdir(parents=True)
        save(model, str(tmp_path / name / "1" / "model.onnx"))
    (tmp_path / "merged" / "config.toml").write_text(
        "[dynamic_batching]\nmax_queue_delay_us = 20000\n"
    )
    (tmp_path / "declared" / "config.toml").write_text("max_batch_size = 8\n")
    dp = DataPlane(ModelRepository(tmp_path), "n")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((1, 3), 10.0, np.float32)

    def request(x: np.ndarray, y: np.ndarray) -> InferRequest:
        return InferRequest(inputs=[Tensor("a", "FP32", x), Tensor("b", "FP32", y)])

    for name in ("add", "merged"):
        await dp.load(name)
        out = await dp.infer(name, request(a, b))
        np.testing.assert_array_equal(out.outputs[0].data, a + b)
    # beside requests that do merge, each answered with its own sum
    pairs = [(a, b), (a[:1], a[:1]), (b, a), (a[1:], b)]
    results = await asyncio.gather(*(dp.infer("merged", request(x, y)) for x, y in pairs))
    for (x, y), r in zip(pairs, results, strict=True):
        np.testing.assert_array_equal(r.outputs[0].data, x + y)
    # what the runtime refuses is still a clear error
    with pytest.raises(InvalidInput):
        await dp.infer("add", request(a, np.ones((3, 3), np.float32)))
    await dp.load("declared")  # a declared batch axis: every input shares it, as in Triton
    with pytest.raises(InvalidInput, match="share one batch size"):
        await dp.infer("declared", request(a, b))
    await dp.close()


async def test_a_triton_repository_serves_its_config_pbtxt_versions_and_labels(tmp_path):
    write_softmax_model(tmp_path / "sm" / "1" / "model.onnx")
    write_softmax_model(tmp_path / "sm" / "2" / "model.onnx")
    (tmp_path / "sm" / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    (tmp_path / "sm" / "config.pbtxt").write_text(
        'name: "sm"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
        "version_policy: { all { } }\n"
        'output [ { name: "probs" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]\n'
        "dynamic_batching { }\n"
    )
    dp = DataPlane(ModelRepository(tmp_path), "n")
    await dp.load("sm")
    x = np.array([[0.0, 3.0, 1.0, 2.0]], np.float32)
    for version in ("1", "2"):
        req = _request(x)
        req.model_version = version
        req.outputs = [RequestedOutput("probs", parameters={"classification": 1})]
        out = (await dp.infer("sm", req)).outputs[0]
        assert out.data.tolist()[0][0].endswith(b":1:dog")
    with pytest.raises(InvalidInput, match=r"batch dimension must be 1\.\.4"):
        await dp.infer("sm", _request(np.ones((5, 4), np.float32)))
    await dp.close()


async def test_a_model_whose_outputs_are_not_batch_major_never_merges_requests(tmp_path):
    # Y = transpose(X): with X [n, 3, 2], Y is [2, 3, n]; a batch of two requests gives
    # [2, 3, 2], whose first dim matches the item count, and was cut into rows that mixed
    # the two clients' values.  Found at load: every request then runs alone.
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Transpose", ["X"], ["Y"], perm=[2, 1, 0])],
        "t",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", "h", "w"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["a", "b", "c"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "t" / "1").mkdir(parents=True)
    onnx.save(model, str(tmp_path / "t" / "1" / "model.onnx"))
    (tmp_path / "t" / "config.toml").write_text(
        "max_batch_size = 8\n[dynamic_batching]\nmax_queue_delay_us = 50000\npreferred_batch_sizes = [2]\n"
    )
    dp = DataPlane(ModelRepository(tmp_path), "n")
    await dp.load("t")
    xs = [np.random.default_rng(i).random((1, 3, 2), dtype=np.float32) for i in range(6)]
    results = await asyncio.gather(
        *(dp.infer("t", InferRequest(inputs=[Tensor.from_array("X", x)])) for x in xs)
    )
    for x, r in zip(xs, results, strict=True):
        np.testing.assert_array_equal(r.outputs[0].data, x.transpose(2, 1, 0))
    await dp.close()


async def test_a_reload_of_a_serving_version_keeps_its_counters_running(repo):
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("a")
    for _ in range(3):
        await dp.infer("a", _request(np.ones((2, 4), np.float32)))
    before = dp.get("a").stats.snapshot()
    (repo / "a" / "config.toml").write_text("[runtime]\nthreads = 1\n")
    await dp.load("a")  # a hot reload: new sessions, the same version
    await dp.infer("a", _request(np.ones((1, 4), np.float32)))
    after = dp.get("a").stats.snapshot()
    assert after.success_count == before.success_count + 1 == 4
    assert after.inference_count == before.inference_count + 1 == 7
    await dp.unload("a")
    await dp.load("a")  # unloaded in between: a new start, as in Triton
    assert dp.get("a").stats.snapshot().success_count == 0
    await dp.close()


class _Fleet:
    """The fleet as the dataplane sees it, placing nothing and recording misses."""

    handover_wait_s = 0.0

    def __init__(self) -> None:
        self.misses: list[str] = []

    def hosted(self, name: str) -> bool:
        return False

    def placed(self, name: str) -> bool:
        return False

    def missed(self, name: str) -> None:
        self.misses.append(name)

    def unplaced(self, name: str) -> str | None:
        return None


async def test_only_requests_for_repository_models_count_as_misses_the_fleet_may_place(repo):
    """Junk names had filled the fleet's miss table (and so every node's status) for good,
    and demand for a real model was then never counted."""
    dp = DataPlane(ModelRepository(repo), "n", cores=2)
    fleet = _Fleet()
    dp.remote = fleet
    for name in ("a", "nope", "x" * 200, "../a"):
        with pytest.raises(FerryError):
            dp.check_servable(name)
    assert fleet.misses == ["a"]
    await dp.close()


async def test_a_rescan_loads_new_models_reloads_changed_ones_and_leaves_the_rest(repo):
    """Triton's poll mode on demand (SIGHUP): a standalone node had no way to pick up
    a model added or changed on disk short of a restart."""
    dp = DataPlane(ModelRepository(repo), "n", cores=2)
    await dp.load("a")
    await dp.load("b")
    sessions_b = dp.get("b").sessions
    assert await dp.rescan(every_model=False) == {
        "loaded": [],
        "reloaded": [],
        "unloaded": [],
        "failed": [],
    }
    write_linear_model(repo / "a" / "2" / "model.onnx", seed=9)  # a new version of a
    write_linear_model(repo / "d" / "1" / "model.onnx", seed=4)  # a new model
    (repo / "e" / "1").mkdir(parents=True)
    (repo / "e" / "1" / "model.onnx").write_bytes(b"not a model")
    explicit = await dp.rescan(every_model=False)  # only what is loaded is refreshed
    assert explicit["reloaded"] == ["a"] and explicit["loaded"] == []
    assert dp.get("a").version == 2 and dp.get("b").sessions is sessions_b
    done = await dp.rescan(every_model=True)
    assert done["loaded"] == ["c", "d"] and done["reloaded"] == []
    assert [f.split(":")[0] for f in done["failed"]] == ["e"]
    again = await dp.rescan(every_model=True)  # a failed one is tried again (and says so)
    assert [f.split(":")[0] for f in again["failed"]] == ["e"] and again["loaded"] == []
    import shutil

    shutil.rmtree(repo / "d")
    assert (await dp.rescan(every_model=True))["unloaded"] == ["d"]
    assert "d" not in dp.loaded_names() and "a" in dp.loaded_names()
    await dp.close()


async def test_loads_and_unloads_of_names_the_repository_lacks_keep_nothing(repo):
    """Each junk name sent to load or unload had kept a lock for good."""
    from shared.errors import ModelNotFound

    dp = DataPlane(ModelRepository(repo), "n", cores=2)
    for i in range(50):
        with pytest.raises(ModelNotFound):
            await dp.load(f"junk{i}")
        with pytest.raises(ModelNotFound):
            await dp.unload(f"junk{i}")
    assert not any(name.startswith("junk") for name in dp._locks)
    await dp.close()


async def test_a_model_served_through_a_triton_reshape_batches_in_the_declared_shape(tmp_path):
    """A Triton repository's ``dims: [1] reshape: { shape: [ ] }`` model: requests of
    [n, 1] merged into one batch, the model fed [N], each answer [n, 1] again."""
    from tests.shared.repository import write_identity_model

    write_identity_model(tmp_path / "r" / "1" / "model.onnx", [("x", "FP32", ["N"])])
    (tmp_path / "r" / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]\n'
        'output [ { name: "x_out" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]\n'
    )
    dp = DataPlane(ModelRepository(tmp_path), "n", cores=2)
    await dp.load("r")
    assert dp.metadata("r")["inputs"][0]["shape"] == [-1, 1]
    assert dp.model_config("r")["input"][0]["reshape"] == {"shape": []}
    xs = [np.full((n, 1), n, np.float32) for n in (1, 2, 3)]
    replies = await asyncio.gather(*(dp.infer("r", _request(x)) for x in xs))
    for x, reply in zip(xs, replies, strict=True):
        np.testing.assert_array_equal(reply.outputs[0].data, x)
    assert any(r.parameters["batch_size"] > 1 for r in replies)  # merged, and cut back
    await dp.close()


async def test_a_bare_onnx_file_is_served_by_openvino_where_the_config_says_so(repo):
    """OpenVINO reads ONNX itself, as Triton's OpenVINO backend and OVMS serve a
    model.onnx: the load had failed ("has only model.onnx"), asking for a conversion."""
    # (f32: on a CPU with bf16 OpenVINO computes in it by default, 0.2% off ONNX Runtime)
    (repo / "a" / "config.toml").write_text(
        'backend = "openvino"\n[runtime]\nprecision_hint = "f32"\n'
    )
    dp = DataPlane(ModelRepository(repo), "n")
    await dp.load("a")
    assert dp.get("a").config.backend == "openvino"
    assert type(dp.get("a").sessions[0]).__module__ == "shared.runtimes.openvino_backend"
    x = np.random.default_rng(0).random((2, 4), dtype=np.float32)
    got = (await dp.infer("a", _request(x))).outputs[0].data
    reference = DataPlane(ModelRepository(repo), "ref")
    (repo / "a" / "config.toml").unlink()
    await reference.load("a")
    want = (await reference.infer("a", _request(x))).outputs[0].data
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    await dp.close()
    await reference.close()


async def test_a_keyed_retry_across_a_rollout_of_a_new_version_is_the_same_request(tmp_path):
    """The key's fingerprint held the version that served: after version 2 loaded, the
    same request with the same key was a 409 "other inputs" (and a deferred request
    its agent resent failed for good)."""
    from shared.errors import IdempotencyConflict

    write_linear_model(tmp_path / "m" / "1" / "model.onnx", seed=1)
    dp = DataPlane(ModelRepository(tmp_path), "n")
    await dp.load("m")
    x = np.ones((1, 4), np.float32)
    first = await dp.infer("m", _request(x, idempotency_key="k1"))
    assert first.model_version == "1"
    write_linear_model(tmp_path / "m" / "2" / "model.onnx", seed=2)
    await dp.load("m")
    again = await dp.infer("m", _request(x, idempotency_key="k1"))
    assert again.parameters.get("duplicate") is True and again.model_version == "1"
    with pytest.raises(IdempotencyConflict):  # (other inputs under the key still are one)
        await dp.infer("m", _request(x * 2, idempotency_key="k1"))
    await dp.close()


async def test_the_index_tells_loading_and_serving_versions_and_a_failed_load_is_logged(
    tmp_path, caplog
):
    """During a first load the index said UNAVAILABLE and requests "unknown model" (a
    404 clients take for good); a version serving from deleted files was left out of
    the index; a load that failed through the API left no line in the log."""
    import shutil

    from shared.errors import ModelNotReady
    from tests.support import write_slow_model

    write_slow_model(tmp_path / "slow" / "1" / "model.onnx")
    dp = DataPlane(ModelRepository(tmp_path), "n")
    loading = asyncio.create_task(dp.load("slow"))
    while "slow" not in dp._loading:
        await asyncio.sleep(0.001)
    assert dp.index() == [{"name": "slow", "version": "1", "state": "LOADING", "reason": ""}]
    with pytest.raises(ModelNotReady, match="loading"):
        dp.check_servable("slow")
    await loading
    assert dp.index()[0]["state"] == "READY"
    shutil.rmtree(tmp_path / "slow" / "1")
    (entry,) = dp.index(ready_only=True)
    assert entry["state"] == "READY" and "no longer in the repository" in entry["reason"]
    assert [e["state"] for e in dp.index() if e["name"] == "slow"] == ["READY"]  # (one)
    (tmp_path / "junk" / "1").mkdir(parents=True)
    (tmp_path / "junk" / "1" / "model.onnx").write_bytes(b"not a model")
    with caplog.at_level("ERROR"), pytest.raises(FerryError):
        await dp.load("junk")
    assert "failed to load junk" in caplog.text
    await dp.close()


async def test_a_long_model_of_several_instances_gets_no_lone_session_unless_asked(tmp_path):
    """The lone session holds every instance while it runs: beside two instances, a
    second request waited out the first's whole (long) run beside an idle one."""
    from tests.support import write_slow_model

    for name, extra in (("one", ""), ("two", "[instance_group]\ncount = 2\n")):
        # (a batch-1 run long enough for a lone session to pay, and past 20 ms)
        write_slow_model(tmp_path / name / "1" / "model.onnx", layers=36)
        (tmp_path / name / "config.toml").write_text("[runtime]\nthreads = 1\n" + extra)
    (tmp_path / "asked" / "1").mkdir(parents=True)
    write_slow_model(tmp_path / "asked" / "1" / "model.onnx", layers=4)
    (tmp_path / "asked" / "config.toml").write_text(
        "[runtime]\nthreads = 1\nlone_threads = 4\n[instance_group]\ncount = 2\n"
    )
    dp = DataPlane(ModelRepository(tmp_path), "n", cores=4)
    for name in ("one", "two", "asked"):
        await dp.load(name)
    assert dp.get("one").lone is not None  # (one instance: the lone run as before)
    assert dp.get("two").lone is None and len(dp.get("two").sessions) == 2
    assert dp.get("asked").lone is not None  # (said outright in the config)
    await dp.close()
