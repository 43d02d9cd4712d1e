"""The OpenVINO backend on ONNX files, on IR saved from them, and on a real CNN."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from ml_dtypes import bfloat16

from shared.errors import BackendMissing, ConfigError, InvalidInput, ModelNotFound, ModelNotReady
from shared.runtimes import load_session
from shared.runtimes.base import Cancel, RuntimeOptions, TensorSpec
from shared.runtimes.openvino_backend import load

EXACT = RuntimeOptions(threads=1, precision_hint="f32")


def _to_ir(onnx_path: Path, folder: Path) -> Path:
    folder.mkdir()
    xml = folder / "model.xml"
    # save_model stores FP16 weights unless told not to; these tests check exactness
    ov.save_model(ov.Core().read_model(str(onnx_path)), str(xml), compress_to_fp16=False)
    return xml


@pytest.fixture(params=["onnx", "ir"])
def mlp_file(request, mlp_onnx, tmp_path: Path) -> Path:
    """The MLP as the .onnx file itself and as IR (.xml + .bin) saved from it."""
    if request.param == "onnx":
        return mlp_onnx.path
    return _to_ir(mlp_onnx.path, tmp_path / "ir")


def test_specs_match_the_onnx_file_in_both_formats(mlp_file: Path) -> None:
    session = load(mlp_file, EXACT)
    assert session.backend == "openvino"
    assert session.inputs == [TensorSpec("x", "FP32", (-1, 4))]
    assert session.outputs == [
        TensorSpec("y", "FP32", (-1, 3)),
        TensorSpec("logits", "FP32", (-1, 3)),
    ]


def test_mlp_matches_numpy_for_any_batch_size(mlp_file: Path, mlp_onnx) -> None:
    session = load(mlp_file, EXACT)
    for batch in (1, 3, 17, 2):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        out = session.run({"x": x})
        for name, want in mlp_onnx.reference(x).items():
            assert out[name].dtype == np.float32 and out[name].shape == (batch, 3)
            np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5)


def test_a_scalar_input_keeps_rank_0_in_both_formats(scalar_onnx, tmp_path: Path) -> None:
    # a [1] in its place is refused by OpenVINO: "model input (shape=[]) ... incompatible"
    for path in (scalar_onnx.path, _to_ir(scalar_onnx.path, tmp_path / "ir")):
        session = load(path, EXACT)
        out = session.run({"x": np.array(3.5, dtype=np.float32)})
        assert out["y"].shape == ()
        assert out["y"] == np.float32(7.0)


def test_conv_nchw_matches_numpy_with_f32_precision(conv_onnx) -> None:
    session = load(conv_onnx.path, EXACT)
    for batch in (1, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
        out = session.run({"x": x})["y"]
        np.testing.assert_allclose(out, conv_onnx.reference(x)["y"], rtol=1e-4, atol=1e-4)


def test_compiled_model_follows_threads_precision_and_latency_hint(mlp_onnx) -> None:
    session = load(mlp_onnx.path, EXACT)
    assert session.property("INFERENCE_NUM_THREADS") == 1
    assert str(session.property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
    assert str(session.property("PERFORMANCE_HINT")) == "LATENCY"
    assert session.device == "CPU"


def test_fp16_int64_bool_uint8_fp64_tensors_round_trip(numeric_onnx) -> None:
    session = load(numeric_onnx.path, EXACT)
    assert {s.name: s.datatype for s in session.outputs} == {
        "h_sq": "FP16", "i_plus": "INT64", "not_flag": "BOOL", "u8_out": "UINT8", "i_f64": "FP64",
    }  # fmt: skip
    x = {
        "h": np.array([[1.5, -2.0], [0.25, 3.0]], np.float16),
        "i": np.array([1, -(2**31)], np.int64),
        "flag": np.array([True, False]),
        "u8": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    out = session.run(x)
    for name, want in numeric_onnx.reference(**x).items():
        assert out[name].dtype == want.dtype, name
        np.testing.assert_array_equal(out[name], want)


def test_bf16_inputs_and_outputs_are_carried_as_ml_dtypes_bfloat16(bf16_onnx: Path) -> None:
    session = load(bf16_onnx, EXACT)
    assert [s.datatype for s in session.inputs] == ["BF16", "FP32"]
    b = np.array([1.5, -2.25, 3.140625], bfloat16)
    x = np.array([1.0, 2.5, 3.14159], np.float32)
    out = session.run({"b": b, "x": x})
    np.testing.assert_array_equal(out["widened"], b.astype(np.float32))
    assert out["narrowed"].dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(out["narrowed"], x.astype(bfloat16))


def test_int64_values_beyond_int32_are_refused_on_cpu(numeric_onnx) -> None:
    """The CPU plugin computes INT64 as INT32: 2**40 + 7 would come back as 7."""
    session = load(numeric_onnx.path, EXACT)
    x = {
        "h": np.zeros((1, 2), np.float16),
        "i": np.array([2**40], np.int64),
        "flag": np.zeros(1, bool),
        "u8": np.zeros((1, 3), np.uint8),
    }
    with pytest.raises(InvalidInput, match="INT32 range"):
        session.run(x)


def test_uint64_values_beyond_int32_are_refused_on_cpu_and_uint32_ones_kept(tmp_path) -> None:
    """UINT64 is computed as INT32 too: 2**40 + 1 had come back 1 with a 200."""
    import onnx
    from onnx import TensorProto, helper

    for dtype, proto in ((np.uint64, TensorProto.UINT64), (np.uint32, TensorProto.UINT32)):
        one = helper.make_tensor("one", proto, [1], [1])
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "one"], ["y"])],
            "add1",
            [helper.make_tensor_value_info("x", proto, [2])],
            [helper.make_tensor_value_info("y", proto, [2])],
            [one],
        )
        path = tmp_path / f"{dtype.__name__}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
        session = load(path, EXACT)
        small = np.array([5, 2**31 - 2], dtype)
        np.testing.assert_array_equal(session.run({"x": small})["y"], small + 1)
        big = np.array([5, 2**32 - 2], dtype)
        if dtype is np.uint64:
            with pytest.raises(InvalidInput, match="UINT64 as INT32"):
                session.run({"x": big})
        else:
            np.testing.assert_array_equal(session.run({"x": big})["y"], big + 1)


def test_fp64_values_beyond_fp32_are_refused_on_cpu_and_the_narrowing_is_said(
    tmp_path, caplog
) -> None:
    """The CPU plugin computes FP64 as FP32: 1e300 + 1 had come back 3.4e38 with a 200."""
    import logging

    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.DOUBLE, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "add1",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])],
        [one],
    )
    path = tmp_path / "f64.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    with caplog.at_level(logging.WARNING, "shared.runtimes.openvino_backend"):
        session = load(path, EXACT)
    assert session.narrowed == {"x": "FP64 as FP32", "y": "FP64 as FP32"}
    assert "computes x FP64 as FP32" in caplog.text and "onnxruntime" in caplog.text
    inside = np.array([0.5, -2.0**127, np.nan])  # (exact in FP32 too)
    np.testing.assert_array_equal(session.run({"x": inside})["y"], inside + 1)
    for beyond in (1e300, -np.inf):  # (an infinity came back as 3.4e38 too)
        with pytest.raises(InvalidInput, match="FP64 as FP32"):
            session.run({"x": np.array([0.5, beyond, 1.0])})


def test_a_fixed_zero_dimension_stays_zero_in_a_made_up_input() -> None:
    """Made 1, every warm-up of a model with a [N, 0] input failed and was logged."""
    assert TensorSpec("x", "FP32", (-1, 0, 3)).sample_dims() == (1, 0, 3)


def test_a_dynamic_rank_is_the_cpu_plugins_refusal_said_without_source_lines(
    anyrank_onnx,
) -> None:
    with pytest.raises(ConfigError) as info:
        load(anyrank_onnx.path, RuntimeOptions(threads=1))
    said = str(info.value)
    assert "dynamic rank" in said and "Operation name: x" in said
    assert "Exception from" not in said and ".cpp" not in said


def test_string_models_are_refused_and_pointed_at_onnxruntime(strings_onnx: Path) -> None:
    with pytest.raises(ConfigError, match="onnxruntime"):
        load(strings_onnx, EXACT)


BAD_REQUESTS = {
    # OpenVINO itself runs the first and silently converts the second
    "wrong inner dim": ({"x": np.zeros((2, 5), np.float32)}, None, "shape"),
    "fp64 for fp32": ({"x": np.zeros((2, 4), np.float64)}, None, "FP32"),
    "wrong rank": ({"x": np.zeros(4, np.float32)}, None, "shape"),
    "missing input": ({}, None, "missing"),
    "unknown input": ({"x": np.zeros((1, 4), np.float32), "q": np.zeros(1)}, None, "unknown"),
    "unknown output": ({"x": np.zeros((1, 4), np.float32)}, ["nope"], "unknown outputs"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_raise_invalid_input(mlp_onnx, case: str) -> None:
    inputs, outputs, message = BAD_REQUESTS[case]
    session = load(mlp_onnx.path, EXACT)
    with pytest.raises(InvalidInput, match=message):
        session.run(inputs, outputs)


def test_inputs_the_plugin_refuses_raise_invalid_input_never_an_earlier_answer(
    add_onnx: Path, tmp_path: Path
) -> None:
    # A reused request's synchronous infer() returned the previous run's sum here.
    for path in (add_onnx, _to_ir(add_onnx, tmp_path / "ir")):
        session = load(path, EXACT)
        for cancel in (None, Cancel()):
            ok = session._run(
                {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)}, None, cancel
            )
            np.testing.assert_array_equal(ok["y"], np.full((2, 3), 2.0, np.float32))
            with pytest.raises(InvalidInput, match=r"cannot run the model on these inputs: .*Add"):
                session._run(
                    {"a": np.ones((2, 3), np.float32), "b": np.ones((4, 3), np.float32)},
                    None,
                    cancel if cancel is None else Cancel(),
                )
        with pytest.raises(InvalidInput) as refused:
            session.run({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 3), np.float32)})
        assert "Exception from" not in str(refused.value)  # C++ source locations dropped


def test_outputs_stay_valid_after_the_next_run(mlp_onnx) -> None:
    session = load(mlp_onnx.path, EXACT)
    first = session.run({"x": np.ones((3, 4), np.float32)}, ["logits"])["logits"]
    kept = first.copy()
    session.run({"x": np.full((3, 4), -5.0, np.float32)})
    np.testing.assert_array_equal(first, kept)


def test_concurrent_runs_share_one_request_safely(mlp_onnx) -> None:
    session = load(mlp_onnx.path, EXACT)
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((n % 6 + 1, 4)).astype(np.float32) for n in range(30)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda x: session.run({"x": x})["y"], batches))
    for x, y in zip(batches, results, strict=True):
        np.testing.assert_allclose(y, mlp_onnx.reference(x)["y"], rtol=1e-5, atol=1e-5)


def test_a_closed_session_refuses_to_run(mlp_onnx) -> None:
    session = load(mlp_onnx.path, EXACT)
    session.close()
    session.close()
    with pytest.raises(ModelNotReady, match="closed"):
        session.run({"x": np.ones((1, 4), np.float32)})


def test_missing_model_or_weights_are_model_not_found(mlp_onnx, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"absent\.xml"):
        load(tmp_path / "absent.xml", EXACT)
    xml = _to_ir(mlp_onnx.path, tmp_path / "ir")
    xml.with_suffix(".bin").unlink()
    with pytest.raises(ModelNotFound, match=r"model\.bin"):
        load(xml, EXACT)


def test_a_gpu_request_without_an_openvino_gpu_is_backend_missing(mlp_onnx) -> None:
    if any(d.startswith("GPU") for d in ov.Core().available_devices):
        pytest.skip("this machine has an OpenVINO GPU")
    with pytest.raises(BackendMissing, match="GPU"):
        load(mlp_onnx.path, RuntimeOptions(threads=1, device="gpu"))


def test_real_cnn_agrees_with_onnxruntime(orientation_onnx: Path) -> None:
    x = np.random.default_rng(5).random((2, 3, 224, 224), dtype=np.float32)
    ort_session = load_session("onnxruntime", orientation_onnx, RuntimeOptions(threads=2))
    ov_session = load_session("openvino", orientation_onnx, RuntimeOptions(threads=2, precision_hint="f32"))  # fmt: skip
    assert ov_session.inputs == ort_session.inputs
    assert [s.name for s in ov_session.outputs] == [s.name for s in ort_session.outputs]
    name = ort_session.inputs[0].name
    want, got = ort_session.run({name: x}), ov_session.run({name: x})
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5)


# ---- cancelling a run (the edge agent stops a race's local run this way) ----------------


def test_a_cancel_stops_a_run_halfway_and_the_session_runs_on(tmp_path: Path) -> None:
    from tests.support import check_cancel_stops_a_run_halfway

    check_cancel_stops_a_run_halfway(lambda path: load(path, RuntimeOptions(threads=1)), tmp_path)
