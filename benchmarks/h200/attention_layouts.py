"""The DiT's attention call (cuDNN's fused kernel, as the engines run it) per memory layout of its
operands, at the served CFM keys' shapes: is the cache's [k | v] layout what holds it at ~170
TFLOP/s (benchmarks/h200/README.md, run 22a)?

Per shape (fp16, 8 heads x 64; B=1: 2 rows of CFG x T=50 queries over 350 cache slots; B=32:
64 x 150 over 550), the call `scaled_dot_product_attention(q, k, v)` with
  - kv_interleaved: k and v the two halves of one (b, h, S, 2d) cache (the model's layout), q in
    (b, T, h, d) memory viewed (b, h, T, d) (what the attention-inputs kernel gives);
  - kv_interleaved_q_bhtd: the same with q contiguous (b, h, T, d);
  - kv_planes: k and v each a contiguous (b, h, S, d) tensor;
  - kv_bshd: k and v each (b, S, h, d) memory viewed (b, h, S, d).
Each launched 20 times in one CUDA graph, replayed 15 times (fused_tiles.graphed_us; run 25
replayed 20): us per call (median) and TFLOP/s (4 b h T S d). Outputs checked against kv_interleaved's (float16: 2e-3).
Usage (device): python3 benchmarks/h200/attention_layouts.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.fused_tiles import graphed_us  # noqa: E402

SHAPES = {"B=1": (2, 50, 350), "B=32": (64, 150, 550)}
HEADS, HEAD_DIM = 8, 64


def layouts(b: int, t: int, s: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.float16, generator=g)
    q_bthd = randn(b, t, HEADS, HEAD_DIM)
    kv = randn(b, HEADS, s, 2 * HEAD_DIM)
    k, v = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    q = q_bthd.transpose(1, 2)
    return {
        "kv_interleaved": (q, k, v),
        "kv_interleaved_q_bhtd": (q.contiguous(), k, v),
        "kv_planes": (q, k.contiguous(), v.contiguous()),
        "kv_bshd": (q, k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "shapes": {}}
    with torch.inference_mode(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for name, (b, t, s) in SHAPES.items():
            flop = 4 * b * HEADS * t * s * HEAD_DIM
            forms = layouts(b, t, s, dev)
            want = F.scaled_dot_product_attention(*forms["kv_interleaved"]).float()
            row = {}
            for form, (q, k, v) in forms.items():
                got = F.scaled_dot_product_attention(q, k, v)
                us = graphed_us(lambda: F.scaled_dot_product_attention(q, k, v))
                row[form] = {"us": us, "tflops": flop / us / 1e6,
                             "right": bool(torch.allclose(got.float(), want, atol=2e-3, rtol=2e-3)),
                             "out_strides": list(got.stride())}
            res["shapes"][name] = row
            print(f"{name}: " + ", ".join(f"{f} {r['us']:.1f} us ({r['tflops']:.0f} TFLOP/s)"
                                          f"{'' if r['right'] else ' WRONG'}" for f, r in row.items()))
    Path(args.out, "attention_layouts.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
