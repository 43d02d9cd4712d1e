"""Helpers for the repository tests: tiny real ONNX models and real sessions."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from shared.runtimes import load_session
from shared.runtimes.base import Session

Dims = list[int | str] | None  # None: no shape in the file (any rank)
_ONNX_TYPES = {"FP32": TensorProto.FLOAT, "INT64": TensorProto.INT64, "BOOL": TensorProto.BOOL}


def write_identity_model(
    path: Path, tensors: list[tuple[str, str, Dims]], out_suffix: str = "_out"
) -> Path:
    """An ONNX model whose outputs copy its inputs: ``name`` -> ``name + out_suffix``.

    A string dim is symbolic (dynamic, reported as -1); ints are fixed; dims
    None leaves the shape out of the file (the runtime takes any rank).
    """
    inputs, outputs, nodes = [], [], []
    for name, datatype, dims in tensors:
        elem = _ONNX_TYPES[datatype]
        out = name.replace(":", "_") + out_suffix
        inputs.append(helper.make_tensor_value_info(name, elem, dims))
        outputs.append(helper.make_tensor_value_info(out, elem, dims))
        nodes.append(helper.make_node("Identity", [name], [out]))
    graph = helper.make_graph(nodes, "tiny", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if all(dims is not None for _, _, dims in tensors):  # (the checker wants every shape)
        onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def open_session(path: Path) -> Session:
    """A real session from the project's onnxruntime backend."""
    return load_session("onnxruntime", path)
