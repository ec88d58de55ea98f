"""Backend registry. Backend SDKs are imported lazily by each backend's methods."""
from __future__ import annotations

import importlib

from runtime.engines.base import ArtifactInfo, Backend, Engine
from runtime.errors import C2WUserError

_BACKENDS = {
    "onnxruntime": ("runtime.engines.onnxruntime", "OnnxRuntimeBackend"),
    "aoti": ("runtime.engines.aoti", "AOTIBackend"),
    "tensorrt": ("runtime.engines.tensorrt", "TensorRTBackend"),
}
NAMES = tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise C2WUserError("backend", repr(name), f"one of {list(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["ArtifactInfo", "Backend", "Engine", "get_backend", "NAMES"]
