"""c2w's Triton attention kernel (runtime/model/triton_kernels.py, `attention`) per tile, against
cuDNN's fused attention as the engines call it, at the served CFM keys' shapes.

Per shape (float16, 8 heads x 64; B=1: 2 rows of CFG x T=50 queries over 350 cache slots; B=32:
64 x 150 over 550): q in (b, T, h, d) memory (as the attention-inputs kernel gives it), the cache
(b, h, S, 2d) = [k | v]. cuDNN's call takes q viewed (b, h, T, d) and the cache's two halves. Each
call is launched 20 times in one CUDA graph, replayed 15 times (fused_tiles.graphed_us): us per
call (median) and TFLOP/s (4 b h T S d). Every tile's output is checked against cuDNN's
(float16: 2e-3); a tile that does not compile (shared memory) is reported and skipped. Tiles are
tried in a fixed order per shape (QUERY_TILES, GRID) until `--seconds` is spent.
Usage (device): python3 benchmarks/h200/attention_kernel.py --out $OUT
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.fused_tiles import graphed_us  # noqa: E402
from c2w.runtime.model import triton_kernels  # noqa: E402

SHAPES = {"B=1": (2, 50, 350), "B=32": (64, 150, 550)}
HEADS, HEAD_DIM = 8, 64
# per shape, the query tiles likeliest to win first (B=1 has 16 (sequence, head) pairs: small
# query tiles give it more programs)
GRID = {"BLOCK_N": [64, 128, 32], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
QUERY_TILES = {"B=1": [16, 32, 64], "B=32": [64, 128, 32]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--seconds", type=float, default=60, help="per shape, for the tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "shapes": {}}
    chosen = triton_kernels.attention_tile
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        for name, (b, t, s) in SHAPES.items():
            flop = 4 * b * HEADS * t * s * HEAD_DIM
            q = torch.randn(b, t, HEADS, HEAD_DIM, device=dev, dtype=torch.float16, generator=g)
            kv = torch.randn(b, HEADS, s, 2 * HEAD_DIM, device=dev, dtype=torch.float16, generator=g)
            k, v = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2).float()
                cudnn = graphed_us(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v))
            row = {"cudnn_us": cudnn, "cudnn_tflops": flop / cudnn / 1e6, "tiles": [],    # the kernel's own tile:
                   "kernel_tile": dict(chosen(t, b * HEADS, triton_kernels.multiprocessors(dev)))}
            t0 = time.time()
            for values in itertools.product(QUERY_TILES[name], *GRID.values()):
                if time.time() - t0 > args.seconds:
                    break
                tile = dict(zip(["BLOCK_M", *GRID], values))
                triton_kernels.attention_tile = lambda *shape, tile=tile: tile
                try:
                    got = triton_kernels.attention(q, kv).float()
                    us = graphed_us(lambda: triton_kernels.attention(q, kv))
                except Exception as exc:                      # noqa: BLE001 - a tile too large to compile
                    row["tiles"].append({**tile, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    continue
                row["tiles"].append({**tile, "us": us, "tflops": flop / us / 1e6,
                                     "right": bool(torch.allclose(got, want, atol=2e-3, rtol=2e-3))})
            triton_kernels.attention_tile = chosen
            timed = [r for r in row["tiles"] if "us" in r and r["right"]]
            row["best"] = min(timed, key=lambda r: r["us"]) if timed else None
            res["shapes"][name] = row
            wrong = sum(1 for r in row["tiles"] if "us" in r and not r["right"])
            best = row["best"]
            own = next((r["us"] for r in timed if all(r[k] == v for k, v in row["kernel_tile"].items())), None)
            print(f"{name}: the kernel's tile {row['kernel_tile']}: " + (f"{own:.1f} us" if own else "not timed"))
            print(f"{name}: cuDNN {cudnn:.1f} us ({row['cudnn_tflops']:.0f} TFLOP/s); {len(row['tiles'])} tiles tried, "
                  f"{wrong} wrong; best " + (f"{best['us']:.1f} us ({best['tflops']:.0f} TFLOP/s) at "
                                             f"{ {k: best[k] for k in ['BLOCK_M', *GRID]} }" if best else "none"), flush=True)
    Path(args.out, "attention_kernel.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
