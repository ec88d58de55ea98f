"""The DiT's Triton kernels against the PyTorch ops they replace: on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets), compiled where CUDA is.

Tolerances: float32 1e-5 absolute and relative on unit-scale values (the norms' float32
arithmetic in another order); float16 2e-3 absolute and relative, a few float16 ulp at these
values (each side rounds its float32 result once, from sums taken in another order). The values v
and every cache slot not written must be bit-exact.
"""
import copy
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":   # tests/conftest.py sets it
    pytest.skip("no CUDA and Triton's interpreter is off (TRITON_INTERPRET is not 1)", allow_module_level=True)

from c2w.runtime.model import dit, triton_kernels  # noqa: E402
from c2w.runtime.model.config import TINY  # noqa: E402
from c2w.runtime.model.dit import Attention, CFMSolver, DiT  # noqa: E402
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
        monkeypatch.setattr(dit, "_triton_kernels", lambda t: kernels)
        bufs = copy.deepcopy(buffers)
        with torch.no_grad():
            x_next, cnn_next, _ = solver.step(mu, spk, cond, x, cnn, bufs, step, dt, att_slots=slots)
        return x_next, cnn_next, bufs

    calls = []
    counting = type("Kernels", (), {"fits": staticmethod(triton_kernels.fits),
                                    "attention_inputs": staticmethod(lambda *a: calls.append(1)
                                                                     or triton_kernels.attention_inputs(*a))})
    fused, ops = run(counting), run(None)
    assert len(calls) == cfg.depth                                           # every block took the kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_l2(fused[0], ops[0]) < tol
    torch.testing.assert_close(fused[1], ops[1], atol=tol, rtol=tol)
    for got, want in zip(fused[2], ops[2]):
        assert rel_l2(got.float(), want.float()) < tol


def test_the_model_takes_the_kernel_on_cuda_only():
    assert dit._triton_kernels(torch.zeros(1)) is None
    if torch.cuda.is_available():
        assert dit._triton_kernels(torch.zeros(1, device="cuda")) is triton_kernels
