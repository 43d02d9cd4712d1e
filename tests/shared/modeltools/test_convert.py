from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from cloud.cli_model import add_model_commands, run_model_command
from shared.errors import InvalidInput, ModelNotFound
from shared.modeltools.convert import convert_to_openvino
from tests.shared.modeltools import conv_inputs, run_onnx, write_conv_model


@pytest.fixture
def fp32(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.onnx"
    write_conv_model(path)
    return path


def run_openvino(xml: Path, x: np.ndarray) -> np.ndarray:
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({"x": x})["probs"]


def test_ir_written_into_a_folder_matches_onnxruntime_at_f32(fp32: Path, tmp_path: Path) -> None:
    xml = convert_to_openvino(fp32, tmp_path / "ir", progress=False)
    assert xml == tmp_path / "ir" / "model.xml"
    assert xml.is_file() and xml.with_suffix(".bin").is_file()
    x = conv_inputs(8)
    np.testing.assert_allclose(run_openvino(xml, x), run_onnx(fp32, x), rtol=1e-5, atol=1e-6)


def test_weights_stay_fp32_in_the_ir(fp32: Path, tmp_path: Path) -> None:
    xml = convert_to_openvino(fp32, tmp_path / "ir", progress=False)
    weights = 8 * 3 * 3 * 3 + 16 * 8 * 3 * 3 + 16 * 4  # the conv and gemm weights alone
    assert xml.with_suffix(".bin").stat().st_size >= weights * 4


def test_an_explicit_xml_path_is_used_as_given(fp32: Path, tmp_path: Path) -> None:
    xml = convert_to_openvino(fp32, tmp_path / "deep" / "tiny.xml", progress=False)
    assert xml == tmp_path / "deep" / "tiny.xml"
    assert (tmp_path / "deep" / "tiny.bin").is_file()


def test_progress_bar_walks_the_conversion_steps(
    fp32: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    convert_to_openvino(fp32, tmp_path / "ir", progress=True)
    err = capsys.readouterr().err
    assert "converting model.onnx" in err
    assert "3/3" in err


def test_a_corrupt_onnx_file_is_invalid_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(InvalidInput, match=r"bad\.onnx"):
        convert_to_openvino(bad, tmp_path / "ir", progress=False)


def test_an_unknown_format_is_invalid_input(tmp_path: Path) -> None:
    other = tmp_path / "weights.h5"
    other.write_bytes(b"\x89HDF")
    with pytest.raises(InvalidInput, match="converts"):
        convert_to_openvino(other, tmp_path / "ir", progress=False)


def test_a_missing_source_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        convert_to_openvino(tmp_path / "nope.onnx", tmp_path / "ir", progress=False)


def test_cli_convert_writes_beside_the_source_by_default(
    fp32: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "convert", str(fp32), "--to", "openvino", "--no-progress"])
    assert run_model_command(args) == 0
    assert fp32.with_suffix(".xml").is_file() and fp32.with_suffix(".bin").is_file()
    assert "model.xml + " in capsys.readouterr().out


def test_unwritable_or_odd_destinations_are_clear_errors_and_leave_nothing(
    fp32: Path, tmp_path: Path
) -> None:
    # OpenVINO's writer took only a lower-case .xml (a traceback for UP.XML); an
    # existing file as the folder was a FileExistsError traceback.
    xml = convert_to_openvino(fp32, tmp_path / "ir" / "UP.XML", progress=False)
    assert xml.name == "UP.xml" and xml.with_suffix(".bin").is_file()
    existing = tmp_path / "existing.txt"
    existing.write_text("x")
    with pytest.raises(InvalidInput, match="is a file"):
        convert_to_openvino(fp32, existing, progress=False)
    with pytest.raises(InvalidInput, match="is a folder: give the model file"):
        convert_to_openvino(tmp_path / "ir", tmp_path / "out", progress=False)
    # a failed conversion leaves no half-written IR over a good one
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not onnx")
    before = xml.read_bytes()
    with pytest.raises(InvalidInput):
        convert_to_openvino(corrupt, xml, progress=False)
    assert xml.read_bytes() == before
    assert sorted(p.name for p in xml.parent.iterdir()) == ["UP.bin", "UP.xml"]


def test_a_conversion_leaves_the_processs_logging_as_it_found_it(tmp_path: Path) -> None:
    # OpenVINO's converter set the root logger to ERROR, failing or not: every warning
    # the process logged after it went unsaid.
    import logging

    root = logging.getLogger()
    before = root.level, list(root.filters), list(root.handlers)
    write_conv_model(tmp_path / "m.onnx")
    convert_to_openvino(tmp_path / "m.onnx", tmp_path / "ir", progress=False)
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(InvalidInput):
        convert_to_openvino(tmp_path / "bad.onnx", tmp_path / "ir2", progress=False)
    assert (root.level, list(root.filters), list(root.handlers)) == before
