#!/usr/bin/env bash
# One device call for the DiT's and the flow encoder's B=1 products (run 38):
#   1. small_products.py: cuBLAS against whole-row Triton tiles at the block's six product shapes;
#   2. the rows_linear candidate (PATCH) with the tiles just measured (C2W_ROWS_LINEAR_TILES), built
#      at full depth beside this tree and served side by side at CFM B=1 T=50 L=300 (ab_candidates.sh);
#   3. the same candidate's flow encoder at B=1 N=28 C=300 beside this tree's (encoder_ab.sh).
# Usage (device tool, repo root): C2W_COMMIT=<hash> bash benchmarks/h200/products_ab.sh
# SP_S, BUILD_S, AB_S, ENC_S: each part's limit in seconds.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PATCH=${PATCH:-benchmarks/h200/results/run38_rows_linear/rows_linear.patch}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt"
timeout "${SP_S:-150}" python3 benchmarks/h200/small_products.py --out "$OUT" > "$OUT/small_products_stdout.txt" 2>&1
echo "rc $?" >> "$OUT/small_products_stdout.txt"
tail -14 "$OUT/small_products_stdout.txt"
[ -f "$OUT/small_products.json" ] && export C2W_ROWS_LINEAR_TILES=$OUT/small_products.json
BATCHES=1 BUILD_S=${BUILD_S:-240} AB_S=${AB_S:-150} PATCHES="rows_linear=$PATCH" \
  bash benchmarks/h200/ab_candidates.sh 2>&1 | tail -30
PATCH=$PATCH SHAPES="1 28 300" STEP_S=150 timeout "${ENC_S:-170}" bash benchmarks/h200/encoder_ab.sh 2>&1 | tail -8
