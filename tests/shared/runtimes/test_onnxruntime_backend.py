"""The ONNX Runtime backend against numpy references on tiny real models."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16

from shared.errors import BackendMissing, ConfigError, InvalidInput, ModelNotFound, ModelNotReady
from shared.runtimes import load_session
from shared.runtimes.base import RuntimeOptions, Session, TensorSpec
from shared.runtimes.onnxruntime_backend import load

ONE_THREAD = RuntimeOptions(threads=1)


def test_mlp_reports_specs_with_dynamic_batch(mlp_onnx) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    assert isinstance(session, Session)
    assert session.backend == "onnxruntime"
    assert session.inputs == [TensorSpec("x", "FP32", (-1, 4))]
    assert session.outputs == [
        TensorSpec("y", "FP32", (-1, 3)),
        TensorSpec("logits", "FP32", (-1, 3)),
    ]


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_mlp_matches_numpy_for_each_batch_size(mlp_onnx, batch: int) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
    out = session.run({"x": x})
    want = mlp_onnx.reference(x)
    assert set(out) == {"y", "logits"}
    for name in want:
        assert out[name].dtype == np.float32 and out[name].shape == (batch, 3)
        np.testing.assert_allclose(out[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_conv_nchw_matches_numpy(conv_onnx, batch: int) -> None:
    session = load(conv_onnx.path, ONE_THREAD)
    x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
    out = session.run({"x": x})
    np.testing.assert_allclose(out["y"], conv_onnx.reference(x)["y"], rtol=1e-4, atol=1e-4)


def test_a_scalar_input_keeps_rank_0_through_the_run(scalar_onnx) -> None:
    session = load(scalar_onnx.path, RuntimeOptions(threads=1))
    assert session.inputs[0].dims == ()
    out = session.run({"x": np.array(3.5, dtype=np.float32)})
    assert out["y"].shape == ()
    assert out["y"] == np.float32(7.0)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (1, 3, 4, 4)])
def test_a_tensor_with_no_shape_in_the_file_takes_any_rank(anyrank_onnx, shape) -> None:
    session = load(anyrank_onnx.path, ONE_THREAD)
    assert session.inputs == [TensorSpec("x", "FP32", (), ranked=False)]
    assert session.outputs == [TensorSpec("y", "FP32", (), ranked=False)]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    out = session.run({"x": x})
    np.testing.assert_array_equal(out["y"], anyrank_onnx.reference(x)["y"])


def test_a_scalar_in_the_file_stays_rank_0_beside_any_rank_tensors(scalar_onnx) -> None:
    # ORT shows a scalar and a shapeless tensor alike as []: the file tells them apart
    session = load(scalar_onnx.path, ONE_THREAD)
    assert session.inputs == [TensorSpec("x", "FP32", ())]
    with pytest.raises(InvalidInput, match="expected shape"):
        session.run({"x": np.ones(2, dtype=np.float32)})


def test_only_the_requested_outputs_come_back(mlp_onnx) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    x = np.ones((2, 4), np.float32)
    assert list(session.run({"x": x}, ["logits"])) == ["logits"]
    assert list(session.run({"x": x}, [])) == ["y", "logits"]


def test_fp16_int64_bool_uint8_and_bytes_tensors_round_trip(mixed_onnx) -> None:
    session = load(mixed_onnx.path, ONE_THREAD)
    types = {s.name: s.datatype for s in session.inputs + session.outputs}
    assert types == {
        "h": "FP16", "i": "INT64", "flag": "BOOL", "u8": "UINT8", "s": "BYTES",
        "h_sq": "FP16", "i_plus": "INT64", "not_flag": "BOOL", "u8_out": "UINT8",
        "i_f64": "FP64", "s_out": "BYTES",
    }  # fmt: skip
    strings = np.array([b"abc", "h\u00e9llo \u2713".encode(), b""], dtype=object)
    x = {
        "h": np.array([[1.5, -2.0], [0.25, 3.0], [0.0, 1.0]], np.float16),
        "i": np.array([1, -8, 2**40], np.int64),
        "flag": np.array([True, False, True]),
        "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
        "s": strings,
    }
    out = session.run(x)
    want = mixed_onnx.reference(**x)
    for name, value in want.items():
        assert out[name].dtype == value.dtype, name
        np.testing.assert_array_equal(out[name], value)
    assert all(type(item) is bytes for item in out["s_out"])


def test_bytes_inputs_must_be_utf8_for_onnxruntime(strings_onnx: Path) -> None:
    session = load(strings_onnx, ONE_THREAD)
    with pytest.raises(InvalidInput, match="UTF-8"):
        session.run({"s": np.array([b"\xff\xfe"], dtype=object)})


def test_bf16_inputs_and_outputs_are_carried_as_ml_dtypes_bfloat16(bf16_onnx: Path) -> None:
    session = load(bf16_onnx, ONE_THREAD)
    assert [s.datatype for s in session.inputs] == ["BF16", "FP32"]
    assert [s.datatype for s in session.outputs] == ["FP32", "BF16"]
    b = np.array([1.5, -2.25, 3.140625, 0.0], bfloat16)
    x = np.array([1.0, 2.5, 3.14159, -7.0], np.float32)
    out = session.run({"b": b, "x": x})
    np.testing.assert_array_equal(out["widened"], b.astype(np.float32))
    assert out["narrowed"].dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(out["narrowed"], x.astype(bfloat16))


BAD_MLP_REQUESTS = {
    "wrong inner dim": ({"x": np.zeros((2, 5), np.float32)}, None, "shape"),
    "wrong rank": ({"x": np.zeros((2, 4, 1), np.float32)}, None, "shape"),
    "wrong dtype": ({"x": np.zeros((2, 4), np.float64)}, None, "FP32"),
    "bytes for floats": ({"x": np.full((2, 4), b"a", dtype=object)}, None, "BYTES"),
    "missing input": ({}, None, "missing"),
    "unknown input": ({"x": np.zeros((2, 4), np.float32), "z": np.zeros(1)}, None, "unknown"),
    "unknown output": ({"x": np.zeros((2, 4), np.float32)}, ["nope"], "unknown outputs"),
    "not an array": ({"x": [[0.0] * 4]}, None, "numpy array"),
}


@pytest.mark.parametrize("case", list(BAD_MLP_REQUESTS))
def test_bad_requests_raise_invalid_input(mlp_onnx, case: str) -> None:
    inputs, outputs, message = BAD_MLP_REQUESTS[case]
    session = load(mlp_onnx.path, ONE_THREAD)
    with pytest.raises(InvalidInput, match=message):
        session.run(inputs, outputs)


def test_dims_sharing_a_symbolic_name_may_differ_when_the_runtime_accepts(
    unnamed_dims_onnx: Path,
) -> None:
    # rapidocr's text-line classifier declares x [?, 3, '?', '?'] and takes 48 x 192 lines
    session = load(unnamed_dims_onnx, ONE_THREAD)
    assert session.inputs == [TensorSpec("x", "FP32", (-1, -1, -1))]
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    np.testing.assert_allclose(session.run({"x": x})["total"], x.sum(axis=(1, 2)))


def test_inputs_sharing_a_batch_name_run_independently_when_no_kernel_ties_them(
    numeric_onnx,
) -> None:
    session = load(numeric_onnx.path, ONE_THREAD)
    x = {
        "h": np.ones((2, 2), np.float16),
        "i": np.arange(3, dtype=np.int64),
        "flag": np.zeros(2, bool),
        "u8": np.zeros((4, 3), np.uint8),
    }
    out = session.run(x)
    np.testing.assert_array_equal(out["i_plus"], np.arange(3) + 7)
    assert out["u8_out"].shape == (4, 3)


def test_a_kernel_refusing_the_shapes_is_invalid_input_not_internal(add_onnx: Path) -> None:
    session = load(add_onnx, ONE_THREAD)
    with pytest.raises(InvalidInput, match="cannot run the model on these inputs") as info:
        session.run({"a": np.zeros((2, 3), np.float32), "b": np.zeros((3, 3), np.float32)})
    # the reason, not the runtime's C++ internals (a client reads it, over MQTT too)
    said = str(info.value)
    assert "broadcast" in said and "onnxruntime_src" not in said and ".h:" not in said
    assert "[ONNXRuntimeError]" not in said
    y = session.run({"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)})["y"]
    np.testing.assert_array_equal(y, np.full((2, 3), 2.0, np.float32))


@pytest.mark.parametrize(
    "fixture, keys", [("zipmap_onnx", [30, 10, 20]), ("zipmap_strings_onnx", ["cat", "ant", "bee"])]
)
def test_zipmap_output_is_served_as_rows_of_classes_in_ascending_key_order(
    request: pytest.FixtureRequest, fixture: str, keys: list
) -> None:
    session = load(request.getfixturevalue(fixture), ONE_THREAD)
    assert session.outputs == [
        TensorSpec("label", "INT64", (-1,)),
        TensorSpec("probs", "FP32", (-1, -1)),
    ]
    x = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, -1.0]], np.float32)
    out = session.run({"x": x})
    soft = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    order = sorted(range(len(keys)), key=lambda i: keys[i])  # file column of each served one
    assert out["probs"].dtype == np.float32 and out["probs"].shape == (2, 3)
    np.testing.assert_allclose(out["probs"], soft[:, order], rtol=1e-6)
    assert list(session.run({"x": x}, ["probs"])) == ["probs"]


def test_outputs_stay_valid_after_the_next_run(mlp_onnx) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    first = session.run({"x": np.ones((3, 4), np.float32)})["logits"]
    kept = first.copy()
    session.run({"x": np.full((3, 4), -5.0, np.float32)})
    np.testing.assert_array_equal(first, kept)


@pytest.mark.parametrize("threads, spinning", [(1, False), (2, True)])
def test_session_options_follow_threads_and_spinning(mlp_onnx, threads, spinning) -> None:
    session = load(mlp_onnx.path, RuntimeOptions(threads=threads, allow_spinning=spinning))
    options = session.session_options
    assert options.intra_op_num_threads == threads
    assert options.inter_op_num_threads == 1
    flag = options.get_session_config_entry("session.intra_op.allow_spinning")
    assert flag == ("1" if spinning else "0")
    assert session.providers == ["CPUExecutionProvider"]


def test_unset_threads_mean_the_cores_this_process_may_use(mlp_onnx) -> None:
    import os

    session = load(mlp_onnx.path, RuntimeOptions())
    assert session.session_options.intra_op_num_threads == len(os.sched_getaffinity(0))


def test_concurrent_runs_from_several_threads_all_match(mlp_onnx) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((n % 5 + 1, 4)).astype(np.float32) for n in range(40)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda x: session.run({"x": x})["y"], batches))
    for x, y in zip(batches, results, strict=True):
        np.testing.assert_allclose(y, mlp_onnx.reference(x)["y"], rtol=1e-5, atol=1e-5)


def test_a_closed_session_refuses_to_run(mlp_onnx) -> None:
    session = load(mlp_onnx.path, ONE_THREAD)
    session.close()
    session.close()  # idempotent
    with pytest.raises(ModelNotReady, match="closed"):
        session.run({"x": np.ones((1, 4), np.float32)})


def test_missing_and_corrupt_model_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"absent\.onnx"):
        load(tmp_path / "absent.onnx", ONE_THREAD)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a protobuf at all")
    with pytest.raises(InvalidInput, match=r"broken\.onnx"):
        load(broken, ONE_THREAD)


def test_load_session_dispatches_by_backend_name(mlp_onnx) -> None:
    session = load_session("onnxruntime", mlp_onnx.path, ONE_THREAD)
    assert session.backend == "onnxruntime"
    with pytest.raises(ConfigError, match="unknown backend 'tflite'"):
        load_session("tflite", mlp_onnx.path)


def test_real_orientation_model_reports_its_nchw_input(orientation_onnx: Path) -> None:
    session = load(orientation_onnx, ONE_THREAD)
    (spec,) = session.inputs
    assert spec.datatype == "FP32" and spec.dims[1:] == (3, 224, 224)
    x = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
    (out,) = session.run({spec.name: x}).values()
    assert out.shape[0] == 2 and np.isfinite(out).all()


# ---- cancelling a run (the edge agent stops a race's local run this way) ----------------


def test_a_cancel_stops_a_run_halfway_and_the_session_runs_on(tmp_path: Path) -> None:
    from tests.support import check_cancel_stops_a_run_halfway

    check_cancel_stops_a_run_halfway(lambda path: load(path, ONE_THREAD), tmp_path)


def test_a_tensor_anywhere_in_a_body_gives_the_answer_an_aligned_array_gives(tmp_path) -> None:
    """A binary tensor's bytes start wherever the JSON header before them ends; ONNX
    Runtime's ReduceSum summed a view at 4, 8 or 12 bytes past a 16-byte boundary in
    another order (1 ulp apart from the same values in a numpy array)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1)],
        "sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    path = tmp_path / "sum.onnx"
    onnx.save(model, str(path))
    session = load(path, RuntimeOptions(threads=1))
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.random((int(rng.integers(2, 40)), 3), np.float32)
        want = session.run({"x": x.copy()})["s"].tobytes()
        for offset in (4, 8, 12, 20):
            body = bytearray(offset + x.nbytes + 64)
            start = (-np.frombuffer(body, np.uint8).ctypes.data) % 64 + offset
            body[start : start + x.nbytes] = x.tobytes()
            view = np.frombuffer(body, np.float32, x.size, start).reshape(x.shape)
            assert session.run({"x": view})["s"].tobytes() == want, offset


def test_a_gpu_instance_without_a_cuda_provider_fails_the_load_as_triton_does(mlp_onnx) -> None:
    """It had run on the CPU while the model's config still said KIND_GPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine's onnxruntime has CUDA")
    with pytest.raises(BackendMissing, match="CUDA"):
        load(mlp_onnx.path, RuntimeOptions(threads=1, device="gpu"))
