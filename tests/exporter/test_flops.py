"""The planner's FLOPs per unit call (exporter/flops.py), held to torch's own counter."""
import pytest
import torch

from c2w.exporter.flops import unit_flops
from c2w.runtime.units import ShapeKey


def test_unit_flops_match_torch_flop_counter():
    """The planner's FLOPs formulas against torch's counter, run on the tiny model on the meta
    device (shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode
    from c2w.runtime.model.config import preset
    from c2w.runtime.model.flow import FlowModel
    from c2w.runtime.model.hift import HiftVocoder
    from c2w.runtime.model.weights import Code2Wav
    from c2w.runtime.units import SPECS
    cfg = preset("tiny")
    with torch.device("meta"):
        model = Code2Wav(cfg, FlowModel(cfg), HiftVocoder(cfg.hift), "meta", "")
    keys = [ShapeKey("flow_encoder", (2, 28, 300, 0), "float32"), ShapeKey("flow_encoder", (1, 53, 0, 0), "float32"),
            ShapeKey("flow_encoder", (3, 13, 400, 1), "float32"), ShapeKey("hift", (2, 50, 0), "float32"),
            ShapeKey("hift", (1, 158, 3840), "float32"), ShapeKey("cfm", (2, 50, 300), "float32")]
    for key in keys:
        spec = SPECS[key.component]
        inputs = [torch.empty(s, dtype=d, device="meta") for s, d in zip(spec.input_shapes(cfg, key),
                                                                         spec.input_dtypes(key))]
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            spec.build(model, key)(*inputs)
        # HiFT: the STFT's one extra frame is not counted by the formula
        assert unit_flops(cfg, key) == pytest.approx(counter.get_total_flops(), rel=1e-3), key.id
