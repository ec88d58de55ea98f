"""Backend registry. Backend SDKs are imported lazily by each backend's methods."""
from __future__ import annotations

import importlib

from c2w.runtime.engines.base import ArtifactInfo, Backend, Engine
from c2w.runtime.errors import C2WUserError

_BACKENDS = {
    "onnxruntime": ("c2w.runtime.engines.onnxruntime", "OnnxRuntimeBackend"),
    "aoti": ("c2w.runtime.engines.aoti", "AOTIBackend"),
    "tensorrt": ("c2w.runtime.engines.tensorrt", "TensorRTBackend"),
}
NAMES = tuple(_BACKENDS)


def get_backend(name: str, *, cuda_graphs: bool | None = None) -> Backend:
    """A backend's runtime side. cuda_graphs: capture engines in CUDA graphs at load (None: the
    backend's default; AOTI: on, TensorRT: off); backends that never capture (ONNX Runtime) ignore it."""
    if name not in _BACKENDS:
        raise C2WUserError("backend", repr(name), f"one of {list(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    if cuda_graphs is None or not backend_cls.captures_cuda_graphs:
        return backend_cls()
    return backend_cls(cuda_graphs=cuda_graphs)


__all__ = ["ArtifactInfo", "Backend", "Engine", "get_backend", "NAMES"]
