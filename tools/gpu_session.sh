#!/usr/bin/env bash
# One GPU machine call of the lab, in phases, each under its own time limit; everything packed into one file.
# Usage (repo root, on the GPU machine, with TileLang and Optuna importable):
#   OUT=<dir> bash tools/gpu_session.sh prewarm pytest bench tune e2e
# Each phase writes <phase>.log into a work folder that is packed, with the results tree the phases updated, into
# $OUT/session.tgz at the end (unpack its results/ over the repo's). Figures land in results/<arch>/ through the lab's
# own commands (lab bench --save, lab tune, lab e2e): this script only sequences them and bounds their time.
set -u
FINAL_OUT=${OUT:-/tmp/lab-out}
OUT=${SESSION_WORK:-/tmp/lab-session}  # two sessions at once (one per GPU, CUDA_VISIBLE_DEVICES) need two work folders
rm -rf "$OUT" && mkdir -p "$OUT" "$FINAL_OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
LAB="python3 -m lab"
T0=$(date +%s)
SUMMARY=()
note() { SUMMARY+=("$(printf '%4ds %s' $(( $(date +%s) - T0 )) "$*")"); echo "== $*"; }

phase_prewarm() {  # compile every tile's default for this GPU in parallel (fills TileLang's disk cache)
  timeout "${PREWARM_S:-90}" $LAB check --compile-only --arch auto --tile all --jobs 16 > "$OUT/prewarm.log" 2>&1
  note "prewarm rc=$?"
}

phase_pytest() {  # the GPU tests (PYTEST_ARGS: files or ids; PYTEST_K: a -k expression; PYTEST_IDS: a file of ids)
  # --deadline skips the tests not started 40 s before the limit, so the run ends by itself with its report and junit
  # file (tools/unstarted_tests.py turns the skipped ones into the next call's PYTEST_IDS); SIGINT is the backstop.
  # 4 workers: compile-bound, and the torch references of the 128K indexer shapes need ~10 GiB each.
  local targets=(${PYTEST_ARGS:-tests})
  [ -n "${PYTEST_IDS:-}" ] && mapfile -t targets < "$PYTEST_IDS"
  timeout -s INT -k 30 "${PYTEST_S:-200}" python3 -m pytest -v -m gpu -n "${PYTEST_N:-4}" -p no:cacheprovider -rfE --tb=short \
    --deadline $(( ${PYTEST_S:-200} - 40 )) --junitxml="$OUT/pytest_gpu.xml" ${PYTEST_K:+-k "$PYTEST_K"} "${targets[@]}" > "$OUT/pytest_gpu.log" 2>&1
  note "pytest -m gpu rc=$?: $(tail -1 "$OUT/pytest_gpu.log")"
}

bench() {  # bench TILE SHAPES: lab bench --save (BENCH_CONFIG=tuned: each shape's stored winner)
  local tile=$1 shapes=$2 name=bench_$1${BENCH_CONFIG:+_$BENCH_CONFIG}
  timeout "${BENCH_S:-90}" $LAB bench --tile "$tile" --shape "$shapes" ${BENCH_CONFIG:+--config "$BENCH_CONFIG"} --save > "$OUT/$name.log" 2>&1
  note "bench $tile $shapes ${BENCH_CONFIG:-} rc=$?"
}

phase_bench() {  # every tile at its registry's target shapes, torch in the same run; BENCH_CONFIG=tuned for the winners
  bench sparse_attn_decode decode_b64_s1,decode_b128_s2
  bench sparse_attn_prefill prefill_s4k
  bench sparse_attn_bf16 decode_b128_s2,prefill_s4k
  bench indexer_topk decode_b64_n128k,decode_b1_n128k,prefill_s4k
  bench reindex_topk decode_b64_n128k
  bench candidate_pool decode_b64_n128k
  bench compressor prefill_r2_s64k,prefill_r1_s64k
  bench fp4_quant_main bulk_1m
  bench fp4_dequant_main bulk_1m
}

phase_bench-one() {  # one tile: BENCH_TILE, BENCH_SHAPES (BENCH_CONFIG=tuned: the stored winners)
  bench "${BENCH_TILE:?BENCH_TILE}" "${BENCH_SHAPES:?BENCH_SHAPES}"
}

phase_paged() {  # the paged cache's kernels: their GPU tests, then paged vs contiguous shapes at one config (the default)
  timeout -s INT -k 20 "${PAGED_TEST_S:-150}" python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfE --tb=short \
    tests/test_paged_kernels.py > "$OUT/paged_pytest.log" 2>&1
  note "paged pytest rc=$?: $(tail -1 "$OUT/paged_pytest.log")"
  BENCH_CONFIG="" bench sparse_attn_decode decode_b64_s1,decode_b64_s1_paged
  BENCH_CONFIG="" bench indexer_topk decode_b64_n128k,decode_b64_n128k_paged
  BENCH_CONFIG="" bench reindex_topk decode_b64_n128k,decode_b64_n128k_paged
}

phase_check() {  # lab check on this GPU, each cell launched CHECK_REPEATS times that must give the same bits
  timeout "${CHECK_S:-420}" $LAB check --arch auto --tile "${CHECK_TILES:-all}" --repeats "${CHECK_REPEATS:-3}" --jobs 16 > "$OUT/check.log" 2>&1
  note "check rc=$?: $(tail -1 "$OUT/check.log")"
}

phase_tune() {  # TUNE_TILES, TUNE_SHAPES, TUNE_TRIALS, TUNE_STUDY_S; winners into results/<arch>/<tile>.yaml
  timeout "${TUNE_S:-240}" $LAB tune --arch auto --tile "${TUNE_TILES:-sparse_attn_decode}" --shapes "${TUNE_SHAPES:-decode_b64_s1,decode_b128_s2}" \
    --trials "${TUNE_TRIALS:-12}" --timeout "${TUNE_STUDY_S:-60}" --compile-jobs 16 > "$OUT/tune.log" 2>&1
  note "tune rc=$?"
}

phase_e2e() {  # the model end to end, tiles vs torch, into results/<arch>/e2e/<gpu>.json and e2e.md
  timeout "${E2E_S:-300}" $LAB e2e --preset v4.1-flash --phase "${E2E_PHASES:-decode,prefill}" --ctx "${E2E_CTX:-64K}" --prefill-ctx "${E2E_PROMPTS:-16K}" \
    --batch "${E2E_BATCH:-64}" --backend "${E2E_BACKENDS:-torch,tiles}" --configs "${E2E_CONFIGS:-default}" --runs 10 --repeats 1 > "$OUT/e2e.log" 2>&1
  note "e2e rc=$?"
}

phase_profile() {  # per-kernel CUDA time of TILE:SHAPE[:CONFIG_JSON] specs against the floor (PROFILE_ARGS; tools/profile_tiles.py)
  # shellcheck disable=SC2086
  timeout "${PROFILE_S:-200}" python3 tools/profile_tiles.py ${PROFILE_ARGS:?PROFILE_ARGS} --compile-jobs 14 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
  note "profile rc=$?"
}

phase_ncu() {  # Nsight Compute of one tile config (NCU_TILE, NCU_SHAPE, NCU_CONFIG: a JSON override; NCU_KERNEL: name regex)
  # with per-instruction stall sampling (SourceCounters): tools/ncu_roles.py splits the SASS export by warp role
  if ! command -v ncu > /dev/null; then note "ncu: not installed"; return; fi
  local rep=/tmp/ncu_$$ pre="$OUT/${NCU_NAME:-ncu}"
  timeout "${NCU_S:-120}" ncu --kernel-name "regex:${NCU_KERNEL:-main}" --launch-skip 1 --launch-count 1 --section WarpStateStats \
    --section SourceCounters --section SpeedOfLight --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section Occupancy \
    --section ComputeWorkloadAnalysis -o "$rep" -f \
    python3 tools/profile_launch.py "${NCU_TILE:-sparse_attn_prefill}" "${NCU_SHAPE:-prefill_s4k}" "${NCU_CONFIG:-{\}}" > "${pre}_run.log" 2>&1
  note "ncu rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "${pre}_details.log" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "${pre}_sass.csv" 2>&1
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
for phase in "$@"; do
  if ! declare -F "phase_$phase" > /dev/null; then note "unknown phase $phase"; continue; fi
  "phase_$phase"
done
cp -r results "$OUT/results" 2>/dev/null
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
tar -czf "$FINAL_OUT/session.tgz" -C "$OUT" .
