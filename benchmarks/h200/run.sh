#!/usr/bin/env bash
# One device call: build a profile's AOTI artifacts in parallel shards, merge, report, bench.
# Usage (device tool, repo root): bash benchmarks/h200/run.sh   (carry .whl for the peer row)
# h200_core at 13 shards: CFM keys take up to ~7 min to build side by side (run 16), hence EXPORT_S.
set -u
N=${SHARDS:-13}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=$(( N < 16 ? 16 / N : 1 )) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
PROFILE=${PROFILE:-benchmarks/h200/h200_core.yaml}
# this run's shards only: a warm machine may still hold more from an earlier run of another profile
SHARD_DIRS=$(seq -f /tmp/art/s%g 1 $N); ALL=/tmp/art/all-$(basename "$PROFILE" .yaml)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# SKIP_EXPORT=1: merge and bench what an earlier call left in /tmp/art/s* (chain calls within ~30 s).
if [ -z "${SKIP_EXPORT:-}" ]; then
  t0=$(date +%s)
  # the shards share this GPU: none measures memory, c2w merge does (docs/budget.md)
  MEASURE=$([ "$N" -gt 1 ] && echo --measure-at-merge || echo "")
  # host and device memory in use every 10 s (MiB): a shard the kernel kills for memory leaves no traceback
  ( while sleep 10; do echo "$(( $(date +%s) - t0 )) s: host $(free -m | awk '/^Mem:/{print $3}'), GPU" \
      "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; done ) > "$OUT/memory_trace.txt" &
  tracer=$!; pids=()
  for k in $(seq 1 $N); do
    # each log ends with the shard's exit status (137: killed, e.g. for memory; 124: the timeout)
    { timeout ${EXPORT_S:-420} python3 cli.py export --profile $PROFILE --out /tmp/art/s$k --shard $k/$N $MEASURE
      echo "exit status $?"; } > "$OUT/export_s$k.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"; kill $tracer
  echo "export wall: $(( $(date +%s) - t0 )) s; shards not ending 0: $(grep -L 'exit status 0$' "$OUT"/export_s*.log | xargs -r -n1 basename | tr '\n' ' ')" \
    | tee "$OUT/export_wall.txt"
  # the device tool returns a limited number of files: one archive for the shard logs
  # and each shard's manifest (per-key build phases and Inductor's timers)
  for d in $SHARD_DIRS; do [ -f "$d/manifest.json" ] && cp "$d/manifest.json" "$OUT/manifest_$(basename "$d").json"; done
  tar czf "$OUT/export_logs.tgz" -C "$OUT" $(cd "$OUT" && ls export_s*.log export_wall.txt manifest_s*.json memory_trace.txt 2>/dev/null) \
    && rm -f "$OUT"/export_s*.log "$OUT"/manifest_s*.json "$OUT/memory_trace.txt"
fi
# MERGE=0: no merge (export only: merge in the next call; or bench the merged directory as it is).
if [ "${MERGE:-1}" != 0 ]; then
  t0=$(date +%s)
  # a line per key as it is measured (kept in merge.log if the call ends first)
  timeout ${MERGE_S:-9999} python3 cli.py merge $ALL $SHARD_DIRS > "$OUT/merge.log" 2>&1; tail -4 "$OUT/merge.log"
  echo "merge wall (measures every key on the GPU): $(( $(date +%s) - t0 )) s" | tee "$OUT/merge_wall.txt"
  python3 cli.py report $ALL --format markdown > "$OUT/report.md"; python3 cli.py report $ALL --format json > "$OUT/report.json"
  cp $ALL/manifest.json "$OUT/"
  grep -E "failed|error" "$OUT/report.md" | head -5
fi
# BENCH_S=0: export only.
if [ "${BENCH_S:-200}" != 0 ]; then
  timeout ${BENCH_S:-200} python3 cli.py bench $ALL --out "$OUT/bench.json" --reps ${REPS:-10} ${BENCH_ARGS:-} 2>&1 | tail -40
fi
