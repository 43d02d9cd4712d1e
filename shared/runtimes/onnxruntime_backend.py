"""ONNX Runtime backend.

Intra-op threads = the cores given to the process unless configured, and
spinning off: on small machines spinning threads of two sessions starve each
other (DESIGN.md section 6).  ``InferenceSession.run`` releases the GIL and
may be called from several threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from shared.errors import BackendMissing, InternalError, InvalidInput, ModelNotFound
from shared.runtimes.base import RuntimeOptions, TensorSpec

_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}


def _spec(arg) -> TensorSpec:
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape)
    return TensorSpec(arg.name, _TYPES.get(arg.type, arg.type), dims)


class OnnxRuntimeSession:
    backend = "onnxruntime"

    def __init__(self, session, ort) -> None:
        self._session = session
        self._ort = ort
        self.inputs = [_spec(a) for a in session.get_inputs()]
        self.outputs = [_spec(a) for a in session.get_outputs()]
        self._input_names = {s.name for s in self.inputs}
        self._output_names = [s.name for s in self.outputs]
        self._bytes_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}
        self._bf16 = any(s.datatype == "BF16" for s in self.inputs + self.outputs)

    def _run_bf16(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """numpy has no bfloat16 ORT knows: pass raw 16-bit words as OrtValues."""
        from ml_dtypes import bfloat16

        bf16_type = 16  # onnx.TensorProto.BFLOAT16
        values = {}
        for name, array in feed.items():
            if array.dtype == np.dtype(bfloat16):
                values[name] = self._ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(array).view(np.uint16), bf16_type
                )
            else:
                values[name] = self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
        out = []
        for value in self._session.run_with_ort_values(names, values):
            if value.data_type() == "tensor(bfloat16)":
                shape = tuple(value.shape())
                count = int(np.prod(shape)) if shape else 1
                raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())
                out.append(np.frombuffer(raw, np.uint16).copy().view(bfloat16).reshape(shape))
            else:
                out.append(value.numpy())
        return out

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        unknown = set(inputs) - self._input_names
        if unknown:
            raise InvalidInput(
                f"unknown inputs {sorted(unknown)}; the model takes {sorted(self._input_names)}"
            )
        missing = self._input_names - set(inputs)
        if missing:
            raise InvalidInput(f"missing inputs {sorted(missing)}")
        names = outputs or self._output_names
        bad = [n for n in names if n not in self._output_names]
        if bad:
            raise InvalidInput(f"unknown outputs {bad}; the model gives {self._output_names}")
        feed = {}
        for name, array in inputs.items():
            if name in self._bytes_inputs:
                try:
                    items = [x.decode() if isinstance(x, bytes) else x for x in array.reshape(-1)]
                except UnicodeDecodeError:
                    raise InvalidInput(
                        f"input {name!r}: onnxruntime string tensors must hold UTF-8 text"
                    ) from None
                array = np.array(items, dtype=object).reshape(array.shape)
            feed[name] = array
        try:
            if self._bf16:
                result = self._run_bf16(names, feed)
            else:
                result = self._session.run(names, feed)
        except (
            self._ort.capi.onnxruntime_pybind11_state.InvalidArgument,
            self._ort.capi.onnxruntime_pybind11_state.InvalidGraph,
        ) as exc:
            raise InvalidInput(str(exc)) from None
        except Exception as exc:
            raise InternalError(f"onnxruntime failed: {exc}") from None
        out = {}
        for name, array in zip(names, result, strict=True):
            if array.dtype == object:
                array = np.array(
                    [x.encode() if isinstance(x, str) else x for x in array.reshape(-1)],
                    dtype=object,
                ).reshape(array.shape)
            out[name] = array
        return out

    def close(self) -> None:
        self._session = None


def load(path: Path, options: RuntimeOptions) -> OnnxRuntimeSession:
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendMissing(
            "the onnxruntime backend needs onnxruntime: pip install 'ferry[edge]'"
        ) from None
    if not Path(path).is_file():
        raise ModelNotFound(f"model file {path} does not exist")
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.resolved_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if options.allow_spinning else "0"
    )
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if options.device == "gpu" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except Exception as exc:
        raise InvalidInput(f"onnxruntime cannot load {path}: {exc}") from None
    return OnnxRuntimeSession(session, ort)
