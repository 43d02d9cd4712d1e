"""Model backends, imported lazily so a missing runtime costs nothing.

``load_session("onnxruntime", path, options)`` imports the backend module on
first use; each module fails with :class:`~shared.errors.BackendMissing`
naming the package to install when its runtime is absent.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from shared.errors import ConfigError
from shared.runtimes.base import RuntimeOptions, Session, TensorSpec

#: backend name -> module under shared.runtimes
BACKENDS: dict[str, str] = {
    "onnxruntime": "shared.runtimes.onnxruntime_backend",
    "openvino": "shared.runtimes.openvino_backend",
    "litert": "shared.runtimes.litert_backend",
    "tensorrt": "shared.runtimes.tensorrt_backend",
}

#: model file name in a version folder -> backend that serves it
MODEL_FILES: dict[str, str] = {
    "model.onnx": "onnxruntime",
    "model.xml": "openvino",
    "model.tflite": "litert",
    "model.plan": "tensorrt",
}


def load_session(backend: str, path: Path, options: RuntimeOptions | None = None) -> Session:
    """Load ``path`` (a model file) with ``backend``."""
    module_name = BACKENDS.get(backend)
    if module_name is None:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {sorted(BACKENDS)}")
    module = importlib.import_module(module_name)
    return module.load(Path(path), options or RuntimeOptions())


__all__ = ["BACKENDS", "MODEL_FILES", "RuntimeOptions", "Session", "TensorSpec", "load_session"]
