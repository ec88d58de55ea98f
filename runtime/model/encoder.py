"""Streaming Conformer flow encoder (speech-token embeddings -> 50 Hz hidden states), export-friendly.

Same maths and same state-dict names as step-audio2's `UpsampleConformerEncoderV2` (the `encoder.`
part of `flow.pt`), rewritten so one streaming step is a pure function of its inputs:

    h, cnn_cache, att_cache = encoder.forward_chunk(xs, cnn_cache, att_cache, last_chunk)

No state lives in the module between calls, nothing is written in place, and every Python branch
depends only on shapes or on `last_chunk` (a static property of the export key), so
`torch.export` and the ONNX exporter see one straight-line graph per exact shape.

Pipeline of one chunk (B streams, N tokens of which the last `pre_lookahead` are right context):

    xs (B, N, D) -> Linear+LayerNorm, *sqrt(D)                                   "embed"
       [last chunk: + `pre_lookahead` zero frames]
    -> lookahead conv (k=pre_lookahead+1, valid) -> leaky ReLU -> causal conv (k=3, 2 cached frames)
       + residual                                    -> (B, T1, D), T1 = N - 3 (or N when last)
    -> `blocks` rel-pos Conformer blocks (attention over [cache C/2 ; T1])
    -> nearest x`stride` upsample -> causal conv (k=2*stride+1, 2*stride cached frames)
    -> Linear+LayerNorm, *sqrt(D)                                                "up_embed"
    -> `up_blocks` rel-pos Conformer blocks (attention over [cache C ; T]), T = stride*T1
    -> LayerNorm                                                                 -> h (B, T, D)

The relative position table (1, 10006, D) fp32 is a non-persistent buffer; an exported graph carries
it whole as a constant (20.5 MB at D=512) and slices it with static bounds.

Cache layouts (kept bit-for-bit as upstream lays them out, so caches are interchangeable):
    cnn_cache (B, D, 2 + 2*stride): [lookahead conv tail (2) | upsample conv tail (2*stride)]
    att_cache (blocks + up_blocks, B, heads, C, 2*d_k): keys in [..., :d_k], values in [..., d_k:].
        The second stack runs at 50 Hz and uses all C frames. The first stack runs at 25 Hz and has
        only C/2 frames; upstream stores them tiled twice along time ([a ; a]) so that both stacks
        share one tensor, and reads back the first C/2. C is therefore always even.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from c2w.runtime.errors import C2WUserError, check_shape
from c2w.runtime.model.config import EncoderConfig
from c2w.runtime.model.dit import PackedQKV, conv_by_product, taps_outer_

# espnet's relative positional table covers relative offsets -(MAX_POS-1) .. +(MAX_POS-1); upstream
# builds it once for 5000 positions and never grows it in the streaming path, so neither do we.
MAX_POS = 5000
# The position scores' width (table rows read) is rounded up to a multiple of this many columns, so
# that the scores' rows start 16-byte aligned in float16 and every matrix-product library takes its
# aligned kernels; the spare rows are never read back (_align_relative). The table holds that many
# extra rows past -(MAX_POS-1) so the widest window still fits.
POSITION_ALIGN = 8
_LOOKAHEAD_CONV_CACHE = 2      # conv2 of the lookahead layer has kernel 3: 2 frames of history


def position_rows(queries: int, keys: int) -> int:
    """The table rows a block's position term reads for `queries` frames against `keys` keys:
    queries + keys - 1 rounded up to a multiple of POSITION_ALIGN (ints, or expressions of the
    dynamic dims in a dynamic export)."""
    return (queries + keys - 1 + POSITION_ALIGN - 1) // POSITION_ALIGN * POSITION_ALIGN


def relative_position_table(d_model: int, max_len: int = MAX_POS, spare: int = 0) -> torch.Tensor:
    """espnet "new-style" relative sinusoid table, with `spare` rows more on the negative side:
    (1, 2*max_len - 1 + spare, d_model) float32.

    Row r holds relative position `max_len - 1 - r`, i.e. +max_len-1 first, 0 at the centre row
    (index max_len - 1), -(max_len-1+spare) last. Interleaved sin (even channels) / cos (odd
    channels). Computed with the same float32 op order as upstream, so rows of the positions its
    table covers match it exactly.
    """
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pos = torch.arange(max_len - 1, -max_len - spare, -1, dtype=torch.float32).unsqueeze(1)  # +L-1 .. -(L-1+spare)
    # sin(-x) and cos(-x) are computed from the negated argument (as upstream does), not by symmetry.
    angle = pos * inv_freq                                                    # (rows, d/2)
    table = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1)         # (rows, d/2, 2)
    return table.reshape(1, 2 * max_len - 1 + spare, d_model)


class _Projection(nn.Module):
    """Linear -> LayerNorm(eps 1e-5) -> * sqrt(D). `out.0` / `out.1` match upstream's Sequential."""

    def __init__(self, width: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, eps=1e-5))
        self.scale = math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class _LookaheadConv(nn.Module):
    """Right-context conv over `lookahead` future tokens, then a causal k=3 conv, plus residual.

    Both convolutions run as one matrix product each in the (B, T, D) layout of the blocks around
    them (dit.conv_by_product, weights stored taps-outer), as the DiT's do: as cuDNN convolutions
    over (B, D, T) they took two layout conversions each per call."""

    def __init__(self, width: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(width, width, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=_LOOKAHEAD_CONV_CACHE + 1)
        taps_outer_(self.conv1)
        taps_outer_(self.conv2)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, N, D) with the lookahead frames at the end; cache: (B, D, 2).
        Returns (B, N - lookahead, D) and the new cache (B, D, 2).

        The new cache is the tail of [old cache ; new conv1 frames]. Upstream takes the tail of the
        new frames alone; the two agree whenever a chunk emits >= 2 frames, and for a 1-frame chunk
        upstream would return a malformed (B, D, 1) cache."""
        a = F.leaky_relu(conv_by_product(self.conv1, x), negative_slope=0.01)   # (B, N - lookahead, D)
        a = torch.cat([cache.transpose(1, 2), a], dim=1)
        new_cache = a[:, a.shape[1] - _LOOKAHEAD_CONV_CACHE:].transpose(1, 2)
        y = conv_by_product(self.conv2, a)                                      # (B, N - lookahead, D)
        return y + x[:, : x.shape[1] - self.lookahead], new_cache


class _Upsample(nn.Module):
    """Nearest-neighbour x`stride` repeat, then a causal conv of kernel 2*stride+1 (one product in
    the (B, T, D) layout, as _LookaheadConv's)."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(width, width, kernel_size=2 * stride + 1)
        taps_outer_(self.conv)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T1, D); cache: (B, D, 2*stride) of already-upsampled frames.
        Returns (B, stride*T1, D) and the new cache."""
        b, t, d = x.shape
        # repeat-each-frame as expand+reshape: exact, and lowers to plain Expand/Reshape (no Resize).
        up = x.unsqueeze(2).expand(b, t, self.stride, d).reshape(b, t * self.stride, d)
        up = torch.cat([cache.transpose(1, 2), up], dim=1)
        keep = 2 * self.stride
        return conv_by_product(self.conv, up), up[:, up.shape[1] - keep:].transpose(1, 2)


# From this many rows (batch x queries) a block attends in one fused call, the position scores
# its additive mask; below, as upstream writes it: two score products, their sum's softmax, the
# product with the values. Same values up to rounding. Measured as float16 AOTI engines on the H200
# (benchmarks/h200/README.md, run 20c): B=32 N=78 C=400 (2,400 and 4,800 rows) 3.67 -> 2.81 ms;
# B=1 N=28 C=300 (25 and 50 rows) 0.75 -> 0.79 ms. No size in between was measured.
FUSED_ATTENTION_ROWS = 512


class _RelPosSelfAttention(PackedQKV):
    """Transformer-XL style self-attention with espnet relative positions and a key/value cache.

    score(i, j) = [(q_i + u) . k_j + (q_i + v) . P(pos_i - pos_j)] / sqrt(d_k), where P is the
    sinusoid table through `linear_pos` (no bias) and u, v are the learned per-head biases.
    The softmax over keys and the product with the values follow; from FUSED_ATTENTION_ROWS rows
    the content term, the softmax and that product are one fused attention call. q, k and v come
    from one matrix product over upstream's three layers (PackedQKV), as in the DiT.
    """

    QKV = ("linear_q", "linear_k", "linear_v")

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.d_k = heads, width // heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)          # upstream key_bias=True
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pack_qkv()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.d_k).transpose(1, 2)           # (B, H, t, d_k)

    def _position_scores(self, q_rows: torch.Tensor, rel_pos: torch.Tensor) -> torch.Tensor:
        """(q + v) . P for q_rows (B, T, D) against the table rows rel_pos (1, W, D) -> (B, H, T, W).

        One product per head over all B x T query rows (the queries laid out heads-outer), so the
        projected table is read where it is rather than copied once per sequence, as a product
        broadcast along the batch is handed to the library."""
        b, t, _ = q_rows.shape
        qv = (q_rows.reshape(b, t, self.heads, self.d_k) + self.pos_bias_v)             # (B, T, H, d_k)
        qv = qv.permute(2, 0, 1, 3).reshape(self.heads, b * t, self.d_k)
        p = self.linear_pos(rel_pos).reshape(-1, self.heads, self.d_k).permute(1, 2, 0)  # (H, d_k, W)
        return torch.matmul(qv, p).reshape(self.heads, b, t, -1).transpose(0, 1)

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, cache: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, D) queries (already normalised); cache: (B, H, C, 2*d_k) or None;
        rel_pos: (1, W, D) table rows for relative positions +(C+T-1) down, W >= C + 2T - 1
        (ConformerEncoder._rel_pos). Returns (B, T, D) and the new cache (B, H, C + T, 2*d_k)."""
        b, t, d = x.shape
        rows = self.project(x)
        q, k, v = (self._heads(y) for y in rows)
        if cache is not None:
            k = torch.cat([cache[..., : self.d_k], k], dim=2)
            v = torch.cat([cache[..., self.d_k:], v], dim=2)
        new_cache = torch.cat([k, v], dim=3)
        s = k.shape[2]                                                          # keys: C + T

        position = _align_relative(self._position_scores(rows[0], rel_pos), s)   # (B,H,T,S)
        q_u = q + self.pos_bias_u.unsqueeze(1)
        if b * t >= FUSED_ATTENTION_ROWS:       # its scale, 1/sqrt(d_k), applies to q_u . k only
            y = F.scaled_dot_product_attention(q_u.contiguous(), k, v, attn_mask=position / math.sqrt(self.d_k))
        else:
            content = torch.matmul(q_u, k.transpose(2, 3))                      # (B,H,T,S)
            y = torch.matmul(torch.softmax((content + position) / math.sqrt(self.d_k), dim=-1), v)
        return self.linear_out(y.transpose(1, 2).reshape(b, t, d)), new_cache


def _align_relative(scores: torch.Tensor, keys: int) -> torch.Tensor:
    """(B, H, T, W) scores against relative rows -> (B, H, T, S) scores against keys, S = `keys`.

    Column r holds relative offset (S-1) - r, for W >= T+S-1 columns (those past T+S-1, the
    alignment's spare rows, are never read). Query i sits at absolute position S-T+i, so key j
    needs r = T-1-i+j: each row shifts left by one more than the row above it. Done with the
    pad/flatten/re-slice skew (pure Pad/Reshape/Slice, no gather): after padding one column in
    front, row stride is W+1, and element (i, j) of the result is flat index T + i*W + j of the
    padded buffer, i.e. row i, column T-i+j. (The same skew without the pad, from flat index T-1
    in rows of W-1, makes torch.export add guards on the encoder's dynamic dims.)
    """
    b, h, t, w = scores.shape
    flat = F.pad(scores, (1, 0)).reshape(b, h, t * (w + 1))
    return flat[:, :, t: t + t * w].reshape(b, h, t, w)[..., :keys]


class _FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(width, hidden)
        self.w_2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class _ConformerBlock(nn.Module):
    """Pre-norm block: x + MHA(LN(x)); x + FFN(LN(x)). No conv module, no macaron FFN (as upstream)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self_attn = _RelPosSelfAttention(cfg.width, cfg.heads)
        self.feed_forward = _FeedForward(cfg.width, cfg.ffn)
        self.norm_ff = nn.LayerNorm(cfg.width, eps=1e-12)
        self.norm_mha = nn.LayerNorm(cfg.width, eps=1e-12)

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, cache: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        a, new_cache = self.self_attn(self.norm_mha(x), rel_pos, cache)
        x = x + a
        x = x + self.feed_forward(self.norm_ff(x))
        return x, new_cache


class ConformerEncoder(nn.Module):
    """The flow encoder. `state_dict()` keys equal upstream `UpsampleConformerEncoderV2`'s.

    `forward` is `forward_chunk`, so `torch.export.export(encoder, (xs, cnn, att), {"last_chunk": b})`
    and thin wrappers both work.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.width % cfg.heads:
            raise C2WUserError("encoder config", f"width {cfg.width}, heads {cfg.heads}",
                               "width divisible by heads")
        if cfg.up_stride != 2:
            # The shared att cache tiles the first stack's frames exactly twice, which only lines up
            # with the second stack's frame count when the upsample rate is 2.
            raise C2WUserError("encoder config", f"up_stride {cfg.up_stride}", "up_stride 2")
        self.cfg = cfg
        self.embed = _Projection(cfg.width)
        self.pre_lookahead_layer = _LookaheadConv(cfg.width, cfg.pre_lookahead)
        self.encoders = nn.ModuleList(_ConformerBlock(cfg) for _ in range(cfg.blocks))
        self.up_layer = _Upsample(cfg.width, cfg.up_stride)
        self.up_embed = _Projection(cfg.width)
        self.up_encoders = nn.ModuleList(_ConformerBlock(cfg) for _ in range(cfg.up_blocks))
        self.after_norm = nn.LayerNorm(cfg.width, eps=1e-5)
        # Not in flow.pt (upstream keeps it as a plain attribute): a non-persistent buffer so it
        # follows .to(device/dtype) without entering the state dict.
        self.register_buffer("pos_table", relative_position_table(cfg.width, spare=POSITION_ALIGN - 1),
                             persistent=False)

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def cnn_cache_frames(self) -> int:
        return _LOOKAHEAD_CONV_CACHE + 2 * self.cfg.up_stride

    @property
    def cache_layers(self) -> int:
        return self.cfg.blocks + self.cfg.up_blocks

    def output_frames(self, n_tokens: int, last_chunk: bool) -> int:
        """Frames of h for a chunk of `n_tokens` tokens (lookahead included)."""
        kept = n_tokens if last_chunk else n_tokens - self.cfg.pre_lookahead
        return self.cfg.up_stride * kept

    def att_cache_shape(self, batch: int, frames: int) -> tuple[int, int, int, int, int]:
        return (self.cache_layers, batch, self.cfg.heads, frames, 2 * self.cfg.d_k)

    def _att_shape_text(self, batch: int) -> str:
        return str(self.att_cache_shape(batch, 0)).replace(" 0,", " C,")

    def cnn_cache_shape(self, batch: int) -> tuple[int, int, int]:
        return (batch, self.cfg.width, self.cnn_cache_frames)

    def check_inputs(self, xs: torch.Tensor, cnn_cache: torch.Tensor | None,
                     att_cache: torch.Tensor | None, last_chunk: bool) -> None:
        """Raise C2WUserError for inputs `forward_chunk` cannot take. Cheap; call it from eager code,
        never inside the export path."""
        cfg = self.cfg
        if xs.dim() != 3 or xs.shape[2] != cfg.width:
            raise C2WUserError("tensor 'xs'", f"shape {tuple(xs.shape)}", f"shape (B, N, {cfg.width})")
        if not xs.is_floating_point():
            raise C2WUserError("tensor 'xs'", f"dtype {xs.dtype}", "a floating dtype (embedded tokens)")
        b, n = xs.shape[0], xs.shape[1]
        min_tokens = 1 if last_chunk else cfg.pre_lookahead + 1
        if n < min_tokens:
            raise C2WUserError("tensor 'xs'", f"{n} tokens",
                               f"at least {min_tokens} tokens ({cfg.pre_lookahead} of them lookahead)"
                               + ("" if last_chunk else " for a non-final chunk"))
        if cnn_cache is not None:
            check_shape("cnn_cache", cnn_cache, self.cnn_cache_shape(b), dtype=xs.dtype)
        frames = 0
        if att_cache is not None:
            if att_cache.dim() != 5:
                raise C2WUserError("tensor 'att_cache'", f"shape {tuple(att_cache.shape)}",
                                   f"shape {self._att_shape_text(b)} (5-D)")
            frames = att_cache.shape[3]
            if frames % 2:
                raise C2WUserError("tensor 'att_cache'", f"shape {tuple(att_cache.shape)} with odd C={frames}",
                                   f"shape {self._att_shape_text(b)} with C even",
                                   "The first-stack half of the cache is stored twice; pass caches "
                                   "returned by forward_chunk, trimmed by an even number of frames.")
            check_shape("att_cache", att_cache, self.att_cache_shape(b, frames), dtype=xs.dtype)
        total = frames + self.output_frames(n, last_chunk)
        if total > MAX_POS:
            raise C2WUserError("attention span", f"{frames} cached + {total - frames} new frames",
                               f"at most {MAX_POS} frames (the relative position table size)",
                               "Trim the attention cache.")

    # ---- compute ------------------------------------------------------------------------------
    def _rel_pos(self, queries: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Table rows for relative offsets +(keys-1) down, `position_rows(queries, keys)` of them:
        (1, W, D).

        Upstream slices the full +-(keys-1) window and discards the right part after its skew;
        rows below -(queries-1) are never read (_align_relative), so we project only the spare rows
        the alignment adds. Static ints (expressions of the dynamic dims in a dynamic export)."""
        start = MAX_POS - keys                  # the row of offset +(keys-1) (offset 0: MAX_POS - 1)
        return self.pos_table[:, start: start + position_rows(queries, keys)].to(dtype)

    def forward_chunk(self, xs: torch.Tensor, cnn_cache: torch.Tensor | None = None,
                      att_cache: torch.Tensor | None = None, last_chunk: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One streaming step.

        xs: (B, N, D) embedded speech tokens, the last `pre_lookahead` (3) being right context.
        cnn_cache: (B, D, 2 + 2*stride) or None (= zeros: start of stream).
        att_cache: (blocks + up_blocks, B, H, C, 2*d_k) with C even, or None (prompt setup, C = 0).
        last_chunk: static. True zero-pads the lookahead so every token is emitted.
        Returns h: (B, T, D) with T = stride*(N - pre_lookahead), or stride*N if last_chunk;
        new cnn_cache (B, D, 2 + 2*stride); new att_cache (blocks + up_blocks, B, H, C + T, 2*d_k).
        """
        cfg = self.cfg
        b = xs.shape[0]
        if cnn_cache is None:
            cnn_cache = xs.new_zeros(self.cnn_cache_shape(b))
        cnn1 = cnn_cache[:, :, :_LOOKAHEAD_CONV_CACHE]
        cnn2 = cnn_cache[:, :, _LOOKAHEAD_CONV_CACHE:]
        half = 0 if att_cache is None else att_cache.shape[3] // 2

        x = self.embed(xs)
        if last_chunk:
            x = F.pad(x, (0, 0, 0, cfg.pre_lookahead))
        x, new_cnn1 = self.pre_lookahead_layer(x, cnn1)                        # (B, T1, D)

        t1 = x.shape[1]
        rel_pos = self._rel_pos(t1, half + t1, x.dtype)
        first = []
        for i, block in enumerate(self.encoders):
            cache = None if att_cache is None else att_cache[i, :, :, :half]
            x, c = block(x, rel_pos, cache)
            first.append(c)

        x, new_cnn2 = self.up_layer(x, cnn2)
        x = self.up_embed(x)                                                    # (B, T, D)

        t = x.shape[1]
        rel_pos = self._rel_pos(t, 2 * half + t, x.dtype)                      # keys: C + T
        second = []
        for i, block in enumerate(self.up_encoders):
            cache = None if att_cache is None else att_cache[cfg.blocks + i]
            x, c = block(x, rel_pos, cache)
            second.append(c)
        h = self.after_norm(x)

        first_t = torch.stack(first, dim=0)                                     # (blocks, B, H, C/2 + T1, 2dk)
        # tile the 25 Hz half twice along time so it has as many frames as the 50 Hz half (C + T)
        new_att = torch.cat([torch.cat([first_t, first_t], dim=3), torch.stack(second, dim=0)], dim=0)
        return h, torch.cat([new_cnn1, new_cnn2], dim=2), new_att

    forward = forward_chunk
