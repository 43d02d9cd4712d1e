"""The LiteRT backend on a real int8 keyword spotter and on small TFLite files."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

from shared.errors import InvalidInput, ModelNotFound, ModelNotReady
from shared.runtimes import load_session
from shared.runtimes.base import RuntimeOptions, TensorSpec
from shared.runtimes.litert_backend import load

ONE_THREAD = RuntimeOptions(threads=1)
WAKE_IN = "serving_default_input_audio:0"
WAKE_OUT = "StatefulPartitionedCall:0"


def _frames(count: int, seed: int = 0) -> list[np.ndarray]:
    """Feature frames in the spotter's int8 input range (3 feature slices x 40 bins)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-128, 128, size=(1, 3, 40), dtype=np.int8) for _ in range(count)]


def test_wakeword_reports_raw_int8_tensors_and_their_quantization(wakeword_tflite: Path) -> None:
    session = load(wakeword_tflite, ONE_THREAD)
    assert session.backend == "litert"
    assert session.inputs == [TensorSpec(WAKE_IN, "INT8", (1, 3, 40))]
    assert session.outputs == [TensorSpec(WAKE_OUT, "UINT8", (1, 1))]
    direct = Interpreter(model_path=str(wakeword_tflite))
    for detail in direct.get_input_details() + direct.get_output_details():
        scale, zero_point = detail["quantization"]
        assert session.quantization[detail["name"]] == pytest.approx((scale, zero_point))
    assert session.quantization[WAKE_IN][1] == -128


def test_wakeword_stream_matches_the_interpreter_called_directly(wakeword_tflite: Path) -> None:
    frames = _frames(30)
    session = load(wakeword_tflite, ONE_THREAD)
    got = [session.run({WAKE_IN: f})[WAKE_OUT] for f in frames]
    direct = Interpreter(model_path=str(wakeword_tflite), num_threads=1)
    direct.allocate_tensors()
    (inp,), (out,) = direct.get_input_details(), direct.get_output_details()
    want = []
    for frame in frames:
        direct.set_tensor(inp["index"], frame)
        direct.invoke()
        want.append(direct.get_tensor(out["index"]))
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    assert all(g.dtype == np.uint8 and g.shape == (1, 1) for g in got)
    scale, zero_point = session.quantization[WAKE_OUT]
    probabilities = (np.concatenate(got).astype(np.float64) - zero_point) * scale
    assert ((probabilities >= 0.0) & (probabilities <= 1.0)).all()
    assert len(np.unique(np.concatenate(got))) > 1  # the stream really moves the output


def test_wakeword_is_deterministic_and_reset_starts_a_new_stream(wakeword_tflite: Path) -> None:
    frames = _frames(25, seed=4)
    first = load(wakeword_tflite, ONE_THREAD)
    second = load(wakeword_tflite, RuntimeOptions(threads=2))
    a = [first.run({WAKE_IN: f})[WAKE_OUT] for f in frames]
    b = [second.run({WAKE_IN: f})[WAKE_OUT] for f in frames]
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))
    first.reset()
    again = [first.run({WAKE_IN: f})[WAKE_OUT] for f in frames]
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate(a))


def test_wakeword_fixed_batch_of_one_refuses_other_batch_sizes(wakeword_tflite: Path) -> None:
    session = load(wakeword_tflite, ONE_THREAD)
    with pytest.raises(InvalidInput, match=r"expected shape \[1, 3, 40\]"):
        session.run({WAKE_IN: np.zeros((2, 3, 40), np.int8)})
    assert session.run({WAKE_IN: np.zeros((1, 3, 40), np.int8)})[WAKE_OUT].shape == (1, 1)


def test_dynamic_batch_is_resized_per_request_and_matches_numpy(fc_tflite) -> None:
    session = load_session("litert", fc_tflite.path, ONE_THREAD)
    assert session.inputs == [TensorSpec("a", "FP32", (-1, 4)), TensorSpec("c", "FP32", (-1, 4))]
    assert session.outputs == [
        TensorSpec("fc", "FP32", (-1, 3)),
        TensorSpec("sum", "FP32", (-1, 4)),
    ]
    assert session.quantization == {}
    rng = np.random.default_rng(2)
    for batch in (1, 5, 2, 5, 16):
        a = rng.standard_normal((batch, 4)).astype(np.float32)
        c = rng.standard_normal((batch, 4)).astype(np.float32)
        out = session.run({"a": a, "c": c})
        for name, want in fc_tflite.reference(a, c).items():
            assert out[name].shape == want.shape and out[name].dtype == np.float32
            np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5)


def test_only_the_requested_outputs_come_back(fc_tflite) -> None:
    session = load(fc_tflite.path, ONE_THREAD)
    x = np.ones((2, 4), np.float32)
    assert list(session.run({"a": x, "c": x}, ["sum"])) == ["sum"]


def test_bytes_tensors_round_trip_including_trailing_nuls(strings_tflite: Path) -> None:
    session = load(strings_tflite, ONE_THREAD)
    assert session.inputs == [TensorSpec("s", "BYTES", (-1,))]
    values = np.array([b"ab", b"c\xff", b"", b"x\x00\x00"], dtype=object)
    out = session.run({"s": values})["s_out"]
    assert out.dtype == object and out.tolist() == values.tolist()


BAD_REQUESTS = {
    "float for int8": ({WAKE_IN: np.zeros((1, 3, 40), np.float32)}, None, "INT8"),
    "wrong inner dim": ({WAKE_IN: np.zeros((1, 3, 41), np.int8)}, None, "shape"),
    "wrong rank": ({WAKE_IN: np.zeros((3, 40), np.int8)}, None, "shape"),
    "missing input": ({}, None, "missing"),
    "unknown output": ({WAKE_IN: np.zeros((1, 3, 40), np.int8)}, ["probs"], "unknown outputs"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_raise_invalid_input(wakeword_tflite: Path, case: str) -> None:
    inputs, outputs, message = BAD_REQUESTS[case]
    session = load(wakeword_tflite, ONE_THREAD)
    with pytest.raises(InvalidInput, match=message):
        session.run(inputs, outputs)


def test_outputs_stay_valid_after_the_next_run(fc_tflite) -> None:
    session = load(fc_tflite.path, ONE_THREAD)
    ones = np.ones((3, 4), np.float32)
    first = session.run({"a": ones, "c": ones})["sum"]
    kept = first.copy()
    session.run({"a": -ones, "c": -ones})
    np.testing.assert_array_equal(first, kept)


def test_concurrent_runs_with_changing_batch_sizes_are_serialised(fc_tflite) -> None:
    session = load(fc_tflite.path, ONE_THREAD)
    rng = np.random.default_rng(9)
    batches = [rng.standard_normal((n % 7 + 1, 4)).astype(np.float32) for n in range(40)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda a: session.run({"a": a, "c": a})["fc"], batches))
    for a, fc in zip(batches, results, strict=True):
        np.testing.assert_allclose(fc, fc_tflite.reference(a, a)["fc"], rtol=1e-5, atol=1e-5)


def test_threads_option_reaches_the_interpreter(fc_tflite) -> None:
    assert load(fc_tflite.path, RuntimeOptions(threads=2)).threads == 2
    assert load(fc_tflite.path, ONE_THREAD).threads == 1


def test_a_closed_session_refuses_to_run(wakeword_tflite: Path) -> None:
    session = load(wakeword_tflite, ONE_THREAD)
    session.close()
    session.close()
    with pytest.raises(ModelNotReady, match="closed"):
        session.run({WAKE_IN: np.zeros((1, 3, 40), np.int8)})
    with pytest.raises(ModelNotReady):
        session.reset()


def test_missing_and_corrupt_model_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"absent\.tflite"):
        load(tmp_path / "absent.tflite", ONE_THREAD)
    broken = tmp_path / "broken.tflite"
    broken.write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidInput, match=r"broken\.tflite"):
        load(broken, ONE_THREAD)


def test_a_dynamic_model_whose_stored_shape_cannot_run_loads_and_resizes(pairs_tflite) -> None:
    # pyopen-wakeword's mel front-end: signature [-1, -1], stored [1, 1], refused by its kernels
    session = load(pairs_tflite, ONE_THREAD)
    assert session.inputs == [TensorSpec("x", "FP32", (-1, -1))]
    assert session.outputs == [TensorSpec("pairs", "FP32", (2, -1))]
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    np.testing.assert_array_equal(session.run({"x": x})["pairs"], x.reshape(2, 3))


def test_shapes_the_kernels_refuse_fail_that_request_only(pairs_tflite) -> None:
    session = load(pairs_tflite, ONE_THREAD)
    with pytest.raises(InvalidInput, match=r"cannot run input shapes \{'x': \[1, 3\]\}"):
        session.run({"x": np.zeros((1, 3), np.float32)})
    for shape in [(1, 3), (2, 2), (1, 3), (4, 5)]:
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        if x.size % 2:
            with pytest.raises(InvalidInput):
                session.run({"x": x})
        else:
            np.testing.assert_array_equal(session.run({"x": x})["pairs"], x.reshape(2, -1))
    session.reset()  # a fresh interpreter at the stored shape: still loads, still resizes
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["pairs"], x.reshape(2, 4))
