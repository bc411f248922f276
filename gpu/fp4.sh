#!/usr/bin/env bash
# FP4 tiles on the GPU, one batch: compile every kernel the run needs in parallel (fills
# TileLang's cache), bit-exact GPU tests, `lab bench --json` of each FP4 tile at all its
# shapes, a short sweep of structural configs at bulk_1m, then a summary table.
# Usage (repo root, GPU machine): OUT=<dir> bash gpu/fp4.sh
set -u
OUT=${OUT:-/tmp/fp4-out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$(date +%s)
export FP4_DEADLINE=$((T0 + ${FP4_BUDGET_S:-115}))
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

$PY -m gpu.fp4_prewarm > "$OUT/prewarm.log" 2>&1
echo "prewarm rc=$? at $(( $(date +%s) - T0 ))s"

$PY -m pytest -q -m gpu tests/test_fp4_tiles.py -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - T0 ))s: $(tail -1 "$OUT/pytest_gpu.log")"

$PY -m gpu.fp4_bench "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 ))s"
cat "$OUT/summary.md" 2>/dev/null || tail -30 "$OUT/bench.log"
