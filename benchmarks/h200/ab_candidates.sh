#!/usr/bin/env bash
# One device call: candidate changes to the CFM step, each a patch against this tree, built at full
# depth for the steady B=32 key and the B=1 key beside the tree as it is (tag `main`), all in
# parallel (variants.sh, build only), then served side by side in one process per key
# (ab_engines.py: ms per solve in alternating rounds, kernels, idle time, mel SNR against float32).
# Usage (device tool, repo root):
#   C2W_COMMIT=<hash> bash benchmarks/h200/ab_candidates.sh
# PATCHES: tag=patch pairs (default: run 25's conv-block candidates and run 26's attention
# kernel); BATCHES: "32 1" or one of them; BUILD_S: the parallel builds' limit (B=32 full depth: ~150 s side by side, run 25);
# AB_S: each comparison's limit.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=benchmarks/h200/results
PATCHES=${PATCHES:-"taps_outer=$R/run25_conv_taps/taps_outer.patch conv_kernels=$R/run25_conv_taps/conv_kernels.patch
conv_kernels_outer=$R/run25_conv_taps/conv_kernels_outer.patch triton_attention=$R/run26_attention_kernel/triton_attention.patch"}
BATCHES=${BATCHES:-"32 1"}
declare -A SHAPE=([32]="32 150 400" [1]="1 50 300")   # B T L of the steady B=32 key and the B=1 key
args() { read -r b t l <<< "${SHAPE[$1]}"; echo "--batch $b --T $t --L $l --depth 16"; }
variants=""
for b in $BATCHES; do                                  # B=32 first: its builds take longest
  variants="$variants${variants:+$'\n'}main|{}|$(args "$b")"
  for p in $PATCHES; do variants="$variants"$'\n'"${p%%=*}|{}|$(args "$b")|${p#*=}"; done
done
for p in main= $PATCHES; do                          # a warm machine's older builds must not stand in
  rm -f /tmp/cfm_profile_B*_d16_"${p%%=*}".{pt2,build.json}
done
VARIANTS="$variants" TIME=0 STEP_S=${BUILD_S:-330} bash benchmarks/h200/variants.sh
for b in $BATCHES; do
  read -r _ t l <<< "${SHAPE[$b]}"
  tags=""               # the builds that finished (cfm_profile.build_name; a failed one's log is in variants.tar)
  for p in main= $PATCHES; do
    tag=${p%%=*}
    [ -f "/tmp/cfm_profile_B${b}_T${t}_L${l}_d16_${tag}.build.json" ] && tags="$tags${tags:+,}$tag"
  done
  echo "B=$b: built $tags"
  [ "$b" = 32 ] && reps="--rounds 5 --reps 5" || reps="--rounds 6 --reps 10"
  # shellcheck disable=SC2046,SC2086
  timeout "${AB_S:-200}" python3 benchmarks/h200/ab_engines.py $(args "$b") --tags "$tags" $reps --out "$OUT" 2>&1 \
    | grep -v Warning
done
