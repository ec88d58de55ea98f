"""Builders by backend name; each module is imported on first use (its SDK with it, lazily)."""
from __future__ import annotations

import importlib

from c2w.exporter.backends.base import Builder, BuildJob
from c2w.runtime.engines import get_backend

_BUILDERS = {
    "onnxruntime": ("c2w.exporter.backends.onnxruntime", "OnnxRuntimeBuilder"),
    "aoti": ("c2w.exporter.backends.aoti", "AOTIBuilder"),
    "tensorrt": ("c2w.exporter.backends.tensorrt", "TensorRTBuilder"),
}


def get_builder(name: str) -> Builder:
    """The builder of backend `name` (an unknown name: the runtime registry's C2WUserError)."""
    backend = get_backend(name)
    module, cls = _BUILDERS[name]
    return getattr(importlib.import_module(module), cls)(backend)


__all__ = ["Builder", "BuildJob", "get_builder"]
