#!/usr/bin/env bash
# Run 36d: HiFT revision 6 engines + the encoder's convolutions, product against cuDNN, at B=32 N=78 and B=1 N=28.
export PYTHONUNBUFFERED=1 C2W_COMMIT=${C2W_COMMIT:-$(git rev-parse --short HEAD)} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/enc
t0=$(date +%s)
( PROFILE=benchmarks/h200/results/run36_hift6_encoder_conv/hift36.yaml SHARDS=7 EXPORT_S=260 MERGE=0 BENCH_S=0 OUT=/tmp/hout bash benchmarks/h200/run.sh > /tmp/hift_export.log 2>&1 ) &
hp=$!
for shape in "32 78 400" "1 28 300"; do set -- $shape; for conv in model cudnn; do
  TORCHINDUCTOR_COMPILE_THREADS=2 timeout 260 python3 benchmarks/h200/encoder_profile.py --batch $1 --tokens $2 --cache $3 --conv $conv --phase build --out /tmp/enc > /tmp/enc/build_$1_$2_$conv.log 2>&1 &
done; done
wait
echo "builds done at $(( $(date +%s) - t0 )) s"; tail -2 /tmp/hift_export.log
for shape in "32 78 400" "1 28 300"; do set -- $shape; for conv in model cudnn; do
  timeout 60 python3 benchmarks/h200/encoder_profile.py --batch $1 --tokens $2 --cache $3 --conv $conv --phase time --reps 50 --out /tmp/enc 2>&1 | grep encoder_profile_
done; done
echo "encoder timed at $(( $(date +%s) - t0 )) s"
cp /tmp/enc/build_*.log /tmp/enc/ 2>/dev/null; tar czf $OUT/encoder_conv.tgz -C /tmp/enc .
left=$(( 560 - ($(date +%s) - t0) ))
SKIP_EXPORT=1 PROFILE=benchmarks/h200/results/run36_hift6_encoder_conv/hift36.yaml SHARDS=7 MERGE_S=60 BENCH_S=$(( left - 70 )) BENCH_ARGS="--batches 1" OUT=/tmp/hout bash benchmarks/h200/run.sh > /tmp/hift_bench.log 2>&1
grep "^| hift\|^| cfm\|^| flow\|^| 1 " /tmp/hift_bench.log
cp /tmp/hout/bench.json /tmp/hout/device.txt /tmp/hout/manifest.json $OUT/ 2>/dev/null
cp /tmp/hift_export.log /tmp/hift_bench.log /tmp/hout/; tar czf $OUT/hift36_extras.tgz -C /tmp/hout --exclude bench.json --exclude manifest.json .
echo "all done at $(( $(date +%s) - t0 )) s"
