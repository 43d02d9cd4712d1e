"""ONNX Runtime backend.

Intra-op threads = the cores given to the process unless configured, one
inter-op thread, and spinning off unless asked for: on small machines the
spinning threads of two sessions starve each other (DESIGN.md section 6).

``InferenceSession.run`` releases the GIL and is safe to call from several
threads at once; the dataplanes still give each session one worker thread,
because two concurrent runs only split the same intra-op threads.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np

from shared.datatypes import bf16_dtype
from shared.errors import (
    BackendMissing,
    ConfigError,
    FerryError,
    InternalError,
    InvalidInput,
    ModelNotFound,
    RunCancelled,
)
from shared.runtimes._common import (
    bytes_array,
    check_inputs,
    check_outputs,
    closed_error,
    text_array,
)
from shared.runtimes.base import Cancel, RuntimeOptions, TensorSpec

#: ONNX Runtime type strings -> V2 datatypes
ORT_TYPES: dict[str, str] = {
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

_BF16_ONNX_TYPE = 16  # onnx.TensorProto.BFLOAT16


#: ZipMap's output (scikit-learn classifiers' probabilities): one map per row
_SEQ_MAP = re.compile(r"seq\(map\((int64|string),tensor\((float|double)\)\)\)")


def _shapeless(path: Path) -> set[str] | None:
    """Names of the graph's inputs and outputs that carry no shape at all (any rank).

    ONNX Runtime shows those and scalars alike as ``[]``; only the file tells
    them apart.  None when the ``onnx`` package is absent (the edge install
    may lack it) or cannot read the file: every ``[]`` is then taken as any
    rank, which only leaves the rank check to the runtime.
    """
    try:
        import onnx
    except ImportError:
        return None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return None
    graph = model.graph
    return {
        v.name
        for v in (*graph.input, *graph.output)
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
    }


def _spec(arg: Any, kind: str, path: Path, shapeless: set[str] | None = None) -> TensorSpec:
    datatype = ORT_TYPES.get(arg.type)
    if datatype is None and kind == "output":
        zipmap = _SEQ_MAP.fullmatch(arg.type)
        if zipmap:
            # Served as a [rows, classes] tensor (see OnnxRuntimeSession); the class
            # count is only known once the model has run.
            return TensorSpec(arg.name, "FP32" if zipmap[2] == "float" else "FP64", (-1, -1))
    if datatype is None:
        raise ConfigError(
            f"{path}: {kind} {arg.name!r} has type {arg.type}, which Ferry cannot carry; "
            f"supported: {sorted(ORT_TYPES)} (and seq(map(int64|string, float)) outputs)"
        )
    shape = arg.shape if isinstance(arg.shape, list) else []
    if not shape and (shapeless is None or arg.name in shapeless):
        return TensorSpec(arg.name, datatype, (), ranked=False)
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)
    return TensorSpec(arg.name, datatype, dims)


def _rows(value: Any, name: str, datatype: str) -> np.ndarray:
    """A ZipMap's list of ``{class: probability}`` as ``[rows, classes]``, ascending keys."""
    keys = sorted(value[0]) if value else []
    dtype = np.float32 if datatype == "FP32" else np.float64
    try:
        return np.array([[row[k] for k in keys] for row in value], dtype=dtype).reshape(
            len(value), len(keys)
        )
    except (KeyError, TypeError, ValueError):
        raise InternalError(
            f"output {name!r}: the maps of a row do not share one key set"
        ) from None


#: "[ONNXRuntimeError] : 1 : FAIL : " and the C++ source file, line and function a
#: check sits in ("/onnxruntime_src/.../element_wise_ops.h:583 void onnxruntime::...
#: Append(ptrdiff_t, ptrdiff_t) "): the runtime's internals, not the reason
_ORT_CODE = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_SOURCE = re.compile(r"/\S+\.(?:h|hpp|cc|cpp|c):\d+ (?:[^(\s]+ )*[^(\s]*\([^)]*\)(?: const)? ?")


def _said(exc: Exception) -> str:
    """ONNX Runtime's message without its error-code prefix and C++ source locations."""
    return _ORT_SOURCE.sub("", _ORT_CODE.sub("", str(exc))).strip() or type(exc).__name__


def _kernel_refused(message: str) -> bool:
    """Whether a FAIL from ``run`` is a kernel refusing these inputs (two dims that must
    agree do not, a sequence too short for a pad): the same request fails again, so it
    is the caller's.  A failed allocation is the server's, even when a huge input
    caused it, and ORT says both only in words."""
    return "while running" in message and "allocate" not in message


class OnnxRuntimeSession:
    """One ``InferenceSession``; BYTES tensors travel as object arrays of bytes.

    ONNX Runtime's string tensors hold text, so BYTES inputs must be UTF-8;
    string outputs come back UTF-8 encoded.  A ``seq(map(key, float))`` output
    (ZipMap, which scikit-learn converters put after a classifier) has no
    tensor form in V2: it is served as an FP32 (FP64 for double) tensor of
    ``[rows, classes]``, one column per key in ascending key order.

    Only datatypes, ranks and fixed dims are checked here: symbolic dim names
    are the exporter's hints (paddle2onnx names H and W both '?'), so whether
    two dims must agree is the runtime's call, and its refusal is an
    :class:`InvalidInput` like Ferry's own.
    """

    backend = "onnxruntime"

    def __init__(self, session: Any, ort: Any, path: Path) -> None:
        self._session = session
        self._ort = ort
        self.path = path
        args = (*session.get_inputs(), *session.get_outputs())
        # (the file is read again only where a shape says [], rare: scalars, any rank)
        blank = any(a.shape == [] and a.type in ORT_TYPES for a in args)
        shapeless = _shapeless(path) if blank else set()
        self.inputs = [_spec(a, "input", path, shapeless) for a in session.get_inputs()]
        self.outputs = [_spec(a, "output", path, shapeless) for a in session.get_outputs()]
        self._output_names = [s.name for s in self.outputs]
        self._maps = {
            a.name: spec.datatype
            for a, spec in zip(session.get_outputs(), self.outputs, strict=True)
            if a.type not in ORT_TYPES
        }
        self._bytes_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}
        self._bf16 = any(s.datatype == "BF16" for s in self.inputs + self.outputs)
        if self._bf16 and any(s.datatype == "BYTES" for s in self.inputs + self.outputs):
            raise ConfigError(
                f"{path}: onnxruntime's Python API cannot run a model with both bfloat16 "
                "and string tensors; serve it with another backend or change its I/O types"
            )
        state = ort.capi.onnxruntime_pybind11_state
        self._bad_input_errors = (state.InvalidArgument, state.InvalidGraph)
        self._node_failure = state.Fail

    @property
    def session_options(self) -> Any:
        """The ``SessionOptions`` the session runs with (threads, spinning)."""
        if self._session is None:
            raise closed_error(self.backend)
        return self._session.get_session_options()

    @property
    def providers(self) -> list[str]:
        if self._session is None:
            raise closed_error(self.backend)
        return list(self._session.get_providers())

    #: ONNX Runtime stops a run between two nodes once its RunOptions say terminate
    cancellable = True

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        return self._run(inputs, outputs, None)

    def run_cancellable(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, cancel: Cancel
    ) -> dict[str, np.ndarray]:
        """:meth:`run`, stopped halfway by ``cancel`` (then RunCancelled)."""
        run_options = self._ort.RunOptions()
        # ORT reads the flag before each node; the setter is safe from another thread.
        if not cancel.bind(lambda: setattr(run_options, "terminate", True)):
            raise RunCancelled("onnxruntime: the run was cancelled before it started")
        try:
            return self._run(inputs, outputs, run_options)
        except FerryError:
            if cancel.cancelled:
                raise RunCancelled("onnxruntime: the run was cancelled") from None
            raise

    def _run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None, run_options: Any
    ) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise closed_error(self.backend)
        feed = check_inputs(self.inputs, inputs)
        names = check_outputs(self._output_names, outputs)
        for name in self._bytes_inputs:
            feed[name] = text_array(feed[name], name, self.backend)
        try:
            if self._bf16:
                result = self._run_ort_values(session, names, feed, run_options)
            else:
                result = session.run(names, feed, run_options)
        except self._bad_input_errors as exc:
            raise InvalidInput(f"onnxruntime rejected the inputs: {_said(exc)}") from None
        except self._node_failure as exc:
            if not _kernel_refused(str(exc)):
                raise InternalError(f"onnxruntime failed: {_said(exc)}") from None
            raise InvalidInput(
                f"onnxruntime cannot run the model on these inputs: {_said(exc)}"
            ) from None
        except Exception as exc:
            raise InternalError(f"onnxruntime failed: {type(exc).__name__}: {_said(exc)}") from None
        # ORT's outputs are fresh arrays the caller owns; only strings and maps need converting.
        out = {}
        for name, value in zip(names, result, strict=True):
            if name in self._maps:
                value = _rows(value, name, self._maps[name])
            elif value.dtype.kind in "OSU":
                value = bytes_array(value, name)
            out[name] = value
        return out

    def _run_ort_values(
        self, session: Any, names: list[str], feed: dict[str, np.ndarray], run_options: Any
    ) -> list[np.ndarray]:
        """numpy has no bfloat16 ONNX Runtime knows: pass raw 16-bit words as OrtValues."""
        ort_value = self._ort.OrtValue
        values = {}
        for name, array in feed.items():
            if array.dtype.name == "bfloat16":
                values[name] = ort_value.ortvalue_from_numpy_with_onnx_type(
                    array.view(np.uint16), _BF16_ONNX_TYPE
                )
            else:
                values[name] = ort_value.ortvalue_from_numpy(array)
        out = []
        for value in session.run_with_ort_values(names, values, run_options):
            if value.data_type() == "tensor(bfloat16)":
                shape = tuple(value.shape())
                count = int(np.prod(shape, dtype=np.int64))
                words = np.empty(count, dtype=np.uint16)
                if count:
                    ctypes.memmove(words.ctypes.data, value.data_ptr(), 2 * count)
                out.append(words.view(bf16_dtype()).reshape(shape))
            else:
                out.append(value.numpy())
        return out

    def close(self) -> None:
        """Drop the session (ORT frees it when the last reference goes)."""
        self._session = None


def load(path: Path, options: RuntimeOptions) -> OnnxRuntimeSession:
    """Load an ``.onnx`` file on CPU (CUDA first when ``options.device == "gpu"`` and present)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendMissing(
            "the onnxruntime backend needs onnxruntime: pip install 'ferry[edge]' "
            "(or pip install onnxruntime)"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"model file {path} does not exist")
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.resolved_threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if options.allow_spinning else "0"
    )
    so.add_session_config_entry(
        "session.inter_op.allow_spinning", "1" if options.allow_spinning else "0"
    )
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if options.device == "gpu":
        # a GPU instance that cannot be made fails the load, as Triton's does (it had
        # quietly run on the CPU while the config still said KIND_GPU)
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise BackendMissing(
                f"onnxruntime has no CUDA execution provider here (available: {available}); "
                "install onnxruntime-gpu, or set the instance group's kind to cpu"
            )
        providers.insert(0, "CUDAExecutionProvider")
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except Exception as exc:
        raise InvalidInput(f"onnxruntime cannot load {path}: {exc}") from None
    return OnnxRuntimeSession(session, ort, path)
