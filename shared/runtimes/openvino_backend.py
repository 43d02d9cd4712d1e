"""OpenVINO backend: IR ``.xml`` + ``.bin`` (or an ``.onnx`` file) on CPU or GPU.

OpenVINO picks bf16 on CPUs that have it (fast, small error); set
``precision_hint = "f32"`` in the model's ``[runtime]`` when exactness
matters.  One infer request per session, guarded by a lock: requests are not
thread-safe, and the dataplanes give each session one worker anyway.

OpenVINO itself checks little: it converts an FP64 array to FP32 without a
word and runs a MatMul whose inner dimension is wrong, so every request is
checked against the port specs before it reaches the request.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from shared.datatypes import bf16_dtype
from shared.errors import (
    BackendMissing,
    ConfigError,
    InternalError,
    InvalidInput,
    ModelNotFound,
    RunCancelled,
)
from shared.runtimes._common import check_inputs, check_outputs, closed_error
from shared.runtimes.base import Cancel, RuntimeOptions, TensorSpec

#: OpenVINO element type names -> V2 datatypes
OV_TYPES: dict[str, str] = {
    "boolean": "BOOL",
    "u8": "UINT8",
    "u16": "UINT16",
    "u32": "UINT32",
    "u64": "UINT64",
    "i8": "INT8",
    "i16": "INT16",
    "i32": "INT32",
    "i64": "INT64",
    "f16": "FP16",
    "f32": "FP32",
    "f64": "FP64",
    "bf16": "BF16",
}

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FP32_MAX = float(np.finfo(np.float32).max)

#: what the CPU plugin computes each wide datatype as (measured with OpenVINO 2026.4:
#: 2**40 + 1 came back 1, an FP64 1e300 + 1 came back 3.4e38, 0.1 + 1 as 1.100000023841858)
CPU_NARROWS: dict[str, str] = {"INT64": "INT32", "UINT64": "INT32", "FP64": "FP32"}

log = logging.getLogger(__name__)


def _names(port: Any, fallback: str) -> list[str]:
    """The port's tensor names, primary (``get_any_name``) first."""
    names = sorted(port.get_names())
    if not names:
        return [fallback]
    primary = port.get_any_name()
    return [primary, *(n for n in names if n != primary)]


def _spec(port: Any, name: str, kind: str, path: Path) -> TensorSpec:
    type_name = port.get_element_type().get_type_name()
    if type_name == "string":
        # Measured with OpenVINO 2026.4: inferring a string tensor on CPU corrupts the
        # heap (the process aborts at exit), so such models are refused up front.
        raise ConfigError(
            f"{path}: {kind} {name!r} is a string tensor, which the openvino backend does "
            "not serve; serve this model with onnxruntime"
        )
    datatype = OV_TYPES.get(type_name)
    if datatype is None:
        raise ConfigError(
            f"{path}: {kind} {name!r} has element type {type_name}, which Ferry cannot carry"
        )
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        return TensorSpec(name, datatype, (), ranked=False)  # any rank: the runtime checks
    dims = tuple(d.get_length() if d.is_static else -1 for d in shape)
    return TensorSpec(name, datatype, dims)


def _said(exc: Exception) -> str:
    """OpenVINO's message without its lines of C++ source locations."""
    lines = []
    for line in str(exc).splitlines():
        line = line.strip().removeprefix("Caught exception: ")
        if not line or line.startswith("Exception from "):
            continue
        if line.startswith("Check '") and " failed at " in line and line.endswith(":"):
            continue  # the check's source location; its words follow
        lines.append(line)
    return "; ".join(lines) or type(exc).__name__


def _run_error(exc: Exception) -> InvalidInput | InternalError:
    """What a failed run means: a node's shape inference refusing these inputs is the
    request's fault (400, as ONNX Runtime's are), anything else the node's (500).
    OpenVINO wraps the plugin's words in lines of C++ source locations: dropped."""
    text = str(exc)
    said = _said(exc)
    if "shape_inference" in text or "shape infer" in text.lower():
        return InvalidInput(f"openvino cannot run the model on these inputs: {said}")
    return InternalError(f"openvino failed: {said}")


class OpenVinoSession:
    """A compiled model and its one infer request."""

    backend = "openvino"

    def __init__(self, compiled: Any, ov: Any, path: Path, device: str) -> None:
        self._compiled = compiled
        self._ov = ov
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()
        self.path = path
        self.device = device
        in_names = [_names(p, f"input_{i}") for i, p in enumerate(compiled.inputs)]
        out_names = [_names(p, f"output_{i}") for i, p in enumerate(compiled.outputs)]
        self.inputs = [
            _spec(p, n[0], "input", path) for p, n in zip(compiled.inputs, in_names, strict=True)
        ]
        self.outputs = [
            _spec(p, n[0], "output", path) for p, n in zip(compiled.outputs, out_names, strict=True)
        ]
        self._in_index = {s.name: i for i, s in enumerate(self.inputs)}
        # every name of an output port finds it, the primary one is reported
        self._out_index = {name: i for i, names in enumerate(out_names) for name in names}
        self._output_names = [s.name for s in self.outputs]
        self._bf16_inputs = {s.name for s in self.inputs if s.datatype == "BF16"}
        # The CPU plugin computes INT64 and UINT64 as INT32 and wraps larger values
        # silently (2**40 + 1 came back 1); UINT32 it keeps.  Results that leave the
        # INT32 range wrap too, which no check of the inputs can see.
        self._int64_inputs = (
            {s.name for s in self.inputs if s.datatype in ("INT64", "UINT64")}
            if device == "CPU"
            else set()
        )
        # FP64 it computes as FP32: a value past FP32's range comes back clamped
        self._fp64_inputs = (
            {s.name for s in self.inputs if s.datatype == "FP64"} if device == "CPU" else set()
        )
        #: port -> what it is computed as, where that is narrower than its datatype
        #: (tuning does not pick this backend for such a model in another's place)
        self.narrowed: dict[str, str] = {
            s.name: f"{s.datatype} as {CPU_NARROWS[s.datatype]}"
            for s in (*self.inputs, *self.outputs)
            if device == "CPU" and s.datatype in CPU_NARROWS
        }

    def property(self, name: str) -> Any:
        """A property of the compiled model (e.g. ``INFERENCE_NUM_THREADS``)."""
        if self._compiled is None:
            raise closed_error(self.backend)
        return self._compiled.get_property(name)

    #: an infer request started asynchronously can be cancelled while it runs
    cancellable = True

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        return self._run(inputs, outputs, None)

    def run_cancellable(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel
    ) -> dict[str, np.ndarray]:
        """:meth:`run`, stopped halfway by ``cancel`` (then RunCancelled)."""
        return self._run(inputs, outputs, cancel)

    def _run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel | None
    ) -> dict[str, np.ndarray]:
        feed = check_inputs(self.inputs, inputs)
        names = check_outputs(list(self._out_index), outputs or self._output_names)
        for name in self._int64_inputs:
            array = feed[name]
            if array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
                raise InvalidInput(
                    f"input {name!r}: OpenVINO's CPU plugin computes {array.dtype.name.upper()} "
                    f"as INT32, so values outside the INT32 range [{_INT32_MIN}, {_INT32_MAX}] "
                    "would be wrapped"
                )
        for name in self._fp64_inputs:
            array = feed[name]
            if array.size:
                # (NaN passes as NaN; an infinity comes back as FP32's largest value)
                top = float(np.abs(array[~np.isnan(array)]).max(initial=0.0))
                if top > _FP32_MAX:
                    raise InvalidInput(
                        f"input {name!r}: OpenVINO's CPU plugin computes FP64 as FP32, so "
                        f"values beyond +-{_FP32_MAX:.7g} (infinities too) would come back "
                        'clamped (backend = "onnxruntime" computes FP64)'
                    )
        data: dict[int, Any] = {}
        for name, array in feed.items():
            if name in self._bf16_inputs:
                data[self._in_index[name]] = self._bf16_tensor(array)
            else:
                data[self._in_index[name]] = array
        with self._lock:
            request = self._request
            if request is None:
                raise closed_error(self.backend)
            try:
                values = self._infer(request, data, cancel)
            except (RuntimeError, TypeError, ValueError) as exc:
                if cancel is not None and cancel.cancelled:
                    raise RunCancelled("openvino: the run was cancelled") from None
                raise _run_error(exc) from None
        out = {}
        for name in names:
            index = self._out_index[name]
            array = values[index]
            if self.outputs[index].datatype == "BF16":
                # the Python API hands bf16 back as float16 holding bf16 bits
                array = array.view(np.uint16).view(bf16_dtype())
            out[name] = array
        return out

    def _infer(self, request: Any, data: dict[int, Any], cancel: Cancel | None) -> tuple:
        """Started asynchronously and waited for, cancelled or not: measured with
        OpenVINO 2026.4, a reused request's synchronous ``infer`` does not raise when
        the plugin refuses the inputs (two inputs that do not broadcast, a Reshape
        whose element count does not fit): it hands back an empty array, or the
        previous request's outputs, another client's answer; ``wait`` raises.  It
        costs no more (2.7 ms either way on the example CNN here)."""
        if cancel is not None and not cancel.bind(request.cancel):
            raise RunCancelled("openvino: the run was cancelled before it started")
        request.start_async(data, share_inputs=True)
        request.wait()  # a refused or cancelled request raises here
        # copies the caller owns past the next run (the request's tensors are reused)
        return tuple(np.array(t.data, copy=True) for t in request.output_tensors)

    def _bf16_tensor(self, array: np.ndarray) -> Any:
        tensor = self._ov.Tensor(self._ov.Type.bf16, self._ov.Shape(list(array.shape)))
        tensor.data[...] = array.view(np.uint16).view(tensor.data.dtype)
        return tensor

    def close(self) -> None:
        """Drop the request and the compiled model (waits for a run in progress)."""
        with self._lock:
            self._request = None
            self._compiled = None


def load(path: Path, options: RuntimeOptions) -> OpenVinoSession:
    """Read and compile ``path`` (``.xml`` with its ``.bin``, or ``.onnx``)."""
    try:
        import openvino as ov
    except ImportError:
        raise BackendMissing(
            "the openvino backend needs OpenVINO: pip install 'ferry[cloud]' "
            "(or pip install openvino)"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"model file {path} does not exist")
    core = ov.Core()
    device = "GPU" if options.device == "gpu" else "CPU"
    if not any(d.split(".")[0] == device for d in core.available_devices):
        raise BackendMissing(
            f"OpenVINO has no {device} device here (available: {core.available_devices})"
        )
    config: dict[str, Any] = {
        "INFERENCE_NUM_THREADS": options.resolved_threads(),
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }
    if options.precision_hint:
        config["INFERENCE_PRECISION_HINT"] = options.precision_hint
    try:
        model = core.read_model(str(path))
    except RuntimeError as exc:
        weights = path.with_suffix(".bin")
        if path.suffix == ".xml" and not weights.is_file():
            raise ModelNotFound(
                f"model weights {weights} (next to {path.name}) do not exist"
            ) from None
        raise InvalidInput(f"openvino cannot read {path}: {exc}") from None
    try:
        compiled = core.compile_model(model, device, config)
    except RuntimeError as exc:
        raise ConfigError(f"openvino cannot compile {path} for {device}: {_said(exc)}") from None
    session = OpenVinoSession(compiled, ov, path, device)
    if session.narrowed:
        log.warning(
            "%s: OpenVINO's CPU plugin computes %s: results lose precision and range "
            '(integers past INT32 wrap; backend = "onnxruntime" computes them as they are)',
            path,
            ", ".join(f"{name} {how}" for name, how in sorted(session.narrowed.items())),
        )
    return session
