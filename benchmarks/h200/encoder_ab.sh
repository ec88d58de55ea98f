#!/usr/bin/env bash
# One device call: the flow encoder's engine from this tree against a patched copy of it, at
# several keys (encoder_profile.py): all builds in parallel, then each timed and profiled alone.
# Usage (device tool, repo root):
#   PATCH=benchmarks/h200/results/session36_position/before.patch C2W_COMMIT=<hash> bash benchmarks/h200/encoder_ab.sh
# SHAPES: "B N C" triples, ';'-separated (default: the B=32 N=78 and B=1 N=28 keys of h200_core).
# The results (tag "main" and the patch's name) and build logs come back in $OUT/encoder_ab.tgz.
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${THREADS:-4}
OUT=${OUT:-/tmp/out}; rm -rf /tmp/encoder_ab; mkdir -p "$OUT" /tmp/encoder_ab
ROOT=$PWD; TAG=$(basename "${PATCH:?a patch file, relative to the repo root}" .patch)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
rm -rf "/tmp/tree_$TAG" && cp -r "$ROOT" "/tmp/tree_$TAG" && (cd "/tmp/tree_$TAG" && git apply "$ROOT/$PATCH") \
  || { echo "$PATCH does not apply"; exit 1; }
IFS=';' read -ra SHAPES <<< "${SHAPES:-32 78 400;1 28 300}"
profile() {  # tree tag phase B N C
  ( cd "$1" && PYTHONPATH=$1 timeout "${STEP_S:-300}" python3 benchmarks/h200/encoder_profile.py --tag "$2" \
      --phase "$3" --batch "$4" --tokens "$5" --cache "$6" --out /tmp/encoder_ab )
}
t0=$(date +%s)
for shape in "${SHAPES[@]}"; do
  # shellcheck disable=SC2086
  profile "$ROOT" main build $shape > "/tmp/encoder_ab/build_main_${shape// /_}.log" 2>&1 &
  # shellcheck disable=SC2086
  profile "/tmp/tree_$TAG" "$TAG" build $shape > "/tmp/encoder_ab/build_${TAG}_${shape// /_}.log" 2>&1 &
done
wait
echo "parallel builds: $(( $(date +%s) - t0 )) s"
for shape in "${SHAPES[@]}"; do
  # shellcheck disable=SC2086
  profile "$ROOT" main time $shape 2>&1 | tee "/tmp/encoder_ab/time_main_${shape// /_}.log" | grep encoder_profile_
  # shellcheck disable=SC2086
  profile "/tmp/tree_$TAG" "$TAG" time $shape 2>&1 | tee "/tmp/encoder_ab/time_${TAG}_${shape// /_}.log" | grep encoder_profile_
done
tar czf "$OUT/encoder_ab.tgz" -C /tmp/encoder_ab .
