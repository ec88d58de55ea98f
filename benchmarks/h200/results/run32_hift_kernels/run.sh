#!/usr/bin/env bash
# Run 32 (one device call; C2W_COMMIT=<commit> bash benchmarks/h200/results/run32_hift_kernels/run.sh): (a) HiFT's f0 kernel and multiply-add sine, alone and in compiled HiFT; (b) the HiFT
# engines built with both, beside the B=1 first chunk (5 keys, 5 shards), merged and benched.
export PYTHONUNBUFFERED=1 C2W_COMMIT=${C2W_COMMIT:-?}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s)
timeout 150 python3 benchmarks/h200/hift_kernels.py --out $OUT > $OUT/hift_kernels_stdout.txt 2>&1; echo "rc $?" >> $OUT/hift_kernels_stdout.txt
echo "32a wall $(( $(date +%s) - t0 )) s"
left=$(( 330 - ($(date +%s) - t0) ))
OUT=$OUT/b SHARDS=5 PROFILE=benchmarks/h200/results/run32_hift_kernels/hift_check.yaml EXPORT_S=$(( left * 55 / 100 )) MERGE_S=40 BENCH_S=$(( left * 30 / 100 )) \
  BENCH_ARGS="--batches 1,32" bash benchmarks/h200/run.sh > $OUT/run_b.log 2>&1
cd $OUT/b && tar czf ../b_extras.tgz . && cd .. && rm -rf b
grep -v "^\[" $OUT/hift_kernels_stdout.txt | tail -30; tail -25 $OUT/run_b.log
