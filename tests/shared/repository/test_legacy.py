from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.repository import ModelRepository, complete_config, parse_legacy_config
from shared.runtimes.base import TensorSpec
from tests.shared.repository import open_session, write_identity_model

# The example from dl_inference's TisPredictOnline/README.MD (resnet50 config.txt).
DL_INFERENCE_EXAMPLE = {
    "batch_size": 0,
    "input": [
        {"name": "image", "data_type": "float", "dims": [-1, 224, 224, 3], "node_name": "input_1:0"}
    ],
    "output": [
        {"name": "probs", "data_type": "float", "dims": [-1, 19], "node_name": "dense_1/Softmax:0"}
    ],
}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "m" / "config.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=4))
    return path


def test_the_dl_inference_example_reads_with_node_names_as_tensor_names(tmp_path: Path) -> None:
    path = write(tmp_path, DL_INFERENCE_EXAMPLE)
    config = parse_legacy_config(path, "resnet50")
    assert config.name == "resnet50"
    assert config.max_batch_size == 0
    assert config.inputs == (TensorSpec("input_1:0", "FP32", (-1, 224, 224, 3)),)
    assert config.outputs == (TensorSpec("dense_1/Softmax:0", "FP32", (-1, 19)),)
    assert config.source == path
    assert config.backend is None and config.dynamic_batching is None


def test_name_is_the_tensor_name_when_there_is_no_node_name(tmp_path: Path) -> None:
    data = {"input": [{"name": "x", "data_type": "FP32", "dims": [3]}]}
    config = parse_legacy_config(write(tmp_path, data), "m")
    assert config.inputs == (TensorSpec("x", "FP32", (3,)),)
    assert config.max_batch_size is None  # left to the model file


@pytest.mark.parametrize(
    ("spelling", "datatype"),
    [
        ("DT_FLOAT", "FP32"),
        ("TYPE_FP32", "FP32"),
        ("FP32", "FP32"),
        ("float", "FP32"),
        ("float32", "FP32"),
        ("DT_DOUBLE", "FP64"),
        ("DT_HALF", "FP16"),
        ("TYPE_FP16", "FP16"),
        ("DT_INT64", "INT64"),
        ("int64", "INT64"),
        ("TYPE_UINT8", "UINT8"),
        ("DT_BOOL", "BOOL"),
        ("TYPE_BOOL", "BOOL"),
        ("DT_STRING", "BYTES"),
        ("TYPE_STRING", "BYTES"),
        ("string", "BYTES"),
        ("BYTES", "BYTES"),
        ("DT_BFLOAT16", "BF16"),
    ],
)
def test_every_datatype_spelling_maps_to_its_v2_name(
    tmp_path: Path, spelling: str, datatype: str
) -> None:
    data = {"input": [{"name": "x", "data_type": spelling, "dims": [1]}]}
    assert parse_legacy_config(write(tmp_path, data), "m").inputs[0].datatype == datatype


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"input": [{"name": "x", "data_type": "DT_QUINT8", "dims": [1]}]},
            "key 'input[0].data_type': expected a datatype",
        ),
        (
            {"output": [{"name": "y", "data_type": "float"}]},
            "key 'output[0].dims' is required",
        ),
        (
            {"input": [{"data_type": "float", "dims": [1]}]},
            "key 'input[0].name' is required (or 'input[0].node_name')",
        ),
        ({"batch_size": -1}, "key 'batch_size': expected a non-negative integer, got -1"),
        ({"model_name": "x"}, "unknown key 'model_name'"),
        (
            {"input": [{"name": "x", "data_type": "float", "dims": [1], "format": "NHWC"}]},
            "unknown key 'input[0].format'",
        ),
        ({"input": {"name": "x"}}, "key 'input': expected a list of tensor objects"),
        ([1, 2], "key '': expected a table"),
        (
            {"input": [{"name": "x", "data_type": "float", "dims": [-2]}]},
            "key 'input[0].dims'",
        ),
    ],
)
def test_a_bad_legacy_config_names_file_and_key(
    tmp_path: Path, data: object, expected: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        parse_legacy_config(path, "m")
    assert str(err.value).startswith(f"{path}: ")
    assert expected in str(err.value)


def test_bad_json_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '{"batch_size": 0,, }')
    with pytest.raises(ConfigError, match=r"config\.txt: not valid JSON"):
        parse_legacy_config(path, "m")


def test_a_legacy_model_folder_serves_through_the_repository(tmp_path: Path) -> None:
    """A dl_inference-style folder (TF-style tensor names, full dims with batch_size 0)
    reads, completes against the real model file and keeps the file's names."""
    write_identity_model(
        tmp_path / "legacy" / "1" / "model.onnx", [("input_1:0", "FP32", ["N", 3])]
    )
    (tmp_path / "legacy" / "config.txt").write_text(
        json.dumps(
            {
                "batch_size": 0,
                "input": [
                    {
                        "name": "x",
                        "data_type": "DT_FLOAT",
                        "dims": [-1, 3],
                        "node_name": "input_1:0",
                    }
                ],
                "output": [
                    {
                        "name": "y",
                        "data_type": "TYPE_FP32",
                        "dims": [-1, -1],
                        "node_name": "input_1_0_out",
                    }
                ],
            }
        )
    )
    repo = ModelRepository(tmp_path)
    assert repo.model_names() == ["legacy"]
    config = repo.read_config("legacy")
    backend, path = repo.model_file("legacy", 1, config.backend)
    session = open_session(path)
    full = complete_config(config, session)
    session.close()
    assert full.backend == backend == "onnxruntime"
    assert full.max_batch_size == 0
    assert full.inputs == (TensorSpec("input_1:0", "FP32", (-1, 3)),)
    assert full.outputs == (TensorSpec("input_1_0_out", "FP32", (-1, 3)),)
