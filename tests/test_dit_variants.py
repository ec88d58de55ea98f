"""The DiT variants the H200 benchmarks build (benchmarks/h200/conv_variants.py, cfm_profile.py)
compute the model's function: a variant that is faster but wrong must not reach a device call."""
import torch
import torch.nn.functional as F

from benchmarks.h200.cfm_profile import (attention_with_lse, bthd_attention_forward, explicit_attention_with_lse,
                                         split_attention_forward)
from benchmarks.h200.conv_variants import frame_conv, per_tap_conv
from c2w.runtime.model.dit import Attention, CausalConvBlock, conv_by_product

TOL = dict(rtol=1e-5, atol=1e-5)     # float32: only the order of the sums differs


def test_the_convolution_forms_before_run_17_are_the_models_function():
    """cfm_profile.py --conv frames / per-tap measure them against the model's form."""
    torch.manual_seed(0)
    blk = CausalConvBlock(16).eval()
    conv = blk.block[1]
    h = torch.randn(3, 9 + 2, 16)                                  # (b, T + k - 1, c)
    want = F.conv1d(h.transpose(1, 2), conv.weight, conv.bias).transpose(1, 2)
    for form in (frame_conv, per_tap_conv, conv_by_product):
        got = form(conv, h)
        assert got.shape == (3, 9, 16)
        torch.testing.assert_close(got, want, **TOL)


def test_attention_with_q_normalized_before_its_transpose_matches_the_model():
    torch.manual_seed(2)
    attn = Attention(32, 4, 8).eval()
    x, cache = torch.randn(2, 5, 32), torch.randn(2, 4, 6, 16)     # (b, T, dim), (b, h, L, 2 d)
    want = attn(x, cache)
    got = bthd_attention_forward(attn, x, cache)
    assert got[1].shape == (2, 4, 11, 16)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_attention_split_over_chunk_and_cache_merged_by_log_sum_exp_matches_the_model():
    """Two attention calls (the chunk's frames, the cache) merged by their log-sum-exps are one
    attention over [chunk | cache]; also when one part dominates (a cache far from q or near it)."""
    torch.manual_seed(3)
    attn = Attention(32, 4, 8).eval()
    x = torch.randn(2, 5, 32)
    for scale in (1.0, 30.0):
        cache = torch.randn(2, 4, 6, 16) * scale                  # keys far larger: softmax mass moves
        want = attn(x, cache)
        got = split_attention_forward(attn, x, cache)
        assert got[1].shape == (2, 4, 11, 16)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL)


def test_the_explicit_attention_with_log_sum_exp_is_the_fused_one():
    """The float32 CUDA path of the split variant (cuDNN's fused kernel takes half precision
    only), checked against the CPU's fused kernel: the same output and log-sum-exp."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (5, 9, 9))
    for got, want in zip(explicit_attention_with_lse(q, k, v), attention_with_lse(q, k, v), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)
