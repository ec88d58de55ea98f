"""The attention-inputs kernel (runtime/model/triton_kernels.py) alone, per launch, against the
ops it replaces as Inductor builds them, at the served CFM keys' shapes.

Per shape (fp16; B=1: 2 rows of CFG x T=50 frames, a 350-slot ring; B=32: 64 x 150, 550 slots):
the reference (q/k LayerNorms, [k | v], index_copy_ into the ring, and q's copy to (b, T, h d)
that the kernel's layout saves) compiled by torch.compile, and the kernel at each tile of a small
grid (rows per program x warps). Each form is launched 20 times in one CUDA graph, replayed 15
times (fused_tiles.graphed_us; run 25 replayed 20): microseconds per launch, median. Every kernel result is checked against the reference
(float16: 2e-3). Usage (device): python3 benchmarks/h200/attention_inputs.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.fused_tiles import graphed_us  # noqa: E402
from c2w.runtime.model import triton_kernels  # noqa: E402
from c2w.runtime.model.dit import Attention  # noqa: E402

SHAPES = {"B=1": (2, 50, 350), "B=32": (64, 150, 550)}
TILES = [(rows, warps) for rows in (8, 16, 32, 64) for warps in (1, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    attn = Attention(512, 8, 64).to(dev, torch.float16)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    heads, head_dim = attn.heads, attn.head_dim

    def reference(qkv, kv, slots):
        q, new = attn._normed(*qkv.chunk(3, -1))
        kv.index_copy_(2, slots, new)
        return q.transpose(1, 2).contiguous()            # what attention's output copy costs today
    compiled = torch.compile(reference)

    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "shapes": {}}
    for name, (b, frames, slots_n) in SHAPES.items():
        qkv = torch.randn(b, frames, 3 * heads * head_dim, device=dev, dtype=torch.float16) * 2
        kv = torch.randn(b, heads, slots_n, 2 * head_dim, device=dev, dtype=torch.float16)
        slots = torch.randperm(slots_n, device=dev)[:frames]
        want_kv = kv.clone()
        want_q = compiled(qkv, want_kv, slots)
        row = {"reference_us": graphed_us(lambda: compiled(qkv, kv, slots)), "tiles": {}}
        for rows, warps in TILES:
            triton_kernels._ROWS, triton_kernels._WARPS = rows, warps
            got_kv = kv.clone()
            with torch.no_grad():
                got_q = triton_kernels.attention_inputs(qkv, attn.q_norm.weight, attn.q_norm.bias, attn.q_norm.eps,
                                                        attn.k_norm.weight, attn.k_norm.bias, attn.k_norm.eps,
                                                        got_kv, slots)
            right = (torch.allclose(got_q.float(), want_q.float(), atol=2e-3, rtol=2e-3)
                     and torch.allclose(got_kv.float(), want_kv.float(), atol=2e-3, rtol=2e-3))
            us = graphed_us(lambda: triton_kernels.attention_inputs(
                qkv, attn.q_norm.weight, attn.q_norm.bias, attn.q_norm.eps,
                attn.k_norm.weight, attn.k_norm.bias, attn.k_norm.eps, kv, slots))
            row["tiles"][f"{rows}x{warps}"] = {"us": us, "right": right}
        best = min(row["tiles"], key=lambda t: row["tiles"][t]["us"])
        row["best"] = best
        result["shapes"][name] = row
        print(f"{name}: reference {row['reference_us']:.2f} us; " + ", ".join(
            f"{t} {v['us']:.2f}{'' if v['right'] else ' WRONG'}" for t, v in row["tiles"].items()) + f"; best {best}")
    Path(args.out, "attention_inputs.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
