"""What a model file holds: backend, sizes, inputs and outputs.

Reads the file's own metadata (the ``onnx`` protobuf, OpenVINO's IR reader,
the LiteRT interpreter) rather than building a serving session, so it works on
any file, on any machine, without the runtime's thread pools, and reports
what only the file knows (opset, parameter count, quantization nodes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shared.datatypes import v2_datatype
from shared.errors import BackendMissing, InvalidInput, ModelNotFound
from shared.runtimes import MODEL_FILES

#: file suffix -> backend that serves it
SUFFIX_BACKENDS: dict[str, str] = {
    ".onnx": "onnxruntime",
    ".xml": "openvino",
    ".tflite": "litert",
    ".plan": "tensorrt",
    ".engine": "tensorrt",
}

_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def describe(path: Path) -> dict[str, Any]:
    """Describe a model file (or a version / model folder holding one) as plain data.

    Keys: ``path``, ``backend``, ``files`` (name -> bytes), ``size_bytes``,
    ``inputs`` / ``outputs`` (``name``, ``datatype``, ``dims``; -1 is dynamic);
    ONNX adds ``opset``, ``parameters``, ``qdq``, ``producer``, ``metadata``.
    """
    path = resolve_model_file(Path(path))
    backend = SUFFIX_BACKENDS.get(path.suffix.lower())
    if backend is None:
        raise InvalidInput(
            f"cannot tell the backend of {path.name}; expected one of {sorted(SUFFIX_BACKENDS)}"
        )
    files = {path.name: path.stat().st_size}
    if not files[path.name]:
        raise InvalidInput(f"{path} is empty (0 bytes): not a model")
    info: dict[str, Any] = {"path": str(path), "backend": backend}
    if backend == "onnxruntime":
        info.update(_describe_onnx(path, files))
    elif backend == "openvino":
        bin_path = path.with_suffix(".bin")
        if bin_path.exists():
            files[bin_path.name] = bin_path.stat().st_size
        info.update(_describe_openvino(path))
    elif backend == "litert":
        info.update(_describe_litert(path))
    else:
        raise BackendMissing(
            f"{path.name} is a TensorRT engine; inspecting it needs TensorRT and a GPU"
        )
    info["files"] = files
    info["size_bytes"] = sum(files.values())
    return info


def resolve_model_file(path: Path) -> Path:
    """A model file itself, the model file in a version folder, or the latest version's."""
    if path.is_file():
        return path
    if not path.exists():
        raise ModelNotFound(f"{path} does not exist")
    for name in MODEL_FILES:
        if (path / name).is_file():
            return path / name
    versions = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and p.name.isdigit())
    # the newest version that holds a model file, as the repository serves it (an
    # empty folder for the next version is not a broken model)
    for _, folder in reversed(versions):
        for name in MODEL_FILES:
            if (folder / name).is_file():
                return folder / name
    raise ModelNotFound(f"{path} holds no model file (expected one of {sorted(MODEL_FILES)})")


def format_description(d: dict[str, Any]) -> str:
    """The description as a few aligned lines for a terminal."""
    facts = [d["backend"], _human_bytes(d["size_bytes"])]
    if d.get("opset", {}).get(""):
        facts.append(f"opset {d['opset']['']}")
    if "parameters" in d:
        facts.append(f"{d['parameters']:,} parameters")
    if d.get("qdq"):
        facts.append("int8 QDQ")
    lines = [f"{d['path']}", f"  {'; '.join(facts)}"]
    if len(d["files"]) > 1:
        lines.append(
            "  files: " + ", ".join(f"{k} {_human_bytes(v)}" for k, v in d["files"].items())
        )
    width = max((len(t["name"]) for t in d["inputs"] + d["outputs"]), default=0)
    for title in ("inputs", "outputs"):
        lines.append(f"  {title}:")
        for t in d[title]:
            dims = (
                "any rank"
                if t["dims"] is None
                else ", ".join("?" if x < 0 else str(x) for x in t["dims"])
            )
            served = f"  (the file's {t['onnx_type']})" if "onnx_type" in t else ""
            lines.append(f"    {t['name']:<{width}}  {t['datatype']:<6}[{dims}]{served}")
    return "\n".join(lines)


def onnx_io(graph: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Inputs (without initializers) and outputs of an ONNX graph as name/datatype/dims.

    A ``seq(map(key, float))`` output (ZipMap) is described as the tensor the
    onnxruntime backend serves it as, ``[rows, classes]`` (see
    :mod:`shared.runtimes.onnxruntime_backend`), with ``onnx_type`` telling
    what the file holds; other non-tensor types (and non-tensor inputs, which
    no backend takes) get datatype ``onnx:<type>``.
    """
    from onnx.helper import tensor_dtype_to_np_dtype

    initializers = {init.name for init in graph.initializer}

    def tensor_datatype(elem_type: int) -> str:
        try:
            return v2_datatype(tensor_dtype_to_np_dtype(elem_type))
        except (KeyError, InvalidInput, TypeError):
            return f"onnx:{elem_type}"

    def spec(value: Any, output: bool = False) -> dict[str, Any]:
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            onnx_type = _type_text(value.type)
            served = _ZIPMAP_SERVED.get(onnx_type) if output else None
            if served is None:
                return {"name": value.name, "datatype": f"onnx:{onnx_type}", "dims": []}
            return {
                "name": value.name,
                "datatype": served,
                "dims": [-1, -1],
                "onnx_type": onnx_type,
            }
        tensor_type = value.type.tensor_type
        dims: list[int] | None = None  # no shape at all: any rank (not a scalar's [])
        if tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
        return {
            "name": value.name,
            "datatype": tensor_datatype(tensor_type.elem_type),
            "dims": dims,
        }

    inputs = [spec(v) for v in graph.input if v.name not in initializers]
    return inputs, [spec(v, output=True) for v in graph.output]


#: non-tensor output types the onnxruntime backend serves, and as what datatype
_ZIPMAP_SERVED = {
    f"seq(map({key},tensor({value})))": datatype
    for key in ("int64", "string")
    for value, datatype in (("float", "FP32"), ("double", "FP64"))
}

_ELEM_NAMES = {1: "float", 6: "int32", 7: "int64", 8: "string", 11: "double"}


def _type_text(type_proto: Any) -> str:
    """An ONNX type in onnxruntime's notation, e.g. ``seq(map(int64,tensor(float)))``."""
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        elem = type_proto.tensor_type.elem_type
        return f"tensor({_ELEM_NAMES.get(elem, str(elem))})"
    if kind == "sequence_type":
        return f"seq({_type_text(type_proto.sequence_type.elem_type)})"
    if kind == "map_type":
        key = type_proto.map_type.key_type
        return f"map({_ELEM_NAMES.get(key, str(key))},{_type_text(type_proto.map_type.value_type)})"
    return str(kind)


def _describe_onnx(path: Path, files: dict[str, int]) -> dict[str, Any]:
    try:
        import onnx
    except ImportError as exc:
        raise BackendMissing(
            "inspecting ONNX files needs the onnx package: pip install onnx"
        ) from exc
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # the protobuf parser raises DecodeError and friends
        raise InvalidInput(f"{path.name} is not a readable ONNX model: {exc}") from exc
    graph = model.graph
    if not graph.node and not graph.input and not graph.output:
        # protobuf reads any few stray bytes as a message with nothing set
        raise InvalidInput(f"{path.name} holds no ONNX graph (cut short, or not a model)")
    for init in graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                data = path.parent / entry.value
                if not data.is_file():  # the graph reads, the model never loads
                    raise ModelNotFound(
                        f"{path.name} keeps tensor {init.name!r} in {entry.value}, "
                        f"which is not in {path.parent}"
                    )
                files[data.name] = data.stat().st_size
    inputs, outputs = onnx_io(graph)
    ops = [node.op_type for node in graph.node]
    return {
        "inputs": inputs,
        "outputs": outputs,
        "opset": {o.domain: o.version for o in model.opset_import},
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "parameters": sum(int(np.prod(init.dims, dtype=np.int64)) for init in graph.initializer),
        "nodes": len(ops),
        "qdq": any(op in _QDQ_OPS for op in ops),
        "metadata": {p.key: p.value for p in model.metadata_props},
    }


def _describe_openvino(path: Path) -> dict[str, Any]:
    try:
        import openvino as ov
    except ImportError as exc:
        raise BackendMissing("inspecting OpenVINO IR needs openvino: pip install openvino") from exc
    try:
        model = ov.Core().read_model(str(path))
    except RuntimeError as exc:
        raise InvalidInput(f"{path.name} is not a readable OpenVINO IR: {exc}") from exc

    def spec(port: Any) -> dict[str, Any]:
        shape = port.get_partial_shape()
        dims = (
            [d.get_length() if d.is_static else -1 for d in shape] if shape.rank.is_static else []
        )
        return {
            "name": port.get_any_name(),
            "datatype": v2_datatype(port.get_element_type().to_dtype()),
            "dims": dims,
        }

    return {
        "inputs": [spec(p) for p in model.inputs],
        "outputs": [spec(p) for p in model.outputs],
        "nodes": len(model.get_ops()),
    }


def _describe_litert(path: Path) -> dict[str, Any]:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        try:
            from tflite_runtime.interpreter import Interpreter
        except ImportError as exc:
            raise BackendMissing(
                "inspecting TFLite files needs ai-edge-litert: pip install ai-edge-litert"
            ) from exc
    try:
        interpreter = Interpreter(model_path=str(path))
    except (ValueError, RuntimeError) as exc:
        raise InvalidInput(f"{path.name} is not a readable TFLite model: {exc}") from exc

    def spec(detail: dict[str, Any]) -> dict[str, Any]:
        signature = detail.get("shape_signature")
        dims = signature if signature is not None and len(signature) else detail["shape"]
        return {
            "name": detail["name"],
            "datatype": v2_datatype(np.dtype(detail["dtype"])),
            "dims": [int(x) for x in dims],
        }

    return {
        "inputs": [spec(d) for d in interpreter.get_input_details()],
        "outputs": [spec(d) for d in interpreter.get_output_details()],
    }


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KB", "MB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
