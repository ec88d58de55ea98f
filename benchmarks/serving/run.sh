#!/usr/bin/env bash
# The serving benchmark on the H200, in two device calls chained while the machine is warm:
#   1. C2W_COMMIT=<sha> bash benchmarks/serving/run.sh export   (build h200_serve.yaml in SHARDS shards)
#   2. C2W_COMMIT=<sha> bash benchmarks/serving/run.sh bench    (MERGE=1: merge an export call's MERGE=0
#      shards first; c2w bench --serve: 28 and 78 tokens, one
#      shared voice; LANES="1 2" runs both with one and with two chunk lanes; SDET=<seconds> adds
#      determinism.py; PACED, OVERHEAD and LONG78 below add runs)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-}" in
  export)
    PROFILE=benchmarks/serving/h200_serve.yaml SHARDS=${SHARDS:-14} EXPORT_S=${EXPORT_S:-520} BENCH_S=0 \
      bash benchmarks/h200/run.sh ;;
  bench)
    # MERGE=1: first merge the shards an `export` call with MERGE=0 left (measuring on the GPU)
    [ "${MERGE:-0}" != 0 ] && SKIP_EXPORT=1 BENCH_S=0 bash benchmarks/h200/run.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
    # OVERLAP=<seconds>: first, how two engine calls overlap when two lanes run them (overlap.py)
    [ "${OVERLAP:-0}" != 0 ] && timeout $OVERLAP python3 benchmarks/serving/overlap.py /tmp/art/all \
      --out "$OUT/overlap.json" 2>&1 | grep -v Warning | tail -8
    # OVERHEAD=<seconds>: where a lone stream's time goes in the server (overhead.py)
    [ "${OVERHEAD:-0}" != 0 ] && timeout $OVERHEAD python3 benchmarks/serving/overhead.py /tmp/art/all \
      --out "$OUT/overhead.json" 2>&1 | grep -v Warning | tail -3
    for L in ${LANES:-1}; do       # LANES="1 2": each level with one and with two chunk lanes
      sfx=$([ "$L" = 1 ] && echo "" || echo "_lanes$L")
      timeout ${S28:-200} python3 cli.py bench /tmp/art/all --serve --lanes $L --concurrency ${N28:-1,2,4,8,16,32,64} \
        --chunk-tokens 28 --steady-chunks 8 --out "$OUT/serve28$sfx.json" 2>&1 | grep -v Warning | tail -30
      # PACED=<tokens/s>: the same with clients paced like an LLM yielding that many tokens per second
      [ "${PACED:-0}" != 0 ] && timeout ${S28:-200} python3 cli.py bench /tmp/art/all --serve --lanes $L \
        --concurrency ${N28:-1,2,4,8,16,32,64} --chunk-tokens 28 --steady-chunks 8 --token-rate $PACED \
        --out "$OUT/serve28_paced$sfx.json" 2>&1 | grep -v Warning | tail -30
      timeout ${S78:-200} python3 cli.py bench /tmp/art/all --serve --lanes $L --concurrency ${N78:-1,8,32,64} \
        --chunk-tokens 78 --steady-chunks 10 --out "$OUT/serve78$sfx.json" 2>&1 | grep -v Warning | tail -30
      # LONG78=<seconds>: 78-token sessions three times as long (30 steady chunks), so that the
      # steady phase outlasts the arrivals' ramp
      [ "${LONG78:-0}" != 0 ] && timeout $LONG78 python3 cli.py bench /tmp/art/all --serve --lanes $L \
        --concurrency ${NL78:-32,64} --chunk-tokens 78 --steady-chunks 30 --out "$OUT/serve78_long$sfx.json" \
        2>&1 | grep -v Warning | tail -30
    done
    # streams sharing one voice (a deployment's default speaker): set-ups come from the voice cache
    [ "${SV:-120}" != 0 ] && timeout ${SV:-120} python3 cli.py bench /tmp/art/all --serve --concurrency ${NV:-1,8,32} \
      --chunk-tokens 28 --steady-chunks 8 --voices 1 --out "$OUT/serve28_voice.json" 2>&1 | grep -v Warning | tail -20
    [ "${SDET:-0}" != 0 ] && timeout $SDET python3 benchmarks/serving/determinism.py /tmp/art/all --out "$OUT/determinism.json" 2>&1 | tail -12
    # the device tool returns a limited number of files: the markdown tables go in one archive
    (cd "$OUT" && tar czf tables.tgz *.md && rm -f *.md)
    true ;;
  *) echo "usage: run.sh export|bench" >&2; exit 2 ;;
esac
