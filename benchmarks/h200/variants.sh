#!/usr/bin/env bash
# One device call: Inductor build variants of the depth-2 CFM proxy (cfm_profile.py), compiled in
# parallel, then timed and profiled one at a time. Usage (device tool, repo root):
#   C2W_COMMIT=<hash> bash benchmarks/h200/variants.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_COMPILE_THREADS=3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
AUTOTUNE='{"max_autotune": true, "max_autotune_gemm_backends": "TRITON,ATEN"}'
# tag|inductor JSON|cfm_profile.py shape arguments
VARIANTS=${VARIANTS:-"default|{}|--batch 1
combo|{\"combo_kernels\": true}|--batch 1
autotune|$AUTOTUNE|--batch 1
default|{}|--batch 32 --T 150 --L 400
autotune|$AUTOTUNE|--batch 32 --T 150 --L 400"}
run() {  # phase tag json args...
  local phase=$1 tag=$2 json=$3; shift 3
  C2W_AOTI_INDUCTOR="$json" timeout ${STEP_S:-300} python3 benchmarks/h200/cfm_profile.py --phase "$phase" --tag "$tag" --out "$OUT" "$@"
}
t0=$(date +%s); i=0
while IFS='|' read -r tag json args; do
  i=$(( i + 1 ))
  # shellcheck disable=SC2086
  run build "$tag" "$json" $args > "$OUT/build_${i}_${tag}.log" 2>&1 &
done <<< "$VARIANTS"
wait
echo "parallel builds: $(( $(date +%s) - t0 )) s"
while IFS='|' read -r tag json args; do
  # shellcheck disable=SC2086
  run time "$tag" "$json" $args 2>&1 | grep -v Warning | tail -9
done <<< "$VARIANTS"
grep -h "built in\|Error" "$OUT"/build_*.log | tail -12
