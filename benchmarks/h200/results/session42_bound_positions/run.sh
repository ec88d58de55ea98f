#!/usr/bin/env bash
# The A/B this candidate waits for (device tool, repo root, one call, ~330 s on an H100 for three
# keys): main (flow encoder revision 5) against main + bound_positions.patch (revision 6), each
# key built side by side and timed alone under its graph; encoder_ab_table.py prints the table.
# Rule set before the run: adopt if B=1 N=28 C=300 gains and B=32 N=78 C=400 does not lose.
export C2W_COMMIT=${C2W_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PATCH=benchmarks/h200/results/session42_bound_positions/bound_positions.patch \
SHAPES="${SHAPES:-1 28 300;32 78 400;1 28 400}" bash benchmarks/h200/encoder_ab.sh
