"""Exported program -> ONNX graph whose weights live once on disk, shared across keys.

Used by the ONNX Runtime builder (one exact-shape graph per key) and the TensorRT builder (one
graph per variant, with named dynamic dims). `torch.onnx.export(dynamo=True, optimize=False)`:
the optimizer constant-folds per-step copies of weights in the unrolled Euler loop (the graph
would hold the DiT's weights once per step), so it stays off. Every initializer is then moved
to external data in a content-addressed file `weights/<sha256[:20]>.bin` beside the graph: the
same tensor in 40 keys' graphs is one file, and the ONNX Runtime backend maps each file to one
shared OrtValue.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from c2w.runtime.atomic import atomic_write

WEIGHTS_DIR = "weights"


@dataclass
class OnnxStats:
    initializers: int
    initializer_bytes: int          # sum over this graph's initializers
    unique_bytes: int               # after content dedupe within the graph
    node_count: int
    files: list[str]                # external weights files, relative to the graph's directory


def export_onnx(unit: torch.nn.Module, inputs: list[torch.Tensor], input_names, output_names,
                path: Path, dynamic_shapes=None) -> OnnxStats:
    """Export `unit` at the inputs' exact shapes (or with `dynamic_shapes`) to `path`."""
    import onnx
    from onnx import numpy_helper

    prog = torch.onnx.export(unit, tuple(inputs), input_names=list(input_names), output_names=list(output_names),
                             dynamo=True, optimize=False, dynamic_shapes=dynamic_shapes, verbose=False)
    model = prog.model_proto
    wdir = path.parent / WEIGHTS_DIR
    wdir.mkdir(parents=True, exist_ok=True)
    total = unique = 0
    seen, files = set(), []
    for init in model.graph.initializer:
        raw = init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).tobytes()
        if not raw:
            continue                                   # tiny or empty tensors stay inline
        digest = hashlib.sha256(raw).hexdigest()[:20] + f"-{init.data_type}"
        fname = wdir / f"{digest}.bin"
        total += len(raw)
        if digest not in seen:
            seen.add(digest)
            unique += len(raw)
        if not fname.exists():
            atomic_write(fname, raw)
        files.append(f"{WEIGHTS_DIR}/{fname.name}")
        del init.external_data[:]
        init.ClearField("raw_data")
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            init.ClearField(f)
        init.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", f"{WEIGHTS_DIR}/{fname.name}"), ("offset", "0"), ("length", str(len(raw)))):
            entry = init.external_data.add()
            entry.key, entry.value = k, v
    atomic_write(path, model.SerializeToString())
    return OnnxStats(len(model.graph.initializer), total, unique, len(model.graph.node), sorted(set(files)))


def onnx_bytes_on_disk(path: Path) -> int:
    """The graph file plus every external weights file it references (shared files counted once)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    files = {path}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            files.add(path.parent / {e.key: e.value for e in init.external_data}["location"])
    return sum(f.stat().st_size for f in files)
