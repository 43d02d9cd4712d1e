from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from types import ModuleType

import pytest
from google.protobuf import json_format

from shared.datatypes import DATATYPES
from shared.repository import (
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    VersionPolicy,
    triton_datatype,
    triton_model_config,
)
from shared.runtimes import BACKENDS
from shared.runtimes.base import TensorSpec

CONFIG = ModelConfig(
    name="orientation",
    backend="onnxruntime",
    max_batch_size=32,
    inputs=(TensorSpec("x", "FP32", (3, 224, 224)),),
    outputs=(TensorSpec("probs", "FP32", (4,)), TensorSpec("label", "BYTES", (1,))),
    dynamic_batching=DynamicBatching(
        max_queue_delay_us=2000,
        preferred_batch_sizes=(8, 16),
        max_queue_size=256,
        priority_levels=2,
        default_priority_level=1,
        default_timeout_us=5000,
    ),
    instance_group=InstanceGroup(count=2, kind="cpu"),
)


@pytest.fixture(scope="module")
def triton_pb2() -> ModuleType:
    """Triton's own model-config protobuf, shipped inside tritonclient (loaded from
    its file: the grpc package's __init__ needs grpcio, which is not installed)."""
    path = importlib.metadata.distribution("tritonclient").locate_file(
        "tritonclient/grpc/model_config_pb2.py"
    )
    spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_full_config_renders_in_tritons_json_shape() -> None:
    assert triton_model_config(CONFIG) == {
        "name": "orientation",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 32,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}],
        "output": [
            {"name": "probs", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "label", "data_type": "TYPE_STRING", "dims": [1]},
        ],
        "instance_group": [{"name": "orientation", "kind": "KIND_CPU", "count": 2}],
        "dynamic_batching": {
            "preferred_batch_size": [8, 16],
            "max_queue_delay_microseconds": 2000,
            "preserve_ordering": False,
            "priority_levels": 2,
            "default_priority_level": 1,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": 5000,
                "allow_timeout_override": False,
                "max_queue_size": 256,
            },
        },
    }


def test_the_rendering_is_valid_for_tritons_own_schema(triton_pb2: ModuleType) -> None:
    rendered = json.loads(json.dumps(triton_model_config(CONFIG)))
    message = json_format.ParseDict(rendered, triton_pb2.ModelConfig())
    assert message.input[0].data_type == triton_pb2.TYPE_FP32
    assert message.output[1].data_type == triton_pb2.TYPE_STRING
    assert list(message.dynamic_batching.preferred_batch_size) == [8, 16]
    assert message.instance_group[0].kind == triton_pb2.ModelInstanceGroup.KIND_CPU


def test_every_datatype_has_a_triton_enum_name(triton_pb2: ModuleType) -> None:
    names = {dt: triton_datatype(dt) for dt in DATATYPES}
    assert names["BYTES"] == "TYPE_STRING" and names["BOOL"] == "TYPE_BOOL"
    assert names["BF16"] == "TYPE_BF16"
    for name in names.values():
        triton_pb2.DataType.Value(name)  # raises for a name Triton does not know


@pytest.mark.parametrize(
    ("policy", "rendered"),
    [
        (VersionPolicy(latest=3), {"latest": {"num_versions": 3}}),
        (VersionPolicy(latest=None, all=True), {"all": {}}),
        (VersionPolicy(latest=None, specific=(1, 3)), {"specific": {"versions": [1, 3]}}),
    ],
)
def test_each_version_policy_renders_as_triton_writes_it(
    triton_pb2: ModuleType, policy: VersionPolicy, rendered: dict
) -> None:
    result = triton_model_config(ModelConfig(name="m", backend="openvino", version_policy=policy))
    assert result["version_policy"] == rendered
    json_format.ParseDict(result, triton_pb2.ModelConfig())


def test_each_backend_maps_to_its_triton_platform() -> None:
    platforms = {
        b: triton_model_config(ModelConfig(name="m", backend=b))["platform"] for b in BACKENDS
    }
    assert platforms == {
        "onnxruntime": "onnxruntime_onnx",
        "openvino": "openvino",
        "tensorrt": "tensorrt_plan",
        "litert": "tflite",
    }


def test_a_config_without_batching_or_backend_renders_minimal_fields() -> None:
    result = triton_model_config(ModelConfig(name="m"))
    assert "dynamic_batching" not in result
    assert result["max_batch_size"] == 0 and result["platform"] == ""
    assert result["instance_group"] == [{"name": "m", "kind": "KIND_CPU", "count": 1}]


def test_the_platform_hint_overrides_the_backend_platform() -> None:
    result = triton_model_config(CONFIG, platform_hint="ensemble")
    assert result["platform"] == "ensemble" and result["backend"] == "onnxruntime"


def test_gpu_instances_render_as_kind_gpu() -> None:
    config = ModelConfig(name="m", instance_group=InstanceGroup(count=1, kind="gpu"))
    assert triton_model_config(config)["instance_group"][0]["kind"] == "KIND_GPU"
