"""OpenVINO backend (CPU by default; reads IR ``.xml`` + ``.bin`` or ``.onnx``).

OpenVINO picks bf16 on CPUs that have it (fast, small error); set
``precision_hint = "f32"`` in the model's ``[runtime]`` when exactness
matters.  One infer request per session, guarded by a lock: requests are
not thread-safe, and the batcher gives each session one worker anyway.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from shared.datatypes import numpy_dtype
from shared.errors import BackendMissing, InternalError, InvalidInput, ModelNotFound
from shared.runtimes.base import RuntimeOptions, TensorSpec

_TYPES = {
    "boolean": "BOOL", "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64",
    "f16": "FP16", "f32": "FP32", "f64": "FP64", "bf16": "BF16", "string": "BYTES",
}


def _spec(port) -> TensorSpec:
    shape = port.get_partial_shape()
    dims = tuple(d.get_length() if d.is_static else -1 for d in shape)
    return TensorSpec(port.get_any_name(), _TYPES.get(port.get_element_type().get_type_name(), "FP32"), dims)


class OpenVinoSession:
    backend = "openvino"

    def __init__(self, compiled) -> None:
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()
        self.inputs = [_spec(p) for p in compiled.inputs]
        self.outputs = [_spec(p) for p in compiled.outputs]
        self._in = {s.name: s for s in self.inputs}
        self._out_index = {s.name: i for i, s in enumerate(self.outputs)}

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        unknown = set(inputs) - set(self._in)
        if unknown:
            raise InvalidInput(f"unknown inputs {sorted(unknown)}; the model takes {sorted(self._in)}")
        missing = set(self._in) - set(inputs)
        if missing:
            raise InvalidInput(f"missing inputs {sorted(missing)}")
        names = outputs or list(self._out_index)
        bad = [n for n in names if n not in self._out_index]
        if bad:
            raise InvalidInput(f"unknown outputs {bad}; the model gives {list(self._out_index)}")
        feed = {}
        for name, array in inputs.items():
            spec = self._in[name]
            if spec.datatype != "BYTES" and array.dtype != numpy_dtype(spec.datatype):
                raise InvalidInput(f"input {name!r}: expected {spec.datatype}, got {array.dtype}")
            if len(array.shape) != len(spec.dims) or any(d not in (-1, g) for d, g in zip(spec.dims, array.shape, strict=False)):
                raise InvalidInput(f"input {name!r}: expected shape {list(spec.dims)}, got {list(array.shape)}")
            feed[name] = np.ascontiguousarray(array)
        try:
            with self._lock:
                result = self._request.infer(feed)
                return {n: np.array(result[self._compiled.outputs[self._out_index[n]]], copy=True) for n in names}
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InternalError(f"openvino failed: {exc}") from None

    def close(self) -> None:
        self._request = None
        self._compiled = None


def load(path: Path, options: RuntimeOptions) -> OpenVinoSession:
    try:
        import openvino as ov
    except ImportError:
        raise BackendMissing("the openvino backend needs OpenVINO: pip install 'ferry[cloud]'") from None
    if not Path(path).is_file():
        raise ModelNotFound(f"model file {path} does not exist")
    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": options.resolved_threads(), "PERFORMANCE_HINT": "LATENCY"}
    if options.precision_hint:
        config["INFERENCE_PRECISION_HINT"] = options.precision_hint
    device = "GPU" if options.device == "gpu" else "CPU"
    try:
        model = core.read_model(str(path))
        compiled = core.compile_model(model, device, config)
    except RuntimeError as exc:
        raise InvalidInput(f"openvino cannot load {path}: {exc}") from None
    return OpenVinoSession(compiled)
