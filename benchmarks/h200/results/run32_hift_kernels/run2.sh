#!/usr/bin/env bash
# Run 32, second call (C2W_COMMIT=<commit> bash benchmarks/h200/results/run32_hift_kernels/run2.sh, ~230 s):
# the three HiFT engines of hift_only.yaml built, merged and benched, then hift_kernels.py at the
# B=32 F=158 key only (its compiled before/after last, cut by the timeout if the call runs short).
# EXPORT_S, MERGE_S, BENCH_S and TOTAL_S (the call's seconds; 0 after the engines skips the script) shorten it.
export PYTHONUNBUFFERED=1 C2W_COMMIT=${C2W_COMMIT:-?}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s)
OUT=$OUT/b SHARDS=3 PROFILE=benchmarks/h200/results/run32_hift_kernels/hift_only.yaml EXPORT_S=${EXPORT_S:-110} \
  MERGE_S=${MERGE_S:-30} BENCH_S=${BENCH_S:-60} BENCH_ARGS="--batches 1" bash benchmarks/h200/run.sh > $OUT/run_b.log 2>&1
cd $OUT/b && tar czf ../b_extras.tgz . && cd - > /dev/null && rm -rf $OUT/b
echo "engines: $(( $(date +%s) - t0 )) s"; grep -E "hift-B.*served engine" $OUT/run_b.log
left=$(( ${TOTAL_S:-225} - ($(date +%s) - t0) ))
[ $left -gt 20 ] && timeout $left python3 benchmarks/h200/hift_kernels.py --out $OUT --cases 32x158 \
  --tiles 64x128x32x4x3,16x32x64x2x3 > $OUT/hift_kernels_stdout.txt 2>&1; echo "rc $?" >> $OUT/hift_kernels_stdout.txt
grep -v "^\[" $OUT/hift_kernels_stdout.txt | grep -v "^  File\|^    " | tail -14
