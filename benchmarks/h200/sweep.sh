#!/usr/bin/env bash
# A whole profile's sweep on one H200, longer than one device call: run.sh (export in shards,
# merge, which measures every key together, report) runs detached from the call (setsid), and each
# call waits on it for a while and brings back what it has so far. Chain the calls while the
# machine is warm; it goes back ~30 s after a call ends, and the run with it.
#   bash benchmarks/h200/sweep.sh start [WAIT_S]   start it, then wait as below
#   bash benchmarks/h200/sweep.sh wait [WAIT_S]    wait until it ends or WAIT_S (default 570) pass
# run.sh's settings pass through (PROFILE, SHARDS); the export gets no timeout of its own.
set -u
DIR=/tmp/sweep
OUT=${OUT:-/tmp/out}
if [ "${1:-}" = start ]; then
  mkdir -p "$DIR/out"; date +%s > "$DIR/t0"
  OUT=$DIR/out EXPORT_S=${EXPORT_S:-7200} BENCH_S=0 PROFILE=${PROFILE:-profiles/h200.yaml} SHARDS=${SHARDS:-24} \
    setsid nohup bash -c 'bash benchmarks/h200/run.sh; date +%s > /tmp/sweep/t_end' > "$DIR/run.log" 2>&1 < /dev/null &
fi
limit=${2:-570}; t=0
while [ ! -f "$DIR/t_end" ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$(( t + 10 )); done
mkdir -p "$OUT"
cp -r "$DIR"/out/. "$OUT"/ 2>/dev/null; cp "$DIR/run.log" "$OUT"/ 2>/dev/null
# the shards' manifests so far (run.sh archives them with the logs once the export ends)
for d in /tmp/art/s*; do [ -f "$d/manifest.json" ] && cp "$d/manifest.json" "$OUT/manifest_$(basename "$d").json"; done
tar czf "$OUT/progress.tgz" -C "$OUT" $(cd "$OUT" && ls export_s*.log manifest_s*.json 2>/dev/null) 2>/dev/null \
  && rm -f "$OUT"/export_s*.log "$OUT"/manifest_s*.json
now=$(date +%s); t0=$(cat "$DIR/t0")
echo "elapsed $(( now - t0 )) s; ended: $([ -f "$DIR/t_end" ] && echo "yes, at $(( $(cat "$DIR/t_end") - t0 )) s" || echo no)"
echo "keys started: $(cat "$DIR"/out/export_s*.log 2>/dev/null | grep -c ' building ') of the plan's; built so far:" \
  "$(cat /tmp/art/s*/manifest.json 2>/dev/null | grep -o '"status": "built"' | wc -l)"
[ -f "$DIR/out/merge.log" ] && { echo "merge:"; tail -3 "$DIR/out/merge.log"; }
free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv,noheader; df -h /tmp | tail -1
