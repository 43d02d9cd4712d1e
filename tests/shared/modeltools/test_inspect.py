from __future__ import annotations

import argparse
import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from cloud.cli_model import add_model_commands, run_model_command
from shared.errors import InvalidInput, ModelNotFound
from shared.modeltools.convert import convert_to_openvino
from shared.modeltools.inspect import describe, format_description
from shared.modeltools.quantize import quantize_static_qdq
from tests.shared.modeltools import write_conv_model


@pytest.fixture
def fp32(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "tiny" / "3" / "model.onnx"
    return path, write_conv_model(path)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    return run_model_command(parser.parse_args(["model", *argv]))


def test_onnx_description_lists_io_sizes_and_parameters(fp32: tuple[Path, int]) -> None:
    path, parameters = fp32
    d = describe(path)
    assert d["backend"] == "onnxruntime"
    assert d["inputs"] == [{"name": "x", "datatype": "FP32", "dims": [-1, 3, 16, 16]}]
    assert d["outputs"] == [{"name": "probs", "datatype": "FP32", "dims": [-1, 4]}]
    assert d["files"] == {"model.onnx": path.stat().st_size}
    assert d["size_bytes"] == path.stat().st_size
    assert d["parameters"] == parameters
    assert d["opset"][""] == 17
    assert d["qdq"] is False


def test_a_quantized_model_is_reported_as_qdq(fp32: tuple[Path, int], tmp_path: Path) -> None:
    int8 = tmp_path / "int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static_qdq(fp32[0], int8, samples=4, progress=False)
    d = describe(int8)
    assert d["qdq"] is True
    assert "int8 QDQ" in format_description(d)


def test_openvino_description_counts_the_bin_file(fp32: tuple[Path, int], tmp_path: Path) -> None:
    xml = convert_to_openvino(fp32[0], tmp_path / "ir", progress=False)
    d = describe(xml)
    assert d["backend"] == "openvino"
    assert set(d["files"]) == {"model.xml", "model.bin"}
    assert d["size_bytes"] == xml.stat().st_size + xml.with_suffix(".bin").stat().st_size
    assert d["inputs"] == [{"name": "x", "datatype": "FP32", "dims": [-1, 3, 16, 16]}]
    assert d["outputs"][0]["dims"] == [-1, 4]


def test_a_shipped_tflite_keyword_spotter_is_described() -> None:
    spec = importlib.util.find_spec("pymicro_wakeword")
    assert spec is not None and spec.submodule_search_locations
    models = sorted(Path(next(iter(spec.submodule_search_locations))).glob("models/*.tflite"))
    assert models, "pymicro-wakeword ships no .tflite models"
    d = describe(models[0])
    assert d["backend"] == "litert"
    assert d["inputs"][0]["datatype"] == "INT8"
    assert len(d["inputs"][0]["dims"]) == 3
    assert d["size_bytes"] == models[0].stat().st_size


def test_a_model_folder_resolves_to_its_latest_version(
    fp32: tuple[Path, int], tmp_path: Path
) -> None:
    write_conv_model(tmp_path / "tiny" / "1" / "model.onnx", seed=9)
    assert describe(tmp_path / "tiny")["path"] == str(fp32[0])
    assert describe(tmp_path / "tiny" / "3")["path"] == str(fp32[0])


def test_human_format_shows_names_types_and_dims(fp32: tuple[Path, int]) -> None:
    text = format_description(describe(fp32[0]))
    assert "x      FP32  [?, 3, 16, 16]" in text
    assert "probs  FP32  [?, 4]" in text
    assert "opset 17" in text


def test_cli_inspect_prints_text_or_json(
    fp32: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("inspect", str(fp32[0])) == 0
    assert "inputs:" in capsys.readouterr().out
    assert run_cli("inspect", str(fp32[0]), "--json") == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["name"] == "probs"


def test_unknown_and_missing_files_raise_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InvalidInput, match="backend"):
        describe(tmp_path / "notes.txt")
    with pytest.raises(ModelNotFound):
        describe(tmp_path / "absent.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no model file"):
        describe(tmp_path / "empty")
    (tmp_path / "broken.onnx").write_bytes(b"garbage")
    with pytest.raises(InvalidInput, match="not a readable ONNX"):
        describe(tmp_path / "broken.onnx")


def test_an_empty_or_graphless_file_is_not_described_as_a_model(tmp_path: Path) -> None:
    # serve refuses to load these; inspect must not call them a valid model either
    (tmp_path / "zero.onnx").write_bytes(b"")
    with pytest.raises(InvalidInput, match="empty"):
        describe(tmp_path / "zero.onnx")
    (tmp_path / "stray.onnx").write_bytes(b"\x08\x07")  # ir_version 7 and nothing else
    with pytest.raises(InvalidInput, match="no ONNX graph"):
        describe(tmp_path / "stray.onnx")


def test_a_zipmap_output_is_described_as_the_tensor_ferry_serves(tmp_path: Path) -> None:
    from tests.shared.runtimes.conftest import _zipmap

    path = _zipmap(tmp_path / "zipmap.onnx", {"classlabels_int64s": [30, 10, 20]})
    d = describe(path)
    assert d["outputs"] == [
        {"name": "label", "datatype": "INT64", "dims": [-1]},
        {
            "name": "probs",
            "datatype": "FP32",
            "dims": [-1, -1],
            "onnx_type": "seq(map(int64,tensor(float)))",
        },
    ]
    assert "probs  FP32  [?, ?]  (the file's seq(map(int64,tensor(float))))" in (
        format_description(d)
    )


def test_a_model_folder_resolves_to_the_newest_version_holding_a_file(tmp_path: Path) -> None:
    # an empty folder for the next version made inspect fail; the repository serves 1
    from shared.modeltools.inspect import resolve_model_file
    from tests.shared.modeltools import write_conv_model

    write_conv_model(tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "2").mkdir()
    assert resolve_model_file(tmp_path / "m") == tmp_path / "m" / "1" / "model.onnx"


def test_an_onnx_file_whose_external_weights_are_missing_is_not_found(tmp_path: Path) -> None:
    # inspect described it and exited 0; no runtime can load it
    import onnx

    from tests.shared.modeltools import write_conv_model

    src = tmp_path / "m.onnx"
    write_conv_model(src)
    model = onnx.load(str(src))
    onnx.save(
        model,
        str(tmp_path / "ext.onnx"),
        save_as_external_data=True,
        size_threshold=0,
        location="ext.data",
    )
    assert describe(tmp_path / "ext.onnx")["files"]["ext.data"] > 0
    # (its size counts its weights: memory estimates and the tools' size reports)
    from shared.repository.capacity import model_file_bytes

    assert model_file_bytes(tmp_path / "ext.onnx") >= model_file_bytes(src) * 0.9
    (tmp_path / "ext.data").unlink()
    with pytest.raises(ModelNotFound, match=r"ext\.data"):
        describe(tmp_path / "ext.onnx")


def test_external_data_outside_the_model_folder_is_not_counted_and_never_raises(
    tmp_path: Path,
) -> None:
    # an absolute location killed the controller at start (ValueError from relative_to)
    import onnx

    from shared.repository.capacity import model_file_bytes
    from tests.shared.modeltools import write_conv_model

    src = tmp_path / "m.onnx"
    write_conv_model(src)
    (tmp_path / "elsewhere").mkdir()
    model = onnx.load(str(src))
    onnx.save(
        model,
        str(tmp_path / "elsewhere" / "w.onnx"),
        save_as_external_data=True,
        size_threshold=0,
        location="w.data",
    )
    ext = onnx.load(str(tmp_path / "elsewhere" / "w.onnx"), load_external_data=False)
    for init in ext.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = str(tmp_path / "elsewhere" / "w.data")  # absolute
    (tmp_path / "model").mkdir()
    onnx.save(ext, str(tmp_path / "model" / "model.onnx"))
    path = tmp_path / "model" / "model.onnx"
    assert model_file_bytes(path) == path.stat().st_size


def test_a_tensor_with_no_shape_is_described_as_any_rank_not_a_scalar(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    from tests.shared.runtimes.conftest import _save

    path = _save(
        tmp_path / "anyrank.onnx",
        [helper.make_node("Add", ["x", "s"], ["y"])],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        check=False,
    )
    d = describe(path)
    assert [t["dims"] for t in d["inputs"]] == [None, []]
    text = format_description(d)
    assert "x  FP32  [any rank]" in text and "s  FP32  []" in text
