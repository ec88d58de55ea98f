"""The model's Triton kernels (the DiT's, then HiFT's f0 predictor's) against the PyTorch ops they
replace: on the CPU under Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets),
compiled where CUDA is.

Tolerances: float32 1e-5 absolute and relative on unit-scale values (the norms' float32
arithmetic in another order); float16 2e-3 absolute and relative, a few float16 ulp at these
values (each side rounds its float32 result once, from sums taken in another order). The values v
and every cache slot not written must be bit-exact. The f0 predictor's kernel is held to float32's
accuracy against float64: 2e-6 relative (its products are TF32's three-product split, which the
interpreter computes in plain float32; sums of up to 1,536 terms).
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":   # tests/conftest.py sets it
    pytest.skip("no CUDA and Triton's interpreter is off (TRITON_INTERPRET is not 1)", allow_module_level=True)

import triton.language as tl  # noqa: E402

from c2w.runtime.model import dit, hift, triton_kernels  # noqa: E402
from c2w.runtime.model.config import TINY  # noqa: E402
from c2w.runtime.model.dit import Attention, CausalConvBlock, CFMSolver, DiT, conv_taps, modulate, parts  # noqa: E402
from c2w.runtime.model.weights import init_random_  # noqa: E402
from c2w.runtime.units import rel_l2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _attention(heads=2, head_dim=16, dim=24, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    attn = Attention(dim, heads, head_dim)
    with torch.no_grad():        # norms away from the identity, so a kernel skipping them fails
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    attn.q_norm.eps = 0.3        # eps that move the values by ~4 % at these inputs' variance, and
    attn.k_norm.eps = 1e-5       # differ, so one misplaced or swapped fails
    return attn.to(DEVICE, dtype)


def _reference(attn, qkv, kv, slots):
    q, new = attn._normed(*qkv.chunk(3, -1))
    kv = kv.clone()
    kv.index_copy_(2, slots, new)
    return q, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b, frames, slots_of", [
    (1, 5, lambda s, t: torch.arange(t)),                         # a fresh ring: the first slots
    (3, 7, lambda s, t: torch.randperm(s)[:t]),                    # a ring's free slots, any order
    (2, 19, lambda s, t: torch.arange(s - t, s)),                  # more rows than one program's
])
def test_attention_inputs_match_the_norms_and_index_copy(dtype, b, frames, slots_of):
    attn = _attention(dtype=dtype)
    heads, head_dim, s = attn.heads, attn.head_dim, frames + 6
    torch.manual_seed(1)
    qkv = (torch.randn(b, frames, 3 * heads * head_dim) * 2 + 0.5).to(DEVICE, dtype)
    kv = torch.randn(b, heads, s, 2 * head_dim).to(DEVICE, dtype)
    slots = slots_of(s, frames).to(DEVICE)
    q_ref, kv_ref = _reference(attn, qkv, kv, slots)

    out = kv.clone()
    q = triton_kernels.attention_inputs(qkv, attn.q_norm.weight, attn.q_norm.bias, attn.q_norm.eps,
                                        attn.k_norm.weight, attn.k_norm.bias, attn.k_norm.eps, out, slots)
    assert q.shape == (b, frames, heads, head_dim) and q.is_contiguous()
    torch.testing.assert_close(q.transpose(1, 2), q_ref, **TOL[dtype])
    new = out.index_select(2, slots)
    torch.testing.assert_close(new[..., :head_dim], kv_ref.index_select(2, slots)[..., :head_dim], **TOL[dtype])
    assert torch.equal(new[..., head_dim:], kv_ref.index_select(2, slots)[..., head_dim:])     # v as it is
    kept = torch.ones(s, dtype=torch.bool, device=DEVICE)
    kept[slots] = False
    assert torch.equal(out[:, :, kept], kv[:, :, kept])                                          # nothing else


def test_attention_inputs_follow_the_strides_of_qkv_and_of_the_cache_buffer():
    """qkv may be a view (frames-major memory, a slice of wider rows), and a block's buffer a
    slice of a larger one with its heads and slots interleaved: the kernel follows every stride
    and writes the buffer where it is."""
    attn = _attention()
    heads, head_dim, b, frames, s = attn.heads, attn.head_dim, 2, 4, 9
    torch.manual_seed(2)
    wide = torch.randn(frames, b, 3 * heads * head_dim + 8, device=DEVICE)
    qkv = wide[..., 8:].transpose(0, 1)                           # (b, T, 3hd): strides (3hd + 8, b (3hd + 8), 1)
    whole = torch.randn(2 * b + 1, s, heads, 2 * head_dim, device=DEVICE).transpose(1, 2)   # (.., h, S, 2d)
    before = whole.clone()
    kv = whole[1:2 * b + 1:2]                                     # every other row, slots outside heads
    slots = torch.tensor([8, 0, 3, 5], device=DEVICE)
    q_ref, kv_ref = _reference(attn, qkv, kv, slots)
    triton_kernels.attention_inputs(qkv, attn.q_norm.weight, attn.q_norm.bias, attn.q_norm.eps,
                                    attn.k_norm.weight, attn.k_norm.bias, attn.k_norm.eps, kv, slots)
    torch.testing.assert_close(whole[1:2 * b + 1:2], kv_ref, **TOL[torch.float32])
    untouched = [0, 2, 4]
    assert torch.equal(whole[untouched], before[untouched])


def test_fits_only_the_kernels_case():
    attn = _attention()
    qkv = torch.randn(2, 3, 3 * 32, device=DEVICE)
    kv = torch.randn(2, 2, 5, 32, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    assert triton_kernels.fits(qkv, kv, slots, attn.q_norm, attn.k_norm)
    assert not triton_kernels.fits(qkv, kv.transpose(2, 3).contiguous().transpose(2, 3), slots, attn.q_norm, attn.k_norm)
    assert not triton_kernels.fits(qkv, kv, slots.int(), attn.q_norm, attn.k_norm)
    assert not triton_kernels.fits(qkv.half(), kv, slots, attn.q_norm, attn.k_norm)
    assert not triton_kernels.fits(torch.randn(2, 3, 3 * 24, device=DEVICE), torch.randn(2, 2, 5, 24, device=DEVICE),
                                   slots, attn.q_norm, attn.k_norm)           # head size 12: not a power of two
    assert not triton_kernels.fits(qkv, kv[:1], slots, attn.q_norm, attn.k_norm)          # fewer cache rows
    assert not triton_kernels.fits(qkv, kv, torch.arange(6, device=DEVICE)[::2], attn.q_norm, attn.k_norm)  # strided
    assert not triton_kernels.fits(qkv, kv, slots[:2], attn.q_norm, attn.k_norm)          # a slot short
    assert not triton_kernels.fits(qkv.double(), kv.double(), slots, attn.q_norm, attn.k_norm)
    wide = _attention(heads=1, head_dim=32, dim=24)                   # the norms of one 32-wide head
    assert not triton_kernels.fits(qkv, kv, slots, wide.q_norm, wide.k_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_euler_step_with_the_kernel_matches_the_ops(monkeypatch, dtype):
    """The tiny model's in-place Euler step (what AOTI compiles) with the kernel, as on CUDA,
    against the same step with the PyTorch ops: same x, same caches."""
    torch.manual_seed(3)
    cfg = TINY.dit
    model = DiT(cfg)
    init_random_(model, seed=3)
    spk_affine = torch.nn.Linear(192, 80)
    solver = CFMSolver(model.to(DEVICE, dtype), spk_affine.to(DEVICE, dtype), TINY).to(DEVICE)
    b, frames, s = 2, 6, 10
    mu, cond, x = (torch.randn(b, 80, frames, device=DEVICE) for _ in range(3))
    spk = torch.randn(b, 192, device=DEVICE)
    cnn = torch.randn(cfg.depth, 2 * b, 2 * cfg.hidden, 2, device=DEVICE, dtype=dtype)
    buffers = [torch.randn(2 * b, cfg.heads, s, 2 * cfg.head_dim, device=DEVICE, dtype=dtype) for _ in range(cfg.depth)]
    slots = torch.tensor([1, 4, 5, 7, 8, 9], device=DEVICE)
    step = torch.tensor([3], device=DEVICE)
    dt = torch.tensor([0.1], device=DEVICE)

    def run(kernels):
        monkeypatch.setattr(dit, "triton_kernels_for", lambda t: kernels)
        bufs = copy.deepcopy(buffers)
        with torch.no_grad():
            x_next, cnn_next, _ = solver.step(mu, spk, cond, x, cnn, bufs, step, dt, att_slots=slots)
        return x_next, cnn_next, bufs

    calls = []

    def counted(name):
        return staticmethod(lambda *a: calls.append(name) or getattr(triton_kernels, name)(*a))
    names = ("attention_inputs", "attention", "conv_norm_mish", "conv_residual_norm")
    counting = type("Kernels", (), {**{f: staticmethod(getattr(triton_kernels, f))
                                       for f in ("fits", "attention_fits", "conv_fits")},
                                    **{n: counted(n) for n in names}})
    fused, ops = run(counting), run(None)
    for name in names:                                                       # every block took each kernel
        takes = dtype == torch.float16 or name != "attention"                # (attention: float16 only)
        assert calls.count(name) == (cfg.depth if takes else 0), name
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_l2(fused[0], ops[0]) < tol
    torch.testing.assert_close(fused[1], ops[1], atol=tol, rtol=tol)
    for got, want in zip(fused[2], ops[2]):
        assert rel_l2(got.float(), want.float()) < tol


def test_the_model_takes_the_kernel_on_cuda_only():
    assert dit.triton_kernels_for(torch.zeros(1)) is None
    if torch.cuda.is_available():
        assert dit.triton_kernels_for(torch.zeros(1, device="cuda")) is triton_kernels


def _conv_block(c=32, dtype=torch.float32, seed=4):
    torch.manual_seed(seed)
    blk = CausalConvBlock(c)
    with torch.no_grad():
        for p in blk.parameters():
            p.uniform_(-0.3, 0.3)
        blk.block[3].weight.uniform_(0.5, 1.5)
    return blk.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b, frames", [(1, 3), (3, 10)])
def test_conv_kernels_match_the_conv_block_and_the_norm_after_it(dtype, b, frames):
    """conv_norm_mish and conv_residual_norm (the block's second half) against CausalConvBlock's
    and DiTBlock's ops in float32 on the same products' outputs (taps), rounded once to the dtype
    (the kernels compute in float32 too, where the ops in float16 round after each op): the
    second conv's input rows with the cache's frames first, the new residual stream and the MLP's
    modulated input. The whole chain through the model's ops is the Euler step test above."""
    c = 32
    blk = _conv_block(c, dtype)
    norm2 = torch.nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
    torch.manual_seed(5)
    x_in = torch.randn(b, frames, c).to(DEVICE, dtype)
    x = torch.randn(b, frames, c).to(DEVICE, dtype)
    cache = torch.randn(b, 2 * c, 2).to(DEVICE, dtype)
    mod = (torch.randn(1, 1, 9 * c) * 0.5).to(DEVICE, dtype)
    _, _, _, shift_mlp, scale_mlp, _, _, _, gate_conv = (v.float() for v in parts(mod, 9, -1))
    ln = blk.block[3]
    f32 = {k: v.float() for k, v in blk.state_dict().items()}

    def tap_sum(taps, bias):                        # float32, (b, T, c)
        t = taps.shape[1] - taps.shape[2] + 1
        return sum(taps[:, j:j + t, j].float() for j in range(taps.shape[2])) + bias

    c1, c2 = parts(cache, 2, 1)
    h1 = torch.cat([c1.transpose(1, 2), x_in], dim=1)
    taps1 = conv_taps(blk.block[1], h1)
    y = F.layer_norm(tap_sum(taps1, f32["block.1.bias"]), (c,), f32["block.3.weight"], f32["block.3.bias"], ln.eps)
    mid_ref = torch.cat([c2.transpose(1, 2), F.mish(y).to(dtype)], dim=1)
    assert triton_kernels.conv_fits(x_in, mod, cache, blk, norm2)
    mid = triton_kernels.conv_norm_mish(taps1, blk.block[1].bias, ln.weight, ln.bias, ln.eps, c2)
    torch.testing.assert_close(mid, mid_ref, **TOL[dtype])
    assert torch.equal(mid[:, :2], c2.transpose(1, 2))                    # the cache's frames as they are

    taps2, new_cache = blk.second_taps(triton_kernels, x_in, cache)
    _, cache_ref = blk(x_in, cache)
    assert torch.equal(new_cache[:, :c], cache_ref[:, :c])                 # the first conv's input frames
    torch.testing.assert_close(new_cache, cache_ref, **TOL[dtype])
    x_ref = x.float() + gate_conv * tap_sum(taps2, f32["block.6.bias"])
    h_ref = modulate(F.layer_norm(x_ref, (c,), eps=norm2.eps), shift_mlp, scale_mlp)
    x_new, h = triton_kernels.conv_residual_norm(taps2, blk.block[6].bias, x, mod, 8 * c, 3 * c, 4 * c, norm2.eps)
    torch.testing.assert_close(x_new, x_ref.to(dtype), **TOL[dtype])
    torch.testing.assert_close(h, h_ref.to(dtype), **TOL[dtype])


def test_conv_kernels_read_the_taps_in_either_memory_order():
    """The taps view may come from tap-major conv weights (a channel's taps side by side) or
    taps-outer ones (a tap's channels side by side): the kernels follow its strides."""
    c, b, frames = 16, 2, 5
    blk = _conv_block(c)
    torch.manual_seed(6)
    h1 = torch.randn(b, frames + 2, c, device=DEVICE)
    cache = torch.randn(b, c, 2, device=DEVICE)
    taps = conv_taps(blk.block[1], h1)
    outer = taps.contiguous()                                         # each tap's channels side by side
    major = taps.transpose(2, 3).contiguous().transpose(2, 3)         # each channel's taps side by side
    assert outer.stride() != major.stride()
    args = (blk.block[1].bias, blk.block[3].weight, blk.block[3].bias, blk.block[3].eps, cache)
    torch.testing.assert_close(triton_kernels.conv_norm_mish(outer, *args), triton_kernels.conv_norm_mish(major, *args),
                               atol=1e-6, rtol=1e-6)


def test_conv_fits_only_the_kernels_case():
    c = 32
    blk = _conv_block(c)
    norm2 = torch.nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
    x, mod, cache = (torch.randn(2, 5, c, device=DEVICE), torch.randn(1, 1, 9 * c, device=DEVICE),
                     torch.randn(2, 2 * c, 2, device=DEVICE))
    assert triton_kernels.conv_fits(x, mod, cache, blk, norm2)
    assert not triton_kernels.conv_fits(x, torch.randn(2, 1, 9 * c, device=DEVICE), cache, blk, norm2)  # per row
    assert not triton_kernels.conv_fits(x, mod, cache[:1], blk, norm2)
    assert not triton_kernels.conv_fits(x.half(), mod, cache, blk, norm2)
    assert not triton_kernels.conv_fits(x, mod, cache, blk, torch.nn.LayerNorm(c).to(DEVICE))          # affine norm2
    odd = _conv_block(24)
    assert not triton_kernels.conv_fits(torch.randn(2, 5, 24, device=DEVICE), torch.randn(1, 1, 9 * 24, device=DEVICE),
                                        torch.randn(2, 48, 2, device=DEVICE), odd, torch.nn.LayerNorm(24))
def _sdpa(q, kv):
    """PyTorch's attention in float32 of q (b, T, h, d) over kv (b, h, S, 2d), laid out as q."""
    d = q.shape[-1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), kv[..., :d].float(), kv[..., d:].float()).transpose(1, 2)


@pytest.mark.parametrize("b, frames, heads, head_dim, s", [
    (1, 5, 2, 16, 9),             # fewer slots than one step of the kernel's tile
    (2, 70, 3, 32, 130),          # two query tiles, the last one short; the slots end mid-step
    (2, 6, 8, 64, 128),           # the model's head size, the slots a whole number of steps
    (1, 3, 2, 16, 65),            # one slot past a whole number of steps
])
def test_attention_matches_pytorchs(b, frames, heads, head_dim, s):
    """float16 against PyTorch's attention in float32, within TOL (the kernel rounds the
    probabilities to float16 for their product with v, as the fused kernels do)."""
    torch.manual_seed(4)
    q = torch.randn(b, frames, heads, head_dim).to(DEVICE, torch.float16)
    kv = (torch.randn(b, heads, s, 2 * head_dim) * 1.5).to(DEVICE, torch.float16)
    assert triton_kernels.attention_fits(q, kv)
    out = triton_kernels.attention(q, kv)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), _sdpa(q, kv), **TOL[torch.float16])


def test_attention_takes_the_wide_tile_where_it_fills_the_gpu():
    """The served keys' shapes (8 heads): B=32's 64 sequences of 150 frames take the wide tile,
    B=1's 2 sequences of 50 the narrow one; the wide tile from one program per SM on (132 on an
    H100 or H200, the default; another GPU's count where given)."""
    assert triton_kernels.attention_tile(150, 64 * 8) is triton_kernels.WIDE_TILE
    assert triton_kernels.attention_tile(50, 2 * 8) is triton_kernels.NARROW_TILE
    assert triton_kernels.attention_tile(64, 132) is triton_kernels.WIDE_TILE
    assert triton_kernels.attention_tile(64, 131) is triton_kernels.NARROW_TILE
    assert triton_kernels.attention_tile(65, 66) is triton_kernels.WIDE_TILE        # two query tiles each
    assert triton_kernels.attention_tile(64, 108, sms=108) is triton_kernels.WIDE_TILE   # a GPU of 108 SMs
    assert triton_kernels.attention_tile(64, 107, sms=108) is triton_kernels.NARROW_TILE


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 128), (128, 16), (16, 128), (64, 64)])
def test_attention_is_right_at_other_tiles(monkeypatch, block_m, block_n):
    """The tiles benchmarks/h200/attention_kernel.py tries, the narrow and wide ones among them:
    queries and slots that end mid-tile."""
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=3)
    monkeypatch.setattr(triton_kernels, "attention_tile", lambda *shape: tile)
    torch.manual_seed(6)
    q = torch.randn(2, 37, 2, 16).to(DEVICE, torch.float16)
    kv = torch.randn(2, 2, 45, 32).to(DEVICE, torch.float16)
    torch.testing.assert_close(triton_kernels.attention(q, kv).float(), _sdpa(q, kv), **TOL[torch.float16])


def test_attention_follows_the_strides_of_q_and_of_the_cache_buffer():
    """q may be every other sequence and frame of a larger one, and the cache a block's buffer inside a
    larger one with heads and slots interleaved (as in the attention-inputs test)."""
    torch.manual_seed(5)
    b, frames, heads, head_dim, s = 2, 7, 2, 16, 11
    q = torch.randn(2 * b, 2 * frames, heads, head_dim).to(DEVICE, torch.float16)[::2, ::2]   # frames apart too
    whole = torch.randn(2 * b + 1, s, heads, 2 * head_dim).to(DEVICE, torch.float16).transpose(1, 2)
    kv = whole[1:2 * b + 1:2]
    out = triton_kernels.attention(q, kv)
    torch.testing.assert_close(out.float(), _sdpa(q, kv), **TOL[torch.float16])


def test_attention_fits_only_float16_heads_side_by_side():
    q = torch.randn(2, 3, 2, 16, device=DEVICE, dtype=torch.float16)
    kv = torch.randn(2, 2, 5, 32, device=DEVICE, dtype=torch.float16)
    fits = triton_kernels.attention_fits
    assert fits(q, kv)
    assert not fits(q.float(), kv.float()) and not fits(q.bfloat16(), kv.bfloat16())
    assert not fits(q.transpose(1, 2).contiguous().transpose(1, 2), kv)        # (b, h, T, d) memory
    assert not fits(q, kv[:1]) and not fits(q, kv[:, :1])                      # batch or heads differ
    assert not fits(q, torch.randn(2, 2, 5, 16, device=DEVICE, dtype=torch.float16))   # another head size
    assert not fits(torch.randn(2, 3, 2, 8, device=DEVICE, dtype=torch.float16),
                    torch.randn(2, 2, 5, 16, device=DEVICE, dtype=torch.float16))  # head size 8: below the products'
    assert not fits(q, kv.transpose(2, 3).contiguous().transpose(2, 3))        # values not side by side


@triton.jit
def _elu_of(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, triton_kernels._elu(tl.load(x + i)))


def test_elu_matches_torch_to_a_few_ulp():
    """The kernel's ELU (expm1 by Kahan's formula) against float64 expm1: tiny, moderate and large
    negative inputs, zero and positive ones."""
    x = torch.cat([-torch.logspace(-9, 2, 240, dtype=torch.float64), torch.tensor([0.0, 1e-8, 0.5, 3.0, 80.0],
                                                                                    dtype=torch.float64)])
    x = torch.cat([x, torch.zeros(256 - x.numel(), dtype=torch.float64)]).float().to(DEVICE)
    y = torch.empty_like(x)
    _elu_of[(1,)](x, y, N=256)
    want = F.elu(x.double())
    assert ((y.cpu().double() - want).abs() <= 4 * 2.0 ** -23 * want.abs().clamp(min=2.0 ** -126)).all()


def _f0_conv(c_in, c_out, seed):
    torch.manual_seed(seed)
    conv = torch.nn.Conv1d(c_in, c_out, 3, padding=1)
    with torch.no_grad():
        conv.weight.normal_(0, c_in ** -0.5 * 0.6)
        conv.bias.normal_(0, 0.1)
    return conv.to(DEVICE)


@pytest.mark.parametrize("tile", ["F0_WIDE_TILE", "F0_NARROW_TILE"])
@pytest.mark.parametrize("b, frames, c_in, c_out, tap_major, view, elu", [
    (1, 4, 5, 20, False, False, True),       # fewer rows, input and output channels than one tile
    (3, 29, 80, 130, True, True, True),      # the mel's (B, 80, F) transposed view; rows across sequences
    (2, 70, 40, 24, True, False, False),     # more rows than one program's; no ELU
])
def test_conv3_elu_matches_conv1d_and_elu_in_float64(monkeypatch, tile, b, frames, c_in, c_out, tap_major, view,
                                                     elu):
    monkeypatch.setattr(triton_kernels, "f0_tile", lambda *a: getattr(triton_kernels, tile))
    conv = _f0_conv(c_in, c_out, seed=b)
    if tap_major:
        dit.tap_major_(conv)
    torch.manual_seed(7)
    mel = torch.randn(b, c_in, frames, device=DEVICE)
    x = mel.transpose(1, 2) if view else mel.transpose(1, 2).contiguous()
    assert triton_kernels.conv3_fits(x, conv)
    got = triton_kernels.conv3_elu(x, conv.weight, conv.bias, elu)
    want = F.conv1d(mel.double(), conv.weight.double(), conv.bias.double(), padding=1)
    want = (F.elu(want) if elu else want).transpose(1, 2)
    assert got.shape == (b, frames, c_out) and got.is_contiguous()
    assert rel_l2(got.double(), want) < 2e-6
    # the frames at either end see zero padding, not the neighbouring sequence's frames
    torch.testing.assert_close(got[:, [0, -1]].double(), want[:, [0, -1]], atol=1e-5, rtol=1e-5)


def test_f0_tile_is_wide_where_its_programs_reach_half_the_gpu():
    """As runs 35b and 36c timed them on an H100 (132 SMs)."""
    assert triton_kernels.f0_tile(32 * 158, 512, sms=132) is triton_kernels.F0_WIDE_TILE
    assert triton_kernels.f0_tile(32 * 58, 512, sms=132) is triton_kernels.F0_WIDE_TILE    # 120 wide programs
    assert triton_kernels.f0_tile(58, 512, sms=132) is triton_kernels.F0_NARROW_TILE
    assert triton_kernels.f0_tile(8 * 58, 512, sms=132) is triton_kernels.F0_NARROW_TILE   # 32 wide programs


def test_conv3_fits_only_the_f0_predictors_convolutions():
    x = torch.randn(2, 9, 16, device=DEVICE)
    assert triton_kernels.conv3_fits(x, _f0_conv(16, 8, 0))
    assert not triton_kernels.conv3_fits(x.half(), _f0_conv(16, 8, 0))
    assert not triton_kernels.conv3_fits(x, torch.nn.Conv1d(16, 8, 5, padding=2).to(DEVICE))
    assert not triton_kernels.conv3_fits(x, torch.nn.Conv1d(16, 8, 3, padding=1, dilation=2).to(DEVICE))
    assert not triton_kernels.conv3_fits(x, torch.nn.Conv1d(16, 8, 3, padding=1, bias=False).to(DEVICE))
    assert not triton_kernels.conv3_fits(x, _f0_conv(12, 8, 0))


def test_f0_predictor_takes_the_kernel_and_keeps_its_f0(monkeypatch):
    """HiFT's f0 predictor through the kernel (each of its five convs with its ELU) against its
    PyTorch ops, at the real widths (80 mel bins, 512 channels) on a short chunk; with the
    weights stored tap-major, as the float16 policy stores them, each path gives the same bits."""
    pred = hift.F0Predictor(80, 512)
    init_random_(pred, seed=11)
    pred = pred.to(DEVICE)
    stored_tap_major = copy.deepcopy(pred)
    stored_tap_major.store_weights(tap_major=True)
    torch.manual_seed(8)
    mel = torch.randn(2, 80, 12, device=DEVICE)
    calls = []
    counting = type("Kernels", (), {"conv3_fits": staticmethod(triton_kernels.conv3_fits),
                                    "conv3_elu": staticmethod(lambda *a: calls.append(1) or triton_kernels.conv3_elu(*a))})
    monkeypatch.setattr(hift, "triton_kernels_for", lambda t: counting)
    with torch.no_grad():
        fused, fused_tap_major = pred(mel), stored_tap_major(mel)
        monkeypatch.setattr(hift, "triton_kernels_for", lambda t: None)
        ops, ops_tap_major = pred(mel), stored_tap_major(mel)
        want = pred.double()(mel.double())
    assert len(calls) == 10
    assert torch.equal(fused_tap_major, fused) and torch.equal(ops_tap_major, ops)
    assert pred.condnet[2].weight.is_contiguous()                          # upstream's layout kept
    assert rel_l2(fused.double(), want) < 2e-6 and rel_l2(ops.double(), want) < 2e-6
