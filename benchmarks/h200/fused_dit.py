"""A candidate, measured and not shipped: the DiT block in a few fused Triton kernels.

At B=1 the compiled solve runs ~25 kernels per block and Euler step, a few microseconds each
whatever their size (benchmarks/h200/README.md, run 9): the cost is their number. Here one kernel
is one matrix product with what surrounds it folded in:

- a prologue on its input rows: LayerNorm + adaLN modulation, or LayerNorm (affine) + Mish;
- for the causal convolutions, the k = 3 frames read straight from the previous chunk's cache
  and the current rows (no concatenation);
- an epilogue: bias, bias + GELU (tanh), or the gated residual `residual + gate * (y + bias)`.

`block_forward` runs a DiT block with up to eight of them (q, k, v or the three packed in one,
output projection, two convolutions, two MLP layers), leaving Inductor the q/k norms with the new
attention cache, the attention itself and the two-frame conv cache. Which products are fused,
and with which tile, comes from a table (`load_tiles`, from fused_tiles.py's measurements); the
others run as the model's ops. Same function as `DiTBlock.modulated`; a fused product rounds once
to the weights' dtype instead of after every op.

`fused_linear` is a `torch.library.triton_op`, so `torch.export` keeps it as one node and
AOTInductor compiles its kernel into the package. `apply(dit, max_rows, tiles)` rebinds the
blocks and the final layer of one DiT instance to it for calls of at most `max_rows` rows (0:
never); cfm_profile.py --triton-rows --tiles builds with it. Measured on the H200 (run 9, one
default tile for every product): the values are right (mel 62.3 dB against float32, eager
float16 62.0), the kernels are not fast enough (36 us each at B=1 where cuBLAS takes 4.5 us per
product): the full B=1 solve took 58 ms against 14.6. Runs 11c and 12b tuned the tiles
(fused_tiles.py); built with them (run 12c) the full B=1 solve took 17.8 ms against 15.3, still
slower: 9.3 us per fused launch inside the engine, and more kernels around them, not fewer.

`python3 benchmarks/h200/fused_dit.py` checks the kernels against the block on the CPU, under
Triton's interpreter (needs `pip install triton`).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import MethodType

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from c2w.runtime.model.dit import DiT, DiTBlock, FinalLayer, conv_by_product, modulate, parts  # noqa: E402

# prologue applied to each input row before the product
NO_PROLOGUE, LN_MODULATE, LN_MISH = 0, 1, 2
# epilogue applied to each output element
BIAS, BIAS_GELU, GATED_RESIDUAL = 0, 1, 2
# the same codes as the kernel sees them (compiled Triton reads only constexpr globals)
_NO_PROLOGUE, _LN_MODULATE, _LN_MISH = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_BIAS_GELU, _GATED_RESIDUAL = tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _row_stats(X, src, from_x, stride_xm, eps, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """LayerNorm mean and 1/std of the source rows, stepping through K (two passes, centred)."""
    total = tl.zeros(src.shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        total += tl.sum(tl.load(X + src[:, None] * stride_xm + rk[None, :],
                                mask=from_x[:, None] & (rk[None, :] < K), other=0.0).to(tl.float32), axis=1)
    mean = total / K
    sq = tl.zeros(src.shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ok = from_x[:, None] & (rk[None, :] < K)
        x = tl.load(X + src[:, None] * stride_xm + rk[None, :], mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, x - mean[:, None], 0.0)
        sq += tl.sum(d * d, axis=1)
    return mean, (1.0 / tl.sqrt(sq / K + eps)).to(tl.float32)


@triton.jit
def _prologue(x, mean, rstd, k_ok, P0, P1, rk, PROLOGUE: tl.constexpr):
    """x: (BLOCK_M, BLOCK_K) float32 -> the prologue's output, given the rows' statistics."""
    if PROLOGUE != _NO_PROLOGUE:
        x = (x - mean[:, None]) * rstd[:, None]
        p0 = tl.load(P0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        p1 = tl.load(P1 + rk, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == _LN_MODULATE:       # p0, p1 = shift, scale
            x = x * (1.0 + p1[None, :]) + p0[None, :]
        if PROLOGUE == _LN_MISH:           # p0, p1 = LayerNorm weight, bias
            x = x * p0[None, :] + p1[None, :]
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            x = x * _tanh(softplus)
    return x


@triton.jit
def _fused_linear_kernel(
        X, CACHE, W, BIAS_PTR, Y, P0, P1, RES, GATE,
        M, N, T,
        stride_xm, stride_cb, stride_ck, stride_cf, stride_wn, stride_ym, stride_rm,
        eps,
        K: tl.constexpr, TAPS: tl.constexpr, PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[m, n] = epilogue(sum_j sum_k prologue(X)[row(m, j), k] * W[n, j * K + k]).

    Rows m = b * T + t. Tap j reads frame t + j - (TAPS - 1) of sequence b; a negative frame is
    read from CACHE[b, k, frame + TAPS - 1] (already transformed: it holds the previous chunk's
    last prologue outputs). P0/P1: shift/scale (LN_MODULATE) or LayerNorm weight/bias (LN_MISH),
    K long. GATE (N,) and RES (M, N) for GATED_RESIDUAL. A prologue's LayerNorm statistics come
    from the tile itself when BLOCK_K covers K (one pass), else from two passes over the rows first.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    seq = rm // T
    frame = rm % T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(TAPS):
        src_frame = frame + j - (TAPS - 1)
        from_x = m_ok & (src_frame >= 0)
        from_cache = m_ok & (src_frame < 0)
        src = seq * T + src_frame
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PROLOGUE != _NO_PROLOGUE and BLOCK_K < K:
            mean, rstd = _row_stats(X, src, from_x, stride_xm, eps, K, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            ok = from_x[:, None] & k_ok[None, :]
            a = tl.load(X + src[:, None] * stride_xm + rk[None, :], mask=ok, other=0.0).to(tl.float32)
            if PROLOGUE != _NO_PROLOGUE and BLOCK_K >= K:     # whole rows in the tile: one pass
                mean = tl.sum(a, axis=1) / K
                d = tl.where(ok, a - mean[:, None], 0.0)
                # AOTInductor passes a float argument as fp64: keep the loop-carried rstd fp32
                # (run 12: "rstd has initial type fp32 but is re-assigned to fp64 in loop")
                rstd = (1.0 / tl.sqrt(tl.sum(d * d, axis=1) / K + eps)).to(tl.float32)
            a = _prologue(a, mean, rstd, k_ok, P0, P1, rk, PROLOGUE)
            if TAPS > 1:
                cached = tl.load(CACHE + seq[:, None] * stride_cb + rk[None, :] * stride_ck
                                 + (src_frame[:, None] + TAPS - 1) * stride_cf,
                                 mask=from_cache[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                a = tl.where(from_cache[:, None], cached, a)
            w = tl.load(W + rn[None, :] * stride_wn + (j * K + rk)[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(a.to(W.dtype.element_ty), w)
    y = acc + tl.load(BIAS_PTR + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == _BIAS_GELU:
        y = 0.5 * y * (1.0 + _tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))
    if EPILOGUE == _GATED_RESIDUAL:
        gate = tl.load(GATE + rn, mask=n_ok, other=0.0).to(tl.float32)
        res = tl.load(RES + rm[:, None] * stride_rm + rn[None, :],
                      mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        y = res + gate[None, :] * y
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# the products of a block (and the final layer) that can run fused, by the names fused_tiles.py tunes
PRODUCTS = ("q/k/v", "qkv", "proj", "conv1", "conv2", "fc1", "fc2", "final")
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def load_tiles(paths: list[str]) -> dict[str, dict]:
    """Tile configurations from fused_tiles.py results (later files win): product -> its best
    configuration, for the products whose best beat the PyTorch ops it replaces (under one CUDA
    graph). A product left out runs as the model's ops (block_forward)."""
    import json
    tiles = {}
    for path in paths:
        for name, row in json.loads(Path(path).read_text())["shapes"].items():
            best = row.get("best")
            if best and best["us"] < row["ops_us"]:
                tiles[name] = {k: best[k] for k in TILE_KEYS}
            else:
                tiles.pop(name, None)
    return tiles


@triton_op("c2w_bench::fused_linear", mutates_args={})
def fused_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], cache: torch.Tensor,
                 p0: torch.Tensor, p1: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor,
                 frames: int, taps: int, prologue: int, epilogue: int, eps: float,
                 block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> list[torch.Tensor]:
    """x (M, K) rows, M = sequences x `frames`; weights (N, taps * K), unit inner stride, with their
    biases (N,): one launch each over the same rows; cache (b, K, taps - 1) (any strides; read only
    when taps > 1); p0, p1 (K,); residual (M, N); gate (N,). Unused tensors may be any tensor (they
    are never read). The tile (block_*, warps, stages) is fixed per call site (no autotuning in the
    build). -> one (M, N) result per weight, in x's dtype."""
    m, k = x.shape
    ys = []
    for weight, bias in zip(weights, biases):
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        wrap_triton(_fused_linear_kernel)[grid](
            x, cache, weight, bias, y, p0, p1, residual, gate,
            m, n, frames,
            x.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), weight.stride(0), y.stride(0),
            residual.stride(0), eps,
            K=k, TAPS=taps, PROLOGUE=prologue, EPILOGUE=epilogue,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
        ys.append(y)
    return ys


def linear(x, weight, bias, tile: dict, *, prologue=NO_PROLOGUE, p0=None, p1=None, epilogue=BIAS,
           residual=None, gate=None, eps=1e-6, taps=1, cache=None, frames=None):
    """`fused_linear` over x (b, T, K) -> (b, T, N) (a list of them when weight and bias are lists),
    with the tile configuration `tile` (TILE_KEYS); vectors may come as (1, 1, K) views."""
    b, t, k = x.shape
    rows = x.reshape(b * t, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    flat = [v.reshape(-1) if v is not None else rows for v in (p0, p1, gate)]
    res = residual.reshape(b * t, -1) if residual is not None else rows
    many = isinstance(weight, (list, tuple))
    ys = fused_linear(rows, list(weight) if many else [weight], list(bias) if many else [bias],
                      cache if cache is not None else rows.unsqueeze(-1), flat[0], flat[1], res, flat[2],
                      t, taps, prologue, epilogue, eps, *(int(tile[key]) for key in TILE_KEYS))
    ys = [y.reshape(b, t, -1) for y in ys]
    return ys if many else ys[0]


def block_forward(block, x: torch.Tensor, mod: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor,
                  tiles: dict[str, dict]):
    """`DiTBlock.modulated` (same arguments and results) with the products named in `tiles` fused
    (load_tiles), the others as the model computes them; mod: (1, 1, 9d). "qkv" is one launch over
    the model's packed q/k/v weight, "q/k/v" one launch per weight (used if "qkv" is not in `tiles`)."""
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_conv, scale_conv, gate_conv) = parts(mod, 9, -1)
    attn, conv, mlp = block.attn, block.conv, block.mlp
    b, t, d = x.shape
    h, hd = attn.heads, attn.head_dim

    # attention: q, k and v products over the modulated LayerNorm, then Inductor's q/k norms, cache, SDPA
    ln_mod = dict(prologue=LN_MODULATE, p0=shift_msa, p1=scale_msa, eps=block.norm1.eps)
    if "qkv" in tiles:
        q, k, v = parts(linear(x, attn.qkv_weight, attn.qkv_bias, tiles["qkv"], **ln_mod), 3, -1)
    elif "q/k/v" in tiles:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        q, k, v = linear(x, [p.weight for p in projections], [p.bias for p in projections], tiles["q/k/v"], **ln_mod)
    else:
        q, k, v = attn.project(modulate(block.norm1(x), shift_msa, scale_msa))
    q = attn.q_norm(attn._heads(q))
    k, v = attn.k_norm(attn._heads(k)), attn._heads(v)
    kv = torch.cat([torch.cat([k, v], dim=-1), att_cache], dim=2)
    k, v = parts(kv, 2, -1)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h * hd)
    if "proj" in tiles:
        x = linear(a, attn.proj.weight, attn.proj.bias, tiles["proj"], epilogue=GATED_RESIDUAL, residual=x,
                   gate=gate_msa)
    else:
        x = x + gate_msa * attn.proj(a)

    # causal conv block: frames read from the cache and the rows, LayerNorm + Mish in conv2's prologue
    c1, c2 = parts(cnn_cache, 2, 1)                                             # (b, d, 2) each
    conv1, norm, conv2 = conv.block[1], conv.block[3], conv.block[6]
    taps, ctx = conv1.kernel_size[0], conv.context
    m3 = modulate(block.norm3(x), shift_conv, scale_conv) if "conv1" not in tiles else None
    if m3 is None:
        y1 = linear(x, conv1.weight.permute(0, 2, 1).flatten(1), conv1.bias, tiles["conv1"], prologue=LN_MODULATE,
                    p0=shift_conv, p1=scale_conv, eps=block.norm3.eps, taps=taps, cache=c1, frames=t)
        m3_tail = modulate(block.norm3(x[:, -ctx:]), shift_conv, scale_conv)
    else:
        y1 = conv_by_product(conv1, torch.cat([c1.transpose(1, 2), m3], dim=1))
        m3_tail = m3[:, -ctx:]
    if "conv2" in tiles:
        x2 = linear(y1, conv2.weight.permute(0, 2, 1).flatten(1), conv2.bias, tiles["conv2"], prologue=LN_MISH,
                    p0=norm.weight, p1=norm.bias, eps=norm.eps, epilogue=GATED_RESIDUAL, residual=x, gate=gate_conv,
                    taps=taps, cache=c2, frames=t)
        mish_tail = conv.block[4](norm(y1[:, -ctx:]))
    else:
        mished = conv.block[4](norm(y1))
        x2 = x + gate_conv * conv_by_product(conv2, torch.cat([c2.transpose(1, 2), mished], dim=1))
        mish_tail = mished[:, -ctx:]
    # the new conv cache: the last two frames of each convolution's input, as the block computes them
    h1 = torch.cat([c1.transpose(1, 2), m3_tail], dim=1)
    h2 = torch.cat([c2.transpose(1, 2), mish_tail], dim=1)
    new_cnn = torch.cat([h1[:, -ctx:], h2[:, -ctx:]], dim=2).transpose(1, 2)

    # MLP: LayerNorm + modulation + GELU around the first product, gated residual after the second
    if "fc1" in tiles:
        hid = linear(x2, mlp.fc1.weight, mlp.fc1.bias, tiles["fc1"], prologue=LN_MODULATE, p0=shift_mlp,
                     p1=scale_mlp, eps=block.norm2.eps, epilogue=BIAS_GELU)
    else:
        hid = mlp.act(mlp.fc1(modulate(block.norm2(x2), shift_mlp, scale_mlp)))
    if "fc2" in tiles:
        x3 = linear(hid, mlp.fc2.weight, mlp.fc2.bias, tiles["fc2"], epilogue=GATED_RESIDUAL, residual=x2,
                    gate=gate_mlp)
    else:
        x3 = x2 + gate_mlp * mlp.fc2(hid)
    return x3, new_cnn, kv


def final_forward(layer, x: torch.Tensor, mod: torch.Tensor, tiles: dict[str, dict]) -> torch.Tensor:
    """`FinalLayer.modulated` with one fused kernel when `tiles` has "final"; mod: (1, 1, 2d)."""
    if "final" not in tiles:
        return FinalLayer.modulated(layer, x, mod)
    shift, scale = parts(mod, 2, -1)
    return linear(x, layer.linear.weight, layer.linear.bias, tiles["final"], prologue=LN_MODULATE, p0=shift,
                  p1=scale, eps=layer.norm_final.eps)


def _fused_block(self, x, mod, cnn_cache, att_cache):
    if mod.shape[0] == 1 and x.shape[0] * x.shape[1] <= self.fused_rows:
        return block_forward(self, x, mod, cnn_cache, att_cache, self.fused_tiles)
    return DiTBlock.modulated(self, x, mod, cnn_cache, att_cache)


def _fused_final(self, x, mod):
    if mod.shape[0] == 1 and x.shape[0] * x.shape[1] <= self.fused_rows:
        return final_forward(self, x, mod, self.fused_tiles)
    return FinalLayer.modulated(self, x, mod)


def apply(dit: DiT, max_rows: int, tiles: dict[str, dict] | None = None) -> None:
    """Run `dit`'s blocks and final layer through the fused kernels when a call has at most
    `max_rows` rows (2B x T) and one modulation for all of them; 0 turns them off. tiles: product
    -> tile configuration (load_tiles); the products it leaves out run as the model's ops."""
    for layer, fn in [(b, _fused_block) for b in dit.blocks] + [(dit.final_layer, _fused_final)]:
        layer.fused_rows, layer.fused_tiles = max_rows, dict(tiles or {})
        layer.modulated = MethodType(fn, layer)


if __name__ == "__main__":      # CPU check under Triton's interpreter: the kernels compute the block
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are checked on the CPU by Triton's interpreter)")
    from c2w.runtime.model.config import TINY
    from c2w.runtime.model.flow import FlowModel
    from c2w.runtime.model.weights import init_random_
    from c2w.runtime.units import rel_l2
    flow = FlowModel(TINY)
    init_random_(flow, 3)
    g = torch.Generator().manual_seed(0)
    narrow = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2)      # two-pass statistics
    whole = dict(narrow, BLOCK_K=512)                                                   # whole rows in the tile
    every = {name: narrow for name in PRODUCTS}
    # all fused (packed q/k/v, then one launch per weight; both prologue paths), then each product alone
    per_weight = {name: tile for name, tile in every.items() if name != "qkv"}
    tables = [every, {**per_weight, "q/k/v": whole, "conv1": whole, "fc1": whole, "final": whole},
              *({name: whole} for name in PRODUCTS)]
    for dtype, bound in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        dit = flow.decoder.estimator.eval().to(dtype)
        x = torch.randn(2, 6, 512, generator=g).to(dtype)
        mod = (0.3 * torch.randn(1, 1, 9 * 512, generator=g)).to(dtype)
        cnn = torch.randn(2, 1024, 2, generator=g).to(dtype)
        att = torch.randn(2, 8, 5, 128, generator=g).to(dtype)
        worst = 0.0
        for tiles in tables:
            with torch.no_grad():
                want = (*DiTBlock.modulated(dit.blocks[0], x, mod, cnn, att),
                        FinalLayer.modulated(dit.final_layer, x, mod[..., :1024]))
                got = (*block_forward(dit.blocks[0], x, mod, cnn, att, tiles),
                       final_forward(dit.final_layer, x, mod[..., :1024], tiles))
            errs = [rel_l2(a.float(), b.float()) for a, b in zip(got, want)]
            assert max(errs) <= bound, (dtype, sorted(tiles), errs)
            worst = max(worst, *errs)
        print(f"{dtype}: {len(tables)} tile tables, worst rel-L2 of x, caches, final layer: {worst:.1e}")
