"""The ONNX Runtime builder (exporter/backends/onnxruntime.py), its graph export stood in for: the
manifest extra it returns, and the refusal of a graph that stored weights more than once."""
import types

import pytest
import torch

import c2w.exporter.backends.onnxruntime as builder_module
from c2w.exporter.backends import get_builder
from c2w.exporter.backends.base import BuildJob
from c2w.exporter.backends.onnx_export import OnnxStats
from c2w.runtime.model.config import TINY
from c2w.runtime.units import ShapeKey

KEY = ShapeKey("hift", (1, 50, 0), "float32")
UNIT = torch.nn.Linear(100, 100)                      # 10100 float32 weights: 40400 bytes


def _build(tmp_path, monkeypatch, unique_bytes):
    def export(unit, inputs, input_names, output_names, path):
        assert (list(input_names), list(output_names)) == (["mel", "noise"], ["speech", "source"])
        return OnnxStats(3, 2 * unique_bytes, unique_bytes, 7, ["weights/abc-1.bin"])
    monkeypatch.setattr(builder_module, "export_onnx", export)
    job = BuildJob(types.SimpleNamespace(cfg=TINY), torch.device("cpu"), None, KEY.id, [KEY], [UNIT],
                   tmp_path / "onnxruntime" / f"{KEY.id}.onnx", tmp_path, {})
    return get_builder("onnxruntime").build(job)


def test_the_extra_records_initializers_nodes_and_weights_files_relative_to_the_directory(tmp_path, monkeypatch):
    assert _build(tmp_path, monkeypatch, 40400) == [{"initializer_bytes": 80800, "unique_initializer_bytes": 40400,
                                                     "nodes": 7, "weights_files": ["onnxruntime/weights/abc-1.bin"]}]


def test_initializers_beyond_the_weights_and_the_constant_slack_are_refused(tmp_path, monkeypatch):
    limit = int(builder_module.CONSTANT_SLACK_RATIO * 40400 + builder_module.CONSTANT_SLACK_BYTES)
    assert _build(tmp_path, monkeypatch, limit)[0]["unique_initializer_bytes"] == limit       # at the bound: kept
    with pytest.raises(RuntimeError, match=rf"ONNX initializers hold {limit + 1} bytes against 40400 bytes of weights: "
                                           "the export duplicated or folded weights"):
        _build(tmp_path, monkeypatch, limit + 1)
