"""The DiT attention's one call per block and step, under each of PyTorch's fused SDPA backends.

The estimator attends its chunk's T queries to [chunk | cache], T + L keys, with 8 heads of 64
(runtime.model.dit.Attention): q is a transposed (b, T, h, d) tensor, k and v are the two halves of
the (b, h, T + L, 2d) cache, as in the model. This times that call alone for each backend
that takes it (cuDNN, flash, memory-efficient), at the shapes of the CFM keys the bench serves,
replayed from a CUDA graph as an engine's are, and checks each against float32 math.

Usage (device): python3 benchmarks/h200/sdpa_backends.py --out $OUT   -> $OUT/sdpa_backends.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 8, 64
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
# (B, T, L) of the CFM keys in benchmarks/h200/h200_core.yaml that the bench's rows serve
SHAPES = ((1, 50, 300), (1, 56, 300), (8, 50, 400), (32, 50, 400), (32, 150, 400))


def inputs(B: int, T: int, L: int, device, dtype=torch.float16):
    rows = 2 * B                                    # the CFG halves
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, T, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g).transpose(1, 2)
    kv = torch.randn(rows, HEADS, T + L, 2 * HEAD_DIM, device=device, dtype=dtype, generator=g)
    return q, kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]


def time_us(fn, reps: int) -> float:
    """Mean GPU µs per call of `fn`, `reps` calls captured in one CUDA graph: at B=1 an eager call
    costs more on the host (cuDNN's ~30-60 µs) than on the GPU, which is not what an engine pays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for B, T, L in SHAPES:
        q, k, v = inputs(B, T, L, device)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flop = 4 * 2 * B * HEADS * T * (T + L) * HEAD_DIM
        row = {"B": B, "T": T, "L": L, "gflop": flop / 1e9}
        for name, backend in BACKENDS.items():
            with sdpa_kernel([backend]):
                try:
                    out = F.scaled_dot_product_attention(q, k, v)
                except RuntimeError as exc:          # the backend does not take these inputs
                    row[name] = {"error": str(exc).splitlines()[0][:200]}
                    continue
                us = time_us(lambda: F.scaled_dot_product_attention(q, k, v), args.reps)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row[name] = {"us": us, "tflops": flop / us / 1e6, "rel_l2_vs_fp32": err}
        rows.append(row)
    dev = torch.cuda.get_device_name(device)
    with open(os.path.join(args.out, "sdpa_backends.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{dev}, torch {torch.__version__}; us per call (TFLOP/s)")
    print("| B, T, L | " + " | ".join(BACKENDS) + " |")
    for r in rows:
        cells = [f"{r[n]['us']:.1f} ({r[n]['tflops']:.0f})" if "us" in r[n] else "n/a" for n in BACKENDS]
        print(f"| {r['B']}, {r['T']}, {r['L']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
