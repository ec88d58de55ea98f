"""Builders by backend name; each module is imported on first use (its SDK with it, lazily)."""
from __future__ import annotations

import importlib

from exporter.backends.base import Builder, BuildJob
from runtime.engines import get_backend

_BUILDERS = {
    "onnxruntime": ("exporter.backends.onnxruntime", "OnnxRuntimeBuilder"),
    "aoti": ("exporter.backends.aoti", "AOTIBuilder"),
    "tensorrt": ("exporter.backends.tensorrt", "TensorRTBuilder"),
}


def get_builder(name: str) -> Builder:
    """The builder of backend `name` (an unknown name: the runtime registry's C2WUserError)."""
    backend = get_backend(name)
    module, cls = _BUILDERS[name]
    return getattr(importlib.import_module(module), cls)(backend)


__all__ = ["Builder", "BuildJob", "get_builder"]
