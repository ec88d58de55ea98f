#!/usr/bin/env bash
# One device call: the flow encoder's engine from this tree against patched copies of it, at
# several keys (encoder_profile.py): all builds in parallel, then each timed and profiled alone.
# Usage (device tool, repo root):
#   PATCH=benchmarks/h200/results/session39_position_align/before.patch C2W_COMMIT=<hash> bash benchmarks/h200/encoder_ab.sh
# PATCH: one patch file or several, space-separated, relative to the repo root; each is applied
# to its own copy of this tree and tagged with its file name (without .patch).
# SHAPES: "B N C" triples, ';'-separated (default: the B=32 N=78 and B=1 N=28 keys of h200_core).
# The results (tag "main" and the patches' names) and build logs come back in $OUT/encoder_ab.tgz;
# the summary table (encoder_ab_table.py) is printed last and kept as $OUT/encoder_ab_table.txt.
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${THREADS:-4}
OUT=${OUT:-/tmp/out}; rm -rf /tmp/encoder_ab; mkdir -p "$OUT" /tmp/encoder_ab
ROOT=$PWD
. benchmarks/h200/patched_tree.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TREES=("main=$ROOT")
for patch in ${PATCH:?one or more patch files, relative to the repo root}; do
  tag=$(basename "$patch" .patch)
  patched_tree "$ROOT" "$patch" "/tmp/tree_$tag" || exit 1
  TREES+=("$tag=/tmp/tree_$tag")
done
IFS=';' read -ra SHAPES <<< "${SHAPES:-32 78 400;1 28 300}"
profile() {  # tree tag phase B N C
  ( cd "$1" && PYTHONPATH=$1 timeout "${STEP_S:-300}" python3 benchmarks/h200/encoder_profile.py --tag "$2" \
      --phase "$3" --batch "$4" --tokens "$5" --cache "$6" --out /tmp/encoder_ab )
}
t0=$(date +%s)
for shape in "${SHAPES[@]}"; do
  for tree in "${TREES[@]}"; do
    # shellcheck disable=SC2086
    profile "${tree#*=}" "${tree%%=*}" build $shape > "/tmp/encoder_ab/build_${tree%%=*}_${shape// /_}.log" 2>&1 &
  done
done
wait
echo "parallel builds: $(( $(date +%s) - t0 )) s"
for shape in "${SHAPES[@]}"; do
  for tree in "${TREES[@]}"; do
    # shellcheck disable=SC2086
    profile "${tree#*=}" "${tree%%=*}" time $shape 2>&1 | tee "/tmp/encoder_ab/time_${tree%%=*}_${shape// /_}.log" | grep encoder_profile_
  done
done
tar czf "$OUT/encoder_ab.tgz" -C /tmp/encoder_ab .
python3 benchmarks/h200/encoder_ab_table.py /tmp/encoder_ab | tee "$OUT/encoder_ab_table.txt"
