from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from onnx import TensorProto

from tests.support import ServerProcess, cloud_server, write_identity_model, write_linear_model

#: V2 datatype -> ONNX element type, for identity models that echo one datatype.
IDENTITY_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BF16": TensorProto.BFLOAT16,
    "BYTES": TensorProto.STRING,
}

LINEAR_CONFIG = """
backend = "onnxruntime"
max_batch_size = 16
[[input]]
name = "x"
datatype = "FP32"
dims = [4]
[[output]]
name = "y"
datatype = "FP32"
dims = [3]
[dynamic_batching]
max_queue_delay_us = 20000
preferred_batch_sizes = [16]
max_queue_size = 256
[runtime]
threads = 1
"""


def build_test_repository(root: Path) -> Path:
    """Tiny real ONNX models: a configured linear model, an auto-configured one, echoes."""
    write_linear_model(root / "linear" / "1" / "model.onnx", seed=1)
    write_linear_model(root / "linear" / "2" / "model.onnx", seed=2)
    (root / "linear" / "config.toml").write_text(LINEAR_CONFIG + "[version_policy]\nall = true\n")
    write_linear_model(root / "auto" / "1" / "model.onnx", seed=3)
    for datatype, onnx_type in IDENTITY_TYPES.items():
        write_identity_model(root / f"echo_{datatype.lower()}" / "1" / "model.onnx", onnx_type)
    return root


@pytest.fixture(scope="module")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def server(test_repository: Path) -> Iterator[ServerProcess]:
    proc = cloud_server(test_repository, "--node", "test-node").start()
    yield proc
    proc.terminate()
