"""TensorRT backend: a serialized engine (``model.plan``) on an NVIDIA GPU.

Uses the TensorRT 10 tensor API (``num_io_tensors``, ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3``) and moves data with the CUDA
runtime from ``cuda-python`` (``cuda.bindings.runtime``, or the older
``cuda.cudart``), else with PyTorch's CUDA allocator when torch is installed.

TensorRT's libraries come from NVIDIA's own index, so on most machines this
backend is absent; it then fails with :class:`~shared.errors.BackendMissing`
before touching the file.  An engine is tied to the TensorRT version and GPU
model that built it.

One execution context and one CUDA stream per session, guarded by a lock: a
context runs one batch at a time.  Device buffers are kept between runs and
grow when a larger batch arrives.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np

from shared.datatypes import numpy_dtype
from shared.errors import BackendMissing, ConfigError, InternalError, InvalidInput, ModelNotFound
from shared.runtimes._common import check_inputs, check_outputs, closed_error
from shared.runtimes.base import RuntimeOptions, TensorSpec

#: TensorRT DataType names -> V2 datatypes (FP8, INT4 and FP4 have no V2 carrier)
TRT_TYPES: dict[str, str] = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "UINT8": "UINT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
}

_INSTALL = (
    "TensorRT backend needs the 'tensorrt' package and an NVIDIA GPU: pip install 'ferry[gpu]' "
    "(TensorRT's wheels come from NVIDIA's index: "
    "pip install --extra-index-url https://pypi.nvidia.com tensorrt)"
)


class _CudaRuntime:
    """Device memory and one stream through cuda-python's runtime API."""

    def __init__(self, cudart: Any) -> None:
        self._rt = cudart
        self._stream = self._call(cudart.cudaStreamCreate(), "cudaStreamCreate")

    def _call(self, result: Any, what: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self._rt.cudaError_t.cudaSuccess:
            raise InternalError(f"CUDA {what} failed: {err}")
        return rest[0] if len(rest) == 1 else None

    @property
    def stream_handle(self) -> int:
        return _pointer(self._stream)

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        ptr = self._call(self._rt.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})")
        return ptr, _pointer(ptr)

    def free(self, handle: Any) -> None:
        self._rt.cudaFree(handle)

    def upload(self, handle: Any, ptr: int, array: np.ndarray) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        if array.nbytes:
            self._call(
                self._rt.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self._stream),
                "cudaMemcpyAsync (host to device)",
            )

    def download(self, array: np.ndarray, handle: Any, ptr: int) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        if array.nbytes:
            self._call(
                self._rt.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, self._stream),
                "cudaMemcpyAsync (device to host)",
            )

    def synchronize(self) -> None:
        self._call(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        self._rt.cudaStreamDestroy(self._stream)


class _TorchCuda:
    """The same operations through PyTorch's CUDA allocator and a torch stream."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._stream = torch.cuda.Stream()

    @property
    def stream_handle(self) -> int:
        return int(self._stream.cuda_stream)

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        tensor = self._torch.empty(max(nbytes, 1), dtype=self._torch.uint8, device="cuda")
        return tensor, int(tensor.data_ptr())

    def free(self, handle: Any) -> None:
        del handle  # the caching allocator reclaims it once unreferenced

    def _bytes(self, array: np.ndarray) -> Any:
        return self._torch.from_numpy(array.reshape(-1).view(np.uint8))

    def upload(self, handle: Any, ptr: int, array: np.ndarray) -> None:
        if array.nbytes:
            source = array if array.flags.writeable else array.copy()
            with self._torch.cuda.stream(self._stream):
                handle[: array.nbytes].copy_(self._bytes(source))

    def download(self, array: np.ndarray, handle: Any, ptr: int) -> None:
        if array.nbytes:
            with self._torch.cuda.stream(self._stream):
                self._bytes(array).copy_(handle[: array.nbytes])

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        self._stream = None


def _pointer(value: Any) -> int:
    """An integer address from cuda-python's handle objects (or an int)."""
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except TypeError:
        return int(value.getPtr())


def _open_cuda() -> _CudaRuntime | _TorchCuda:
    """A CUDA binding with at least one device, else BackendMissing saying what is absent."""
    cudart = None
    try:
        from cuda.bindings import runtime as cudart
    except (ImportError, OSError):
        try:
            from cuda import cudart
        except (ImportError, OSError):
            cudart = None
    if cudart is not None:
        try:
            err, count = cudart.cudaGetDeviceCount()[:2]
        except (RuntimeError, OSError) as exc:  # no driver library to load
            raise BackendMissing(f"the tensorrt backend found no CUDA driver here: {exc}") from None
        if err != cudart.cudaError_t.cudaSuccess or count < 1:
            raise BackendMissing(f"the tensorrt backend found no CUDA device here ({err})")
        return _CudaRuntime(cudart)
    try:
        import torch
    except ImportError:
        raise BackendMissing(
            "the tensorrt backend needs a CUDA binding to move data: pip install cuda-python "
            "(or install torch with CUDA)"
        ) from None
    if not torch.cuda.is_available():
        raise BackendMissing("the tensorrt backend found no CUDA device here (torch sees none)")
    return _TorchCuda(torch)


@functools.cache
def _logger(trt: Any) -> Any:
    # TensorRT wants one logger per process; it warns when runtimes get different ones.
    return trt.Logger(trt.Logger.WARNING)


class TensorRtSession:
    """One engine, one execution context, one stream, buffers kept between runs."""

    backend = "tensorrt"

    def __init__(self, trt: Any, runtime: Any, engine: Any, cuda: Any, path: Path) -> None:
        self._trt = trt
        self._runtime = runtime
        self._engine = engine
        self._cuda = cuda
        self._lock = threading.Lock()
        self.path = path
        self._context = engine.create_execution_context()
        if self._context is None:
            raise InternalError(f"{path}: TensorRT could not create an execution context")
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self._on_host: set[str] = set()
        self._bounds: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            type_name = engine.get_tensor_dtype(name).name
            datatype = TRT_TYPES.get(type_name)
            if datatype is None:
                raise ConfigError(
                    f"{path}: tensor {name!r} has type {type_name}, which Ferry cannot carry"
                )
            spec = TensorSpec(name, datatype, tuple(int(d) for d in engine.get_tensor_shape(name)))
            if engine.get_tensor_location(name) == trt.TensorLocation.HOST:
                self._on_host.add(name)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self.inputs.append(spec)
                if -1 in spec.dims:
                    low, _, high = engine.get_tensor_profile_shape(name, 0)
                    self._bounds[name] = (tuple(low), tuple(high))
            else:
                self.outputs.append(spec)
        self._output_names = [s.name for s in self.outputs]
        self._buffers: dict[str, tuple[Any, int, int]] = {}  # name -> (handle, ptr, nbytes)

    def run(
        self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        feed = check_inputs(self.inputs, inputs)
        names = check_outputs(self._output_names, outputs)
        for name, (low, high) in self._bounds.items():
            shape = feed[name].shape
            if any(s < lo or s > hi for s, lo, hi in zip(shape, low, high, strict=True)):
                raise InvalidInput(
                    f"input {name!r}: shape {list(shape)} is outside the engine's optimization "
                    f"profile (min {list(low)}, max {list(high)})"
                )
        with self._lock:
            context = self._context
            if context is None:
                raise closed_error(self.backend)
            return self._execute(context, feed, names)

    def _execute(
        self, context: Any, feed: dict[str, np.ndarray], names: list[str]
    ) -> dict[str, np.ndarray]:
        for name, array in feed.items():
            if not context.set_input_shape(name, array.shape):
                raise InvalidInput(f"input {name!r}: TensorRT rejected shape {list(array.shape)}")
        for name, array in feed.items():
            # host inputs (shape tensors) are read from the array itself at enqueue
            ptr = array.ctypes.data if name in self._on_host else self._device(name, array.nbytes)
            if name not in self._on_host:
                self._cuda.upload(*self._buffers[name][:2], array)
            context.set_tensor_address(name, ptr)
        results: dict[str, np.ndarray] = {}
        for spec in self.outputs:
            shape = tuple(int(d) for d in context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise InternalError(
                    f"output {spec.name!r} has a data-dependent shape {list(shape)}, "
                    "which this backend does not serve"
                )
            array = np.empty(shape, dtype=numpy_dtype(spec.datatype))
            if spec.name in self._on_host:
                context.set_tensor_address(spec.name, array.ctypes.data)
            else:
                context.set_tensor_address(spec.name, self._device(spec.name, array.nbytes))
            results[spec.name] = array
        if not context.execute_async_v3(self._cuda.stream_handle):
            raise InternalError("TensorRT could not enqueue the batch (execute_async_v3 failed)")
        for name in names:
            if name not in self._on_host:
                self._cuda.download(results[name], *self._buffers[name][:2])
        self._cuda.synchronize()
        return {name: results[name] for name in names}

    def _device(self, name: str, nbytes: int) -> int:
        """The device address of ``name``'s buffer, grown to ``nbytes`` when needed."""
        held = self._buffers.get(name)
        if held is not None and held[2] >= nbytes:
            return held[1]
        if held is not None:
            self._cuda.synchronize()
            self._cuda.free(held[0])
            del self._buffers[name]
        handle, ptr = self._cuda.alloc(nbytes)
        self._buffers[name] = (handle, ptr, nbytes)
        return ptr

    def close(self) -> None:
        """Free the buffers, the stream, the context and the engine, in that order."""
        with self._lock:
            if self._context is None:
                return
            self._cuda.synchronize()
            for handle, _, _ in self._buffers.values():
                self._cuda.free(handle)
            self._buffers.clear()
            self._cuda.close()
            self._context = None
            self._engine = None
            self._runtime = None


def load(path: Path, options: RuntimeOptions) -> TensorRtSession:
    """Deserialize ``path`` on the current CUDA device (``options`` has nothing to tune here)."""
    try:
        import tensorrt as trt
    except (ImportError, OSError):
        raise BackendMissing(_INSTALL) from None
    path = Path(path)
    cuda = _open_cuda()
    try:
        if not path.is_file():
            raise ModelNotFound(f"model file {path} does not exist")
        runtime = trt.Runtime(_logger(trt))
        try:
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
        except (RuntimeError, TypeError, ValueError):
            engine = None
        if engine is None:
            raise InvalidInput(
                f"TensorRT {trt.__version__} cannot load {path}: not an engine, or one built "
                "by another TensorRT version or for another GPU model"
            )
        return TensorRtSession(trt, runtime, engine, cuda, path)
    except BaseException:
        cuda.close()
        raise
