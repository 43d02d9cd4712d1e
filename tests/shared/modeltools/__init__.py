"""Tests of shared.modeltools, plus the tiny CNN they quantize, convert and inspect."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: the tiny CNN's input shape without the batch dimension
CONV_INPUT = (3, 16, 16)
CONV_CLASSES = 4


def write_conv_model(path: Path, seed: int = 0, batch: int | str = "N") -> int:
    """Conv-Relu-Conv-Relu-GlobalAveragePool-Flatten-Gemm-Softmax, x [N,3,16,16] -> probs [N,4].

    Shaped like the CNNs Ferry serves (so QDQ has convolutions, a matmul and
    activations to calibrate) yet quantizes and converts in well under a
    second.  Returns the number of weight elements.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.standard_normal((8, 3, 3, 3)) * 0.3,
        "b1": rng.standard_normal(8) * 0.1,
        "w2": rng.standard_normal((16, 8, 3, 3)) * 0.2,
        "b2": rng.standard_normal(16) * 0.1,
        "w3": rng.standard_normal((16, CONV_CLASSES)) * 0.5,
        "b3": rng.standard_normal(CONV_CLASSES) * 0.1,
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
            helper.make_node("Relu", ["c2"], ["r2"]),
            helper.make_node("GlobalAveragePool", ["r2"], ["pool"]),
            helper.make_node("Flatten", ["pool"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w3", "b3"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        ],
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, *CONV_INPUT])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, CONV_CLASSES])],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return sum(v.size for v in weights.values())


def conv_inputs(n: int, seed: int = 1) -> np.ndarray:
    """Inputs in the range a normalised image has (what calibration should see)."""
    return np.random.default_rng(seed).standard_normal((n, *CONV_INPUT)).astype(np.float32)


def run_onnx(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]
