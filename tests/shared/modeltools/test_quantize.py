from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from cloud.cli_model import add_model_commands, run_model_command
from shared.errors import InvalidInput, ModelNotFound
from shared.modeltools.calibration import CalibrationWarning, InputSpec, folder_reader
from shared.modeltools.quantize import quantize_static_qdq
from tests.shared.modeltools import conv_inputs, run_onnx, write_conv_model


@pytest.fixture
def fp32(tmp_path: Path) -> Path:
    path = tmp_path / "fp32.onnx"
    write_conv_model(path)
    return path


@pytest.fixture
def npy_folder(tmp_path: Path) -> Path:
    """16 samples: singles without a batch dimension and one file holding a batch of 4."""
    folder = tmp_path / "calibration"
    folder.mkdir()
    samples = conv_inputs(16, seed=2)
    for i in range(12):
        np.save(folder / f"{i:02d}.npy", samples[i])
    np.save(folder / "batch.npy", samples[12:])
    (folder / "README.txt").write_text("not a sample; ignored")
    return folder


def op_types(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


def assert_close_to_fp32(fp32: Path, int8: Path) -> None:
    x = conv_inputs(32, seed=3)
    want, got = run_onnx(fp32, x), run_onnx(int8, x)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 0.08, np.abs(got - want).max()
    agreement = float(np.mean(got.argmax(1) == want.argmax(1)))
    assert agreement >= 0.9, agreement


def test_random_calibration_warns_and_still_writes_a_loadable_qdq_model(
    fp32: Path, tmp_path: Path
) -> None:
    int8 = tmp_path / "int8.onnx"
    with pytest.warns(CalibrationWarning, match="random"):
        result = quantize_static_qdq(fp32, int8, samples=8, progress=False)
    assert result == int8
    assert {"QuantizeLinear", "DequantizeLinear"} <= op_types(int8)
    assert_close_to_fp32(fp32, int8)


def test_npy_folder_calibration_is_silent_and_stays_close_to_fp32(
    fp32: Path, npy_folder: Path, tmp_path: Path
) -> None:
    int8 = tmp_path / "out" / "int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        quantize_static_qdq(fp32, int8, npy_folder, progress=False)
    ops = op_types(int8)
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert "DynamicQuantizeLinear" not in ops  # static ranges, never run-time ones
    assert_close_to_fp32(fp32, int8)


def test_weights_are_quantized_per_channel(fp32: Path, npy_folder: Path, tmp_path: Path) -> None:
    int8 = tmp_path / "int8.onnx"
    quantize_static_qdq(fp32, int8, npy_folder, progress=False)
    model = onnx.load(str(int8))
    scales = {init.name: tuple(init.dims) for init in model.graph.initializer}
    conv_weight_dq = [
        node
        for node in model.graph.node
        if node.op_type == "DequantizeLinear" and node.input[0].startswith("w1")
    ]
    assert conv_weight_dq, "the first convolution's weights are not quantized"
    assert scales[conv_weight_dq[0].input[1]] == (8,)  # one scale per output channel


def test_progress_bar_spans_loading_preprocessing_calibration_and_writing(
    fp32: Path, npy_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quantize_static_qdq(fp32, tmp_path / "int8.onnx", npy_folder, batch_size=4, progress=True)
    err = capsys.readouterr().err
    assert "quantizing fp32.onnx" in err
    for stage in ("load", "pre-process", "calibrate", "quantize + write"):
        assert stage in err, stage
    assert "7/7" in err  # load + pre-process + 4 batches + quantize and write
    assert "6/7" not in err.rsplit("\r", 1)[-1]  # it ends full, not at the last batch


def test_an_already_quantized_model_is_refused(
    fp32: Path, npy_folder: Path, tmp_path: Path
) -> None:
    int8 = tmp_path / "int8.onnx"
    quantize_static_qdq(fp32, int8, npy_folder, progress=False)
    before = int8.read_bytes()
    with pytest.raises(InvalidInput, match=r"already quantized.*QuantizeLinear"):
        quantize_static_qdq(int8, int8, npy_folder, progress=False)
    assert int8.read_bytes() == before


def test_folder_reader_caps_samples_and_batches_them(npy_folder: Path) -> None:
    spec = InputSpec("x", np.dtype(np.float32), (-1, 3, 16, 16))
    reader = folder_reader(npy_folder, [spec], samples=6, batch_size=2)
    batches = []
    while (batch := reader.get_next()) is not None:
        batches.append(batch["x"])
    assert [b.shape for b in batches] == [(2, 3, 16, 16)] * 3
    np.testing.assert_array_equal(np.concatenate(batches), conv_inputs(16, seed=2)[:6])


def test_a_fixed_batch_dimension_overrides_batch_size(tmp_path: Path) -> None:
    fixed = tmp_path / "fixed.onnx"
    write_conv_model(fixed, batch=2)
    int8 = tmp_path / "int8.onnx"
    with pytest.warns(CalibrationWarning):
        quantize_static_qdq(fixed, int8, samples=4, batch_size=1, progress=False)
    assert run_onnx(int8, conv_inputs(2)).shape == (2, 4)


def test_a_sample_with_the_wrong_shape_is_rejected_naming_the_file(
    fp32: Path, npy_folder: Path, tmp_path: Path
) -> None:
    np.save(npy_folder / "00-bad.npy", np.zeros((3, 8, 8), np.float32))
    with pytest.raises(InvalidInput, match=r"00-bad\.npy.*\[1, 3, 8, 8\]"):
        quantize_static_qdq(fp32, tmp_path / "int8.onnx", npy_folder, progress=False)


def test_an_empty_calibration_folder_is_rejected(fp32: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match=r"no \.npy"):
        quantize_static_qdq(fp32, tmp_path / "int8.onnx", tmp_path / "empty", progress=False)


def test_a_missing_source_model_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        quantize_static_qdq(tmp_path / "nope.onnx", tmp_path / "int8.onnx", progress=False)


def test_npz_files_feed_inputs_by_name(fp32: Path, tmp_path: Path) -> None:
    folder = tmp_path / "npz"
    folder.mkdir()
    np.savez(folder / "a.npz", x=conv_inputs(4, seed=5))
    int8 = tmp_path / "int8.onnx"
    quantize_static_qdq(fp32, int8, folder, progress=False)
    assert {"QuantizeLinear", "DequantizeLinear"} <= op_types(int8)


def test_cli_quantize_writes_the_model_and_reports_sizes(
    fp32: Path, npy_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    dst = tmp_path / "cli-int8.onnx"
    args = parser.parse_args(
        [
            "model",
            "quantize",
            str(fp32),
            str(dst),
            "--calibration",
            str(npy_folder),
            "--samples",
            "8",
        ]
    )
    assert run_model_command(args) == 0
    assert dst.is_file()
    assert f"wrote {dst}" in capsys.readouterr().out


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    return run_model_command(parser.parse_args(["model", *argv]))


def test_cli_quantize_in_place_reports_the_size_the_source_had(
    fp32: Path, npy_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = fp32.stat().st_size
    assert _cli("quantize", str(fp32), str(fp32), "--calibration", str(npy_folder)) == 0
    after = fp32.stat().st_size
    assert {"QuantizeLinear", "DequantizeLinear"} <= op_types(fp32)
    out = capsys.readouterr().out
    assert f"{after:,} bytes (fp32.onnx: {before:,} bytes, {before / after:.2f}x)" in out
    assert not list(fp32.parent.glob(".*partial*"))


def test_cli_prints_the_random_calibration_warning_as_one_clean_line(
    fp32: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli("quantize", str(fp32), str(tmp_path / "q.onnx"), "--samples", "4") == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert len(lines) == 1
    assert lines[0].startswith("ferry-cloud: warning: no calibration data given")
    assert "CalibrationWarning" not in err and ".py:" not in err


def _opset12_mlp(path: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "mlp12",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)
    onnx.save(model, str(path))
    return path


def test_a_model_below_opset_13_is_upgraded_and_its_quantized_copy_loads(tmp_path: Path) -> None:
    # Quantized at opset 12 it got per-channel DequantizeLinear (an axis, opset 13+):
    # "wrote ..." and exit 0 for a model no runtime loads.
    import onnxruntime as ort

    src = _opset12_mlp(tmp_path / "mlp12.onnx")
    folder = tmp_path / "cal"
    folder.mkdir()
    np.save(folder / "a.npy", np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32))
    out = quantize_static_qdq(src, tmp_path / "q.onnx", folder, progress=False)
    x = np.ones((2, 8), np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], run_onnx(src, x), atol=0.5)


def test_calibration_with_an_infinity_is_refused_naming_the_file(
    fp32: Path, tmp_path: Path
) -> None:
    # one inf made every range infinite: a model answering one constant, exit 0
    folder = tmp_path / "cal"
    folder.mkdir()
    bad = conv_inputs(4, seed=3)
    bad[1, 0, 0, 0] = np.inf
    np.save(folder / "a.npy", bad)
    with pytest.raises(InvalidInput, match=r"a\.npy: input 'x' holds NaN or infinite"):
        quantize_static_qdq(fp32, tmp_path / "q.onnx", folder, progress=False)
    assert not (tmp_path / "q.onnx").exists()


def test_samples_of_several_sizes_and_scalar_inputs_calibrate(tmp_path: Path) -> None:
    # [N, 3, ?, ?] images of two sizes cannot be stacked (a traceback); a rank-0 input
    # (a sample rate, as silero_vad takes) had no batch dimension to count (another).
    specs = [InputSpec("x", np.dtype(np.float32), (-1, 3, -1, -1))]
    folder = tmp_path / "sizes"
    folder.mkdir()
    np.save(folder / "a.npy", np.zeros((3, 16, 16), np.float32))
    np.save(folder / "b.npy", np.zeros((2, 3, 24, 20), np.float32))
    batches = [
        b["x"].shape
        for b in iter(folder_reader(folder, specs, samples=8, batch_size=1).get_next, None)
    ]
    assert sorted(batches) == [(1, 3, 16, 16), (1, 3, 24, 20), (1, 3, 24, 20)]
    specs = [
        InputSpec("state", np.dtype(np.float32), (2, -1, 4)),
        InputSpec("sr", np.dtype(np.int64), ()),
    ]
    folder = tmp_path / "scalar"
    folder.mkdir()
    for i in range(3):
        np.savez(folder / f"{i}.npz", state=np.zeros((2, 1, 4), np.float32), sr=np.array(16000))
    feeds = list(iter(folder_reader(folder, specs, samples=8, batch_size=1).get_next, None))
    assert len(feeds) == 3 and feeds[0]["sr"].shape == () and feeds[0]["state"].shape == (2, 1, 4)


def test_output_paths_that_cannot_be_written_are_clear_errors(fp32: Path, tmp_path: Path) -> None:
    (tmp_path / "adir.onnx").mkdir()
    with pytest.raises(InvalidInput, match="is a folder"):
        quantize_static_qdq(fp32, tmp_path / "adir.onnx", progress=False)
    with pytest.raises(InvalidInput, match="a file stands where its folder should be"):
        quantize_static_qdq(fp32, fp32 / "x.onnx", progress=False)
    with pytest.raises(InvalidInput, match="is a folder: give the model file"):
        quantize_static_qdq(tmp_path, tmp_path / "q.onnx", progress=False)
    with pytest.raises(InvalidInput, match="batch size must be >= 1"):
        quantize_static_qdq(fp32, tmp_path / "q.onnx", batch_size=0, progress=False)


def test_files_of_many_samples_feed_a_fixed_batch_of_one(tmp_path: Path) -> None:
    # [1, 3, 4, 4] exports (the common case) were read file by file and refused
    specs = [InputSpec("x", np.dtype(np.float32), (1, 3, 4, 4))]
    folder = tmp_path / "cal"
    folder.mkdir()
    for name in ("a", "b"):
        np.save(folder / f"{name}.npy", np.zeros((8, 3, 4, 4), np.float32))
    batches = list(iter(folder_reader(folder, specs, samples=32, batch_size=4).get_next, None))
    assert len(batches) == 16 and {b["x"].shape for b in batches} == {(1, 3, 4, 4)}


def test_a_fixed_lead_beside_a_dynamic_batch_is_fed_file_by_file(tmp_path: Path) -> None:
    # a recurrent state's [2, 3] beside x [N, 4]: the 2 is layers, not samples
    specs = [
        InputSpec("x", np.dtype(np.float32), (-1, 4)),
        InputSpec("h", np.dtype(np.float32), (2, 3)),
    ]
    folder = tmp_path / "cal"
    folder.mkdir()
    for i in range(3):
        np.savez(
            folder / f"s{i}.npz", x=np.zeros((1, 4), np.float32), h=np.zeros((2, 3), np.float32)
        )
    feeds = list(iter(folder_reader(folder, specs, samples=8, batch_size=1).get_next, None))
    assert [(f["x"].shape, f["h"].shape) for f in feeds] == [((1, 4), (2, 3))] * 3


def test_an_input_of_any_rank_calibrates_from_files_fed_as_they_are(tmp_path: Path) -> None:
    specs = [InputSpec("x", np.dtype(np.float32), None)]
    folder = tmp_path / "cal"
    folder.mkdir()
    np.save(folder / "a.npy", np.ones((2, 5), np.float32))
    np.save(folder / "b.npy", np.ones(7, np.float32))
    feeds = list(iter(folder_reader(folder, specs, samples=8, batch_size=4).get_next, None))
    assert sorted(f["x"].shape for f in feeds) == [(2, 5), (7,)]


def test_random_calibration_of_an_input_of_any_rank_asks_for_a_folder(tmp_path: Path) -> None:
    from tests.shared.runtimes.conftest import _save

    path = _save(
        tmp_path / "anyrank.onnx",
        [onnx.helper.make_node("Relu", ["x"], ["y"])],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        check=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        with pytest.raises(InvalidInput, match=r"any rank.*give a calibration folder"):
            quantize_static_qdq(path, tmp_path / "q.onnx", progress=False)
