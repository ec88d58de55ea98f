#!/usr/bin/env bash
# Run 40: the q/k/v product returning q + u and q + v (query_fold.patch) against revision 5.
# Call 2 ran it with SHAPES="1 28 300;32 78 400"; call 1 with the default three keys (and the
# patch before its inference-tensor fix).
OUT=${OUT:-/tmp/out}
PATCH="benchmarks/h200/results/run40_query_fold/query_fold.patch" SHAPES="${SHAPES:-32 78 400;1 28 300;32 28 400}" \
  bash benchmarks/h200/encoder_ab.sh > $OUT/ab_stdout.txt 2>&1
tail -20 $OUT/ab_stdout.txt
python3 - <<'PY' | tee -a $OUT/ab_stdout.txt
import json, glob
print("key              tag     served  eager_g  x_eg  kernels kernel_ms  relL2_fp32  top align1 kernels")
for f in sorted(glob.glob("/tmp/encoder_ab/encoder_profile_*.json")):
    d = json.load(open(f)); p = d.get("profile", {})
    a1 = sum(k["ms"] for k in p.get("top", []) if "align1" in k["name"])
    print(f"B{d['B']} N{d['N']} C{d['C']:<5} {d['tag']:7s} {d['engine_graph']['median_ms']:.3f}  {d['eager_graph']['median_ms']:.3f}  "
          f"{d['eager_graph']['median_ms']/d['engine_graph']['median_ms']:.2f}  {p.get('kernels_per_solve')}  {p.get('kernel_ms_per_solve', 0):.3f}  "
          f"{d['rel_l2_vs_fp32']['engine']:.2e}  {a1:.3f}")
PY
