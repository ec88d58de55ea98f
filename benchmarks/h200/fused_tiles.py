"""The fused Triton product of fused_dit.py alone, over tile configurations, at a DiT block's shapes.

Run 9 built the fused kernels into AOTI engines and found them right but slow (24-36 us per
product at B=1 against 4.5 us for cuBLAS's product alone). Tiles can be chosen without an AOTI
build: this script launches `_fused_linear_kernel` eagerly (Triton's JIT) at each of a block's
product shapes (q, k and v share one; "qkv" is the three packed in one weight; "final" is the
final layer's) for ROWS rows (2B x T: 100 at B=1, T=50), over a grid of tile shapes, warps and
pipeline stages, and reports per shape:
  - the PyTorch ops the kernel replaces (LayerNorm, modulation or Mish, frames, product, GELU or
    gated residual), eager ops captured in one CUDA graph (Inductor fuses some of them, so this
    bounds from above the time a fused kernel must beat; run 9's kernel table has Inductor's);
  - cuBLAS's product alone (F.linear), captured the same way;
  - every configuration's time and its rel-L2 against those ops (fp16; a wrong one is marked).
Times are per launch: 20 launches per graph, median of the replays.

Usage (device): python3 benchmarks/h200/fused_tiles.py --out $OUT [--rows 100] [--seconds 150]
  [--shapes conv1,conv2] (the time budget is split evenly over the products tuned)
  [--grid '{"BLOCK_M": [16], "num_warps": [4]}'] (fewer configurations: GRID with these values)
fused_dit.load_tiles reads the JSON it writes (the products whose best beat the ops they replace).
CPU check of the script itself (reference and kernel paths, two configurations, fp32, under
Triton's interpreter): TRITON_INTERPRET=1 python3 benchmarks/h200/fused_tiles.py --check
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.fused_dit import (BIAS, BIAS_GELU, GATED_RESIDUAL, LN_MISH, LN_MODULATE,  # noqa: E402
                                       NO_PROLOGUE, _fused_linear_kernel)
from c2w.runtime.units import rel_l2  # noqa: E402

D = 512
# name: (K, N, taps, prologue, epilogue) of the products in one DiT block (fused_dit.block_forward)
SHAPES = {
    "q/k/v": (D, D, 1, LN_MODULATE, BIAS),
    "qkv": (D, 3 * D, 1, LN_MODULATE, BIAS),        # q, k and v packed in one weight (the model's)
    "proj": (D, D, 1, NO_PROLOGUE, GATED_RESIDUAL),
    "conv1": (D, D, 3, LN_MODULATE, BIAS),
    "conv2": (D, D, 3, LN_MISH, GATED_RESIDUAL),
    "fc1": (D, 4 * D, 1, LN_MODULATE, BIAS_GELU),
    "fc2": (4 * D, D, 1, NO_PROLOGUE, GATED_RESIDUAL),
    "final": (D, 80, 1, LN_MODULATE, BIAS),
}
GRID = {"BLOCK_M": (16, 32), "BLOCK_N": (32, 64, 128), "BLOCK_K": (64, 128, 512), "num_warps": (2, 4),
        "num_stages": (2, 3)}


def make_inputs(shape, rows: int, frames: int, dtype, device, seed: int = 0) -> dict:
    k, n, taps, _, _ = shape
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g)).to(dtype=dtype, device=device)  # noqa: E731
    seqs = rows // frames
    return {"x": r(rows, k), "w": r(n, taps * k, scale=(taps * k) ** -0.5), "b": r(n, scale=0.1),
            "cache": r(seqs, k, max(taps - 1, 1)), "p0": r(k, scale=0.3), "p1": r(k, scale=0.3),
            "res": r(rows, n), "gate": r(n, scale=0.5), "frames": frames}


def reference(shape, t: dict) -> torch.Tensor:
    """The PyTorch ops one fused product replaces (as DiTBlock computes them)."""
    k, n, taps, prologue, epilogue = shape
    x = t["x"]
    if prologue == LN_MODULATE:
        x = F.layer_norm(x, (k,), eps=1e-6) * (1 + t["p1"]) + t["p0"]
    elif prologue == LN_MISH:
        x = F.mish(F.layer_norm(x, (k,), t["p0"], t["p1"], eps=1e-5))
    if taps > 1:
        seqs, frames = t["cache"].shape[0], t["frames"]
        h = torch.cat([t["cache"].transpose(1, 2), x.reshape(seqs, frames, k)], dim=1)
        x = torch.cat([h[:, j:j + frames] for j in range(taps)], dim=-1).reshape(seqs * frames, taps * k)
    y = F.linear(x, t["w"], t["b"])
    if epilogue == BIAS_GELU:
        y = F.gelu(y, approximate="tanh")
    elif epilogue == GATED_RESIDUAL:
        y = t["res"] + t["gate"] * y
    return y


def launch(shape, t: dict, y: torch.Tensor, config: dict) -> torch.Tensor:
    k, n, taps, prologue, epilogue = shape
    m = t["x"].shape[0]
    c = t["cache"]
    grid = ((m + config["BLOCK_M"] - 1) // config["BLOCK_M"], (n + config["BLOCK_N"] - 1) // config["BLOCK_N"])
    _fused_linear_kernel[grid](
        t["x"], c, t["w"], t["b"], y, t["p0"], t["p1"], t["res"], t["gate"],
        m, n, t["frames"], t["x"].stride(0), c.stride(0), c.stride(1), c.stride(2), t["w"].stride(0), y.stride(0),
        t["res"].stride(0), 1e-6 if prologue == LN_MODULATE else 1e-5,
        K=k, TAPS=taps, PROLOGUE=prologue, EPILOGUE=epilogue, **config)
    return y


def graphed_us(fn, per_graph: int = 20, replays: int = 15) -> float:
    """Median µs per call of fn, captured `per_graph` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return sorted(times)[len(times) // 2]


def configs(grid: dict):
    names = list(GRID)
    for values in itertools.product(*(grid[n] for n in names)):
        yield dict(zip(names, values))


def check() -> None:
    """CPU, fp32, interpreter: both prologue paths (tile covers K, and not) against reference()."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check runs under Triton's interpreter: TRITON_INTERPRET=1 python3 ... --check")
    for name, shape in SHAPES.items():
        t = make_inputs(shape, 12, 6, torch.float32, "cpu")
        want = reference(shape, t)
        for block_k in (64, 512):
            cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=2)
            got = launch(shape, t, torch.empty_like(want), cfg)
            err = rel_l2(got, want)
            print(f"{name:6s} BLOCK_K={block_k}: rel-L2 {err:.1e}")
            assert err < 1e-5, (name, block_k, err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100, help="2B x T (100: B=1, T=50)")
    ap.add_argument("--frames", type=int, default=50, help="T (rows must be a multiple)")
    ap.add_argument("--seconds", type=float, default=150, help="stop trying configurations after this long")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated products to tune (default all: {','.join(SHAPES)})")
    ap.add_argument("--grid", default="{}",
                    help="JSON: values to try instead of GRID's for some of its keys, e.g. '{\"BLOCK_M\": [16]}'")
    ap.add_argument("--check", action="store_true", help="CPU check of the script (see the docstring)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    if a.check:
        check()
        return
    dev, t0 = torch.device("cuda"), time.time()
    res = {"rows": a.rows, "frames": a.frames, "commit": os.environ.get("C2W_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name(), "shapes": {}}
    names = [n for n in a.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: {unknown} are not products of a block; expected some of {list(SHAPES)}")
    try:
        grid = {**GRID, **{k: tuple(v) for k, v in json.loads(a.grid).items()}}
    except (ValueError, TypeError, AttributeError) as exc:
        ap.error(f"--grid {a.grid!r}: {exc}; expected a JSON object of lists, keys among {list(GRID)}")
    if set(grid) != set(GRID):
        ap.error(f"--grid: unknown keys {sorted(set(grid) - set(GRID))}; expected some of {list(GRID)}")
    res["grid"] = {k: list(v) for k, v in grid.items()}
    budget = a.seconds / len(names)
    for name in names:
        shape = SHAPES[name]
        t = make_inputs(shape, a.rows, a.frames, torch.float16, dev)
        want = reference(shape, t)
        product_in = t["x"] if shape[2] == 1 else torch.randn(a.rows, shape[2] * shape[0], device=dev).half()
        row = {"ops_us": graphed_us(lambda: reference(shape, t)),
               "cublas_us": graphed_us(lambda: F.linear(product_in, t["w"], t["b"])),
               "configs": []}
        y = torch.empty_like(want)
        start = time.time()
        for cfg in configs(grid):
            if time.time() - start > budget:
                row["stopped_early"] = True
                break
            try:
                err = rel_l2(launch(shape, t, y, cfg).float(), want.float())
                us = graphed_us(lambda: launch(shape, t, y, cfg))
                row["configs"].append({**cfg, "us": us, "rel_l2": err})
            except Exception as exc:           # a configuration Triton refuses (e.g. shared memory)
                row["configs"].append({**cfg, "error": repr(exc)[:200]})
        ok = [c for c in row["configs"] if "us" in c and c["rel_l2"] < 5e-3]
        row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        res["shapes"][name] = row
        Path(a.out, "fused_tiles.json").write_text(json.dumps(res, indent=1))
    print(f"rows {a.rows}; {time.time() - t0:.0f} s; per launch, µs (fp16):")
    print(f"{'product':8s} {'ops it replaces':>16s} {'cuBLAS alone':>13s} {'best fused':>11s}  config (tried, wrong)")
    for name, row in res["shapes"].items():
        best = row["best"]
        tried = len(row["configs"])
        wrong = sum(1 for c in row["configs"] if "us" in c and c["rel_l2"] >= 5e-3)
        desc = "none" if best is None else " ".join(f"{k}={best[k]}" for k in GRID)
        print(f"{name:8s} {row['ops_us']:16.2f} {row['cublas_us']:13.2f} "
              f"{best['us'] if best else float('nan'):11.2f}  {desc} ({tried}, {wrong})")


if __name__ == "__main__":
    main()
