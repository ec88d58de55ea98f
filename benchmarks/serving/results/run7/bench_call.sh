set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD C2W_COMMIT=6284366
END=$(( $(date +%s) + ${TOTAL:-575} ))
left() { r=$(( END - $(date +%s) )); [ $r -lt $1 ] && echo $r || echo $1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); timeout $(left 170) python3 cli.py merge /tmp/art/all /tmp/art/s* 2>&1 | grep -v Warning | tail -5
echo "merge wall $(( $(date +%s) - t0 )) s" | tee $OUT/merge_wall.txt
python3 cli.py report /tmp/art/all --format json > $OUT/report.json 2>/dev/null; cp /tmp/art/all/manifest.json $OUT/
B="python3 cli.py bench /tmp/art/all --serve --lanes 1"
timeout $(left 150) $B --concurrency 32 --chunk-tokens 78 --steady-chunks 30 --out $OUT/serve78_long.json 2>&1 | grep -v Warning | tail -12
timeout $(left 110) $B --concurrency 1,8 --chunk-tokens 28 --steady-chunks 8 --out $OUT/serve28.json 2>&1 | grep -v Warning | tail -12
timeout $(left 100) $B --concurrency 8 --chunk-tokens 28 --steady-chunks 8 --token-rate 25 --out $OUT/serve28_paced.json 2>&1 | grep -v Warning | tail -12
timeout $(left 45) python3 benchmarks/serving/overhead.py /tmp/art/all --out $OUT/overhead.json 2>&1 | grep -v Warning | tail -6
(cd $OUT && tar czf tables.tgz *.md 2>/dev/null && rm -f *.md); true
