#!/usr/bin/env bash
# Run 36e: the encoder B=32 N=78 key built alone by c2w export and benched alone, against encoder_profile.py's build, same machine.
export PYTHONUNBUFFERED=1 C2W_COMMIT=${C2W_COMMIT:-$(git rev-parse --short HEAD)} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; K=flow_encoder-B32-N78-C400-last0-float16
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s)
timeout 200 python3 cli.py export --profile benchmarks/h200/results/run36e_encoder_alone/enc78.yaml --out /tmp/e78 --shard 1/4 > /tmp/e78_export.log 2>&1; echo "export rc $? at $(( $(date +%s) - t0 )) s"
timeout 120 python3 cli.py bench /tmp/e78 --keys $K --batches 1 --reps 20 --out $OUT/bench.json > /tmp/e78_bench.log 2>&1; echo "bench rc $? at $(( $(date +%s) - t0 )) s"
grep "^| flow" /tmp/e78_bench.log
timeout 90 python3 benchmarks/h200/engine_kernels.py /tmp/e78 $K --out $OUT > /tmp/e78_kernels.log 2>&1; echo "kernels rc $? at $(( $(date +%s) - t0 )) s"; tail -3 /tmp/e78_kernels.log
timeout 200 python3 benchmarks/h200/encoder_profile.py --batch 32 --tokens 78 --cache 400 --reps 50 --out $OUT 2>&1 | grep encoder_profile_; echo "profile at $(( $(date +%s) - t0 )) s"
cp /tmp/e78/manifest.json $OUT/; tar czf $OUT/e78_logs.tgz -C /tmp e78_export.log e78_bench.log e78_kernels.log
timeout 60 python3 -m pytest -q -rs tests/runtime/test_cuda.py -k "eager_hift or example_inputs" 2>&1 | tail -4
