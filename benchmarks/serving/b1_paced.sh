#!/usr/bin/env bash
# One device call (~6 min): the B=1 keys of h200_serve.yaml (its shards 1-10 and 24-26 of 26: the
# prompt set-up, the whole 28-token schedule, the final chunk), then `c2w bench --serve` at N=1
# and N=8 with clients paced at RATE tokens/s (default 25), which the paced N=8 level serves with
# B=1 calls only. Usage: C2W_COMMIT=<sha> bash benchmarks/serving/b1_paced.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_COMPILE_THREADS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=benchmarks/serving/h200_serve.yaml
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
for k in 1 2 3 4 5 6 7 8 9 10 24 25 26; do
  timeout ${EXPORT_S:-220} python3 cli.py export --profile $P --out /tmp/art/s$k --shard $k/26 --measure-at-merge \
    > "$OUT/export_s$k.log" 2>&1 &
done
wait
echo "export wall: $(( $(date +%s) - t0 )) s" | tee "$OUT/export_wall.txt"
grep -h "built, " "$OUT"/export_s*.log | sort | uniq -c
tar czf "$OUT/export_logs.tgz" -C "$OUT" $(cd "$OUT" && ls export_s*.log) && rm -f "$OUT"/export_s*.log
# the merge writes the merged manifest, then measures every key on the GPU (minutes for full-size
# keys); the benchmark needs no measurement, so the merge is stopped after the copy
timeout ${MERGE_S:-30} python3 cli.py merge /tmp/art/all /tmp/art/s* > /dev/null 2>&1
timeout ${BENCH_S:-80} python3 cli.py bench /tmp/art/all --serve --concurrency 1,8 --chunk-tokens 28 --steady-chunks 8 \
  --token-rate ${RATE:-25} --out "$OUT/serve28_paced.json" 2>&1 | grep -v Warning | tail -14
