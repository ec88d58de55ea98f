"""The encoder attention form benchmarks/h200/encoder_profile.py measures (`--attn sdpa`) computes
the model's function, with and without a cache: a faster but wrong form must not reach a device call."""
import pytest
import torch

from benchmarks.h200.encoder_profile import sdpa_attention_forward
from c2w.runtime.model.encoder import _RelPosSelfAttention


@pytest.mark.parametrize("cached", [0, 6])
def test_position_scores_as_the_mask_of_one_attention_match_the_model(cached):
    torch.manual_seed(cached)
    attn = _RelPosSelfAttention(32, 4).eval()
    torch.nn.init.normal_(attn.pos_bias_u)          # zeros at init: make both biases count
    torch.nn.init.normal_(attn.pos_bias_v)
    b, t = 2, 5
    x = torch.randn(b, t, 32)
    cache = torch.randn(b, 4, cached, 16) if cached else None
    rel_pos = torch.randn(1, 2 * t + cached - 1, 32)
    want = attn(x, rel_pos, cache)
    got = sdpa_attention_forward(attn, x, rel_pos, cache)
    assert got[0].shape == (b, t, 32) and got[1].shape == (b, 4, cached + t, 16)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)    # float32: only the order of the sums differs
