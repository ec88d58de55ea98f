"""Floating-point operations of one call of a unit at a ShapeKey, from the model config alone.

Counted the way torch.utils.flop_counter counts them: 2 per multiply-add of every matrix product
and convolution (attention included), nothing for element-wise ops, norms and activations. The
planner's timing model without a calibration file is proportional to these counts
(exporter/traffic.py); tests/exporter/test_flops.py holds each formula to torch's counter.
"""
from __future__ import annotations

import math

from c2w.runtime.model.config import ModelConfig
from c2w.runtime.model.encoder import position_rows
from c2w.runtime.units import ShapeKey


def _linear(rows: int, n_in: int, n_out: int) -> int:
    return 2 * rows * n_in * n_out


def cfm_flops(cfg: ModelConfig, key: ShapeKey) -> int:
    """The 10-step solve: per step the DiT runs 2B rows (guidance) of T frames, attending to
    T + L keys; the timestep and adaLN projections run once per step on one row."""
    B, T, L = key.dim("B"), key.dim("T"), key.dim("L")
    d = cfg.dit
    inner, mlp = d.heads * d.head_dim, int(d.hidden * d.mlp_ratio)
    rows = 2 * B * T
    block = (_linear(rows, d.hidden, 3 * inner) + _linear(rows, inner, d.hidden)       # q k v, proj
             + 2 * 2 * (2 * B) * d.heads * T * (T + L) * d.head_dim                      # scores, values
             + 2 * _linear(2 * B * (T + 2), d.hidden, 3 * d.hidden)     # two k=3 convs: all taps over T + 2 rows
             + _linear(rows, d.hidden, mlp) + _linear(rows, mlp, d.hidden)
             + _linear(1, d.hidden, 9 * d.hidden))                                        # adaLN
    step = (_linear(rows, d.in_channels, d.hidden) + d.depth * block
            + _linear(1, d.freq_embed, d.hidden) + _linear(1, d.hidden, d.hidden)         # timestep MLP
            + _linear(1, d.hidden, 2 * d.hidden) + _linear(rows, d.hidden, cfg.mel_bins)  # final layer
            + _linear(B, cfg.spk_embed_dim, cfg.mel_bins))                                # speaker proj
    return cfg.n_timesteps * step


def _conformer_block(cfg: ModelConfig, B: int, queries: int, keys: int) -> int:
    """One rel-pos Conformer block: `queries` frames attending to `keys` (cache + themselves)."""
    e = cfg.encoder
    rows = B * queries
    rel = position_rows(queries, keys)                        # relative-position rows projected once
    return (4 * _linear(rows, e.width, e.width) + _linear(rel, e.width, e.width)
            + 2 * B * queries * (2 * keys + rel) * e.width   # content, position and value products
            + _linear(rows, e.width, e.ffn) + _linear(rows, e.ffn, e.width))


def flow_encoder_flops(cfg: ModelConfig, key: ShapeKey) -> int:
    """Embedding projection over N tokens, the lookahead convs, `blocks` blocks at 25 Hz over
    T1 = N - 3 (N when last) frames with C/2 cached, the x2 upsample conv and projection, `up_blocks`
    blocks at 50 Hz over T = 2 T1 with C cached, the projection to mel bins. Each conv of kernel k
    is one product of all its taps over its T + k - 1 input rows (dit.conv_by_product)."""
    B, N, C, last = key.dim("B"), key.dim("N"), key.dim("C"), key.dim("last")
    e = cfg.encoder
    t1 = N if last else N - e.pre_lookahead
    t = e.up_stride * t1
    k1, k_up = e.pre_lookahead + 1, 2 * e.up_stride + 1
    return (_linear(B * N, e.width, e.width)
            + _linear(B * (t1 + k1 - 1), e.width, k1 * e.width) + _linear(B * (t1 + 2), e.width, 3 * e.width)
            + e.blocks * _conformer_block(cfg, B, t1, C // 2 + t1)
            + _linear(B * (t + k_up - 1), e.width, k_up * e.width) + _linear(B * t, e.width, e.width)
            + e.up_blocks * _conformer_block(cfg, B, t, C + t)
            + _linear(B * t, e.width, cfg.mel_bins))


def _resblock(channels: int, kernel: int, dilations, positions: int) -> int:
    return 2 * len(dilations) * _linear(positions, channels * kernel, channels)


def hift_flops(cfg: ModelConfig, key: ShapeKey) -> int:
    """Proportional to B x F (the source cache only replaces samples): the f0 predictor and
    conv_pre at frame rate, then per upsampling stage its transposed conv, the source branch's
    down conv and ResBlock, and the decoder's ResBlocks, at that stage's rate; STFT, conv_post
    and ISTFT at the STFT frame rate."""
    B, F = key.dim("B"), key.dim("F")
    h = cfg.hift
    bins2 = h.n_fft + 2
    frames = B * F
    stft = frames * h.samples_per_frame // h.hop                   # STFT frames (+1 ignored)
    n = (_linear(frames, cfg.mel_bins * 3, h.f0_channels) + 4 * _linear(frames, h.f0_channels * 3, h.f0_channels)
         + _linear(frames, h.f0_channels, 1) + _linear(frames * h.samples_per_frame, h.nb_harmonics + 1, 1)
         + _linear(stft, h.n_fft, bins2) + _linear(frames, cfg.mel_bins * 7, h.base_channels))
    positions = frames
    for i, (rate, kernel) in enumerate(zip(h.upsample_rates, h.upsample_kernels)):
        c_in, c_out = h.base_channels // 2 ** i, h.base_channels // 2 ** (i + 1)
        n += _linear(positions, c_in * kernel, c_out)              # transposed conv, per input position
        positions *= rate
        stride = math.prod(h.upsample_rates[i + 1:])
        n += _linear(positions, bins2 * (1 if stride == 1 else 2 * stride), c_out)
        n += _resblock(c_out, h.source_resblock_kernels[i], h.source_resblock_dilations[i], positions)
        n += sum(_resblock(c_out, k, dl, positions) for k, dl in zip(h.resblock_kernels, h.resblock_dilations))
    c_last = h.base_channels // 2 ** len(h.upsample_rates)
    return n + _linear(positions, c_last * 7, bins2) + _linear(stft, bins2, h.n_fft)


FLOPS = {"cfm": cfm_flops, "flow_encoder": flow_encoder_flops, "hift": hift_flops}


def unit_flops(cfg: ModelConfig, key: ShapeKey) -> int:
    return FLOPS[key.component](cfg, key)
