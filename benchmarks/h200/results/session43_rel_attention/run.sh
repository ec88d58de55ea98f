#!/usr/bin/env bash
# The A/B the flow encoder's two candidates wait for (device tool, repo root, one call; about 400 s
# on an H100 by runs 39a and 40: eight builds side by side, then each timed alone under its graph):
#   main                 flow encoder AOTI revision 5
#   bound_positions      revision 6: the projected position tables bound per key (session 42)
#   rel_attention        revision 7: the attention after the products as one Triton kernel (session 43)
#   rel_attention_bound  revision 8: both
# at the B=1 N=28 C=300 and B=32 N=78 C=400 keys; encoder_ab_table.py prints the table last.
# Rules, set before the run (served ms of the engine under its graph, against main's):
#   bound_positions: adopt if B=1 gains and B=32 does not lose (session 42's rule).
#   rel_attention: adopt if both keys gain and its rel-L2 against float32 is at most 1.1x main's.
#   both adopted: apply rel_attention_bound.patch if it is at least as fast as the faster of the
#   two alone at both keys; else apply the patch of the one with the larger B=1 gain.
export C2W_COMMIT=${C2W_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
HERE=benchmarks/h200/results
PATCH="$HERE/session42_bound_positions/bound_positions.patch $HERE/session43_rel_attention/rel_attention.patch
$HERE/session43_rel_attention/rel_attention_bound.patch" \
SHAPES="${SHAPES:-1 28 300;32 78 400}" bash benchmarks/h200/encoder_ab.sh
