"""The TensorRT compatibility check on the real exported graphs of all three units (no TensorRT
here: this checks the ONNX a TensorRT build would consume, never builds an engine)."""
import dataclasses

import pytest
import torch

from exporter.trt_check import dim_param_names, errors, format_findings
from exporter.backends.tensorrt import DYNAMIC_DIMS, graph_variant, variant_onnx
from runtime.model.config import FULL
from runtime.model.flow import FlowModel
from runtime.model.hift import HiftVocoder
from runtime.model.weights import Code2Wav, init_random_, load_model
from runtime.units import ShapeKey

TINY_KEYS = [ShapeKey("flow_encoder", (1, 28, 100, 0), "float16"), ShapeKey("flow_encoder", (1, 13, 200, 1), "float32"),
             ShapeKey("cfm", (1, 50, 100), "float16"), ShapeKey("hift", (1, 50, 0), "float32"),
             ShapeKey("hift", (1, 58, 3840), "float32")]


def _check(model, key, tmp_path):
    path, findings = variant_onnx(model, key, graph_variant(key), tmp_path, torch.device("cpu"))
    assert not errors(findings), format_findings(findings)
    assert not [f for f in findings if f.code == "dynamic-export"], format_findings(findings)
    import onnx
    g = onnx.load(str(path), load_external_data=False).graph
    names = {n for i in g.input for d in i.type.tensor_type.shape.dim for n in dim_param_names(d.dim_param)}
    assert names <= set(DYNAMIC_DIMS[key.component]) and "B" in names     # one plan serves every B
    return findings


@pytest.mark.parametrize("key", TINY_KEYS, ids=lambda k: k.id)
def test_tiny_graphs_are_clean(key, tmp_path):
    model = load_model("random:tiny")
    prec = {key.component: {"float16": torch.float16, "float32": torch.float32}[key.dtype]}
    model.to("cpu", prec)
    _check(model, key, tmp_path)


def test_full_size_graphs_are_clean(tmp_path):
    """Full widths and the encoder's and HiFT's full depth; the CFM as one Euler step of 2 of the
    DiT's 16 blocks (the ten steps repeat the same ops, and so do the 16 identical blocks: depth
    2 keeps every op and tensor size of depth 16, at an eighth of the export time)."""
    cfg = dataclasses.replace(FULL, n_timesteps=1, dit=dataclasses.replace(FULL.dit, depth=2))
    flow, hift = FlowModel(cfg), HiftVocoder(cfg.hift)
    init_random_(flow, 0)
    init_random_(hift, 1)
    model = Code2Wav(cfg, flow.eval(), hift.eval(), "random:full", "test")
    model.to("cpu", {"flow_encoder": torch.float16, "cfm": torch.float16})
    for key in (ShapeKey("flow_encoder", (1, 28, 300, 0), "float16"), ShapeKey("cfm", (1, 50, 300), "float16"),
                ShapeKey("hift", (1, 58, 3840), "float32")):
        findings = _check(model, key, tmp_path)
        info = [f for f in findings if f.code == "initializer-bytes"]
        assert info and "duplicates" in info[0].message
