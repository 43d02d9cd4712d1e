"""LiteRT (TFLite) backend: ``ai-edge-litert``, else ``tflite-runtime``.

ai-edge-litert is the maintained runtime; tflite-runtime 2.14 only runs with
numpy<2 (DESIGN.md section 6), so it is only the fallback.

Tensors are reported as the file stores them: an int8-quantized model has
INT8 inputs, and :attr:`LiteRtSession.quantization` carries each quantized
tensor's ``(scale, zero_point)`` so callers can quantize
(``q = round(x / scale) + zero_point``) and dequantize.

An ``Interpreter`` is not thread-safe, so every run holds the session's lock.
Streaming models (the micro_wakeword keyword spotters) keep state in
variables between invocations: consecutive runs continue one stream, and
:meth:`LiteRtSession.reset` starts a new one.  (``reset_all_variables`` is no
reset for them: it zeroes the variables, while a fresh interpreter runs the
model's CALL_ONCE initializer, which sets them to the quantized zero state.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shared.datatypes import v2_datatype
from shared.errors import BackendMissing, ConfigError, InternalError, InvalidInput, ModelNotFound
from shared.runtimes._common import bytes_array, check_inputs, check_outputs, closed_error
from shared.runtimes.base import RuntimeOptions, TensorSpec


def _interpreter_class() -> Any:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        pass
    else:
        return Interpreter
    try:
        from tflite_runtime.interpreter import Interpreter
    except ImportError:
        raise BackendMissing(
            "the litert backend needs LiteRT: pip install 'ferry[litert]' "
            "(or pip install ai-edge-litert; tflite-runtime also works with numpy<2)"
        ) from None
    return Interpreter


def _spec(detail: dict[str, Any], kind: str, path: Path) -> TensorSpec:
    name = detail["name"]
    try:
        datatype = v2_datatype(np.dtype(detail["dtype"]))
    except (InvalidInput, TypeError):
        raise ConfigError(
            f"{path}: {kind} {name!r} has type {detail['dtype']}, which Ferry cannot carry"
        ) from None
    signature = detail.get("shape_signature")
    if signature is None or len(signature) != len(detail["shape"]):
        signature = detail["shape"]
    return TensorSpec(name, datatype, tuple(int(d) for d in signature))


class LiteRtSession:
    """One ``Interpreter``, resized when a request's dynamic dims change.

    A model with dynamic dims (-1 in its shape signature) may not run at the
    placeholder shape its file stores (pyopen-wakeword's mel front-end
    stores [1, 1], which its own kernels refuse): it loads unallocated, and
    every request resizes it to its own shape first.  A shape the kernels
    refuse fails that request only; the next one resizes again.
    """

    backend = "litert"

    def __init__(self, make: Callable[[], Any], path: Path, threads: int) -> None:
        self._make = make
        interpreter = make()
        self._lock = threading.Lock()
        self.path = path
        self.threads = threads
        in_details = interpreter.get_input_details()
        out_details = interpreter.get_output_details()
        self.inputs = [_spec(d, "input", path) for d in in_details]
        self.outputs = [_spec(d, "output", path) for d in out_details]
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ConfigError(f"{path}: two {kind}s share a name: {names}")
        #: tensor name -> (scale, zero_point), for quantized tensors only
        self.quantization: dict[str, tuple[float, int]] = {}
        for detail in [*in_details, *out_details]:
            scale, zero_point = detail.get("quantization", (0.0, 0))
            if scale:
                self.quantization[detail["name"]] = (float(scale), int(zero_point))
        self._in_index = {d["name"]: int(d["index"]) for d in in_details}
        self._out_index = {d["name"]: int(d["index"]) for d in out_details}
        self._dynamic = any(-1 in spec.dims for spec in self.inputs)
        self._output_names = [s.name for s in self.outputs]
        # the input shapes the interpreter is allocated for; None: not allocated
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._interpreter = interpreter
        self._allocate_stored_shapes(interpreter)

    def _allocate_stored_shapes(self, interpreter: Any) -> None:
        """Allocate at the file's shapes; a dynamic model may wait for its first request."""
        try:
            interpreter.allocate_tensors()
        except (RuntimeError, ValueError):
            if not self._dynamic:
                raise
            self._shapes = None
            return
        self._shapes = {
            d["name"]: tuple(int(x) for x in d["shape"]) for d in interpreter.get_input_details()
        }

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        feed = check_inputs(self.inputs, inputs)
        names = check_outputs(self._output_names, outputs)
        for spec in self.inputs:
            if spec.datatype == "BYTES":
                feed[spec.name] = bytes_array(feed[spec.name], spec.name)
        with self._lock:
            interpreter = self._interpreter
            if interpreter is None:
                raise closed_error(self.backend)
            self._resize(interpreter, {n: a.shape for n, a in feed.items()})
            try:
                for name, array in feed.items():
                    interpreter.set_tensor(self._in_index[name], array)
            except ValueError as exc:
                raise InvalidInput(f"litert rejected the inputs: {exc}") from None
            try:
                interpreter.invoke()
                # get_tensor copies: the arrays stay valid after the next run
                result = {n: interpreter.get_tensor(self._out_index[n]) for n in names}
            except (RuntimeError, ValueError) as exc:
                raise InternalError(f"litert failed: {exc}") from None
        return {n: bytes_array(a, n) if a.dtype.kind in "OSU" else a for n, a in result.items()}

    def _resize(self, interpreter: Any, shapes: dict[str, tuple[int, ...]]) -> None:
        """Resize the inputs whose shapes changed and allocate; InvalidInput when the
        model's kernels refuse the shapes (the interpreter then waits for the next ones)."""
        current = self._shapes
        if current == shapes:
            return
        changed = {n: s for n, s in shapes.items() if current is None or s != current[n]}
        self._shapes = None  # until allocate_tensors succeeds
        try:
            for name, shape in changed.items():
                interpreter.resize_tensor_input(self._in_index[name], list(shape), strict=True)
            interpreter.allocate_tensors()
        except (RuntimeError, ValueError) as exc:
            shown = {n: list(s) for n, s in changed.items()}
            raise InvalidInput(f"litert cannot run input shapes {shown}: {exc}") from None
        self._shapes = dict(shapes)

    def reset(self) -> None:
        """Start a new stream: a fresh interpreter, its variables initialised by the model."""
        with self._lock:
            if self._interpreter is None:
                raise closed_error(self.backend)
            interpreter = self._make()
            self._allocate_stored_shapes(interpreter)
            self._interpreter = interpreter

    def close(self) -> None:
        """Drop the interpreter (waits for a run in progress)."""
        with self._lock:
            self._interpreter = None


def load(path: Path, options: RuntimeOptions) -> LiteRtSession:
    """Load a ``.tflite`` file with ``options.resolved_threads()`` threads."""
    interpreter_class = _interpreter_class()
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"model file {path} does not exist")
    threads = options.resolved_threads()
    content = path.read_bytes()

    def make() -> Any:
        return interpreter_class(model_content=content, num_threads=threads)

    try:
        return LiteRtSession(make, path, threads)
    except (RuntimeError, ValueError) as exc:
        raise InvalidInput(f"litert cannot load {path}: {exc}") from None
