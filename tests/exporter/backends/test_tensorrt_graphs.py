"""The TensorRT compatibility check on the real exported graphs of all three units (no TensorRT
here: this checks the ONNX a TensorRT build would consume, never builds an engine).

One graph per graph variant (each is one TensorRT plan), at the dtypes of profiles/h100.yaml,
from one model with the full model's widths, fewer repeated layers (tests.conftest.fewer_layers)
and 2 Euler steps instead of 10 (the steps repeat the same ops; their caches still stack over
steps and feed the next step). The fifth variant, the HiFT's steady chunk (with a source
cache), is exported and checked the same way by the dry run of backends/test_tensorrt.py.
"""
import dataclasses
import math

import pytest
import torch

from c2w.exporter.backends.tensorrt import variant_onnx
from c2w.exporter.trt_check import dim_param_names, errors, format_findings
from c2w.runtime.model.config import FULL
from c2w.runtime.model.flow import FlowModel
from c2w.runtime.model.hift import HiftVocoder
from c2w.runtime.model.weights import Code2Wav, init_random_
from c2w.runtime.units import SPECS, ShapeKey
from tests.conftest import fewer_layers

CFG = dataclasses.replace(fewer_layers(FULL), n_timesteps=2)
KEYS = [ShapeKey("flow_encoder", (1, 28, 300, 0), "float16"), ShapeKey("flow_encoder", (1, 13, 400, 1), "float16"),
        ShapeKey("cfm", (1, 50, 300), "float16"), ShapeKey("hift", (1, 50, 0), "float32")]


@pytest.fixture(scope="module")
def model():
    flow, hift = FlowModel(CFG), HiftVocoder(CFG.hift)
    init_random_(flow, 0)
    init_random_(hift, 1)
    m = Code2Wav(CFG, flow.eval(), hift.eval(), "random:full", "test")
    return m.to("cpu", {"flow_encoder": torch.float16, "cfm": torch.float16})


def assert_clean_variant_graph(path, findings, component: str) -> None:
    """No TensorRT errors, exported with its named dynamic dims (no static fallback), and only
    dims of that component's profile dims named, B among them: one plan serves every batch size."""
    import onnx
    assert not errors(findings), format_findings(findings)
    assert not [f for f in findings if f.code == "dynamic-export"], format_findings(findings)
    g = onnx.load(str(path), load_external_data=False).graph
    names = {n for i in g.input for d in i.type.tensor_type.shape.dim for n in dim_param_names(d.dim_param)}
    assert names <= set(SPECS[component].dynamic_dims) and "B" in names


def test_one_key_per_graph_variant():
    assert len({SPECS[k.component].graph_variant(k) for k in KEYS}) == len(KEYS)
    assert {k.component for k in KEYS} == set(SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS, ids=lambda k: SPECS[k.component].graph_variant(k))
def test_graph_is_clean(model, key, tmp_path):
    import onnx
    path, findings = variant_onnx(model, key, SPECS[key.component].graph_variant(key), tmp_path, torch.device("cpu"))
    assert_clean_variant_graph(path, findings, key.component)
    info = [f for f in findings if f.code == "initializer-bytes"]
    assert info and "duplicates" in info[0].message
    # the weights are in the profile's dtype: fp16 graphs carry fp16 weights
    g = onnx.load(str(path), load_external_data=False).graph
    largest = max(g.initializer, key=lambda t: math.prod(t.dims))
    assert largest.data_type == (onnx.TensorProto.FLOAT16 if key.dtype == "float16" else onnx.TensorProto.FLOAT)
