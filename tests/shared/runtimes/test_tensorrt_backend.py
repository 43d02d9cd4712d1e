"""The TensorRT backend: a clean failure without TensorRT, real runs where it exists.

TensorRT cannot be installed from the registries this project uses (DESIGN.md
section 6), so on most machines only the first tests run; the engine tests
run on a GPU machine with ``tensorrt`` and a CUDA binding installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from shared.errors import BackendMissing, ConfigError, InvalidInput, ModelNotFound, ModelNotReady
from shared.runtimes import load_session
from shared.runtimes.base import RuntimeOptions, TensorSpec

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_without_tensorrt_loading_is_backend_missing_naming_the_package(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"\x00" * 32)
    with pytest.raises(BackendMissing, match="tensorrt") as caught:
        load_session("tensorrt", plan)
    assert "pip install 'ferry[gpu]'" in caught.value.message
    assert caught.value.http_status == 501


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_the_missing_package_is_reported_before_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BackendMissing):
        load_session("tensorrt", tmp_path / "absent.plan")


def test_an_unknown_backend_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tensorrt"):
        load_session("tensor-rt", tmp_path / "model.plan")


def _cuda_ready() -> bool:
    if not HAS_TENSORRT:
        return False
    from shared.runtimes.tensorrt_backend import _open_cuda

    try:
        _open_cuda().close()
    except BackendMissing:
        return False
    return True


gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs tensorrt, a CUDA binding and a GPU")


@pytest.fixture
def mlp_plan(mlp_onnx, tmp_path: Path) -> Path:
    """The test MLP built into a TensorRT engine with a batch profile of 1..32."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(mlp_onnx.path.read_bytes()), [
        str(parser.get_error(i)) for i in range(parser.num_errors)
    ]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 4), (8, 4), (32, 4))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    path = tmp_path / "model.plan"
    path.write_bytes(bytes(plan))
    return path


@gpu
def test_engine_reports_specs_and_matches_numpy_for_several_batches(mlp_plan, mlp_onnx) -> None:
    session = load_session("tensorrt", mlp_plan, RuntimeOptions(device="gpu"))
    try:
        assert session.backend == "tensorrt"
        assert session.inputs == [TensorSpec("x", "FP32", (-1, 4))]
        assert {s.name for s in session.outputs} == {"y", "logits"}
        kept = None
        for batch in (1, 3, 17, 32, 2):
            x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
            out = session.run({"x": x})
            for name, want in mlp_onnx.reference(x).items():
                np.testing.assert_allclose(out[name], want, rtol=1e-3, atol=1e-3)
            if kept is None:
                kept, copy = out["y"], out["y"].copy()
        np.testing.assert_array_equal(kept, copy)  # outputs survive later runs
        assert list(session.run({"x": x}, ["logits"])) == ["logits"]
    finally:
        session.close()


@gpu
def test_engine_refuses_bad_requests_and_runs_after_close_fail(mlp_plan, tmp_path: Path) -> None:
    session = load_session("tensorrt", mlp_plan, RuntimeOptions(device="gpu"))
    with pytest.raises(InvalidInput, match="profile"):
        session.run({"x": np.zeros((33, 4), np.float32)})
    with pytest.raises(InvalidInput, match="FP32"):
        session.run({"x": np.zeros((2, 4), np.float64)})
    with pytest.raises(InvalidInput, match="unknown outputs"):
        session.run({"x": np.zeros((2, 4), np.float32)}, ["nope"])
    session.close()
    with pytest.raises(ModelNotReady):
        session.run({"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(ModelNotFound):
        load_session("tensorrt", tmp_path / "absent.plan")
    junk = tmp_path / "junk.plan"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidInput, match="junk"):
        load_session("tensorrt", junk)
