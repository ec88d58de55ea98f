"""The DiT's causal k=3 convolution block in several formulations, compiled by Inductor, timed.

Why: in the depth-2 CFM proxy at B=32 T=150 (results/run5_attn) one Inductor kernel per block and
step, `triton_poi_fused_cat_mish_select_slice_stack_transpose`, took 163 us: the shifted-frame
stack that feeds the block's second convolution, ~40 MB of traffic, i.e. ~0.25 TB/s (Inductor
tiled it over the k = 3 axis). This script times the whole CausalConvBlock (conv -> LayerNorm ->
Mish -> conv, 2-frame caches) at full width, fp16, for the CFM's row counts (2B = 2 and 64; T = 50
and 150), one formulation per row:
  shipped      runtime.model.dit.CausalConvBlock as it is: ONE product over all T + 2 rows against
               the three taps' weights side by side (a view of the tap-major weight), then each
               tap's outputs summed shifted by its offset (the model's form since run 17)
  tap_major    the frame product: frames (b, T, k * c), weight stored (c_out, k, c_in)
               (`frame_conv`; the model's form below 512 rows until run 17)
  per_tap      one product per tap over shifted views, weight slices read as strided views
               (`per_tap_conv`; the model's form from 512 rows on until run 17)
  chan_major   frames (b, T, c, k) = torch.stack(..., -1), contiguous weight: the form before
  stack_mid    frames torch.stack(..., -2), weight permuted once outside
  three_mm     three accumulated GEMMs over shifted views, weight slices made contiguous outside
  cudnn        F.conv1d in (b, c, T) layout (the form before the conv-as-GEMM change)
Usage (device): python3 benchmarks/h200/conv_variants.py [--out DIR]; prints a table, writes JSON.
(results/run5_conv/table.txt is from 7d084f7, where the block always took the frame product: its
`tap_major` row is this script's `tap_major` row; `per_tap` came later, and its `shipped` row is
this script's `tap_major`.)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.kernel_classes import profile_kernels  # noqa: E402
from c2w.exporter.bench.engines import timed  # noqa: E402
from c2w.runtime.model.dit import CausalConvBlock, parts  # noqa: E402


def _head(blk, x, cache):
    c1, c2 = parts(cache, 2, 1)
    h = torch.cat([c1.transpose(1, 2), x], dim=1)
    return c1, c2, h


def _tail(blk, h, y1, c2):
    h2 = torch.cat([c2.transpose(1, 2), blk.block[4](blk.block[3](y1))], dim=1)
    new = torch.cat([h[:, -2:], h2[:, -2:]], dim=2).transpose(1, 2)
    return h2, new


def stacked(blk, x, cache, pre, dim):
    def conv(i, h):
        t = h.shape[1] - 2
        frames = torch.stack([h.narrow(1, j, t) for j in range(3)], dim=dim)
        return F.linear(frames.flatten(2), pre[i], blk.block[i].bias)
    _, c2, h = _head(blk, x, cache)
    h2, new = _tail(blk, h, conv(1, h), c2)
    return conv(6, h2), new


def three_mm(blk, x, cache, pre):
    def conv(i, h):
        t = h.shape[1] - 2
        y = F.linear(h.narrow(1, 0, t), pre[i][0], blk.block[i].bias)
        for j in (1, 2):
            y = y + F.linear(h.narrow(1, j, t), pre[i][j])
        return y
    _, c2, h = _head(blk, x, cache)
    h2, new = _tail(blk, h, conv(1, h), c2)
    return conv(6, h2), new


def frame_conv(conv, h):
    """One product over the frames [t, t + k) side by side: (b, T, k * c) @ (c_out, k * c)."""
    k = conv.kernel_size[0]
    t = h.shape[1] - k + 1
    w = conv.weight.permute(0, 2, 1)                                            # (c_out, k, c_in), a view
    frames = torch.cat([h.narrow(1, j, t) for j in range(k)], dim=-1)
    return F.linear(frames, w.flatten(1), conv.bias)


def per_tap_conv(conv, h):
    """k products, one per tap, over shifted views of h, summed."""
    k = conv.kernel_size[0]
    t = h.shape[1] - k + 1
    w = conv.weight.permute(0, 2, 1)
    y = F.linear(h.narrow(1, 0, t), w[:, 0], conv.bias)
    for j in range(1, k):
        y = y + F.linear(h.narrow(1, j, t), w[:, j])
    return y


def cudnn(blk, x, cache):
    def conv(i, h):
        return F.conv1d(h.transpose(1, 2), blk.block[i].weight, blk.block[i].bias).transpose(1, 2)
    _, c2, h = _head(blk, x, cache)
    h2, new = _tail(blk, h, conv(1, h), c2)
    return conv(6, h2), new


def kernel_stats(fn, args) -> dict:
    """Kernels of one call, their summed µs and the three names that took longest (kernel_classes.py)."""
    prof = profile_kernels(lambda: fn(*args), top=3)
    return {"kernels": prof["kernels_per_solve"], "kernel_us": round(prof["kernel_ms_per_solve"] * 1e3, 1),
            "top": [{"us": round(k["ms"] * 1e3, 1), "name": k["name"][:70]} for k in prof["top"]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    c = 512
    blk = CausalConvBlock(c).to(dev).half().eval()
    pre_cm = {i: blk.block[i].weight.contiguous().flatten(1) for i in (1, 6)}
    pre_mid = {i: blk.block[i].weight.permute(0, 2, 1).reshape(c, -1).contiguous() for i in (1, 6)}
    pre_mm = {i: [blk.block[i].weight[:, :, j].contiguous() for j in range(3)] for i in (1, 6)}
    frames_only, per_tap = copy.deepcopy(blk), copy.deepcopy(blk)
    frames_only._conv, per_tap._conv = frame_conv, per_tap_conv
    variants = {
        "shipped": lambda x, k: blk(x, k),
        "tap_major": lambda x, k: frames_only(x, k),
        "per_tap": lambda x, k: per_tap(x, k),
        "chan_major": lambda x, k: stacked(blk, x, k, pre_cm, -1),
        "stack_mid": lambda x, k: stacked(blk, x, k, pre_mid, -2),
        "three_mm": lambda x, k: three_mm(blk, x, k, pre_mm),
        "cudnn": lambda x, k: cudnn(blk, x, k),
    }
    rows = []
    with torch.inference_mode():
        for rows_2b, t in ((2, 50), (64, 150)):
            x = torch.randn(rows_2b, t, c, device=dev, dtype=torch.float16)
            k = torch.randn(rows_2b, 2 * c, 2, device=dev, dtype=torch.float16) * 0.5
            ref = blk(x, k)
            for name, fn in variants.items():
                torch._dynamo.reset()
                comp = torch.compile(fn, fullgraph=True, dynamic=False)
                out = comp(x, k)
                err = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref))
                res = {"variant": name, "rows": rows_2b, "T": t, "max_abs_diff": err,
                       **timed(lambda: comp(x, k), dev, 5, a.reps), **kernel_stats(comp, (x, k))}
                rows.append(res)
                print(f"2B={rows_2b:3d} T={t:3d} {name:12s} {res['median_ms'] * 1e3:8.1f} us  "
                      f"kernels {res['kernels']:3d}  kernel time {res['kernel_us']:7.1f} us  diff {err:.1e}  "
                      f"top {res['top'][0]['us']:.1f} us {res['top'][0]['name']}", flush=True)
    Path(a.out, "conv_variants.json").write_text(json.dumps({"commit": os.environ.get("C2W_COMMIT", "unknown"),
                                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
