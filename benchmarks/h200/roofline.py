"""How far a CFM engine's kernels are from the GPU's limits: per kernel class of the in-place
solve, the measured time against the least time the class's arithmetic or its memory traffic
allows at the card's peak rates (issue #15: "show the measured floor of what you built").

Reads engine_kernels.py's JSON of a CFM key (the kernel names and times of one solve) and counts,
from the model config and the key's B, T, L alone, what each class of the solve must do per block
and Euler step:
  - matrix products: the six of a block (q/k/v, attention's output, the two k=3 convolutions' taps
    over T + 2 rows, fc1, fc2): 2 flops per multiply-add; bytes: each read of its input and
    weight, and the write of its output, once;
  - attention (c2w's kernel): the scores and the weighted values; bytes: q and the output once,
    the whole cache [k | v] of T + L slots once;
  - attention inputs: reads q/k/v, writes q and the chunk's k/v into the cache;
  - conv block (c2w's two kernels): the taps' sums with their norms, residual and Mish: the taps
    read once, the outputs written once;
  - norms (Inductor's two per block: the gated residual, LayerNorm and modulation before attention
    and before the conv block): the residual and the branch read, the residual and the normed
    input written.
Every tensor is of the key's dtype (the engines keep the DiT in it). A class's floor is the larger
of its flops at the dense float16 tensor rate and its bytes at the memory bandwidth, both the
card's data-sheet peaks (so no kernel reaches them: copies reach ~90 % of the bandwidth, run 15).
What the classes leave out (the solve's other kernels: the input and final projections, the
timestep table, the Euler update, and the engine_kernels harness's placement of a cache handed
as a tensor, which a resident ring does not need) is one more row, with no floor.

    python3 benchmarks/h200/engine_kernels.py /tmp/art/all-h200_stage cfm-B32-T150-L400-float16 --out $OUT
    python3 benchmarks/h200/roofline.py $OUT/engine_kernels_cfm-B32-T150-L400-float16.json
(run 29's files are in results/run29_stage/stage_extras.tgz; files written before run 29 name no
card: pass --device H100 or H200.)
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from c2w.runtime.model.config import FULL, ModelConfig  # noqa: E402

# data-sheet peaks: dense float16 tensor rate (flop/s) and memory bandwidth (byte/s), SXM cards
PEAKS = {"H100": (989.4e12, 3.35e12), "H200": (989.4e12, 4.8e12)}

# the classes, in the table's order, and the kernel names (c2w's own, then by substring) in each
PRODUCTS, ATTENTION, INPUTS, CONV, NORMS, REST = (
    "matrix products (cuBLAS)", "attention (c2w)", "attention inputs (c2w)", "conv block (c2w, 2 kernels)",
    "norms + modulation (Inductor)", "the rest of the solve (no floor counted)")
CLASSES = (PRODUCTS, ATTENTION, INPUTS, CONV, NORMS)


def classify(name: str) -> str:
    if name == "_attention_kernel":
        return ATTENTION
    if name == "_attention_inputs_kernel":
        return INPUTS
    if name in ("_conv_norm_mish_kernel", "_conv_residual_norm_kernel"):
        return CONV
    if any(k in name for k in ("nvjet", "gemm", "cutlass", "xmma")):
        return PRODUCTS
    if name.startswith("triton_") and "layer_norm" in name:
        return NORMS
    return REST


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float


def block_step_work(cfg: ModelConfig, B: int, T: int, L: int, elem: int = 2) -> dict[str, Work]:
    """What each class does in one block and one Euler step (guidance: 2B sequences)."""
    d = cfg.dit
    dim, inner, mlp = d.hidden, d.heads * d.head_dim, int(d.hidden * d.mlp_ratio)
    rows, conv_rows, slots = 2 * B * T, 2 * B * (T + 2), T + L

    def product(m: int, k: int, n: int) -> Work:
        return Work(2 * m * k * n, elem * (m * k + k * n + m * n))

    products = [product(rows, dim, 3 * inner), product(rows, inner, dim), product(conv_rows, dim, 3 * dim),
                product(conv_rows, dim, 3 * dim), product(rows, dim, mlp), product(rows, mlp, dim)]
    return {
        PRODUCTS: Work(sum(p.flops for p in products), sum(p.bytes for p in products)),
        ATTENTION: Work(2 * 2 * rows * slots * inner, elem * (2 * rows * inner + 2 * B * slots * 2 * inner)),
        INPUTS: Work(0, elem * (rows * 3 * inner + rows * inner + rows * 2 * inner)),
        CONV: Work(0, elem * ((conv_rows * 3 * dim + conv_rows * dim) + (conv_rows * 3 * dim + 3 * rows * dim))),
        NORMS: Work(0, elem * 2 * 4 * rows * dim),
    }


def card(device: str) -> str:
    for name in PEAKS:
        if name in device:
            return name
    raise SystemExit(f"no peak rates for {device!r}: known cards {sorted(PEAKS)}")


def roofline(profile: dict, key_id: str, device: str, cfg: ModelConfig = FULL) -> list[dict]:
    """Rows per class: kernels, measured ms, flops, bytes, floor ms (and what binds it), the
    measured time over the floor, achieved TFLOP/s and TB/s; then the rest and the whole solve."""
    dims = dict((part[0], int(part[1:])) for part in key_id.split("-")[1:4])
    elem = {"float16": 2, "bfloat16": 2, "float32": 4}[key_id.rsplit("-", 1)[1]]
    flop_rate, bandwidth = PEAKS[card(device)]
    steps = cfg.n_timesteps * cfg.dit.depth
    work = block_step_work(cfg, dims["B"], dims["T"], dims["L"], elem)
    measured = {c: [0, 0.0] for c in CLASSES + (REST,)}
    for k in profile["top"]:
        m = measured[classify(k["name"])]
        m[0], m[1] = m[0] + k["count"], m[1] + k["ms"]
    named = sum(m[0] for m in measured.values()), sum(m[1] for m in measured.values())
    measured[REST][0] += profile["kernels_per_solve"] - named[0]
    measured[REST][1] += profile["kernel_ms_per_solve"] - named[1]
    rows = []
    for c in CLASSES:
        flops, moved = work[c].flops * steps, work[c].bytes * steps
        compute_ms, memory_ms = flops / flop_rate * 1e3, moved / bandwidth * 1e3
        n, ms = measured[c]
        rows.append({"class": c, "kernels": n, "ms": ms, "gflop": flops / 1e9, "gb": moved / 1e9,
                     "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms >= memory_ms else "memory",
                     "over_floor": ms / max(compute_ms, memory_ms) if ms else None,
                     "tflop_s": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "tb_s": moved / (ms * 1e-3) / 1e12 if ms else None})
    n, ms = measured[REST]
    rows.append({"class": REST, "kernels": n, "ms": ms})
    floor = sum(r["floor_ms"] for r in rows[:-1])
    rows.append({"class": "whole solve", "kernels": profile["kernels_per_solve"], "ms": profile["kernel_ms_per_solve"],
                 "floor_ms": floor, "over_floor": profile["kernel_ms_per_solve"] / floor})
    return rows


def markdown(rows: list[dict], title: str) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    out = [f"{title}", "", "| class | kernels | ms | GFLOP | GB moved | floor ms (bound) | over the floor | TFLOP/s | TB/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = f"{r['floor_ms']:.2f} ({r['bound']})" if "bound" in r else f(r.get("floor_ms"), ".2f")
        out.append(f"| {r['class']} | {r['kernels']} | {r['ms']:.2f} | {f(r.get('gflop'), '.0f')} | {f(r.get('gb'), '.1f')} "
                   f"| {floor} | {f(r.get('over_floor'), '.2f')}x | {f(r.get('tflop_s'), '.0f')} | {f(r.get('tb_s'), '.2f')} |")
    return "\n".join(out).replace("| -x |", "| - |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, nargs="+", help="engine_kernels.py files of CFM keys")
    ap.add_argument("--device", default="", help="the card, where the file's device is only 'cuda' (e.g. H200)")
    a = ap.parse_args(argv)
    for path in a.json:
        res = json.loads(path.read_text())
        device = a.device or res.get("device_name") or res["device"]
        rows = roofline(res["profile"], res["key"], device)
        print(markdown(rows, f"{res['key']} on the {card(device)} (`{path.name}`, commit {res.get('commit') or '?'})"))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
