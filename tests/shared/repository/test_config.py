from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ConfigError
from shared.repository import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    RuntimeConfig,
    VersionPolicy,
    parse_config,
    parse_config_dict,
)
from shared.runtimes.base import RuntimeOptions, TensorSpec

FULL = """
backend = "openvino"
max_batch_size = 32
[[input]]
name = "x"
datatype = "FP32"
dims = [3, 224, 224]
[[output]]
name = "probs"
datatype = "FP32"
dims = [4]
[[output]]
name = "label"
datatype = "BYTES"
dims = [-1]
[dynamic_batching]
max_queue_delay_us = 2000
preferred_batch_sizes = [16, 8, 8]
max_queue_size = 256
priority_levels = 3
default_priority_level = 2
default_timeout_us = 50000
[instance_group]
count = 2
kind = "gpu"
[version_policy]
specific = [3, 1]
[runtime]
threads = 2
precision_hint = "f32"
allow_spinning = true
lone_threads = 0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_key_of_a_full_config_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    assert parse_config(path, "m") == ModelConfig(
        name="m",
        backend="openvino",
        max_batch_size=32,
        inputs=(TensorSpec("x", "FP32", (3, 224, 224)),),
        outputs=(TensorSpec("probs", "FP32", (4,)), TensorSpec("label", "BYTES", (-1,))),
        dynamic_batching=DynamicBatching(
            max_queue_delay_us=2000,
            preferred_batch_sizes=(8, 16),
            max_queue_size=256,
            priority_levels=3,
            default_priority_level=2,
            default_timeout_us=50000,
        ),
        instance_group=InstanceGroup(count=2, kind="gpu"),
        version_policy=VersionPolicy(latest=None, specific=(1, 3)),
        runtime=RuntimeConfig(threads=2, precision_hint="f32", allow_spinning=True, lone_threads=0),
        source=path,
    )


def test_an_empty_config_leaves_everything_to_the_model_file(tmp_path: Path) -> None:
    config = parse_config(write(tmp_path, "# nothing\n"), "m")
    assert config.backend is None and config.max_batch_size is None
    assert config.inputs == () and config.outputs == ()
    assert config.dynamic_batching is None
    assert config.instance_group == InstanceGroup(1, "cpu")
    assert config.version_policy == VersionPolicy(latest=1)
    assert config.runtime == RuntimeConfig()


def test_an_empty_dynamic_batching_table_turns_batching_on_with_defaults() -> None:
    config = parse_config_dict({"dynamic_batching": {}}, "cfg", "m")
    assert config.dynamic_batching == DynamicBatching()
    assert config.source is None


def test_the_documented_message_names_file_key_and_expectation(tmp_path: Path) -> None:
    path = write(tmp_path, '[dynamic_batching]\nmax_queue_delay_us = "abc"\n')
    with pytest.raises(ConfigError) as err:
        parse_config(path, "m")
    assert str(err.value) == (
        f"{path}: key 'dynamic_batching.max_queue_delay_us': "
        "expected a non-negative integer, got 'abc'"
    )


MALFORMED = {
    "unknown top-level key": ("max_batch = 4", "unknown key 'max_batch'", "max_batch_size"),
    "unknown nested key": (
        "[dynamic_batching]\nmax_delay_us = 5",
        "unknown key 'dynamic_batching.max_delay_us'",
        "max_queue_delay_us",
    ),
    "unknown key in a tensor": (
        '[[input]]\nname = "x"\ndatatype = "FP32"\ndims = [1]\nshape = [1]',
        "unknown key 'input[0].shape'",
        "datatype",
    ),
    "wrong type": ('max_batch_size = "8"', "key 'max_batch_size'", "non-negative integer"),
    "bool for an integer": ("max_batch_size = true", "key 'max_batch_size'", "integer"),
    "float for an integer": ("[runtime]\nthreads = 1.5", "key 'runtime.threads'", "integer"),
    "negative number": (
        "[dynamic_batching]\nmax_queue_size = -1",
        "key 'dynamic_batching.max_queue_size'",
        "non-negative integer, got -1",
    ),
    "zero instances": ("[instance_group]\ncount = 0", "key 'instance_group.count'", "positive"),
    "bad kind": ('[instance_group]\nkind = "tpu"', "key 'instance_group.kind'", "'cpu', 'gpu'"),
    "bad datatype": (
        '[[input]]\nname = "x"\ndatatype = "FP33"\ndims = [1]',
        "key 'input[0].datatype'",
        "'FP32'",
    ),
    "bad backend": ('backend = "tensorflow"', "key 'backend'", "'onnxruntime'"),
    "latest and all": (
        "[version_policy]\nlatest = 1\nall = true",
        "key 'version_policy'",
        "exactly one of",
    ),
    "all = false": ("[version_policy]\nall = false", "key 'version_policy.all'", "true"),
    "empty specific": ("[version_policy]\nspecific = []", "version_policy.specific", "non-empty"),
    "zero latest": ("[version_policy]\nlatest = 0", "key 'version_policy.latest'", "positive"),
    "zero dim": (
        '[[output]]\nname = "y"\ndatatype = "FP32"\ndims = [0]',
        "key 'output[0].dims'",
        "-1 for a dynamic one",
    ),
    "text dim": (
        '[[output]]\nname = "y"\ndatatype = "FP32"\ndims = ["N"]',
        "key 'output[0].dims'",
        "positive integers",
    ),
    "missing tensor name": (
        '[[input]]\ndatatype = "FP32"\ndims = [1]',
        "key 'input[0].name' is required",
        "input[0].name",
    ),
    "duplicate tensor name": (
        '[[input]]\nname = "x"\ndatatype = "FP32"\ndims = [1]\n'
        '[[input]]\nname = "x"\ndatatype = "FP32"\ndims = [2]',
        "key 'input[1].name'",
        "declared twice",
    ),
    "input is not an array of tables": ('input = "x"', "key 'input'", "[[input]]"),
    "section is not a table": ("dynamic_batching = 3", "key 'dynamic_batching'", "a table"),
    "preferred above max_batch_size": (
        "max_batch_size = 8\n[dynamic_batching]\npreferred_batch_sizes = [4, 16]",
        "key 'dynamic_batching.preferred_batch_sizes'",
        "up to max_batch_size (8), got [16]",
    ),
    "zero preferred size": (
        "[dynamic_batching]\npreferred_batch_sizes = [0]",
        "key 'dynamic_batching.preferred_batch_sizes[0]'",
        "positive integer",
    ),
    "default priority out of range": (
        "[dynamic_batching]\npriority_levels = 2\ndefault_priority_level = 3",
        "key 'dynamic_batching.default_priority_level'",
        "a level from 1 to 2",
    ),
    # (as Triton: read as level 1, requests without a priority jumped every other)
    "priority levels without a default level": (
        "[dynamic_batching]\npriority_levels = 3",
        "key 'dynamic_batching.default_priority_level'",
        "a level from 1 to 3",
    ),
    "bad precision hint": (
        '[runtime]\nprecision_hint = "fp8"',
        "key 'runtime.precision_hint'",
        "'bf16'",
    ),
    "spinning not a bool": (
        '[runtime]\nallow_spinning = "no"',
        "key 'runtime.allow_spinning'",
        "true or false",
    ),
    "negative lone threads": (
        "[runtime]\nlone_threads = -2",
        "key 'runtime.lone_threads'",
        "a non-negative integer",
    ),
    "bad TOML syntax": ("max_batch_size = = 3", "not valid TOML", "line 1"),
    "zero latency objective": (
        "[placement]\nlatency_objective_ms = 0",
        "key 'placement.latency_objective_ms'",
        "a positive number",
    ),
    "negative rate": ("[placement]\nrate = -1", "key 'placement.rate'", "a number >= 0"),
    "max below min copies": (
        "[placement]\nmin_copies = 3\nmax_copies = 2",
        "key 'placement.max_copies'",
        "at least min_copies (3)",
    ),
    "unknown placement backend": (
        '[placement]\nbackends = ["cuda"]',
        "key 'placement.backends'",
        "onnxruntime",
    ),
    "unknown placement key": ("[placement]\ncopies = 2", "placement", "copies"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_each_malformed_config_names_its_file_and_key(tmp_path: Path, case: str) -> None:
    text, key_part, expectation = MALFORMED[case]
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        parse_config(path, "m")
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert key_part in message
    assert expectation in message


def test_each_malformed_config_gets_its_own_message(tmp_path: Path) -> None:
    messages = set()
    for i, (text, _, _) in enumerate(MALFORMED.values()):
        path = write(tmp_path / str(i), text + "\n")
        with pytest.raises(ConfigError) as err:
            parse_config(path, "m")
        messages.add(str(err.value).removeprefix(f"{path}: "))
    assert len(messages) == len(MALFORMED)


def test_an_unreadable_config_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "m" / "config.toml"
    path.mkdir(parents=True)  # a folder where the file should be
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config(path, "m")


_INT_KEYS = ["max_queue_delay_us", "max_queue_size", "default_timeout_us"]


@given(key=st.sampled_from(_INT_KEYS), value=st.integers(-(2**40), 2**40))
def test_batching_integers_are_kept_when_non_negative_and_rejected_by_key_otherwise(
    key: str, value: int
) -> None:
    data = {"dynamic_batching": {key: value}}
    if value >= 0:
        config = parse_config_dict(data, "cfg.toml", "m")
        assert getattr(config.dynamic_batching, key) == value
    else:
        with pytest.raises(ConfigError, match=f"cfg.toml: key 'dynamic_batching.{key}'"):
            parse_config_dict(data, "cfg.toml", "m")


# ---- version policy -----------------------------------------------------------------------


def test_latest_n_selects_the_highest_n_versions_ascending() -> None:
    assert VersionPolicy(latest=2).select([3, 1, 10, 2]) == [3, 10]
    assert VersionPolicy(latest=5).select([2, 1]) == [1, 2]
    assert VersionPolicy().select([]) == []


def test_all_selects_every_version() -> None:
    assert VersionPolicy(latest=None, all=True).select([4, 2, 9]) == [2, 4, 9]


def test_specific_selects_exactly_the_named_versions() -> None:
    assert VersionPolicy(latest=None, specific=(3, 1)).select([1, 2, 3, 4]) == [1, 3]


def test_a_missing_specific_version_is_an_error_not_a_substitute() -> None:
    with pytest.raises(ConfigError, match=r"versions \[5\] that do not exist.*\[1, 2\]"):
        VersionPolicy(latest=None, specific=(1, 5)).select([1, 2])


def test_version_policy_keys_parse_to_the_matching_policy() -> None:
    def policy(table: dict) -> VersionPolicy:
        return parse_config_dict({"version_policy": table}, "c", "m").version_policy

    assert policy({"latest": 3}) == VersionPolicy(latest=3)
    assert policy({"all": True}) == VersionPolicy(latest=None, all=True)
    assert policy({"specific": [2, 1, 2]}) == VersionPolicy(latest=None, specific=(1, 2))
    assert policy({}) == VersionPolicy(latest=1)


# ---- runtime options ----------------------------------------------------------------------


def test_runtime_options_carry_threads_hint_spinning_and_the_callers_device() -> None:
    options = RuntimeConfig(threads=3, precision_hint="bf16", allow_spinning=True).to_options("gpu")
    assert options == RuntimeOptions(
        threads=3, device="gpu", precision_hint="bf16", allow_spinning=True
    )


def test_zero_threads_means_the_process_cores() -> None:
    options = RuntimeConfig().to_options()
    assert options.threads is None and options.device == "cpu"
    assert options.allow_spinning is False
    assert options.resolved_threads() >= 1


def test_the_placement_table_is_read_with_defaults_for_what_it_leaves_out(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path, '[placement]\nlatency_objective_ms = 250\nrate = 12\nbackends = ["openvino"]\n'
    )
    policy = parse_config(path, "m").placement
    assert policy.latency_objective_ms == 250.0 and policy.rate == 12.0
    assert policy.min_copies == 1 and policy.max_copies == 0
    assert policy.backends == ("openvino",)
    assert parse_config(write(tmp_path / "empty", ""), "m").placement.min_copies == 1
