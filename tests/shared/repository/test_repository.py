from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ConfigError, InvalidInput, ModelNotFound
from shared.messages import InferRequest
from shared.repository import (
    DEFAULT_MAX_BATCH_SIZE,
    ModelConfig,
    ModelRepository,
    complete_config,
    parse_config_dict,
    v2_model_metadata,
    validate_model_name,
    warm_up_inputs,
)
from shared.repository.validation import validated_inputs
from shared.runtimes.base import TensorSpec
from shared.tensors import Tensor
from tests.shared.repository import open_session, write_identity_model

BATCHED = [("x", "FP32", ["N", 3]), ("mask", "BOOL", ["N", 2])]
FIXED = [("x", "FP32", [1, 3])]


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepository:
    return ModelRepository(tmp_path)


def model(root: Path, name: str, tensors=BATCHED, version: int = 1, config: str | None = None):
    write_identity_model(root / name / str(version) / "model.onnx", tensors)
    if config is not None:
        (root / name / "config.toml").write_text(config)


def completed(repo: ModelRepository, name: str, version: int = 1) -> ModelConfig:
    config = repo.read_config(name)
    _, path = repo.model_file(name, version, config.backend)
    session = open_session(path)
    try:
        return complete_config(config, session)
    finally:
        session.close()


# ---- a folder with only 1/model.onnx --------------------------------------------------------


def test_a_folder_with_only_a_model_file_serves_with_a_completed_config(
    repo: ModelRepository,
) -> None:
    model(repo.root, "tiny")
    assert repo.model_names() == ["tiny"]
    config = repo.read_config("tiny")
    assert config == ModelConfig(name="tiny")
    assert repo.selected_versions("tiny") == [1]
    backend, path = repo.model_file("tiny", 1)
    assert (backend, path) == ("onnxruntime", repo.root / "tiny" / "1" / "model.onnx")

    session = open_session(path)
    full = complete_config(config, session)
    assert full.backend == "onnxruntime"
    assert full.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert full.inputs == (TensorSpec("x", "FP32", (3,)), TensorSpec("mask", "BOOL", (2,)))
    assert full.outputs == (
        TensorSpec("x_out", "FP32", (3,)),
        TensorSpec("mask_out", "BOOL", (2,)),
    )
    # the completed config describes what the session really takes and returns
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = session.run({"x": x, "mask": np.ones((2, 2), dtype=bool)})
    np.testing.assert_array_equal(result["x_out"], x)
    session.close()


ANY_RANK = [("x", "FP32", None)]


def _request(shape: tuple[int, ...]) -> InferRequest:
    return InferRequest(inputs=[Tensor("x", "FP32", np.ones(shape, dtype=np.float32))])


def test_a_tensor_of_any_rank_is_served_as_any_shape_and_shown_as_dynamic(
    repo: ModelRepository,
) -> None:
    model(repo.root, "anyrank", ANY_RANK)
    config = completed(repo, "anyrank")
    assert config.max_batch_size == 0  # nothing says which axis would be a batch
    assert config.inputs == (TensorSpec("x", "FP32", (), ranked=False),)
    for shape in [(), (4,), (2, 3, 5)]:
        assert validated_inputs(config, _request(shape))["x"].shape == shape
    meta = v2_model_metadata("anyrank", config, ["1"])
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    assert warm_up_inputs(config)["x"].shape == (1,)


def test_declared_dims_fix_the_rank_of_a_tensor_the_file_leaves_open(
    repo: ModelRepository,
) -> None:
    model(
        repo.root,
        "anyrank",
        ANY_RANK,
        config='[[input]]\nname = "x"\ndatatype = "FP32"\ndims = [-1, 3]\n',
    )
    config = completed(repo, "anyrank")
    assert config.inputs == (TensorSpec("x", "FP32", (-1, 3)),)
    assert validated_inputs(config, _request((5, 3)))["x"].shape == (5, 3)
    with pytest.raises(InvalidInput, match="expected shape"):
        validated_inputs(config, _request((3,)))


def test_a_declared_batch_axis_is_accepted_over_any_rank(repo: ModelRepository) -> None:
    model(repo.root, "anyrank", ANY_RANK, config="max_batch_size = 4\n")
    config = completed(repo, "anyrank")
    assert config.max_batch_size == 4
    assert validated_inputs(config, _request((2, 7)))["x"].shape == (2, 7)
    with pytest.raises(InvalidInput, match="batch dimension"):
        validated_inputs(config, _request((9, 7)))


def test_a_fixed_first_dimension_means_no_batch_dimension(repo: ModelRepository) -> None:
    model(repo.root, "fixed", FIXED)
    config = completed(repo, "fixed")
    assert config.max_batch_size == 0
    assert config.inputs == (TensorSpec("x", "FP32", (1, 3)),)


def test_the_default_batch_grows_to_the_largest_preferred_size(repo: ModelRepository) -> None:
    model(repo.root, "big", config="[dynamic_batching]\npreferred_batch_sizes = [8, 64]\n")
    assert completed(repo, "big").max_batch_size == 64


def test_max_batch_size_over_a_fixed_first_dimension_is_an_error(repo: ModelRepository) -> None:
    model(repo.root, "fixed", FIXED, config="max_batch_size = 4\n")
    with pytest.raises(ConfigError) as err:
        completed(repo, "fixed")
    message = str(err.value)
    assert str(repo.root / "fixed" / "config.toml") in message
    assert "key 'max_batch_size'" in message and "'x'" in message and "[1, 3]" in message


def test_preferred_sizes_without_a_batch_dimension_are_an_error(repo: ModelRepository) -> None:
    model(repo.root, "fixed", FIXED, config="[dynamic_batching]\npreferred_batch_sizes = [4]\n")
    with pytest.raises(ConfigError, match="max_batch_size = 0"):
        completed(repo, "fixed")


DECLARED = """max_batch_size = 16
[[input]]
name = "x"
datatype = "FP32"
dims = [-1]
[[input]]
name = "mask"
datatype = "BOOL"
dims = [2]
[[output]]
name = "x_out"
datatype = "FP32"
dims = [3]
"""


def test_declared_tensors_are_checked_and_their_dynamic_dims_filled(
    repo: ModelRepository,
) -> None:
    model(repo.root, "m", config=DECLARED)
    config = completed(repo, "m")
    assert config.max_batch_size == 16
    assert config.inputs == (TensorSpec("x", "FP32", (3,)), TensorSpec("mask", "BOOL", (2,)))
    assert config.outputs == (TensorSpec("x_out", "FP32", (3,)),)  # a subset is allowed


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('name = "x"', 'name = "y"', "key 'input[0].name': the model file has no input 'y'"),
        ('datatype = "BOOL"', 'datatype = "INT64"', "'mask' is BOOL in the model file, not INT64"),
        ("dims = [2]", "dims = [5]", "key 'input[1].dims': input 'mask' has dims [2]"),
        ("dims = [3]", "dims = [-1, 3]", "(batch dimension left out), not [-1, 3]"),
        (
            "max_batch_size = 16",
            'backend = "openvino"\nmax_batch_size = 16',
            "config says 'openvino' but the model file was loaded by 'onnxruntime'",
        ),
    ],
)
def test_declared_tensors_that_contradict_the_file_are_errors(
    repo: ModelRepository, old: str, new: str, expected: str
) -> None:
    model(repo.root, "m", config=DECLARED.replace(old, new, 1))
    config = repo.read_config("m")
    session = open_session(repo.root / "m" / "1" / "model.onnx")
    with pytest.raises(ConfigError) as err:
        complete_config(config, session)
    session.close()
    assert str(err.value).startswith(f"{repo.root / 'm' / 'config.toml'}: ")
    assert expected in str(err.value)


def test_an_input_the_config_leaves_out_is_an_error(repo: ModelRepository) -> None:
    model(repo.root, "m", config='[[input]]\nname = "x"\ndatatype = "FP32"\ndims = [3]\n')
    with pytest.raises(ConfigError, match=r"also has inputs \['mask'\]"):
        completed(repo, "m")


# ---- folders, versions, files ---------------------------------------------------------------


def test_only_folders_that_look_like_models_are_listed(repo: ModelRepository) -> None:
    model(repo.root, "b")
    (repo.root / "a").mkdir()
    (repo.root / "a" / "config.toml").write_text("")
    (repo.root / "c" / "docs").mkdir(parents=True)  # no config, no version folder
    (repo.root / ".hidden" / "1").mkdir(parents=True)
    (repo.root / "bad name" / "1").mkdir(parents=True)
    (repo.root / "d").mkdir()
    (repo.root / "d" / "config.txt").write_text("{}")
    (repo.root / "file.onnx").write_text("")
    assert repo.model_names() == ["a", "b", "d"]


def test_a_missing_repository_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a folder"):
        ModelRepository(tmp_path / "nope").model_names()


def test_unknown_and_unsafe_model_names_never_reach_the_disk(repo: ModelRepository) -> None:
    (repo.root / "docs").mkdir()
    with pytest.raises(ModelNotFound):
        repo.read_config("missing")
    with pytest.raises(ModelNotFound):
        repo.read_config("docs")
    for name in ("..", "../etc", "a/b", "", ".git"):
        with pytest.raises(InvalidInput):
            repo.read_config(name)


def test_available_versions_are_numeric_folders_with_a_model_file(repo: ModelRepository) -> None:
    for v in (1, 3, 10):
        model(repo.root, "m", version=v)
    (repo.root / "m" / "2").mkdir()  # empty
    (repo.root / "m" / "4").mkdir()
    (repo.root / "m" / "4" / "README").write_text("")
    write_identity_model(repo.root / "m" / "latest" / "model.onnx", BATCHED)
    write_identity_model(repo.root / "m" / "03" / "model.onnx", BATCHED)  # would alias 3
    assert repo.available_versions("m") == [1, 3, 10]


@pytest.mark.parametrize(
    ("policy", "selected"),
    [("latest = 2", [3, 10]), ("all = true", [1, 3, 10]), ("specific = [1, 10]", [1, 10])],
)
def test_selected_versions_apply_the_policy(
    repo: ModelRepository, policy: str, selected: list[int]
) -> None:
    for v in (1, 3, 10):
        model(repo.root, "m", version=v)
    (repo.root / "m" / "config.toml").write_text(f"[version_policy]\n{policy}\n")
    assert repo.selected_versions("m") == selected


def test_a_specific_version_that_does_not_exist_names_the_config(repo: ModelRepository) -> None:
    model(repo.root, "m", config="[version_policy]\nspecific = [1, 2]\n")
    with pytest.raises(ConfigError) as err:
        repo.selected_versions("m")
    assert str(err.value).startswith(f"{repo.root / 'm' / 'config.toml'}: ")
    assert "'version_policy.specific'" in str(err.value) and "[2]" in str(err.value)


def test_several_model_files_are_picked_by_backend_else_onnx_first(
    repo: ModelRepository,
) -> None:
    folder = repo.root / "m" / "1"
    model(repo.root, "m")
    for name in ("model.xml", "model.bin", "model.tflite"):
        (folder / name).write_text("")
    assert repo.model_file("m", 1) == ("onnxruntime", folder / "model.onnx")
    assert repo.model_file("m", 1, "openvino") == ("openvino", folder / "model.xml")
    assert repo.model_file("m", 1, "litert") == ("litert", folder / "model.tflite")
    (folder / "model.onnx").unlink()
    assert repo.model_file("m", 1) == ("openvino", folder / "model.xml")


def test_a_model_file_in_a_folder_of_its_name_is_found_as_triton_lays_out_onnx(
    repo: ModelRepository,
) -> None:
    """Triton's ONNX layout for a model with external data: 1/model.onnx/model.onnx."""
    write_identity_model(repo.root / "m" / "1" / "model.onnx" / "model.onnx", BATCHED)
    inner = repo.root / "m" / "1" / "model.onnx" / "model.onnx"
    assert repo.available_versions("m") == [1]
    assert repo.model_file("m", 1) == ("onnxruntime", inner)
    assert completed(repo, "m").max_batch_size > 0  # and it loads


def test_a_backend_without_its_file_is_a_config_error(repo: ModelRepository) -> None:
    model(repo.root, "m")
    # (OpenVINO reads the ONNX file itself: not an error)
    assert repo.model_file("m", 1, "openvino") == ("openvino", repo.root / "m" / "1" / "model.onnx")
    with pytest.raises(ConfigError, match=r"backend 'tensorrt' but version 1 has only model.onnx"):
        repo.model_file("m", 1, "tensorrt")
    with pytest.raises(ConfigError, match="unknown backend"):
        repo.model_file("m", 1, "tensorflow")


def test_a_version_without_a_model_file_is_not_found(repo: ModelRepository) -> None:
    model(repo.root, "m")
    (repo.root / "m" / "2").mkdir()
    for version in (2, 7):
        with pytest.raises(ModelNotFound, match=f"no version {version}"):
            repo.model_file("m", version)


def test_the_config_toml_wins_over_a_legacy_config_txt(repo: ModelRepository) -> None:
    model(repo.root, "m", config="max_batch_size = 4\n")
    (repo.root / "m" / "config.txt").write_text('{"batch_size": 0}')
    assert repo.read_config("m").max_batch_size == 4
    (repo.root / "m" / "config.toml").unlink()
    config = repo.read_config("m")
    assert config.max_batch_size == 0 and config.source == repo.root / "m" / "config.txt"


def test_the_index_lists_every_available_version_as_unavailable(repo: ModelRepository) -> None:
    model(repo.root, "a", version=2)
    model(repo.root, "a", version=1)
    (repo.root / "b").mkdir()
    (repo.root / "b" / "config.toml").write_text("")
    assert repo.index() == [
        {"name": "a", "version": "1", "state": "UNAVAILABLE", "reason": ""},
        {"name": "a", "version": "2", "state": "UNAVAILABLE", "reason": ""},
        {
            "name": "b",
            "version": "",
            "state": "UNAVAILABLE",
            "reason": "no version folder holds a model file",
        },
    ]


def test_a_config_read_from_a_dict_names_the_model_in_completion_errors(
    repo: ModelRepository,
) -> None:
    model(repo.root, "m", FIXED)
    config = parse_config_dict({"max_batch_size": 2}, "inline", "m")
    session = open_session(repo.root / "m" / "1" / "model.onnx")
    with pytest.raises(ConfigError, match=r"^model 'm': key 'max_batch_size'"):
        complete_config(config, session)
    session.close()


# ---- model names ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet50", "a", "orientation-int8", "v1.2_b", "A" * 128, "0"])
def test_ordinary_model_names_are_accepted(name: str) -> None:
    assert validate_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/../b", "a/b", "/etc", "a\\b", "..\\x", "a\0b", ".env", "a..b",
     "a b", "é", "m%2F", "A" * 129, "x\n"],
)  # fmt: skip
def test_names_that_could_escape_the_repository_are_rejected(name: str) -> None:
    with pytest.raises(InvalidInput):
        validate_model_name(name)


@given(st.text(max_size=140))
def test_an_accepted_name_never_contains_a_separator_or_parent_reference(name: str) -> None:
    try:
        validate_model_name(name)
    except InvalidInput:
        return
    assert "/" not in name and "\\" not in name and "\0" not in name
    assert ".." not in name and not name.startswith(".")
    root = Path("/repo")
    assert (root / name).resolve().parent == root


@given(
    st.text(st.sampled_from("ab./\\\0-_"), min_size=1, max_size=12).filter(
        lambda s: "/" in s or ".." in s or "\\" in s or "\0" in s
    )
)
def test_a_name_with_a_separator_or_parent_reference_is_always_rejected(name: str) -> None:
    with pytest.raises(InvalidInput):
        validate_model_name(name)


@pytest.mark.parametrize(
    "bad", ["01", "+1", "1_0", " 1", "1 ", "\u0661", "-1", "1.0", "", True, -2]
)
def test_a_version_is_plain_ascii_digits_and_nothing_int_would_also_take(bad):
    from shared.errors import InvalidInput
    from shared.repository import parse_version

    with pytest.raises(InvalidInput, match="plain non-negative integer"):
        parse_version(bad)


def test_plain_versions_parse():
    from shared.repository import parse_version

    assert parse_version("1") == 1 and parse_version("0") == 0 and parse_version(12) == 12


def test_available_memory_takes_the_tighter_of_host_and_cgroup(monkeypatch) -> None:
    from shared.repository import capacity

    monkeypatch.setattr(capacity, "_host_available", lambda: 8 << 30)
    monkeypatch.setattr(capacity, "_cgroup_room", lambda: 1 << 30)
    assert capacity.available_memory() == 1 << 30
    monkeypatch.setattr(capacity, "_cgroup_room", lambda: None)
    assert capacity.available_memory() == 8 << 30


def test_a_model_folder_whose_name_no_url_can_carry_is_named_in_a_warning(
    repo: ModelRepository, caplog
) -> None:
    import logging

    model(repo.root, "ok")
    model(repo.root, "sp ace")
    model(repo.root, "a:b")
    with caplog.at_level(logging.WARNING):
        assert repo.model_names() == ["ok"]
        repo.model_names()  # once, not on every scan
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("not served" in w for w in warned)
    assert any("sp ace" in w for w in warned) and any("a:b" in w for w in warned)


def test_a_model_whose_folders_are_not_version_numbers_says_so(tmp_path):
    from tests.support import write_linear_model

    for folder in ("01", "1.0"):
        write_linear_model(tmp_path / "m" / folder / "model.onnx")
    (tmp_path / "m" / "notes").mkdir()  # (a folder without a model file is no version)
    repo = ModelRepository(tmp_path)
    (entry,) = repo.index()
    assert entry["version"] == "" and "'01', '1.0' hold one" in entry["reason"]
    assert "plain number" in entry["reason"] and "notes" not in entry["reason"]


def test_a_folder_holding_a_model_file_under_another_name_is_no_model(tmp_path):
    from tests.support import write_linear_model

    write_linear_model(tmp_path / "docs" / "examples" / "model.onnx")
    write_linear_model(tmp_path / "m" / "v2" / "model.onnx")
    assert ModelRepository(tmp_path).model_names() == ["m"]  # (v2: a misnamed version)
