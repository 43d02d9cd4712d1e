"""Render a :class:`ModelConfig` in Triton's JSON model-configuration shape.

``GET /v2/models/{m}/config`` answers with this so tools written against
Triton (tritonclient, perf_analyzer, model_analyzer) read Ferry's models
unchanged.  Numbers are JSON numbers, as Triton itself prints them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.datatypes import numpy_dtype
from shared.repository.config import ModelConfig
from shared.runtimes.base import TensorSpec

#: Ferry backend -> Triton platform string
PLATFORMS: dict[str, str] = {
    "onnxruntime": "onnxruntime_onnx",
    "openvino": "openvino",
    "tensorrt": "tensorrt_plan",
    "litert": "tflite",
}


def triton_datatype(datatype: str) -> str:
    """Triton's ``data_type`` for a V2 datatype (BYTES is TYPE_STRING there)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": spec.name,
        "data_type": triton_datatype(spec.datatype),
        "dims": spec.shown_dims(),
    }
    if spec.reshape is not None:
        out["reshape"] = {"shape": list(spec.reshape)}
    return out


def triton_model_config(config: ModelConfig, platform_hint: str | None = None) -> dict[str, Any]:
    """Triton's JSON for ``config``; ``platform_hint`` overrides the platform
    (for a config not yet completed, whose backend is still unknown)."""
    backend = config.backend or ""
    platform = platform_hint or PLATFORMS.get(backend, "")
    policy = config.version_policy
    if policy.specific:
        version_policy: dict[str, Any] = {"specific": {"versions": list(policy.specific)}}
    elif policy.all:
        version_policy = {"all": {}}
    else:
        latest = policy.latest if policy.latest is not None else 1
        version_policy = {"latest": {"num_versions": latest}}
    group = config.instance_group
    result: dict[str, Any] = {
        "name": config.name,
        "platform": platform,
        "backend": backend,
        "version_policy": version_policy,
        "max_batch_size": config.max_batch_size or 0,
        "input": [_tensor(t) for t in config.inputs],
        "output": [_tensor(t) for t in config.outputs],
        "instance_group": [
            {"name": config.name, "kind": f"KIND_{group.kind.upper()}", "count": group.count}
        ],
    }
    batching = config.dynamic_batching
    if batching is not None:
        result["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
            "preserve_ordering": batching.preserve_ordering,
            # (one level is Triton's 0: no priorities; a 1 read as one configured level)
            "priority_levels": batching.priority_levels if batching.priority_levels > 1 else 0,
            "default_priority_level": (
                batching.default_priority_level if batching.priority_levels > 1 else 0
            ),
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": batching.default_timeout_us,
                "allow_timeout_override": batching.allow_timeout_override,
                "max_queue_size": batching.max_queue_size,
            },
        }
    return result


def v2_model_metadata(name: str, config: ModelConfig, versions: list[str]) -> dict[str, Any]:
    """``GET /v2/models/{name}``: the V2 metadata both tiers' HTTP fronts answer."""
    batch = [-1] if config.max_batch_size else []

    def spec(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "datatype": t.datatype, "shape": batch + t.shown_dims()}

    return {
        "name": name,
        "versions": versions,
        "platform": triton_model_config(config)["platform"],
        "inputs": [spec(t) for t in config.inputs],
        "outputs": [spec(t) for t in config.outputs],
    }


def warm_up_inputs(config: ModelConfig) -> dict[str, np.ndarray]:
    """All-zeros inputs of batch 1 (dynamic dims as 1) for the completed ``config``.

    Both tiers run a model once on these after loading: it pays first-call
    costs (allocator arenas, kernel selection) before a client waits on them.
    """
    batch = [1] if config.max_batch_size else []
    inputs = {}
    for spec in config.inputs:
        shape = tuple(batch + list(spec.sample_dims()))
        if spec.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr.fill(b"")
        else:
            arr = np.zeros(shape, dtype=numpy_dtype(spec.datatype))
        inputs[spec.name] = arr
    return inputs
