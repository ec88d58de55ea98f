"""HiFT's float32 parts on the GPU, before and after run 32: the f0 predictor's convolutions
(cuDNN's float32 ones against c2w's conv3_elu kernel) and Snake's sine (libdevice's sin, which
Inductor calls, against the multiply-add form `hift.sin_squared_by_multiply_adds`).

The f0 predictor (five k=3 convs of 512 channels with ELU, a linear head) must stay at float32's
accuracy: its f0 sets the NSF phases (runtime/model/hift.py, "Precision note"). With TF32 off,
cuDNN runs those convolutions on the CUDA cores; run 18c's kernel table of the B=32 F=158 HiFT put
five float32 fprop kernels at 1.28 of its 12.4 ms. The kernel computes each conv as TF32's
three-product split on the tensor cores. Snake's kernels (about 4 ms there) ran slower than
their bytes allow; the suspect is their sine's argument reduction.
This script measures, at the steady key B=32 F=158 and at B=1 F=58 (`--cases`):

1. the f0 predictor alone, under one CUDA graph: PyTorch's ops (cuDNN, TF32 off, cudnn.benchmark
   off and on), the same with TF32 on (fast, not accurate enough: for reference), the kernel
   at each tile of `--tiles` (handed tap-major copies of the weights, as under the float32
   policy), and the kernel at the product's tile reading weights stored tap-major (as the float16
   policy stores them since HiFT's AOTI revision 4: no copies); f0's relative error against
   float64 for each;
2. whole HiFT (float32 policy, eager, TF32 off), speech SNR against the ops and libdevice's sine
   of: the f0 kernel; the f0 kernel and the multiply-add sine (the product); the ops path with
   cudnn.benchmark on (another float32 algorithm: the ulp-level floor of this SNR);
3. whole HiFT in the float16 policy, eager (the runtime's fallback for shapes with no engine),
   timed with torch.sin and with the multiply-add sine: run 35 found eager 2.5x slower with the
   latter, which since then only a compiler's trace takes (hift._sine_as_multiply_adds).

The engines these parts go into are timed by `c2w bench` (h200_core, run 35). A compiled
before/after here (torch.compile of the float16 HiFT) stopped tracing at the read-only numpy
caches of the ISTFT's window envelope in run 35 and was dropped; the AOTI export traces them.

Usage (H200, ~200 s): python3 benchmarks/h200/hift_kernels.py --out $OUT
CPU smoke (interpreter, tiny shapes; no graphs):
  TRITON_INTERPRET=1 python benchmarks/h200/hift_kernels.py --model random:tiny --device cpu --cases 2x20 \\
      --tiles 32x64x16x4x1 --reps 2 --out /tmp/hift_kernels_smoke
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.h200.hift_precision import build_hift, capture, set_tf32, steady_inputs  # noqa: E402
from c2w.exporter.bench.engines import snr_db, timed  # noqa: E402
from c2w.runtime.model import hift as H  # noqa: E402
from c2w.runtime.model import triton_kernels as K  # noqa: E402
from c2w.runtime.units import rel_l2  # noqa: E402

# the first two for B=32's 5,056 rows, the last two for B=1's 58 (more, narrower programs); run 32's
# first call timed these and five more (all slower at both keys)
TILES = "64x128x32x4x3,128x128x32x8x3,16x32x64x2x3,16x64x64x4x3"


def tile(spec: str) -> dict:
    m, n, k, warps, stages = (int(v) for v in spec.split("x"))
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)


def paths(f0_kernel: bool, sine: bool = False):
    """Make the f0 predictor take the kernel (or PyTorch's ops) and Snake the multiply-add sine
    (or torch.sin, which Inductor turns into libdevice's)."""
    H.triton_kernels_for = (lambda t: K if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else None) \
        if f0_kernel else (lambda t: None)
    H._sin_squared = H.sin_squared_by_multiply_adds if sine else (lambda z: torch.sin(z).pow(2))


FORMS = (("before: cuDNN float32 f0, libdevice sine", False, False), ("f0 kernel", True, False),
         ("f0 kernel + multiply-add sine (the product)", True, True))


def timing(fn, args, dev, a) -> dict:
    row = {"direct": timed(lambda: fn(*args), dev, a.warmup, a.reps)}
    if dev.type == "cuda":
        g, _ = capture(fn, args)
        row["graph"] = timed(g.replay, dev, a.warmup, a.reps)
        del g
    return row


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="32x158,1x58", help="BxF, comma-separated; the first is the main key")
    ap.add_argument("--tiles", default=TILES, help="MxNxKxWARPSxSTAGES, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hift_kernels"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    hift, cfg = build_hift(a.model)
    hift = hift.to(dev)
    pred = hift.f0_predictor
    pred64 = H.F0Predictor(cfg.mel_bins, cfg.hift.f0_channels).to(dev).double()
    pred64.load_state_dict({k: v.double() for k, v in pred.state_dict().items()})
    pred_tap_major = copy.deepcopy(pred)           # as HiFT's float16 policy stores the f0 weights
    pred_tap_major.store_weights(tap_major=True)
    paths(False)
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "commit": os.environ.get("C2W_COMMIT", "?"),
                 "product_tiles": {"wide": K.F0_WIDE_TILE, "narrow": K.F0_NARROW_TILE},
                 "f0_alone": [], "hift_fp32": [], "hift_fp16_eager": []}
    product_tile = K.f0_tile

    def save():
        Path(a.out).mkdir(parents=True, exist_ok=True)
        res["elapsed_s"] = round(time.perf_counter() - t0, 1)
        Path(a.out, "hift_kernels.json").write_text(json.dumps(res, indent=1))

    cases = []
    for c in a.cases.split(","):
        b, f = (int(v) for v in c.split("x"))
        cases.append((f"B{b}-F{f}", steady_inputs(hift, cfg, b, f, dev, seed=b)))

    # 1. the f0 predictor alone
    for name, (mel, *_rest) in cases:
        want = pred64(mel.double())

        def add(variant, fn, **extra):
            f0 = fn(mel)
            row = {"case": name, "variant": variant, **extra,
                   "f0_rel_l2_vs_f64": rel_l2(f0.double(), want),
                   "f0_max_rel_vs_f64": float(((f0.double() - want).abs() / want.abs().clamp(min=1.0)).max()),
                   **timing(fn, (mel,), dev, a)}
            res["f0_alone"].append(row)
            print(f"[{time.perf_counter() - t0:6.1f}s] {name} {variant:28s} graph "
                  f"{row.get('graph', row['direct'])['median_ms'] * 1e3:8.1f} us  f0 rel-L2 {row['f0_rel_l2_vs_f64']:.2e}",
                  flush=True)
            save()

        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            add(f"ops, cudnn.benchmark {'on' if bench else 'off'}", pred)
        torch.backends.cudnn.benchmark = False
        set_tf32(True)
        add("ops, TF32 on (reference only)", pred)
        set_tf32(False)
        paths(True)
        for spec in a.tiles.split(","):
            K.f0_tile = lambda *_, t=tile(spec): t
            try:
                add(f"kernel {spec}", pred, tile=spec)
            except Exception as e:                          # noqa: BLE001 - a tile that does not fit
                res["f0_alone"].append({"case": name, "variant": f"kernel {spec}", "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"  tile {spec}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        K.f0_tile = product_tile
        add("kernel, product's tile, weights stored tap-major (float16 policy)", pred_tap_major)
        paths(False)

    # 2. whole HiFT, float32, eager: each form against the one before, beside another float32 algorithm
    name, inputs = cases[0]
    speech = {}
    for label, f0_kernel, sine in FORMS:
        paths(f0_kernel, sine)
        speech[label] = hift(*inputs)[0]
    paths(False)
    torch.backends.cudnn.benchmark = True
    floor = hift(*inputs)[0]
    torch.backends.cudnn.benchmark = False
    before = speech[FORMS[0][0]]
    res["hift_fp32"] = {"case": name, "speech_snr_db_vs_before": {label: snr_db(speech[label], before)
                                                                  for label, *_ in FORMS[1:]},
                        "speech_snr_db_cudnn_benchmark_vs_before": snr_db(floor, before)}
    print(f"HiFT float32 {name}, speech SNR against before: {res['hift_fp32']}", flush=True)
    save()

    # 3. whole HiFT, float16 policy, eager (the runtime's fallback), with each sine
    hift16 = copy.deepcopy(hift).set_precision(torch.float16).eval()
    for name, inputs in cases:
        for label, sine in (("torch.sin (eager as served)", False), ("multiply-add sine", True)):
            paths(True, sine)
            row = {"case": name, "sine": label, **timed(lambda: hift16(*inputs), dev, a.warmup, a.reps)}
            res["hift_fp16_eager"].append(row)
            print(f"HiFT float16 eager {name}, {label}: {row['median_ms']:.2f} ms", flush=True)
    paths(False)
    save()

    print("\ncase | f0 predictor | us under one graph | f0 rel-L2 vs float64")
    for r in res["f0_alone"]:
        if "error" not in r:
            print(f"{r['case']} | {r['variant']} | {r.get('graph', r['direct'])['median_ms'] * 1e3:.1f} | "
                  f"{r['f0_rel_l2_vs_f64']:.2e}")
    save()


if __name__ == "__main__":
    main()
