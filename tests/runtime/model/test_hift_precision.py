"""HiFT's precision policies on the CPU (tiny random model): float16 = the conv stack's
convolutions in float16, everything else float32 (runtime/model/hift.py); bfloat16 refused.

PyTorch runs float16 convolutions on the CPU (slowly; fine at the tiny size). The float32 policy's
bit-for-bit parity with the step-audio2 oracle is tests/runtime/model/test_hift.py's.
"""
from __future__ import annotations

import copy as copy_module
import importlib.util
import io
from pathlib import Path

import pytest
import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.hift import CONV_STACK, PRECISIONS, CastingConv1d, HiftVocoder
from c2w.runtime.model.weights import load_model
from c2w.runtime.precision import load_at_precision
from c2w.runtime.units import DTYPE_NAMES, SPECS, ShapeKey, rel_l2
from c2w.runtime.verify import VERIFY_SEED

ROOT = Path(__file__).resolve().parents[3]
# The tiny model's speech, float16 policy vs float32, on verification inputs of four keys and
# three seeds: rel-L2 3.48-3.66e-3 (49 dB SNR; the full size on the H200 measured 48.6 dB).
FLOAT16_VS_FLOAT32 = (1e-3, 6e-3)          # (the convs did run in float16, the bound with margin)
KEYS = ((1, 50, 0), (1, 58, 3840), (2, 58, 3840))


@pytest.fixture(scope="module")
def models():
    """random:tiny's HiFT at float32 and at float16 (two loads: the same seeded weights)."""
    return load_model("random:tiny").hift, load_model("random:tiny").hift.set_precision(torch.float16)


def _inputs(dims, seed=VERIFY_SEED):
    key = ShapeKey("hift", dims, "float16")
    return SPECS["hift"].example_inputs(load_model("random:tiny").cfg, key, torch.Generator().manual_seed(seed))


def test_float16_casts_only_the_conv_stacks_convolutions(models):
    _, h16 = models
    convs = {id(m) for m in h16.precision_modules()}
    assert len(convs) == 80 and h16.precision == torch.float16
    for name, t in list(h16.named_parameters()) + list(h16.named_buffers()):
        owner = h16.get_submodule(name.rsplit(".", 1)[0]) if "." in name else h16
        in_stack = name.split(".")[0] in CONV_STACK and id(owner) in convs
        assert t.dtype == (torch.float16 if in_stack else torch.float32), name
    # Snake alphas, the f0 predictor, the NSF source and the STFT / ISTFT kernels are float32
    assert h16.resblocks[0].activations1[0].alpha.dtype == torch.float32
    assert h16.f0_predictor.condnet[0].weight.dtype == torch.float32
    assert h16.stft_kernel.dtype == h16.istft_kernel.dtype == torch.float32


@pytest.mark.parametrize("dims", KEYS)
def test_float16_speech_within_the_measured_distance_of_float32_and_the_source_exact(models, dims):
    h32, h16 = models
    x = _inputs(dims)
    with torch.inference_mode():
        speech32, source32 = h32(*x)
        speech16, source16 = h16(*x)
    assert speech16.dtype == source16.dtype == torch.float32           # the unit's outputs stay float32
    err = rel_l2(speech16, speech32)
    assert FLOAT16_VS_FLOAT32[0] < err < FLOAT16_VS_FLOAT32[1], err
    # the f0 predictor and the NSF source are float32 under the policy: the source is the same bits
    assert torch.equal(source16, source32)


def test_casting_conv_is_the_plain_conv_at_float32_and_rounds_at_float16():
    g = torch.Generator().manual_seed(0)
    conv = CastingConv1d(4, 3, 3, padding=1)
    x = torch.randn(2, 4, 9, generator=g)
    with torch.no_grad():
        plain = torch.nn.functional.conv1d(x, conv.weight, conv.bias, padding=1)
        assert torch.equal(conv(x), plain)
        conv.half()
        y = conv(x)
        want = torch.nn.functional.conv1d(x.half(), conv.weight, conv.bias, padding=1).float()
    assert y.dtype == torch.float32 and torch.equal(y, want)


def test_float16_is_the_benchmarked_fp16_conv_nhwc_variant_bit_for_bit(models):
    """What benchmarks/h200/hift_precision.py measures as "fp16-conv+nhwc" is what the policy
    computes: the same casts around the same channels-last 2-D convolutions."""
    spec = importlib.util.spec_from_file_location("hift_precision", ROOT / "benchmarks" / "h200" / "hift_precision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    h32, h16 = models
    for dims in ((1, 50, 0), (2, 58, 3840)):
        x = _inputs(dims, seed=3)
        variant = bench.HiftVariant(h32, torch.float16, "conv", True, [dims[1]]).eval()
        with torch.inference_mode():
            for got, want in zip(variant(*x), h16(*x)):
                assert torch.equal(got, want)


def test_bfloat16_and_other_dtypes_are_refused_with_the_reason():
    h = HiftVocoder(load_model("random:tiny").cfg.hift)
    with pytest.raises(C2WUserError, match=r"HiFT precision: received bfloat16; expected one of \['float32', "
                                           r"'float16'\] \(bfloat16 convolutions measured 27.7-29.7 dB SNR"):
        h.set_precision(torch.bfloat16)
    with pytest.raises(C2WUserError, match=r"received float64; .*not a supported dtype"):
        h.set_precision(torch.float64)
    assert h.precision == torch.float32                       # nothing was cast


def test_the_unit_spec_supports_exactly_the_models_precisions():
    spec = SPECS["hift"]
    assert spec.dtypes == tuple(sorted(DTYPE_NAMES[d] for d in PRECISIONS))
    assert set(spec.refused_dtypes) == {"bfloat16"} and set(spec.tf32_off) == {"float16"}
    key = ShapeKey("hift", (1, 58, 3840), "float16")
    assert spec.input_dtypes(key) == (torch.float32,) * 3 and spec.output_dtypes(key) == (torch.float32,) * 2


def test_float16_weights_are_stored_for_the_channels_last_convolutions_and_keep_that_order(models):
    """Under float16 each conv weight (a, b, k) is stored in (a, k, b) memory order so that cuDNN
    reads `weight.unsqueeze(2)` as the channels-last weight it is, and so is each float32 weight
    of the f0 predictor, which its kernel reads tap-major; loading a contiguous checkpoint and
    moving the model keep the order; under float32 the weights are contiguous again (the oracle
    parity's layout)."""
    h32, h16 = models
    fresh = HiftVocoder(h32.cfg).set_precision(torch.float16)
    fresh.load_state_dict({k: v.contiguous().clone() for k, v in h16.state_dict().items()})
    buf = io.BytesIO()
    torch.save(fresh, buf)
    buf.seek(0)

    def f0_convs(h):
        return list(h.f0_predictor.condnet[::2])

    for copy in (fresh, copy_module.deepcopy(fresh), torch.load(buf, weights_only=False)):
        for m in copy.precision_modules():
            assert m.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last), m
            assert m.weight.permute(0, 2, 1).is_contiguous()
        for m in f0_convs(copy):
            assert m.weight.dtype == torch.float32 and m.weight.permute(0, 2, 1).is_contiguous(), m
    assert torch.equal(fresh.f0_predictor.condnet[2].weight, h16.f0_predictor.condnet[2].weight)
    fresh.set_precision(torch.float32)
    assert all(m.weight.is_contiguous() for m in fresh.precision_modules() + f0_convs(fresh))


def test_the_model_loaded_at_a_float16_hift_policy_stores_the_weights_so():
    """What the exporter and the runtime load (runtime.precision.load_at_precision) goes through
    set_precision: the float16 conv weights in the channels-last order, the rest float32."""
    model = load_at_precision("random:tiny", "cpu", {"hift": "float16"})
    convs = model.hift.precision_modules()
    assert convs and all(m.weight.dtype == torch.float16 for m in convs)
    assert all(m.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert model.hift.f0_predictor.condnet[0].weight.dtype == torch.float32


def test_onnx_graphs_keep_the_1d_convolutions(monkeypatch):
    """TensorRT and ONNX Runtime choose their own layouts: inside an ONNX export the float16
    convolution stays Conv1d, the same function."""
    g = torch.Generator().manual_seed(0)
    conv = CastingConv1d(4, 3, 3, padding=1).half()
    x = torch.randn(2, 4, 9, generator=g)
    with torch.no_grad():
        two_d = conv(x)
        monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
        calls = []
        monkeypatch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: calls.append(a))
        one_d = conv(x)
    assert not calls and torch.allclose(one_d, two_d, rtol=0, atol=1e-3)
