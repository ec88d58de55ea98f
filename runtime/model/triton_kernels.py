"""The DiT's Triton kernels: what Inductor's own kernels do in several launches, in one.

Each kernel is a `torch.library.triton_op`, so `torch.export` keeps it as one node and
AOTInductor compiles it into the package (the runtime loading the package needs no Triton). The
model uses them on CUDA only (`runtime.model.dit._triton_kernels`); on the CPU and in ONNX graphs
it keeps the PyTorch ops they replace. Tests run them on the CPU under Triton's interpreter (TRITON_INTERPRET=1) against
those ops (tests/runtime/model/test_triton_kernels.py).

Two rules learned on the H200 (benchmarks/h200/README.md, runs 9 and 12c): a kernel stores only
through pointers it is given (Inductor reads the kernel's IR to learn what it writes; a store
through a pointer chosen at run time was not seen, and the engine computed garbage), and a float
argument that must stay float32 is a `tl.constexpr` (AOTInductor passes plain floats as float64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# rows of (sequence, frame) per program of attention_inputs, and its warps; one program per
# (rows, head)
_ROWS, _WARPS = 16, 4


@triton.jit
def _layer_norm(x, w, b, D: tl.constexpr, EPS: tl.constexpr):
    """LayerNorm of each row of x (R, D) float32 with weight w and bias b (D,) float32."""
    mean = tl.sum(x, axis=1) / D
    centred = x - mean[:, None]
    var = tl.sum(centred * centred, axis=1) / D
    return centred * tl.rsqrt(var + EPS)[:, None] * w[None, :] + b[None, :]


@triton.jit
def _attention_inputs_kernel(
        qkv, q_out, kv, slots, q_w, q_b, k_w, k_b,
        rows, frames, qkv_seq, qkv_frame, kv_seq, kv_head, kv_slot,
        H: tl.constexpr, D: tl.constexpr, EPS_Q: tl.constexpr, EPS_K: tl.constexpr, ROWS: tl.constexpr):
    head = tl.program_id(1)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = r < rows
    mask = live[:, None]
    seq = (r // frames).to(tl.int64)
    frame = r % frames
    src = qkv + (seq * qkv_seq + frame * qkv_frame)[:, None] + head * D + d[None, :]
    q = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(src + H * D, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(src + 2 * H * D, mask=mask, other=0.0)
    q = _layer_norm(q, tl.load(q_w + d).to(tl.float32), tl.load(q_b + d).to(tl.float32), D, EPS_Q)
    k = _layer_norm(k, tl.load(k_w + d).to(tl.float32), tl.load(k_b + d).to(tl.float32), D, EPS_K)
    tl.store(q_out + (r.to(tl.int64) * (H * D))[:, None] + head * D + d[None, :], q.to(q_out.dtype.element_ty),
             mask=mask)
    slot = tl.load(slots + frame, mask=live, other=0)
    dst = kv + (seq * kv_seq + head * kv_head + slot * kv_slot)[:, None] + d[None, :]
    tl.store(dst, k.to(kv.dtype.element_ty), mask=mask)
    tl.store(dst + D, v.to(kv.dtype.element_ty), mask=mask)


@triton_op("c2w::attention_inputs", mutates_args={"kv"})
def attention_inputs(qkv: torch.Tensor, q_weight: torch.Tensor, q_bias: torch.Tensor, q_eps: float,
                     k_weight: torch.Tensor, k_bias: torch.Tensor, k_eps: float,
                     kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """From the packed projection qkv (b, T, 3 h d) = [q | k | v] (unit inner stride), to what
    attention reads, in one launch:
    - returns q after its LayerNorm (q_weight, q_bias, q_eps over each head's d values), laid
      out (b, T, h, d): `.transpose(1, 2)` is the (b, h, T, d) view attention takes, and cuDNN's
      attention gives its output the layout of q, so the output's way back to (b, T, h d) is a
      view too;
    - writes the chunk's new cache frames [LayerNorm_k(k) | v] into the cache kv (b, h, S, 2d)
      (unit inner stride), frame t into slot slots[t] (T,) int64: `Attention.forward_in_place`'s
      `kv.index_copy_(2, slots, new)`.
    The norms compute in float32 and round once to the tensors' dtype, as Inductor's do."""
    b, frames, width = qkv.shape
    heads, head_dim = kv.shape[1], kv.shape[3] // 2
    q = torch.empty((b, frames, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    rows = b * frames
    grid = (triton.cdiv(rows, _ROWS), heads)
    wrap_triton(_attention_inputs_kernel)[grid](
        qkv, q, kv, slots, q_weight, q_bias, k_weight, k_bias,
        rows, frames, qkv.stride(0), qkv.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        H=heads, D=head_dim, EPS_Q=q_eps, EPS_K=k_eps, ROWS=_ROWS, num_warps=_WARPS)
    return q


def fits(qkv: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, q_norm: torch.nn.LayerNorm,
         k_norm: torch.nn.LayerNorm) -> bool:
    """Whether `attention_inputs` takes these tensors: [q | k | v] of kv's heads and head size (a
    power of two) with unit inner strides, as many cache rows as qkv has sequences, one slot per
    frame in a contiguous int64 vector on the same device, one dtype of float16, bfloat16 or
    float32, and affine norms over one head. The slots must be distinct and within the cache, as a
    RingCache's free slots are: the kernel does not check them (index_copy_ would)."""
    heads, head_dim = kv.shape[1], kv.shape[3] // 2
    return (qkv.dim() == 3 and kv.dim() == 4 and qkv.stride(2) == 1 and kv.stride(3) == 1
            and kv.shape[0] == qkv.shape[0] and kv.shape[3] == 2 * head_dim
            and qkv.shape[2] == 3 * heads * head_dim and head_dim > 0 and head_dim & (head_dim - 1) == 0
            and slots.dtype == torch.int64 and slots.dim() == 1 and slots.stride(0) == 1
            and slots.numel() == qkv.shape[1] and slots.device == qkv.device == kv.device
            and qkv.dtype in (torch.float16, torch.bfloat16, torch.float32) and kv.dtype == qkv.dtype
            and all(n.weight is not None and n.bias is not None and tuple(n.normalized_shape) == (head_dim,)
                    for n in (q_norm, k_norm)))
