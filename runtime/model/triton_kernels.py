"""The model's Triton kernels: what Inductor's own kernels (or cuDNN) do in several launches, or
too slowly, in one.

The DiT's (runtime.model.dit) come first: the attention inputs, the causal conv block's two
halves and attention; then HiFT's f0 predictor's convolution (runtime.model.hift.F0Predictor).

Each kernel is a `torch.library.triton_op`, so `torch.export` keeps it as one node and
AOTInductor compiles it into the package (the runtime loading the package needs no Triton). The
model uses them on CUDA only (`runtime.model.dit.triton_kernels_for`); on the CPU and in ONNX graphs
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
# rows of (sequence, frame) per program of the conv block's kernels, and their warps; each program
# holds its rows' whole channel width
_CONV_ROWS, _CONV_WARPS = 4, 4


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


@triton.jit
def _mish(x):
    """x * tanh(softplus(x)), float32; softplus as PyTorch's (x itself above 20)."""
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return x * (2.0 * tl.sigmoid(2.0 * sp) - 1.0)


@triton.jit
def _tap_sum(taps, bias, seq, frame, live, c, seq_stride, frame_stride, tap_stride, chan_stride,
             K: tl.constexpr):
    """bias + sum over taps j of taps[seq, frame + j, tap j, channel c] as float32 (ROWS, C):
    output frame t of a valid convolution over rows [t, t + K) (CausalConvBlock._conv)."""
    mask = live[:, None]
    y = tl.zeros((seq.shape[0], c.shape[0]), dtype=tl.float32) + tl.load(bias + c).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        row = seq * seq_stride + (frame + j) * frame_stride
        src = taps + row[:, None] + j * tap_stride + c[None, :] * chan_stride
        y += tl.load(src, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _conv_norm_mish_kernel(
        taps, bias, w, b, cache, out,
        rows, frames, seq_stride, frame_stride, tap_stride, chan_stride,
        cache_seq, cache_chan, cache_frame, out_seq, out_frame,
        C: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)        # rows of (sequence, output frame + K - 1)
    c = tl.arange(0, C)
    ctx: tl.constexpr = K - 1
    padded = frames + ctx
    live = r < rows
    seq = (r // padded).to(tl.int64)
    frame = r % padded
    mask = live[:, None]
    from_cache = frame < ctx
    dst = out + (seq * out_seq + frame * out_frame)[:, None] + c[None, :]
    # the first K - 1 rows of each sequence: the cache's frames, as they are
    kept = tl.load(cache + (seq * cache_seq + frame * cache_frame)[:, None] + c[None, :] * cache_chan,
                   mask=mask & from_cache[:, None], other=0.0)
    tl.store(dst, kept.to(out.dtype.element_ty), mask=mask & from_cache[:, None])
    # the others: Mish(LayerNorm(the convolution's output frame))
    conv = live & (frame >= ctx)
    y = _tap_sum(taps, bias, seq, frame - ctx, conv, c, seq_stride, frame_stride, tap_stride, chan_stride, K)
    y = _layer_norm(y, tl.load(w + c).to(tl.float32), tl.load(b + c).to(tl.float32), C, EPS)
    tl.store(dst, _mish(y).to(out.dtype.element_ty), mask=conv[:, None])


@triton_op("c2w::conv_norm_mish", mutates_args={})
def conv_norm_mish(taps: torch.Tensor, bias: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                   eps: float, cache: torch.Tensor) -> torch.Tensor:
    """The first half of the DiT's causal conv block after its first product, in one launch.
    taps (b, T + K - 1, K, c), any strides: the product of the convolution's input rows with its
    taps' weights, tap j of channel o at [..., j, o] (CausalConvBlock._taps); bias (c,); the LayerNorm's
    weight, bias and eps; cache (b, c, K - 1) (any strides): the previous chunk's last K - 1
    frames of the result. -> (b, T + K - 1, c) in taps' dtype: those cache frames, then
    Mish(LayerNorm(bias + the taps summed shifted)) per frame, i.e. the second convolution's
    input rows, `torch.cat([cache.transpose(1, 2), Mish(LN(conv(h)))], 1)`."""
    b, padded, k, c = taps.shape
    out = torch.empty((b, padded, c), dtype=taps.dtype, device=taps.device)
    rows = b * padded
    wrap_triton(_conv_norm_mish_kernel)[(triton.cdiv(rows, _CONV_ROWS),)](
        taps, bias, ln_weight, ln_bias, cache, out,
        rows, padded - k + 1, taps.stride(0), taps.stride(1), taps.stride(2), taps.stride(3),
        cache.stride(0), cache.stride(1), cache.stride(2), out.stride(0), out.stride(1),
        C=c, K=k, EPS=eps, ROWS=_CONV_ROWS, num_warps=_CONV_WARPS)
    return out


@triton.jit
def _conv_residual_norm_kernel(
        taps, bias, x, mod, x_out, h_out,
        rows, frames, seq_stride, frame_stride, tap_stride, chan_stride, x_seq, x_frame,
        C: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr,
        EPS: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)        # rows of (sequence, frame)
    c = tl.arange(0, C)
    live = r < rows
    mask = live[:, None]
    seq = (r // frames).to(tl.int64)
    frame = r % frames
    y = _tap_sum(taps, bias, seq, frame, live, c, seq_stride, frame_stride, tap_stride, chan_stride, K)
    res = tl.load(x + (seq * x_seq + frame * x_frame)[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
    res += tl.load(mod + GATE + c).to(tl.float32)[None, :] * y
    flat = (r.to(tl.int64) * C)[:, None] + c[None, :]
    tl.store(x_out + flat, res.to(x_out.dtype.element_ty), mask=mask)
    mean = tl.sum(res, axis=1) / C
    centred = res - mean[:, None]
    normed = centred * tl.rsqrt(tl.sum(centred * centred, axis=1) / C + EPS)[:, None]
    scale = tl.load(mod + SCALE + c).to(tl.float32)[None, :]
    h = normed * (1.0 + scale) + tl.load(mod + SHIFT + c).to(tl.float32)[None, :]
    tl.store(h_out + flat, h.to(h_out.dtype.element_ty), mask=mask)


@triton_op("c2w::conv_residual_norm", mutates_args={})
def conv_residual_norm(taps: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, mod: torch.Tensor, gate: int,
                       shift: int, scale: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT block from its conv block's second product to the MLP's input, in one launch.
    taps as in `conv_norm_mish` (b, T + K - 1, K, c); bias (c,); x (b, T, c) the block's residual
    stream (unit inner stride); mod: the block's adaLN modulation (1, 1, 9 c), contiguous, its
    vectors at offsets gate, shift and scale. -> (x + gate * (bias + the taps summed shifted),
    LayerNorm(that) * (1 + scale) + shift), both (b, T, c) contiguous in x's dtype: DiTBlock's
    `x = x + gate_conv * c` and `modulate(norm2(x), shift_mlp, scale_mlp)`, the norm without
    affine parameters."""
    b, frames, c = x.shape
    k = taps.shape[2]
    x_out = torch.empty((b, frames, c), dtype=x.dtype, device=x.device)
    h_out = torch.empty((b, frames, c), dtype=x.dtype, device=x.device)
    rows = b * frames
    wrap_triton(_conv_residual_norm_kernel)[(triton.cdiv(rows, _CONV_ROWS),)](
        taps, bias, x, mod, x_out, h_out,
        rows, frames, taps.stride(0), taps.stride(1), taps.stride(2), taps.stride(3), x.stride(0), x.stride(1),
        C=c, K=k, GATE=gate, SHIFT=shift, SCALE=scale, EPS=eps, ROWS=_CONV_ROWS, num_warps=_CONV_WARPS)
    return x_out, h_out


def conv_fits(x: torch.Tensor, mod: torch.Tensor, cnn_cache: torch.Tensor, conv_block: torch.nn.Module,
              norm: torch.nn.LayerNorm) -> bool:
    """Whether `conv_norm_mish` and `conv_residual_norm` take a DiT block's conv block and norm2
    (runtime.model.dit.DiTBlock): x (b, T, c) with c a power of two and unit inner stride, one
    modulation for every row (1, 1, 9 c) with unit inner stride, a (b, 2 c, K - 1) cache, k = K
    taps on both convolutions, one dtype of float16, bfloat16 or float32, the first norm affine
    over c, norm2 without affine parameters."""
    c = x.shape[-1]
    conv1, ln, conv2 = conv_block.block[1], conv_block.block[3], conv_block.block[6]
    k = conv1.kernel_size[0]
    return (x.dim() == 3 and c > 0 and c & (c - 1) == 0 and x.stride(2) == 1
            and tuple(mod.shape) == (1, 1, 9 * c) and mod.stride(2) == 1
            and tuple(cnn_cache.shape) == (x.shape[0], 2 * c, k - 1) and conv2.kernel_size[0] == k
            and conv1.in_channels == conv1.out_channels == conv2.out_channels == c
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(t.dtype == x.dtype for t in (mod, cnn_cache, conv1.weight, conv2.weight))
            and ln.weight is not None and ln.bias is not None and tuple(ln.normalized_shape) == (c,)
            and norm.weight is None and tuple(norm.normalized_shape) == (c,))


# attention's tiles: query frames x cache slots per step, warps, pipeline stages; one program per
# (query tile, sequence, head). Run 27 timed 54 tiles at each served key on the H200
# (benchmarks/h200/attention_kernel.py): the wide tile is the best at B=32 (64 sequences x 150 frames,
# 49.7 us against cuDNN's 62.9), the narrow one at B=1 (2 x 50 frames, 4.8 us against 8.7).
WIDE_TILE = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
NARROW_TILE = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=3)
_SMS = 132                      # the streaming multiprocessors of an H100 or H200: the CPU's stand-in


def attention_tile(frames: int, pairs: int, sms: int = _SMS) -> dict:
    """The tile for `frames` queries in each of `pairs` (sequence, head) pairs on a GPU of `sms`
    streaming multiprocessors: the wide tile when its programs give every SM one, else the narrow
    tile's four times as many programs."""
    return WIDE_TILE if triton.cdiv(frames, WIDE_TILE["BLOCK_M"]) * pairs >= sms else NARROW_TILE


def multiprocessors(device: torch.device) -> int:
    """The SMs of the GPU a package is built on (the tile is fixed in it), _SMS off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _SMS


@triton.jit
def attend(q_tile, cache, kv_slot, D: tl.constexpr, SLOTS: tl.constexpr, SCALE: tl.constexpr,
           BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """q_tile (M, D) over every slot of one (sequence, head)'s cache, [k | v] rows kv_slot apart
    -> (M, D) float32: the online softmax in base 2 (exp(x) = 2^(x log2 e)), float32 statistics
    and accumulator, the probabilities rounded to the cache's dtype for their product with v.
    `CACHE`: the loads' cache modifier ("" by default; ".cg" for a cache written earlier in the
    same launch, which L1 may hold stale)."""
    d = tl.arange(0, D)
    m = tl.full([q_tile.shape[0]], float("-inf"), tl.float32)
    total = tl.zeros([q_tile.shape[0]], dtype=tl.float32)
    acc = tl.zeros([q_tile.shape[0], D], dtype=tl.float32)
    for start in range(0, SLOTS, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = s < SLOTS
        k = tl.load(cache + s[None, :] * kv_slot + d[:, None], mask=inside[None, :], other=0.0,
                    cache_modifier=CACHE)                                                   # (D, N)
        v = tl.load(cache + s[:, None] * kv_slot + D + d[None, :], mask=inside[:, None], other=0.0,
                    cache_modifier=CACHE)                                                   # (N, D)
        scores = tl.dot(q_tile, k) * (SCALE * 1.4426950408889634)
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        rescale = tl.math.exp2(m - m_new)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return acc / total[:, None]


@triton.jit
def _attention_kernel(q, kv, out, frames, q_seq, q_frame, kv_seq, kv_head, kv_slot,
                      H: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(1)
    seq = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)       # int64 offsets: a buffer with heads or slots outermost may pass 2^31
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    live = t < frames
    q_tile = tl.load(q + seq * q_seq + head * D + t[:, None] * q_frame + d[None, :], mask=live[:, None], other=0.0)
    o = attend(q_tile, kv + seq * kv_seq + head * kv_head, kv_slot, D, SLOTS, SCALE, BLOCK_N, "")
    tl.store(out + ((seq * frames + t) * (H * D))[:, None] + head * D + d[None, :], o.to(out.dtype.element_ty),
             mask=live[:, None])


@triton_op("c2w::attention", mutates_args=())
def attention(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """q (b, T, h, d), as `attention_inputs` returns it, attends to every slot of the cache kv
    (b, h, S, 2d) = [k | v], without a mask, scaled by 1/sqrt(d) -> (b, T, h, d) contiguous, so
    (b, T, h d) is a view: `F.scaled_dot_product_attention(q.transpose(1, 2), k, v)` laid out as
    q. One program per tile of query frames, sequence and head walks the S slots with an online
    softmax (float32 statistics and accumulator; the probabilities rounded to the cache's dtype
    for their product with v, as the fused SDPA kernels do)."""
    b, frames, heads, head_dim = q.shape
    out = torch.empty((b, frames, heads, head_dim), dtype=q.dtype, device=q.device)
    tile = attention_tile(frames, b * heads, multiprocessors(q.device))
    grid = (triton.cdiv(frames, tile["BLOCK_M"]), b * heads)
    wrap_triton(_attention_kernel)[grid](
        q, kv, out, frames, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        H=heads, D=head_dim, SLOTS=kv.shape[2], SCALE=head_dim ** -0.5, **tile)
    return out


def attention_fits(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether `attention` takes these tensors: q (b, T, h, d) with its heads side by side at unit
    inner stride, kv (b, h, S, 2d) at unit inner stride, of the same device, batch, heads and head
    size (a power of two, >= 16 for the products), both float16. (A float32 product on the tensor
    cores would round to TF32; bfloat16 is not taken because Triton's interpreter multiplies
    bfloat16 as raw integers, so the CPU tests cannot check it.)"""
    return (q.dim() == 4 and kv.dim() == 4 and q.stride(3) == 1 and q.stride(2) == q.shape[3]
            and kv.stride(3) == 1 and kv.shape[:2] == (q.shape[0], q.shape[2]) and kv.shape[3] == 2 * q.shape[3]
            and q.shape[3] >= 16 and q.shape[3] & (q.shape[3] - 1) == 0 and kv.shape[2] > 0
            and q.dtype == kv.dtype == torch.float16 and q.device == kv.device)


# the f0 predictor's convolution tiles: rows of (sequence, frame) x output channels per program,
# input channels per step, warps, pipeline stages. benchmarks/h200/hift_kernels.py timed them on an
# H100 (runs 32, 35b, 36c): at B=32 the wide tile (F=158: 765 against 863 us for run 35's 64x128
# tile at 4 warps, which also spills registers on Triton 3.6; F=58: 281 against 349), at B=8 and
# B=1 F=58 the narrow one (B=8: 145 against 268 us; 32 wide programs).
F0_WIDE_TILE = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3)
F0_NARROW_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=2, num_stages=3)


def f0_tile(rows: int, c_out: int, sms: int = _SMS) -> dict:
    """The tile for `rows` x `c_out` outputs on a GPU of `sms` streaming multiprocessors: the wide
    tile when its programs reach half the SMs, else the narrow tile's eight times as many."""
    wide = triton.cdiv(rows, F0_WIDE_TILE["BLOCK_M"]) * triton.cdiv(c_out, F0_WIDE_TILE["BLOCK_N"])
    return F0_WIDE_TILE if 2 * wide >= sms else F0_NARROW_TILE


@triton.jit
def _elu(x):
    """F.elu (alpha 1) of float32 x, its negative side expm1(x) to a few ulps without libdevice's
    expm1 (which Triton's interpreter lacks): Kahan's (e^x - 1) x / log(e^x)."""
    u = tl.exp(x)
    um1 = u - 1.0
    small = tl.where(u == 1.0, x, um1 * x / tl.log(tl.where(u == 1.0, 2.0, u)))
    negative = tl.where(um1 == -1.0, -1.0, small)
    return tl.where(x > 0.0, x, negative)


@triton.jit
def _conv3_elu_kernel(x, w, bias, out, rows, frames, c_in, c_out,
                      x_seq, x_frame, x_chan, w_out, w_in, w_tap,
                      ELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)          # rows of (sequence, frame)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)          # output channels
    live = r < rows
    outs = n < c_out
    seq = (r // frames).to(tl.int64)
    frame = r % frames
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(3):                                    # output frame t reads t - 1, t, t + 1
        src = frame + (j - 1)
        inside = live & (src >= 0) & (src < frames)                 # zero padding at either end
        row = seq * x_seq + src.to(tl.int64) * x_frame
        for k0 in range(0, c_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ins = k < c_in
            a = tl.load(x + row[:, None] + k[None, :] * x_chan, mask=inside[:, None] & ins[None, :], other=0.0)
            b = tl.load(w + n[None, :] * w_out + k[:, None] * w_in + j * w_tap, mask=ins[:, None] & outs[None, :],
                        other=0.0)
            # three TF32 products of the operands' high and low parts: float32's accuracy on the
            # tensor cores (a single TF32 product rounds the operands to 10 bits)
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
    acc += tl.load(bias + n, mask=outs, other=0.0)[None, :]
    if ELU:
        acc = _elu(acc)
    tl.store(out + (r.to(tl.int64) * c_out)[:, None] + n[None, :], acc, mask=live[:, None] & outs[None, :])


@triton_op("c2w::conv3_elu", mutates_args=())
def conv3_elu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, elu: bool) -> torch.Tensor:
    """One layer of HiFT's f0 predictor in one launch: x (b, T, c_in) float32, any strides (the mel
    comes as its (b, 80, T) tensor's transposed view); weight (c_out, c_in, 3) and bias (c_out,)
    float32, any strides, the weight best stored tap-major (`dit.tap_major_`, each tap's input
    channels contiguous: in upstream's layout its reads do not coalesce, 5.5x slower on an H100 at
    B=32 F=158, run 32) -> (b, T, c_out) contiguous: `F.elu(F.conv1d(x.transpose(1, 2), weight,
    bias, padding=1)).transpose(1, 2)` (without the ELU if not `elu`), as an implicit product over
    the three taps with float32 accuracy: TF32's three-product split (`tf32x3`), float32
    accumulation. cuDNN's float32 convolutions (TF32 off, which the f0 predictor needs: its f0
    sets the NSF phases) run on the CUDA cores."""
    b, frames, c_in = x.shape
    c_out = weight.shape[0]
    out = torch.empty((b, frames, c_out), dtype=torch.float32, device=x.device)
    rows = b * frames
    tile = f0_tile(rows, c_out, multiprocessors(x.device))
    grid = (triton.cdiv(rows, tile["BLOCK_M"]), triton.cdiv(c_out, tile["BLOCK_N"]))
    wrap_triton(_conv3_elu_kernel)[grid](
        x, weight, bias, out, rows, frames, c_in, c_out,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), weight.stride(2),
        ELU=elu, **tile)
    return out


def conv3_fits(x: torch.Tensor, conv: torch.nn.Conv1d) -> bool:
    """Whether `conv3_elu` takes x (b, T, c_in) through conv: float32 tensors on one device, a
    k = 3 convolution with padding 1, stride 1, dilation 1, one group and a bias."""
    return (x.dim() == 3 and x.dtype == conv.weight.dtype == torch.float32 and conv.bias is not None
            and x.shape[2] == conv.in_channels and conv.kernel_size == (3,) and conv.padding == (1,)
            and conv.stride == (1,) and conv.dilation == (1,) and conv.groups == 1
            and x.device == conv.weight.device)
