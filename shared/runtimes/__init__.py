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

#: a model file's own backend -> other backends that load it too, where the config
#: names one of them (OpenVINO reads ONNX: Triton's OpenVINO backend and OVMS serve
#: a model.onnx; it is not converted first)
ALSO_READS: dict[str, tuple[str, ...]] = {"onnxruntime": ("openvino",)}


#: backend name -> the module its runtime is imported from (any one is enough)
_RUNTIME_MODULES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime",),
    "openvino": ("openvino",),
    "litert": ("ai_edge_litert", "tflite_runtime"),
    "tensorrt": ("tensorrt",),
}


def installed_backends() -> list[str]:
    """Backends whose runtime package is installed (found, not imported: importing
    OpenVINO or TensorRT costs seconds and memory a status report should not)."""
    import importlib.util

    found = []
    for backend, modules in _RUNTIME_MODULES.items():
        for module in modules:
            try:
                if importlib.util.find_spec(module) is not None:
                    found.append(backend)
                    break
            except (ImportError, ValueError):
                continue
    return found


def load_session(backend: str, path: Path, options: RuntimeOptions | None = None) -> Session:
    """Load ``path`` (a model file) with ``backend``."""
    module_name = BACKENDS.get(backend)
    if module_name is None:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {sorted(BACKENDS)}")
    module = importlib.import_module(module_name)
    return module.load(Path(path), options or RuntimeOptions())


__all__ = [
    "ALSO_READS",
    "BACKENDS",
    "MODEL_FILES",
    "RuntimeOptions",
    "Session",
    "TensorSpec",
    "installed_backends",
    "load_session",
]
