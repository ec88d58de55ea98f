#!/usr/bin/env bash
# One device call: Inductor build variants of the depth-2 CFM proxy (cfm_profile.py), compiled in
# parallel, then timed and profiled one at a time. Usage (device tool, repo root):
#   C2W_COMMIT=<hash> bash benchmarks/h200/variants.sh
# A variant line is `tag|inductor JSON|cfm_profile.py arguments[|patch]`: with a patch file (a path
# relative to the repo root), that variant builds and runs from a copy of the tree with the patch
# applied, made afresh in each call, so a product change is measured against the base in the same
# call. Tag and shape arguments together must differ between variants (they name the build).
# A variant whose build did not end well within STEP_S is not timed (a time phase would rebuild it).
# TIME=0 builds only (the packages stay in /tmp for ab_engines.py: ab_candidates.sh).
# The device tool returns 8 files: the build logs and result JSONs go into $OUT/variants.tar as
# each is done, so a call cut short keeps what it finished.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_COMPILE_THREADS=3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
. benchmarks/h200/patched_tree.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
AUTOTUNE='{"max_autotune": true, "max_autotune_gemm_backends": "TRITON,ATEN"}'
# tag|inductor JSON|cfm_profile.py shape arguments[|patch]
VARIANTS=${VARIANTS:-"default|{}|--batch 1
combo|{\"combo_kernels\": true}|--batch 1
autotune|$AUTOTUNE|--batch 1
default|{}|--batch 32 --T 150 --L 400
autotune|$AUTOTUNE|--batch 32 --T 150 --L 400"}
tree() {  # patch -> the tree a variant runs from (made once per patch)
  local patch=$1
  [ -z "$patch" ] && { echo "$ROOT"; return; }
  local dir=/tmp/variant_trees/$(basename "$patch" .patch)
  if [ -z "${MADE[$dir]:-}" ]; then        # a warm machine may hold a copy of an older tree: make it anew
    patched_tree "$ROOT" "$patch" "$dir" || return 1
    MADE[$dir]=1
  fi
  echo "$dir"
}
keep() {  # files... -> appended to $OUT/variants.tar, then removed from $OUT
  (cd "$OUT" && tar -rf variants.tar "$@" && rm -f "$@")
}
run() {  # phase tag json patch args...
  local phase=$1 tag=$2 json=$3 patch=$4 dir; shift 4
  dir=$(tree "$patch") || return 1
  # the variant's tree first on the path, for Inductor's compile workers too
  ( cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} C2W_AOTI_INDUCTOR="$json" timeout ${STEP_S:-300} \
      python3 benchmarks/h200/cfm_profile.py --phase "$phase" --tag "$tag" --out "$OUT" "$@" )
}
# the trees first, in this shell (parallel builds would race to make the same copy, and `tree` in
# a subshell would not remember that it made one)
declare -A MADE
while IFS='|' read -r tag json args patch; do tree "${patch:-}" > /dev/null || exit 1; done <<< "$VARIANTS"
t0=$(date +%s); i=0
while IFS='|' read -r tag json args patch; do
  i=$(( i + 1 ))
  # shellcheck disable=SC2086
  run build "$tag" "$json" "${patch:-}" $args > "$OUT/build_${i}_${tag}.log" 2>&1 &
done <<< "$VARIANTS"
wait
echo "parallel builds: $(( $(date +%s) - t0 )) s"
i=0
[ "${TIME:-1}" = 0 ] || while IFS='|' read -r tag json args patch; do
  i=$(( i + 1 ))
  if ! grep -q "built in" "$OUT/build_${i}_${tag}.log"; then
    echo "$tag ($args): not built (failed, or past ${STEP_S:-300} s: build_${i}_${tag}.log in variants.tar), not timed"
    continue
  fi
  # shellcheck disable=SC2086
  run time "$tag" "$json" "${patch:-}" $args 2>&1 | grep -v Warning | tail -9
  ls "$OUT"/cfm_profile_*.json > /dev/null 2>&1 && keep $(cd "$OUT" && ls cfm_profile_*.json)
done <<< "$VARIANTS"
grep -h "built in\|Error" "$OUT"/build_*.log | tail -12
keep $(cd "$OUT" && ls build_*.log)
