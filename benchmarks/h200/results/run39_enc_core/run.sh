#!/usr/bin/env bash
# Run 39b: c2w export + merge + bench of h200_core's flow encoder keys (revision 5) with the first
# chunk's three keys (enc_core.yaml), one round of 7 shards. Device tool, repo root; C2W_COMMIT as run: d3302b0.
export C2W_COMMIT=${C2W_COMMIT:-$(git rev-parse --short HEAD)}
OUT=${OUT:-/tmp/out} PROFILE=benchmarks/h200/results/run39_enc_core/enc_core.yaml SHARDS=7 EXPORT_S=180 MERGE_S=40 BENCH_S=90 \
  BENCH_ARGS="--batches 1,32" bash benchmarks/h200/run.sh > /tmp/run.log 2>&1
tail -40 /tmp/run.log; cp /tmp/run.log ${OUT:-/tmp/out}/run.log
cd ${OUT:-/tmp/out} && tar czf enc_extras.tgz report.md run.log export_wall.txt merge.log merge_wall.txt calibration.json 2>/dev/null
rm -f report.md run.log merge.log calibration.json export_wall.txt merge_wall.txt; ls
