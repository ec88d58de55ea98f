"""ONNX Runtime builder: one exact-shape ONNX graph per key, its weights in the shared,
content-addressed weights files beside it (exporter/backends/onnx_export.py)."""
from __future__ import annotations

import torch

from c2w.exporter.backends.base import Builder, BuildJob
from c2w.exporter.backends.onnx_export import export_onnx
from c2w.runtime.units import SPECS
from c2w.runtime.verify import unit_weight_bytes

# Slack for shape-specific constant tables a graph holds beside the weights (HiFT's phase
# interpolation, ~0.5 MB), when checking that the export stored each weight once.
CONSTANT_SLACK_RATIO = 1.25
CONSTANT_SLACK_BYTES = 4 << 20


class OnnxRuntimeBuilder(Builder):
    def build(self, job: BuildJob) -> list[dict]:
        (key,), (unit,) = job.keys, job.units
        spec = SPECS[key.component]
        with torch.no_grad():
            stats = export_onnx(unit, job.example_inputs(key), spec.input_names(key), spec.output_names, job.path)
        weights = unit_weight_bytes(unit)
        if stats.unique_bytes > CONSTANT_SLACK_RATIO * weights + CONSTANT_SLACK_BYTES:
            raise RuntimeError(f"ONNX initializers hold {stats.unique_bytes} bytes against {weights} bytes of "
                               "weights: the export duplicated or folded weights")
        graph_dir = job.path.parent.relative_to(job.out_dir)
        return [{"initializer_bytes": stats.initializer_bytes, "unique_initializer_bytes": stats.unique_bytes,
                 "nodes": stats.node_count, "weights_files": [str(graph_dir / f) for f in stats.files]}]
