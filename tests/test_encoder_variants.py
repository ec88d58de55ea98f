"""The encoder forms benchmarks/h200/encoder_profile.py measures against the model's compute the
model's function: the attention's (`--attn unfused`, upstream's form at every size) on both sides
of FUSED_ATTENTION_ROWS, with and without a cache, and the convolutions' (`--conv cudnn`) over a
whole encoder step. A wrong form must not reach a device call."""
import pytest
import torch

from benchmarks.h200.encoder_profile import set_conv, set_form
from c2w.runtime.model.config import TINY
from c2w.runtime.model.encoder import FUSED_ATTENTION_ROWS, ConformerEncoder, _RelPosSelfAttention
from c2w.runtime.model.weights import init_random_


@pytest.mark.parametrize("batch, queries", [(2, 5), (4, FUSED_ATTENTION_ROWS // 4)])
@pytest.mark.parametrize("cached", [0, 6])
def test_the_unfused_form_matches_the_model(batch, queries, cached):
    torch.manual_seed(cached + batch)
    attn = _RelPosSelfAttention(32, 4).eval()
    torch.nn.init.normal_(attn.pos_bias_u)          # zeros at init: make both biases count
    torch.nn.init.normal_(attn.pos_bias_v)
    x = torch.randn(batch, queries, 32)
    cache = torch.randn(batch, 4, cached, 16) if cached else None
    rel_pos = torch.randn(1, 2 * queries + cached - 1, 32)
    want = attn(x, rel_pos, cache)
    try:
        set_form("unfused")
        got = attn(x, rel_pos, cache)
    finally:
        set_form("model")
    assert got[0].shape == (batch, queries, 32) and got[1].shape == (batch, 4, cached + queries, 16)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)    # float32: only the order of the sums differs


def test_the_cudnn_convolutions_match_the_model():
    enc = ConformerEncoder(TINY.encoder).eval()
    init_random_(enc, seed=2)
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 12, TINY.encoder.width, generator=g), torch.randn(enc.cnn_cache_shape(2), generator=g),
            torch.randn(enc.att_cache_shape(2, 8), generator=g))
    with torch.no_grad():
        want = enc(*args)
        try:
            set_conv("cudnn", enc)
            got = enc(*args)
        finally:
            set_conv("model")
    assert all(c.weight.is_contiguous() for c in enc.modules() if isinstance(c, torch.nn.Conv1d))
    for g_, w in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5)    # float32: only the order of the sums differs
