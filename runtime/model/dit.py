"""The CFM estimator (a 16-block DiT) and the whole 10-step Euler solve with guidance.

State-dict compatible with upstream `flow.pt` under `decoder.estimator.`. Written for export:
every cache comes in and goes out as a tensor and nothing is mutated (except in the in-place form
of the attention caches, `att_slots`, which AOTI's Euler step uses), the 10 timesteps are Python
constants (so the solve unrolls into one static graph), and the adaLN modulation, which depends
on the timestep alone, is computed once per solver for all 10 steps (`CFMSolver.modulation_table`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from c2w.runtime.model.config import DiTConfig, ModelConfig


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def tap_major_(conv: nn.Module) -> None:
    """Store conv.weight (c_out, c_in, k) in (c_out, k, c_in) memory order, values unchanged, so
    that `weight.permute(0, 2, 1).reshape(-1, c_in)`, the taps side by side, is a view
    (CausalConvBlock), and `weight.unsqueeze(2)` is a channels-last 2-D weight (HiFT's float16
    convolutions, which cuDNN then reads as it is)."""
    w = conv.weight
    conv.weight = nn.Parameter(w.detach().permute(0, 2, 1).contiguous().permute(0, 2, 1), requires_grad=w.requires_grad)


def taps_outer_(conv: nn.Module) -> None:
    """Store conv.weight (c_out, c_in, k) in (k, c_out, c_in) memory order, values unchanged, so
    that `weight.permute(2, 0, 1).reshape(-1, c_in)`, one tap's weights after the other, is a view
    (conv_by_product)."""
    w = conv.weight
    conv.weight = nn.Parameter(w.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0), requires_grad=w.requires_grad)


def conv_by_product(conv: nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
    """Valid conv1d over time of h (b, T + k - 1, c_in) -> (b, T, c_out), as one matrix product
    (no cuDNN convolution: given the (b, T, c) layout the blocks around it use, cuDNN converted
    input and weight to NHWC on every call, benchmarks/h200/README.md).

    The product reads every row of h as it is, against the weight viewed as (k * c_out, c_in),
    so that output feature j * c_out + o is tap j of channel o; output frame t sums tap j at row
    t + j. The shifted sum is pointwise and fuses into the kernel that reads the convolution's
    output, which reads each tap's c_out values side by side (design note 25). The product has
    k - 1 rows more per sequence than the output (+1.3 % at T=150). With the weight stored
    taps-outer (`taps_outer_`) its (k * c_out, c_in) view is free; in another order it costs a
    copy per call.
    One form for every shape, static or dynamic. It replaced two earlier ones, both of which
    made Inductor copy shifted slices of h contiguous before the products (three copies per
    convolution for the per-tap form, evaluating the Mish before the DiT's second convolution three
    times over; one three-wide frame copy for the frame form): a
    product over the frames [t, t + k) side by side, and one product per tap. On the H200
    depth-2 proxy (benchmarks/h200/README.md, run 17a): B=32 T=150 11.50 -> 10.63 ms per
    solve under graphs (11.57 -> 10.32 without), B=1 2.02 -> 1.82 ms."""
    k = conv.kernel_size[0]
    t = h.shape[1] - k + 1
    taps = conv_taps(conv, h)
    y = taps[:, 0:t, 0] + conv.bias
    for j in range(1, k):
        y = y + taps[:, j:j + t, j]
    return y


def conv_taps(conv: nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
    """The product of `conv_by_product`: h (b, T + k - 1, c_in) -> (b, T + k - 1, k, c_out), tap j
    of channel o at [..., j, o] (the product's output as it is: each tap's c_out values side by side)."""
    k = conv.kernel_size[0]
    w = conv.weight.permute(2, 0, 1)                                        # (k, c_out, c_in), a view
    return F.linear(h, w.reshape(-1, w.shape[2])).unflatten(-1, (k, w.shape[1]))


def parts(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    """`x.chunk(n, dim)` as n slices. The ONNX exporter turns chunk/split into SplitToSequence +
    SequenceAt, which the TensorRT parser rejects; slices export as plain Slice ops."""
    size = x.shape[dim] // n
    return [x.narrow(dim, i * size, size) for i in range(n)]


def euler_schedule(n_steps: int) -> tuple[list[float], list[float]]:
    """(t, dt) per step of the cosine schedule t = 1 - cos(linspace(0, 1, n+1) * pi / 2).

    Reproduces upstream's float32 recurrence (t += dt; dt = t_span[s+1] - t) bit for bit, so the
    constants baked into an engine are the ones the reference uses.
    """
    span = 1 - torch.cos(torch.linspace(0, 1, n_steps + 1, dtype=torch.float32) * 0.5 * torch.pi)
    t, dt = span[0].clone(), span[1] - span[0]
    ts, dts = [], []
    for s in range(1, n_steps + 1):
        ts.append(t.item())
        dts.append(dt.item())
        t = t + dt
        if s < n_steps:
            dt = span[s + 1] - t
    return ts, dts


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_embed: int = 256):
        super().__init__()
        self.freq_embed = freq_embed
        self.mlp = nn.Sequential(nn.Linear(freq_embed, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: (N,) float32 in [0, 1] -> (N, hidden) in the weights' dtype.

        The sinusoid is computed in float32 whatever the weights' dtype: t * 1000 has too few
        mantissa bits in fp16.
        """
        half = self.freq_embed // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (t.float() * 1000.0)[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def triton_kernels_for(x: torch.Tensor):
    """runtime.model.triton_kernels where ops on x take them: on CUDA, outside an ONNX export,
    with Triton installed (a CPU-only torch has none); else None."""
    if not x.is_cuda or torch.onnx.is_in_onnx_export():
        return None
    try:
        from c2w.runtime.model import triton_kernels
    except ImportError:
        return None
    return triton_kernels


class PackedQKV(nn.Module):
    """An attention module whose q, k and v projections, three nn.Linear layers with biases over
    the same input (the attributes named in QKV), run as ONE matrix product (`project`).

    The layers keep upstream's parameter names and shapes, but their weights and biases are views
    of two packed tensors, the non-persistent buffers `qkv_weight` (3 out, in) and `qkv_bias`
    (3 out,). So the state dict, `load_state_dict` and `init_random_` see upstream's three layers,
    the values live once, and an AOTI package binds the packed pair. `.to()`, `.half()`,
    `copy.deepcopy` and unpickling copy each tensor on its own; `_apply` and `__setstate__` pack
    them again afterwards. (Replacing the parameters themselves, e.g. `load_state_dict(...,
    assign=True)`, unties them: call `pack_qkv()` after.) AOTI packages built before a module
    was packed bind the three layers' weights, which still hold the values: they stay valid, and
    a rebuild gives them the one product. A subclass creates its layers, then calls `pack_qkv()`.
    """

    QKV = ("to_q", "to_k", "to_v")

    def pack_qkv(self) -> None:
        """Copy the three layers' weights and biases into one packed pair and make the layers'
        parameters views of it (values unchanged)."""
        layers = [getattr(self, name) for name in self.QKV]
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers])
            bias = torch.cat([layer.bias for layer in layers])
        if "qkv_weight" in self._buffers:
            self.qkv_weight, self.qkv_bias = weight, bias
        else:
            self.register_buffer("qkv_weight", weight, persistent=False)
            self.register_buffer("qkv_bias", bias, persistent=False)
        for layer, w, b in zip(layers, parts(weight, 3, 0), parts(bias, 3, 0)):
            layer.weight = nn.Parameter(w, requires_grad=layer.weight.requires_grad)
            layer.bias = nn.Parameter(b, requires_grad=layer.bias.requires_grad)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.pack_qkv()
        return self

    def __setstate__(self, state):          # copy.deepcopy and unpickling copy each tensor on its own
        super().__setstate__(state)
        self.pack_qkv()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., in) -> q, k, v (..., out) each: one product over the packed weight."""
        return tuple(parts(F.linear(x, self.qkv_weight, self.qkv_bias), 3, -1))


class Attention(PackedQKV):
    """Self-attention over [chunk | cache] with q/k LayerNorms; q, k and v from one product
    (PackedQKV). Measured on the H200 depth-2 proxy at B=1: 2.06 ms per solve against 2.37 with
    three products (benchmarks/h200/README.md, run 12c).
    """

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)
        self.pack_qkv()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)   # (b, h, t, d)

    def _chunk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, T, dim) -> q (b, h, T, d) and the chunk's new cache frames [k | v] (b, h, T, 2d)."""
        return self._normed(*self.project(x))

    def _normed(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's q, k, v (b, T, h * d) -> q (b, h, T, d) and [k | v] (b, h, T, 2d)."""
        return self.q_norm(self._heads(q)), torch.cat([self.k_norm(self._heads(k)), self._heads(v)], dim=-1)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q (b, h, T, d) attends to every frame of kv (b, h, S, 2d) -> (b, T, dim)."""
        b, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(q, *parts(kv, 2, -1))
        return self.proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward(self, x: torch.Tensor, att_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (b, T, dim); att_cache: (b, h, L, 2d) = [k | v] -> out (b, T, dim), cache (b, h, T+L, 2d).

        Upstream order: the chunk's keys come FIRST, then the cache; the chunk attends to all of
        it without a mask.

        The new cache is built by one concatenation, and attention reads its keys and values as
        views of it. (Eagerly, concatenating keys and values separately and then [k | v] again
        passed over the cache three times per block-step; Inductor had already fused those into
        one pass, so engines gained nothing: benchmarks/h200/README.md, run 5a.)
        """
        q, new = self._chunk(x)
        kv = torch.cat([new, att_cache], dim=2)                                   # (b, h, T+L, 2d)
        return self._attend(q, kv), kv

    def forward_in_place(self, x: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`forward` with the cache updated in place: kv (b, h, S, 2d) holds the cache's frames in
        any of its S slots; the chunk's T frames are written into the slots `slots` (T,) int64,
        and the chunk attends to all S. -> out (b, T, dim).

        Attention without a mask or positions does not depend on the order of its keys, so
        where the frames sit changes nothing but rounding; only the trim, which keeps frames by
        their place in upstream's order, needs to know it, and the caller keeps that order
        (runtime.ring.RingCache). Nothing is concatenated or copied: the chunk's frames are the
        only cache values written (design note 21).

        On CUDA the q/k norms and the cache write are one Triton kernel
        (triton_kernels.attention_inputs, same values): Inductor's build of the ops below runs
        four kernels and a copy of attention's output per block and step (design note 23). In
        float16, attention itself is a Triton kernel too (triton_kernels.attention, the same
        function up to rounding), reading q and the cache where they lie."""
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        kernels = triton_kernels_for(x)
        if kernels is not None and kernels.fits(qkv, kv, slots, self.q_norm, self.k_norm):
            q = kernels.attention_inputs(qkv, self.q_norm.weight, self.q_norm.bias, float(self.q_norm.eps),
                                         self.k_norm.weight, self.k_norm.bias, float(self.k_norm.eps), kv, slots)
            if kernels.attention_fits(q, kv):
                return self.proj(kernels.attention(q, kv).flatten(2))
            return self._attend(q.transpose(1, 2), kv)
        q, new = self._normed(*parts(qkv, 3, -1))
        kv.index_copy_(2, slots, new)
        return self._attend(q, kv)


class CausalConvBlock(nn.Module):
    """conv(k=3, causal) -> LayerNorm -> Mish -> conv(k=3, causal), each conv with a 2-frame cache.

    Indices 1, 3 and 6 of `block` hold the parameters so that keys match upstream
    (`conv.block.1`, `conv.block.3`, `conv.block.6`); the other slots are placeholders.

    Each k=3 convolution runs as ONE matrix product in the (b, T, c) layout the rest of the block
    uses, not as a cuDNN convolution: on the H200, cuDNN converted input and weight to NHWC on
    every call, and the two convolutions took 37 % of the B=1 CFM's kernel time
    (benchmarks/h200/README.md). The product is over the input rows as they are, against the k
    taps' weights side by side; the taps' outputs are then summed, shifted (`conv_by_product`). Same
    function, same parameters.

    The taps' weights one after the other are a view when each conv weight keeps upstream's shape
    (c_out, c_in, k) but is STORED in (k, c_out, c_in) memory order (`taps_outer_`), so there is
    no weight copy per call. `load_state_dict`, `.to()` and `.half()` keep that order
    (`assign=True` does not). Eagerly, a weight in another order only costs a copy per call; an
    AOTI package, which binds weights by pointer, records the order it was built for and refuses
    another (runtime/engines/aoti.py).
    """

    def __init__(self, channels: int, kernel: int = 3):
        super().__init__()
        self.channels, self.context = channels, kernel - 1
        self.block = nn.Sequential(
            nn.Identity(), nn.Conv1d(channels, channels, kernel), nn.Identity(),
            nn.LayerNorm(channels), nn.Mish(), nn.Identity(),
            nn.Conv1d(channels, channels, kernel), nn.Identity(),
        )
        for i in (1, 6):
            taps_outer_(self.block[i])

    def second_taps(self, kernels, x: torch.Tensor, cnn_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to its second convolution's product, with c2w's Triton kernel after the
        first (triton_kernels.conv_norm_mish) -> that product's taps (`conv_taps`), the new cache."""
        c1, c2 = parts(cnn_cache, 2, 1)
        h = torch.cat([c1.transpose(1, 2), x], dim=1)
        new1 = h[:, -self.context:]
        conv, norm = self.block[1], self.block[3]
        h = kernels.conv_norm_mish(conv_taps(conv, h), conv.bias, norm.weight, norm.bias, float(norm.eps), c2)
        new2 = h[:, -self.context:]
        return conv_taps(self.block[6], h), torch.cat([new1, new2], dim=2).transpose(1, 2)

    def forward(self, x: torch.Tensor, cnn_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (b, T, c); cnn_cache: (b, 2c, 2) -> y (b, T, c), new cache (b, 2c, 2)."""
        c1, c2 = parts(cnn_cache, 2, 1)                                         # (b, c, 2) each
        h = torch.cat([c1.transpose(1, 2), x], dim=1)                           # (b, T + 2, c)
        new1 = h[:, -self.context:]
        h = self.block[4](self.block[3](conv_by_product(self.block[1], h)))
        h = torch.cat([c2.transpose(1, 2), h], dim=1)
        new2 = h[:, -self.context:]
        return conv_by_product(self.block[6], h), torch.cat([new1, new2], dim=2).transpose(1, 2)


class MLP(nn.Module):
    """fc1 -> GELU (tanh form) -> fc2.

    On CUDA, fc1's bias and GELU run in the product's cuBLASLt epilogue (`torch._addmm_activation`,
    whose CUDA kernel computes the tanh form; AOTInductor keeps it as one cuBLAS call): one kernel
    where Inductor otherwise writes the product and reads it back in a GELU kernel. Measured on the
    H200 depth-2 proxy (benchmarks/h200/README.md, run 15): B=32 T=150 11.80 -> 11.56 ms per solve,
    B=1 unchanged, mel SNR unchanged. On the CPU the same op computes the erf form, so the CPU, and
    an ONNX export, keep the two ops.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the epilogue computes the tanh form only: any other activation takes the two ops
        if x.is_cuda and self.act.approximate == "tanh" and not torch.onnx.is_in_onnx_export():
            h = torch._addmm_activation(self.fc1.bias, x.flatten(0, -2), self.fc1.weight.t(), use_gelu=True)
            return self.fc2(h.unflatten(0, x.shape[:-1]))
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.hidden
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, cfg.heads, cfg.head_dim)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(d, int(d * cfg.mlp_ratio))
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(d)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 9 * d))

    def modulated(self, x, mod, cnn_cache, att_cache, att_slots=None):
        """x: (b, T, d); mod: its adaLN modulation (1 or b, 1, 9 d), from `DiT.modulation`;
        caches as in Attention / CausalConvBlock. With `att_slots`, att_cache is updated in place
        (Attention.forward_in_place) and returned as the new cache."""
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = parts(mod, 9, -1)
        h = modulate(self.norm1(x), shift_msa, scale_msa)
        if att_slots is None:
            a, new_att = self.attn(h, att_cache)
        else:
            a, new_att = self.attn.forward_in_place(h, att_cache, att_slots), att_cache
        x = x + gate_msa * a
        # c2w's Triton kernels serve the in-place step (AOTI's); the other forms keep the ops
        kernels = triton_kernels_for(x) if att_slots is not None else None
        conv_in = modulate(self.norm3(x), shift_conv, scale_conv)
        if kernels is not None and kernels.conv_fits(conv_in, mod, cnn_cache, self.conv, self.norm2):
            taps, new_cnn = self.conv.second_taps(kernels, conv_in, cnn_cache)
            d = x.shape[-1]
            x, h = kernels.conv_residual_norm(taps, self.conv.block[6].bias, x, mod, 8 * d, 3 * d, 4 * d,
                                              float(self.norm2.eps))
        else:
            c, new_cnn = self.conv(conv_in, cnn_cache)
            x = x + gate_conv * c
            h = modulate(self.norm2(x), shift_mlp, scale_mlp)
        x = x + gate_mlp * self.mlp(h)
        return x, new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, out_channels)

    def modulated(self, x, mod):
        """The layer given its adaLN modulation `mod` (1 or b, 1, 2 d)."""
        shift, scale = parts(mod, 2, -1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """The velocity estimator. Parameter names match upstream `decoder.estimator.*`."""

    def __init__(self, cfg: DiTConfig, out_channels: int = 80):
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden, cfg.freq_embed)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden)
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg.hidden, out_channels)

    def forward(self, h_in: torch.Tensor, t, cnn_cache: torch.Tensor, att_cache: torch.Tensor):
        """One velocity evaluation.

        h_in: (2B, 320, T) = [x ; mu ; spk ; cond] channels, in the weights' dtype
        t: the time, a Python float or a (1,) float32 tensor (the solver does not call this: it
           looks the modulation of its steps up in a table, `modulated`)
        cnn_cache: (depth, 2B, 2*hidden, 2); att_cache: (depth, 2B, heads, L, 2*head_dim)
        -> v (2B, 80, T), new cnn cache (depth, 2B, 2*hidden, 2), new att cache (depth, 2B, heads, T+L, 2*head_dim)
        """
        if not isinstance(t, torch.Tensor):
            t = torch.full((1,), t, dtype=torch.float32, device=h_in.device)
        return self.modulated(h_in, self.modulation(t), cnn_cache, att_cache)

    def modulation(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) float32 times -> (N, depth * 9 * hidden + 2 * hidden): every block's adaLN
        modulation, then the final layer's. It depends on t alone (the speaker enters through the
        input), so a solve with a fixed schedule computes it once (CFMSolver.modulation_table)."""
        temb = self.t_embedder(t)
        mods = [block.adaLN_modulation(temb) for block in self.blocks] + [self.final_layer.adaLN_modulation(temb)]
        return torch.cat(mods, dim=-1)

    def modulated(self, h_in: torch.Tensor, mod: torch.Tensor, cnn_cache: torch.Tensor, att_cache, att_slots=None):
        """`forward` given the modulation of its time (1, depth * 9 * hidden + 2 * hidden).
        att_slots: update the attention caches in place (Attention.forward_in_place): att_cache is
        then a sequence of depth buffers (2B, heads, S, 2*head_dim), one per block (per-block
        tensors: a compiled step writes each where it is, where slices of one stacked input would
        be rebuilt), the chunk's frames go to slots `att_slots` (T,) int64 of each, and the
        returned attention cache is None."""
        width = 9 * self.cfg.hidden
        mod = mod.unsqueeze(1)
        x = self.in_proj(h_in.transpose(1, 2))
        cnns, atts = [], []
        for i, block in enumerate(self.blocks):
            x, c, a = block.modulated(x, mod.narrow(-1, i * width, width), cnn_cache[i], att_cache[i], att_slots)
            cnns.append(c)
            atts.append(a)
        final = mod.narrow(-1, len(self.blocks) * width, 2 * self.cfg.hidden)
        v = self.final_layer.modulated(x, final).transpose(1, 2)
        return v, torch.stack(cnns), None if att_slots is not None else torch.stack(atts)


class CFMSolver(nn.Module):
    """The whole n-step Euler solve with classifier-free guidance (one exported unit).

    Holds references to the estimator and the speaker projection of a FlowModel (no copies).
    Rows [0, B) of every estimator cache are the conditional half, rows [B, 2B) the
    unconditional one (mu, spk and cond zeroed), as upstream lays them out.
    """

    def __init__(self, estimator: DiT, spk_affine: nn.Linear, cfg: ModelConfig):
        super().__init__()
        self.estimator = estimator
        self.spk_embed_affine_layer = spk_affine
        self.cfg_rate = cfg.cfg_rate
        self.ts, self.dts = euler_schedule(cfg.n_timesteps)
        # the estimator's adaLN modulation at each step's time, computed once from the weights as
        # they are now (a solver is built from a ready model; rebuild it if the weights change)
        w = estimator.in_proj.weight
        with torch.no_grad():
            table = estimator.modulation(torch.tensor(self.ts, dtype=torch.float32, device=w.device))
        self.register_buffer("modulation_table", table, persistent=False)

    def step(self, mu, spk, cond, x, cnn_cache, att_cache, s, dt, att_slots=None):
        """Euler step `s` with guidance: x (B, 80, T) float32 -> x + dt * v_guided.

        mu, cond: (B, 80, T) float32; spk: (B, 192) float32 raw embedding; caches of THIS step:
        cnn (depth, 2B, 2*hidden, 2), att (depth, 2B, heads, L, 2*head_dim); s: the step's index, a
        Python int or a (1,) int64 tensor (one compiled step serves all of them); dt: a Python
        float or a (1,) float32 tensor. -> (x_next, new cnn cache, new att cache (depth, 2B, heads,
        T + L, 2*head_dim)). With att_slots the attention caches are updated in place, att_cache
        being the depth per-block buffers, and the third result is None (DiT.modulated).
        """
        wdtype = self.estimator.in_proj.weight.dtype
        T = mu.shape[2]
        spk = self.spk_embed_affine_layer(F.normalize(spk, dim=1).to(wdtype))        # (B, 80)
        zeros = torch.zeros_like(mu, dtype=wdtype)
        xw = x.to(wdtype)
        h_in = torch.cat([
            torch.cat([xw, xw], 0),
            torch.cat([mu.to(wdtype), zeros], 0),
            torch.cat([spk, torch.zeros_like(spk)], 0).unsqueeze(-1).expand(-1, -1, T),
            torch.cat([cond.to(wdtype), zeros], 0),
        ], dim=1)                                                                     # (2B, 320, T)
        table = self.modulation_table
        mod = table.narrow(0, s, 1) if isinstance(s, int) else table.index_select(0, s)
        v, c, a = self.estimator.modulated(h_in, mod, cnn_cache, att_cache, att_slots)
        v_cond, v_uncond = parts(v.float(), 2, 0)
        return x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond), c, a

    def forward(self, mu, spk, cond, x0, cnn_cache, att_cache):
        """mu, cond, x0: (B, 80, T) float32; spk: (B, 192) float32 (raw CAM++ embedding);
        cnn_cache: (steps, depth, 2B, 2*hidden, 2), att_cache: (steps, depth, 2B, heads, L, 2*head_dim)
        in the weights' dtype.
        -> mel (B, 80, T) float32, new cnn cache, new att cache (steps, depth, 2B, heads, T+L, 2*head_dim).
        """
        x = x0.float()
        cnns, atts = [], []
        for s, dt in enumerate(self.dts):
            x, c, a = self.step(mu, spk, cond, x, cnn_cache[s], att_cache[s], s, dt)
            cnns.append(c)
            atts.append(a)
        return x, torch.stack(cnns), torch.stack(atts)
