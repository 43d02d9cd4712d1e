"""Triton's ``config.pbtxt``: a Triton repository serves with the settings it declares."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.repository import ModelRepository, complete_config
from shared.repository.config import DynamicBatching, InstanceGroup, VersionPolicy
from shared.repository.pbtxt import parse_text_proto, parse_triton_config
from shared.runtimes.base import TensorSpec
from tests.shared.repository import open_session, write_identity_model

# As a Triton user writes it: comments, both list forms, tuning blocks Ferry has no use for.
SIMPLE = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific: { versions: [1, 3] } }
input [
  {
    name: "x"
    data_type: TYPE_FP32
    dims: [ 3 ]
  },
  { name: "mask", data_type: TYPE_BOOL, dims: [2] }
]
output [
  { name: "x_out"  data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" },
  { name: "mask_out" data_type: TYPE_BOOL dims: [ 2 ] }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100   # Triton's default is 0
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 5000000
    allow_timeout_override: false
    max_queue_size: 16
  }
}
instance_group [ { count: 2 kind: KIND_CPU }, { count: 1, kind: KIND_CPU } ]
optimization { execution_accelerators { cpu_execution_accelerator: [ { name: "openvino" } ] } }
model_warmup [ { name: "zeros" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32
  dims: [3] zero_data: true } } } ]
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def write(root: Path, name: str, text: str, versions=(1,)) -> Path:
    for v in versions:
        write_identity_model(
            root / name / str(v) / "model.onnx",
            [("x", "FP32", ["N", 3]), ("mask", "BOOL", ["N", 2])],
        )
    path = root / name / "config.pbtxt"
    path.write_text(text)
    return path


def test_a_triton_config_is_read_with_every_setting_ferry_has(tmp_path: Path, caplog) -> None:
    path = write(tmp_path, "simple", SIMPLE, versions=(1, 2, 3))
    with caplog.at_level(logging.WARNING):
        config = ModelRepository(tmp_path).read_config("simple")
    assert config.source == path
    assert config.backend == "onnxruntime" and config.max_batch_size == 8
    assert config.inputs == (TensorSpec("x", "FP32", (3,)), TensorSpec("mask", "BOOL", (2,)))
    assert [t.name for t in config.outputs] == ["x_out", "mask_out"]
    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=100,
        preferred_batch_sizes=(4, 8),
        max_queue_size=16,
        priority_levels=2,
        default_priority_level=2,
        default_timeout_us=5_000_000,
        allow_timeout_override=False,
    )
    assert config.instance_group == InstanceGroup(count=3, kind="cpu")
    assert config.version_policy == VersionPolicy(latest=None, specific=(1, 3))
    assert ModelRepository(tmp_path).selected_versions("simple", config) == [1, 3]
    assert [(p.output, p.labels) for p in config.postprocess] == [("x_out", "labels.txt")]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for ignored in ("optimization", "model_warmup", "parameters"):
        assert ignored in warned
    session = open_session(tmp_path / "simple" / "3" / "model.onnx")
    assert complete_config(config, session).max_batch_size == 8
    session.close()


def test_preserve_ordering_is_read_and_shown_as_written(tmp_path: Path) -> None:
    """It had been dropped: accepted, not honoured, and shown as false."""
    from shared.repository import triton_model_config

    path = write(tmp_path, "m", "max_batch_size: 4\ndynamic_batching { preserve_ordering: true }\n")
    config = parse_triton_config(path, "m")
    assert config.dynamic_batching is not None and config.dynamic_batching.preserve_ordering
    assert triton_model_config(config)["dynamic_batching"]["preserve_ordering"] is True


def test_version_policies_and_no_batching_map_to_ferry_keys(tmp_path: Path) -> None:
    repo = ModelRepository(tmp_path)
    write(
        tmp_path,
        "latest2",
        "max_batch_size: 0\nversion_policy { latest { num_versions: 2 } }\n",
        (1, 2, 3),
    )
    write(tmp_path, "all", "version_policy: { all: {} }\n", (1, 2, 3))
    latest = repo.read_config("latest2")
    assert latest.max_batch_size == 0
    assert repo.selected_versions("latest2", latest) == [2, 3]
    assert repo.selected_versions("all", repo.read_config("all")) == [1, 2, 3]
    assert repo.model_names() == ["all", "latest2"]


def test_dims_written_with_the_batch_axis_and_no_max_batch_size_serve_unbatched(
    tmp_path: Path,
) -> None:
    """Triton reads a missing max_batch_size as 0; Ferry had guessed batching, left the
    first dimension out and refused the user's (correct) full-rank dims."""
    write(
        tmp_path,
        "m",
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] },\n'
        '  { name: "mask" data_type: TYPE_BOOL dims: [ -1, 2 ] } ]\n'
        'output [ { name: "x_out" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]\n',
    )
    repo = ModelRepository(tmp_path)
    session = open_session(tmp_path / "m" / "1" / "model.onnx")
    done = complete_config(repo.read_config("m"), session)
    assert done.max_batch_size == 0
    assert [list(t.dims) for t in done.inputs] == [[-1, 3], [-1, 2]]
    write(
        tmp_path,
        "b",
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] },\n'
        '  { name: "mask" data_type: TYPE_BOOL dims: [ 2 ] } ]\n',
    )
    assert complete_config(repo.read_config("b"), session).max_batch_size > 0


def test_the_text_format_reads_as_protobuf_does() -> None:
    fields = parse_text_proto(
        """
        # a comment
        a: 1 a: 2            # a repeated scalar, and the list form below
        b: [3, 4]
        s: "x\\"y" 'z'       # escapes; adjacent strings concatenate
        m < k: true f: -1.5e3 h: 0x10 >
        e: KIND_GPU;
        """,
        "t",
    )
    assert fields == {
        "a": [1, 2],
        "b": [3, 4],
        "s": ['x"yz'],
        "m": [{"k": [True], "f": [-1500.0], "h": [16]}],
        "e": ["KIND_GPU"],
    }


def test_string_escapes_are_bytes_read_as_utf8_as_protobuf_writes_them() -> None:
    text = 's: "\\303\\251"\nt: "a\\x41b"\nu: "q\\\\z\\"w"\n'
    assert parse_text_proto(text, "t") == {"s": ["\u00e9"], "t": ["aAb"], "u": ['q\\z"w']}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sequence_batching { }", "sequence batching"),
        ("ensemble_scheduling { step [] }", "ensembles"),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [3] reshape { shape: [1, 3] } '
            "is_shape_tensor: true } ]",
            "is_shape_tensor",
        ),
        ('name: "other"', "not the folder's name"),
        ('platform: "tensorflow_savedmodel"', "not a runtime Ferry runs"),
        ("max_batch_sise: 8", "unknown field"),
        ("dynamic_batching { default_queue_policy { timeout_action: DELAY } }", "timeout_action"),
        ("model_transaction_policy { decoupled: true }", "decoupled"),
        ("dynamic_batching { max_queue_delay_microseconds: 100", "not closed"),
        ("max_batch_size 8", "expected ':' or '{'"),
        ('input [ { name: "x" dims: [3] } ]', r"input\[0\]\.data_type' is required"),
        ("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", "one kind"),
        ("max_batch_size: -1", "max_batch_size"),
        ("dynamic_batching { priority_queue_policy { key: 1 value { } } }", "per-priority"),
        # (Triton refuses it; read as level 1, unprioritised requests jumped the rest)
        ("dynamic_batching { priority_levels: 3 }", "default_priority_level': required"),
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [3] label_filename: "l" } ]',
            "only an output",
        ),
    ],
)
def test_what_ferry_cannot_honour_is_refused_naming_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, "m", text)
    with pytest.raises(ConfigError, match=message) as err:
        parse_triton_config(path, "m")
    assert str(path) in str(err.value)


def test_a_config_toml_beside_the_pbtxt_wins(tmp_path: Path) -> None:
    write(tmp_path, "m", "max_batch_size: 8\n")
    (tmp_path / "m" / "config.toml").write_text("max_batch_size = 4\n")
    assert ModelRepository(tmp_path).read_config("m").max_batch_size == 4


def test_a_reshape_serves_the_declared_dims_and_feeds_the_model_its_own_shape(
    tmp_path: Path,
) -> None:
    """Triton's idiom for one value per batch item: clients send [N, 1], the model takes
    [N] (``reshape: { shape: [ ] }``, an empty shape); and [N, 6] fed as [N, 2, 3].
    Ferry had refused any reshape, then read an empty one as none."""
    import numpy as np

    from shared.pipeline import open_session as open_pipeline
    from shared.runtimes.base import RuntimeOptions

    write_identity_model(
        tmp_path / "m" / "1" / "model.onnx", [("x", "FP32", ["N"]), ("grid", "INT64", ["N", 2, 3])]
    )
    (tmp_path / "m" / "config.pbtxt").write_text(
        "max_batch_size: 8\n"
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } },\n'
        '  { name: "grid" data_type: TYPE_INT64 dims: [ 6 ] reshape { shape: [ 2, 3 ] } } ]\n'
        'output [ { name: "x_out" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]\n'
    )
    repo = ModelRepository(tmp_path)
    config = repo.read_config("m")
    assert config.inputs[0].reshape == () and config.inputs[1].reshape == (2, 3)
    session = open_pipeline("onnxruntime", tmp_path / "m" / "1" / "model.onnx",
                            RuntimeOptions(threads=1), config)  # fmt: skip
    done = complete_config(config, session)
    assert [list(t.dims) for t in done.inputs] == [[1], [6]] and done.max_batch_size == 8
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    grid = np.arange(18, dtype=np.int64).reshape(3, 6)
    out = session.run({"x": x, "grid": grid})
    assert out["x_out"].shape == (3, 1) and np.array_equal(out["x_out"], x)
    assert out["grid_out"].shape == (3, 2, 3)  # (not declared: the file's own shape)
    session.close()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] '
        "reshape: { shape: [ ] } } ]\n"
    )
    with pytest.raises(ConfigError, match=r"reshape \[\] do not hold the same values"):
        open_pipeline("onnxruntime", tmp_path / "m" / "1" / "model.onnx",
                      RuntimeOptions(threads=1), repo.read_config("m"))  # fmt: skip


def test_a_load_override_reads_as_ferrys_or_tritons_and_says_which_sections_stay() -> None:
    import json

    from shared.repository.pbtxt import parse_load_config

    # protobuf's JSON: a uint64 as a string, a nested camelCase name (read as Triton's)
    config, keep = parse_load_config(
        json.dumps(
            {
                "max_batch_size": 8,
                "dynamic_batching": {"priorityLevels": "2", "defaultPriorityLevel": "1"},
            }
        ),
        "m",
    )
    assert config.dynamic_batching.priority_levels == 2 and len(keep) == 4
    # a partial override, valid in both: the repository's own sections stay
    config, keep = parse_load_config(json.dumps({"max_batch_size": 4}), "m")
    assert config.max_batch_size == 4 and len(keep) == 4
    # one that names a Ferry section replaces that one only (the rest stay)
    _, keep = parse_load_config(json.dumps({"runtime": {"threads": 2}}), "m")
    assert keep == {"preprocess", "postprocess", "placement"}
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):  # Ferry's error, not Triton's
        parse_load_config(json.dumps({"max_batch_size": 4, "bogus": 1}), "m")
    # Ferry's [runtime] beside Triton's instance_group list: refused, not dropped (the
    # model had loaded with 1 thread, the log saying "ignored Triton setting runtime")
    mixed = {
        "max_batch_size": 8,
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "runtime": {"threads": 2},
    }
    with pytest.raises(ConfigError, match=r"key 'runtime': Ferry's \[runtime\] table"):
        parse_load_config(json.dumps(mixed), "m")


def test_errors_found_after_conversion_name_tritons_fields(tmp_path, caplog) -> None:
    # A config.pbtxt's error named config.toml's key (max_queue_delay_us), which the
    # file does not hold; instance placement settings were taken without a word.
    from shared.repository.pbtxt import parse_triton_config

    path = tmp_path / "config.pbtxt"
    path.write_text("max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: -5 }\n")
    with pytest.raises(ConfigError, match=r"key 'dynamic_batching\.max_queue_delay_microseconds'"):
        parse_triton_config(path, "m")
    path.write_text(
        "max_batch_size: 4\ndynamic_batching { default_queue_policy { max_queue_size: -1 } }\n"
    )
    with pytest.raises(ConfigError, match=r"default_queue_policy\.max_queue_size"):
        parse_triton_config(path, "m")
    path.write_text(
        "max_batch_size: 4\ninstance_group [{ count: 1 kind: KIND_CPU passive: true "
        "rate_limiter { priority: 1 } }]\n"
    )
    with caplog.at_level("WARNING"):
        parse_triton_config(path, "m")
    assert "instance_group[0].passive" in caplog.text
    assert "instance_group[0].rate_limiter" in caplog.text
