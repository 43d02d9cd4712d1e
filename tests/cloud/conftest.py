from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from onnx import TensorProto

from tests.support import (
    ServerProcess,
    cloud_server,
    write_identity_model,
    write_linear_model,
    write_slow_model,
    write_softmax_model,
)

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
    """Tiny real ONNX models: a configured linear model, an auto-configured one, echoes,
    a softmax classifier and a linear model served by two instances."""
    write_linear_model(root / "linear" / "1" / "model.onnx", seed=1)
    write_linear_model(root / "linear" / "2" / "model.onnx", seed=2)
    (root / "linear" / "config.toml").write_text(LINEAR_CONFIG + "[version_policy]\nall = true\n")
    write_linear_model(root / "auto" / "1" / "model.onnx", seed=3)
    for datatype, onnx_type in IDENTITY_TYPES.items():
        write_identity_model(root / f"echo_{datatype.lower()}" / "1" / "model.onnx", onnx_type)
    write_softmax_model(root / "softmax" / "1" / "model.onnx")
    write_linear_model(root / "pair" / "1" / "model.onnx", seed=4)
    (root / "pair" / "config.toml").write_text(
        "[instance_group]\ncount = 2\n[runtime]\nthreads = 1\n"
    )
    return root


#: a model whose every run takes ~100+ ms (tests.support.write_slow_model); no
#: [dynamic_batching], so each request runs alone and the rest wait in its queue
SLOW_CONFIG = "[runtime]\nthreads = 1\n"


def build_slow_repository(root: Path, broken: bool = False) -> Path:
    """``slow`` (see SLOW_CONFIG) and, when asked, ``broken``: a config naming an input
    the model file does not have, so its load fails."""
    write_slow_model(root / "slow" / "1" / "model.onnx")
    (root / "slow" / "config.toml").write_text(SLOW_CONFIG)
    if broken:
        write_linear_model(root / "broken" / "1" / "model.onnx")
        (root / "broken" / "config.toml").write_text(
            '[[input]]\nname = "nope"\ndatatype = "FP32"\ndims = [4]\n'
        )
    return root


@pytest.fixture(scope="module")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module")
def server(test_repository: Path) -> Iterator[ServerProcess]:
    proc = cloud_server(test_repository, "--node", "test-node").start()
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def slow_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_slow_repository(tmp_path_factory.mktemp("slow"))


# ---- small HTTP helpers for tests against real server processes --------------------------
def http_call(
    url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 30.0
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request; errors are answers, not exceptions."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url, data=body, headers=headers or {}, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def infer_body(x, parameters: dict | None = None, request_id: str | None = None):
    """A binary V2 request for input ``x``: (body, headers)."""
    from shared import v2
    from shared.messages import InferRequest
    from shared.tensors import Tensor

    req = InferRequest(
        inputs=[Tensor.from_array("x", x)], id=request_id, parameters=dict(parameters or {})
    )
    chunks, hl = v2.encode_request(req)
    return v2.join(chunks), {v2.HEADER_LENGTH: str(hl)}


def decode_infer(status: int, headers: dict, body: bytes):
    """The InferResponse of a 200 answer (binary or JSON)."""
    from shared import v2

    assert status == 200, body[:300]
    length = headers.get(v2.HEADER_LENGTH) or headers.get(v2.HEADER_LENGTH.lower())
    return v2.decode_response(body, int(length) if length else None)


def scrape_value(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text body (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0
