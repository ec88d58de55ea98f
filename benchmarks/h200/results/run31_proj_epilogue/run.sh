#!/usr/bin/env bash
# Run 31, one device call (repo root): C2W_COMMIT=<hash> bash benchmarks/h200/results/run31_proj_epilogue/run.sh
# The output projection with its epilogue as one Triton kernel (proj_epilogue.patch, not adopted)
# against the tree as it is: the kernel alone per tile at B=1's and B=32's rows
# (benchmarks/h200/proj_epilogue.py, which the patch adds), then both builds at full depth side by
# side at the steady B=32 key and the B=1 key (ab_candidates.sh).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=benchmarks/h200/results/run31_proj_epilogue/proj_epilogue.patch
rm -rf /tmp/pe && cp -r . /tmp/pe && (cd /tmp/pe && git apply "$P")
(cd /tmp/pe && PYTHONPATH=/tmp/pe timeout 120 python3 benchmarks/h200/proj_epilogue.py --out "$OUT") > /tmp/micro.log 2>&1
PATCHES="proj_epilogue=$P" BATCHES="32 1" BUILD_S=300 AB_S=150 bash benchmarks/h200/ab_candidates.sh > /tmp/ab.log 2>&1
cp /tmp/ab.log /tmp/micro.log "$OUT/"
tail -12 /tmp/micro.log; grep -v "^\s*$" /tmp/ab.log | tail -45
