"""The DiT's six matrix products at B=1 (100 rows) as one Triton kernel each, against cuBLAS, with
the weights read from device memory as the served solve reads them.

At B=1 the solve's 990 cuBLAS products take 4.2 of its 7.7 ms of kernel time, ~4.3 us each, while
the bytes they read would take ~0.5 ms in all (benchmarks/h200/README.md, runs 28b and 29): each
product is bound by its latency. The earlier Triton tiles (runs 9, 11c, 12b) gave each program 16
rows, so a weight was read once per 16-row tile and each program walked the whole K dimension.
This kernel covers all rows in one tile (BLOCK_M >= rows: every weight byte is read once) and
spreads the weight over many programs two ways: BLOCK_N output columns per program, and the K
dimension split `splits` ways. With splits > 1 each program writes its float32 partial sums to a
workspace and counts its arrival on a per-column-tile counter; the last to arrive adds the partials
in a fixed order (the result does not depend on which program came last), applies bias and
activation, stores the float16 output and resets the counter, so it is one launch with no memset.

Each product is timed under one CUDA graph over enough distinct weights (>= 150 MB) that they come
from device memory rather than L2, per launch: cuBLAS (F.linear; fc1 with its GELU in cuBLASLt's
epilogue, as the model runs it) and every tile. Then a block's six products in the model's order,
16 blocks of distinct weights, cuBLAS against each product's best tile; and a trivial one-program
Triton kernel launched as often, the floor of one launch under a graph.

A prototype, not in the product. Usage (device): python3 benchmarks/h200/small_products.py --out $OUT
The kernel's paths are checked on the CPU under Triton's interpreter by tests/test_small_products.py.
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
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# name -> (K, N, GELU): the block's products in DiTBlock.modulated's order (hidden 512, MLP 2048;
# the conv products are against the three taps' weights side by side)
SHAPES = {"qkv": (512, 1536, False), "proj": (512, 512, False), "conv1": (512, 1536, False),
          "conv2": (512, 1536, False), "fc1": (512, 2048, True), "fc2": (2048, 512, False)}
TILES = [dict(BLOCK_N=n, BLOCK_K=k, splits=s, num_warps=4, num_stages=3)
         for n, k, s in itertools.product((16, 32, 64), (64, 128), (1, 2, 4, 8))]
FLUSH_BYTES = 150 << 20


@triton.jit
def _gelu_tanh(x):
    """GELU's tanh form: 0.5 x (1 + tanh(u)) = x sigmoid(2u)."""
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def _small_product_kernel(x, w, bias, out, partial, counters, rows, n_out, k_in, k_split,
                          x_row, w_out, w_in, GELU: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    splits = tl.num_programs(1)
    r = tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    live = r < rows
    outs = n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum(k_in, (part + 1) * k_split)
    for k0 in range(part * k_split, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ins = k < k_end
        a = tl.load(x + r[:, None] * x_row + k[None, :], mask=live[:, None] & ins[None, :], other=0.0)
        b = tl.load(w + n[None, :] * w_out + k[:, None] * w_in, mask=ins[:, None] & outs[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    here = live[:, None] & outs[None, :]
    if SPLIT:
        cell = (r * n_out)[:, None] + n[None, :]
        tl.store(partial + part * rows * n_out + cell, acc, mask=here)
        tl.debug_barrier()
        if tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for p in range(0, splits):
                acc += tl.load(partial + p * rows * n_out + cell, mask=here, other=0.0, cache_modifier=".cg")
            acc += tl.load(bias + n, mask=outs, other=0.0).to(tl.float32)[None, :]
            if GELU:
                acc = _gelu_tanh(acc)
            tl.store(out + cell, acc.to(out.dtype.element_ty), mask=here)
            tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
    else:
        acc += tl.load(bias + n, mask=outs, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = _gelu_tanh(acc)
        tl.store(out + (r * n_out)[:, None] + n[None, :], acc.to(out.dtype.element_ty), mask=here)


class SmallProduct:
    """x (rows, K) @ w (N, K).T + b [GELU] for one tile; owns its workspace and counters."""

    def __init__(self, rows: int, k_in: int, n_out: int, gelu: bool, tile: dict, device):
        self.rows, self.k_in, self.n_out, self.gelu, self.tile = rows, k_in, n_out, gelu, dict(tile)
        self.block_m = max(16, triton.next_power_of_2(rows))
        self.tiles_n = triton.cdiv(n_out, tile["BLOCK_N"])
        splits = tile["splits"]
        self.k_split = triton.cdiv(triton.cdiv(k_in, splits), tile["BLOCK_K"]) * tile["BLOCK_K"]
        self.splits = triton.cdiv(k_in, self.k_split)
        self.partial = torch.empty((self.splits, rows, n_out), dtype=torch.float32, device=device)
        self.counters = torch.zeros(self.tiles_n, dtype=torch.int32, device=device)

    def __call__(self, x, w, b, out):
        t = self.tile
        _small_product_kernel[(self.tiles_n, self.splits)](
            x, w, b, out, self.partial, self.counters, self.rows, self.n_out, self.k_in, self.k_split,
            x.stride(0), w.stride(0), w.stride(1), GELU=self.gelu, SPLIT=self.splits > 1,
            BLOCK_M=self.block_m, BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
            num_warps=t["num_warps"], num_stages=t["num_stages"])
        return out


def cublas(x, w, b, gelu: bool):
    if gelu and x.is_cuda:
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)
    y = F.linear(x, w, b)
    return F.gelu(y, approximate="tanh") if gelu else y


def reference(x, w, b, gelu: bool):
    y = F.linear(x.double(), w.double(), b.double())
    return F.gelu(y, approximate="tanh") if gelu else y


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@triton.jit
def _touch_kernel(flag):
    tl.store(flag, tl.load(flag) + 1)


def graphed_us(fn, launches: int) -> float:
    """Median us per launch of fn, which makes `launches` launches, captured once in a CUDA graph."""
    from benchmarks.h200.fused_tiles import graphed_us as per_call_us
    return per_call_us(fn, per_graph=1) / launches


def weights(k_in, n_out, copies, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(copies, n_out, k_in, generator=g) / k_in ** 0.5).to(device, dtype)
    b = (torch.randn(copies, n_out, generator=g) * 0.1).to(device, dtype)
    return w, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=int, default=100)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.float16
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rows": args.rows, "shapes": {}}
    rows = args.rows
    start = time.time()
    best = {}
    for name, (k_in, n_out, gelu) in SHAPES.items():
        copies = max(16, FLUSH_BYTES // (2 * k_in * n_out))
        w, b = weights(k_in, n_out, copies, dev, dtype, 1)
        x = torch.randn(rows, k_in, device=dev).to(dtype)
        ref, ref_last = reference(x, w[0], b[0], gelu), reference(x, w[-1], b[-1], gelu)
        out = torch.empty(rows, n_out, device=dev, dtype=dtype)
        row = {"shape": [k_in, n_out], "copies": copies, "weight_MB": 2 * k_in * n_out / 1e6,
               "cublas_us": graphed_us(lambda: [cublas(x, w[i], b[i], gelu) for i in range(copies)], copies),
               "cublas_rel_l2": rel_l2(cublas(x, w[0], b[0], gelu), ref), "tiles": []}
        for tile in TILES:
            op = SmallProduct(rows, k_in, n_out, gelu, tile, dev)
            entry = dict(tile, programs=op.tiles_n * op.splits)
            try:
                entry["rel_l2"] = rel_l2(op(x, w[0], b[0], out), ref)
                entry["us"] = graphed_us(lambda: [op(x, w[i], b[i], out) for i in range(copies)], copies)
                entry["rel_l2_after"] = rel_l2(out, ref_last)       # the graph's last launch wrote out
            except Exception as e:                     # a tile that does not compile or launch
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            row["tiles"].append(entry)
        ok = [t for t in row["tiles"] if "us" in t and max(t["rel_l2"], t["rel_l2_after"]) < 5e-3]
        row["best"] = min(ok, key=lambda t: t["us"]) if ok else None
        whole = [t for t in ok if t["splits"] == 1]
        row["best_whole_k"] = min(whole, key=lambda t: t["us"]) if whole else None
        split = [t for t in ok if t["splits"] > 1]
        if split:
            # as a product op would have to run it: its counters zeroed by a memset node per call
            # (a buffer kept across calls would be shared by engines on other streams)
            t = dict(min(split, key=lambda t: t["us"]))
            op = SmallProduct(rows, k_in, n_out, gelu, t, dev)

            def fresh(i):
                op.counters = torch.zeros(op.tiles_n, dtype=torch.int32, device=dev)
                op(x, w[i], b[i], out)
            t["us_with_memset"] = graphed_us(lambda: [fresh(i) for i in range(copies)], copies)
            row["best_split_with_memset"] = t
        best[name] = row["best"]
        res["shapes"][name] = row
        print(f"{name:6s} K={k_in:5d} N={n_out:5d}: cuBLAS {row['cublas_us']:.2f} us; best tile "
              + (f"{row['best']['us']:.2f} us {row['best']}" if ok else "none"), flush=True)
        del w, b
    # a block's six products in order, 16 blocks of distinct weights (144 MB): cuBLAS against the best tiles
    blocks = []
    for i in range(16):
        blk = {}
        for name, (k_in, n_out, gelu) in SHAPES.items():
            w, b = weights(k_in, n_out, 1, dev, dtype, 100 + i)
            blk[name] = (w[0], b[0], torch.randn(rows, k_in, device=dev).to(dtype),
                         torch.empty(rows, n_out, device=dev, dtype=dtype))
        blocks.append(blk)
    ops = {name: SmallProduct(rows, *SHAPES[name], best[name], dev) for name in SHAPES if best[name]}
    launches = 16 * len(SHAPES)
    res["chain_cublas_us"] = graphed_us(lambda: [cublas(blk[n][2], blk[n][0], blk[n][1], SHAPES[n][2])
                                                 for blk in blocks for n in SHAPES], launches)
    res["chain_tiles_us"] = graphed_us(lambda: [(ops[n] if n in ops else (lambda x, w, b, o, g=SHAPES[n][2]: cublas(x, w, b, g)))(
        blk[n][2], blk[n][0], blk[n][1], blk[n][3]) for blk in blocks for n in SHAPES], launches)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    res["one_program_kernel_us"] = graphed_us(lambda: [_touch_kernel[(1,)](flag) for _ in range(launches)], launches)
    res["seconds"] = round(time.time() - start, 1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "small_products.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}, {rows} rows, float16, us per product under one CUDA graph, weights from device memory")
    print("| product | K | N | cuBLAS | best tile | tile (N x K, splits, programs) | best tile's weight read, GB/s "
          "| best whole-K tile | best split tile with a memset per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in res["shapes"].items():
        t = row["best"]
        k_in, n_out, _ = SHAPES[name]
        print(f"| {name} | {k_in} | {n_out} | {row['cublas_us']:.2f} | "
              + (f"{t['us']:.2f} | {t['BLOCK_N']} x {t['BLOCK_K']}, {t['splits']}, {t['programs']} | "
                 f"{row['weight_MB'] * 1e3 / t['us']:.0f} |" if t else "- | - | - |")
              + (f" {row['best_whole_k']['us']:.2f} ({row['best_whole_k']['BLOCK_N']} x {row['best_whole_k']['BLOCK_K']}) |"
                 if row["best_whole_k"] else " - |")
              + (f" {row['best_split_with_memset']['us_with_memset']:.2f} |" if "best_split_with_memset" in row else " - |"))
    print(f"block's six products in order, per product: cuBLAS {res['chain_cublas_us']:.2f}, best tiles "
          f"{res['chain_tiles_us']:.2f}; a one-program kernel {res['one_program_kernel_us']:.2f} us ({res['seconds']} s)")


if __name__ == "__main__":
    main()
