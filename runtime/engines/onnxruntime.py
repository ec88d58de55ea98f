"""ONNX Runtime engines: one ONNX graph per ShapeKey, weights shared across every session.

The exporter writes each graph's initializers as external data, one file per distinct tensor
content (`weights/<sha>.bin`), so the disk holds each weight once whatever the number of keys.
At load, each distinct file becomes ONE OrtValue, handed to every session with
`SessionOptions.add_initializer`, so memory holds it once too.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from c2w.runtime.engines.base import ArtifactInfo, Backend, Engine
from c2w.runtime.errors import MissingBackendError

INSTALL = "pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA / TensorRT execution providers)"


def _ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise MissingBackendError("onnxruntime", "onnxruntime", INSTALL) from e
    return onnxruntime


def _onnx():
    try:
        import onnx
    except ImportError as e:
        raise MissingBackendError("onnxruntime", "onnx", "pip install onnx") from e
    return onnx


def providers_for(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxRuntimeEngine(Engine):
    def __init__(self, info: ArtifactInfo, session, keep_alive: list, device: torch.device):
        self.info, self.session, self._keep, self.device = info, session, keep_alive, device

    def run_impl(self, inputs: Sequence[torch.Tensor], trim=None) -> list[torch.Tensor]:
        feed = {name: t.detach().cpu().contiguous().numpy() for name, t in zip(self.info.input_names, inputs)}
        outs = self.session.run(list(self.info.output_names), feed)
        return [torch.from_numpy(np.ascontiguousarray(o)).to(self.device) for o in outs]

    def release(self) -> None:
        self.session = None
        self._keep = []


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    suffix = ".onnx"

    def __init__(self):
        self._shared: dict[Path, object] = {}        # weights file -> OrtValue (one per content)
        self._lock = threading.Lock()

    def require(self) -> None:
        _ort()
        _onnx()

    def version(self) -> str:
        return _ort().__version__

    def _initializer(self, path: Path, tensor_proto):
        """One OrtValue per distinct weights file, created on first use and then shared."""
        onnx = _onnx()
        with self._lock:
            if path not in self._shared:
                np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_proto.data_type)
                arr = np.fromfile(path, dtype=np_dtype).reshape(tuple(tensor_proto.dims))
                self._shared[path] = _ort().OrtValue.ortvalue_from_numpy(arr)
            return self._shared[path]

    def load(self, info: ArtifactInfo, weights: Mapping[str, torch.Tensor] | None,
             device: torch.device) -> Engine:
        ort, onnx = _ort(), _onnx()
        model = onnx.load(str(info.path), load_external_data=False)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if device.type == "cpu":
            # ONNX Runtime reads neither torch's thread setting nor OMP_NUM_THREADS: left alone,
            # each session spins one thread per core, and a process that keeps torch to fewer
            # (serving lanes, test workers) oversubscribes its cores. Follow torch's setting.
            opts.intra_op_num_threads = torch.get_num_threads()
        keep = []
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                loc = {e.key: e.value for e in init.external_data}["location"]
                value = self._initializer((info.path.parent / loc).resolve(), init)
                opts.add_initializer(init.name, value)
                keep.append(value)
        session = ort.InferenceSession(str(info.path), sess_options=opts, providers=providers_for(device))
        return OnnxRuntimeEngine(info, session, keep, device)

    def release_shared(self) -> None:
        with self._lock:
            self._shared.clear()
