#!/usr/bin/env bash
# One GPU call of the lab, in phases, each under its own time limit.
# Usage (repo root, GPU machine, after `source .devbundle/prelude.sh`):
#   OUT=<dir> bash gpu/session.sh prewarm pytest bench e2e-quick tune e2e
# Every phase writes <phase>.log (and JSON) into a work folder that is packed into one file,
# $OUT/session.tgz, at the end (the device tool brings back only a few files per call). The
# packed results/ folder (tuned YAML, bench JSON) unpacks over the repo's results/ as it is.
set -u
FINAL_OUT=${OUT:-/tmp/lab-out}
OUT=${SESSION_WORK:-/tmp/lab-session}  # two sessions at once (one per GPU) need two work folders
rm -rf "$OUT" && mkdir -p "$OUT" "$FINAL_OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
LAB="python3 -m lab"
T0=$(date +%s)
SUMMARY=()
note() { SUMMARY+=("$(printf '%4ds %s' $(( $(date +%s) - T0 )) "$*")"); echo "== $*"; }

phase_prewarm() {  # compile every tile's default for this GPU in parallel (fills TileLang's disk cache)
  timeout "${PREWARM_S:-90}" $LAB check --compile-only --arch sm90 --tile all --jobs 16 > "$OUT/prewarm.log" 2>&1
  note "prewarm rc=$? $(grep -c ' ok' "$OUT/prewarm.log") ok lines"
}

phase_pytest() {  # every GPU test (PYTEST_ARGS: a subset), 4 workers (compile-bound; 16 workers ran the GPU out of memory)
  # --deadline skips the tests not started 40 s before the limit, so the run ends by itself with its report and junit
  # file; SIGINT at the limit is the backstop (it lost the junit file twice in session 7, in xdist's teardown)
  # PYTEST_K: a -k expression (spaces allowed; PYTEST_ARGS is split on spaces)
  # PYTEST_IDS: a file of node ids, one per line (ids may hold spaces), e.g. a previous run's unstarted tests from
  # gpu/unstarted_tests.py; it replaces PYTEST_ARGS
  local targets=(${PYTEST_ARGS:-tests})
  [ -n "${PYTEST_IDS:-}" ] && mapfile -t targets < "$PYTEST_IDS"
  timeout -s INT -k 30 "${PYTEST_S:-200}" python3 -m pytest -v -m gpu -n "${PYTEST_N:-4}" -p no:cacheprovider -rfE --tb=short \
    --deadline $(( ${PYTEST_S:-200} - 40 )) --junitxml="$OUT/pytest_gpu.xml" ${PYTEST_K:+-k "$PYTEST_K"} "${targets[@]}" > "$OUT/pytest_gpu.log" 2>&1
  note "pytest -m gpu rc=$?: $(tail -1 "$OUT/pytest_gpu.log")"
}

INDEXER_SHAPES=decode_b64_n128k,decode_b1_n128k,prefill_s4k  # every bench of indexer_topk: its JSON holds one run's rows

bench() {  # bench TILE SHAPE[,SHAPE]: the JSON lands in results/<arch>/bench/ (packed with results/ at the end)
  # BENCH_CONFIG=tuned: each shape's stored winner (lab bench --config tuned), written as bench_<tile>_tuned.json
  local tile=$1 shapes=$2 dir=results/$(python3 -c "from tiles.arch import detect; print(detect().name)")/bench
  local name=bench_$tile${BENCH_CONFIG:+_$BENCH_CONFIG}
  mkdir -p "$dir"
  timeout "${BENCH_S:-60}" $LAB bench --tile "$tile" --shape "$shapes" ${BENCH_CONFIG:+--config "$BENCH_CONFIG"} --json > "$OUT/$name.json" 2> "$OUT/$name.log"
  local rc=$?
  [ $rc -eq 0 ] && cp "$OUT/$name.json" "$dir/$name.json"
  note "bench $tile $shapes ${BENCH_CONFIG:-} rc=$rc"
}

phase_bench() {
  bench sparse_attn_decode decode_b64_s1,decode_b128_s2
  bench sparse_attn_prefill prefill_s4k
  bench sparse_attn_bf16 decode_b128_s2,prefill_s4k
  bench indexer_topk $INDEXER_SHAPES
  bench reindex_topk decode_b64_n128k
  bench compressor prefill_r2_s64k,prefill_r1_s64k
  bench fp4_quant_main bulk_1m
  bench fp4_dequant_main bulk_1m
}

phase_bench-one() {  # one tile at chosen shapes: BENCH_TILE, BENCH_SHAPES (BENCH_CONFIG=tuned: the stored winners)
  bench "${BENCH_TILE:?BENCH_TILE}" "${BENCH_SHAPES:?BENCH_SHAPES}"
}

phase_bench-fp4() {  # the FP4 main-KV tiles at bulk_1m (issue 3's figures come from lab bench --json)
  bench fp4_quant_main bulk_1m
  bench fp4_dequant_main bulk_1m
}

phase_bench-indexer() {  # issue 6's tiles at their target shapes, torch in the same run
  bench indexer_topk $INDEXER_SHAPES
  bench reindex_topk decode_b64_n128k
  bench candidate_pool decode_b64_n128k
  bench compressor prefill_r2_s64k,prefill_r1_s64k
}

phase_bench-compressor() {  # the compressor's two 64K shapes, torch in the same run; then each on its stored winner
  bench compressor prefill_r2_s64k,prefill_r1_s64k
  BENCH_CONFIG=tuned bench compressor prefill_r2_s64k,prefill_r1_s64k
}

phase_bench-tuned() {  # the tiles whose stored winners differ from their defaults, each shape on its winner (torch in the same run)
  BENCH_CONFIG=tuned bench compressor prefill_r2_s64k,prefill_r1_s64k
  BENCH_CONFIG=tuned bench sparse_attn_prefill prefill_s4k
  BENCH_CONFIG=tuned bench indexer_topk $INDEXER_SHAPES
}

phase_bench-attn() {  # issue 5's attention tiles at their target shapes, torch in the same run
  bench sparse_attn_decode decode_b64_s1,decode_b128_s2
  bench sparse_attn_prefill prefill_s4k
}

phase_bench-decode() {  # the decode-sized tiles only (their targets are in microseconds: timed from CUDA-graph replay)
  bench sparse_attn_decode decode_b64_s1,decode_b128_s2
  bench indexer_topk $INDEXER_SHAPES  # (and prefill 4K: one JSON per tile holds every shape it benches)
}

phase_attn() {  # sparse attention: every schedule/producer checked against the reference, then timed (gpu/sparse_attn_check.py)
  mkdir -p "$OUT/attn"
  timeout "${ATTN_S:-300}" python3 gpu/sparse_attn_check.py --out "$OUT/attn" --workers 14 ${ATTN_LABELS:+--labels "$ATTN_LABELS"} > "$OUT/attn.log" 2>&1
  note "attn rc=$? $(grep -c ' ok ' "$OUT/attn.log") ok checks"
}

phase_queued() {  # the options written after a session's device time, checked and timed against the defaults
  # After session 12: compress() keeps each layer's prepared Wk instead of reordering it every call (CPU-tested, not timed):
  # the decode step at 64K on tiles (session 12: 23.84 ms, e2e_decode_64k_run10/) and the compressor/backend GPU tests.
  E2E_NAME=e2e_decode_queued E2E_PHASES=decode E2E_CTX=64K E2E_BATCH=64 E2E_BACKENDS=tiles E2E_CONFIGS=default phase_e2e
  PYTEST_ARGS="tests/test_compressor.py tests/test_tiles_backend.py" PYTEST_S="${PYTEST_S:-240}" phase_pytest
}

phase_prefill-ops() {  # the CED prefill op by op (gpu/prefill_ops.py; PREFILL_PROMPT tokens, default 64K, on tiles/default)
  timeout "${PREFILL_OPS_S:-200}" python3 gpu/prefill_ops.py --prompt "${PREFILL_PROMPT:-65536}" --json "$OUT/prefill_ops.json" > "$OUT/prefill_ops.log" 2>&1
  note "prefill-ops rc=$?"
}

phase_ablation() {  # the attention default with one role's work removed (gpu/attn_ablation.py): which role paces a block
  # ABLATION_CONFIG: a JSON override of every tile's default; ABLATION_VARIANTS: e.g. default,producer_idle;
  # ABLATION_CASES: e.g. sparse_attn_prefill:prefill_s4k (default: every case of gpu/attn_ablation.py)
  timeout "${ABLATION_S:-300}" python3 gpu/attn_ablation.py --json "$OUT/attn_ablation.json" --config "${ABLATION_CONFIG:-{\}}" \
    ${ABLATION_VARIANTS:+--variants "$ABLATION_VARIANTS"} ${ABLATION_CASES:+--cases "$ABLATION_CASES"} > "$OUT/attn_ablation.log" 2>&1
  note "ablation rc=$?"
}

phase_attn-scaling() {  # per-block vs per-CTA time of the attention default (gpu/attn_block_scaling.py; SCALING_CONFIG: JSON override)
  # SCALING_TILE (default sparse_attn_prefill); SCALING_VARIANTS: default and timing ablations, e.g. default,no_q_load
  mkdir -p "$OUT/scaling"
  timeout "${SCALING_S:-150}" python3 gpu/attn_block_scaling.py --out "$OUT/scaling" --config "${SCALING_CONFIG:-{\}}" \
    --tile "${SCALING_TILE:-sparse_attn_prefill}" --variants "${SCALING_VARIANTS:-default}" > "$OUT/scaling.log" 2>&1
  note "attn-scaling rc=$? $(grep 'fixed per CTA' "$OUT/scaling.log" | tr '\n' ';')"
}

phase_profile() {  # indexer and compressor: old and new paths, per-kernel CUDA time against the floor (gpu/profile_tiles.py)
  if [ -n "${PROFILE_ARGS:-}" ]; then  # a subset, e.g. PROFILE_ARGS="indexer_topk:decode_b64_n128k"
    # shellcheck disable=SC2086
    timeout "${PROFILE_S:-200}" python3 gpu/profile_tiles.py $PROFILE_ARGS --compile-jobs 14 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
    note "profile rc=$?"
    return
  fi
  timeout "${PROFILE_S:-200}" python3 gpu/profile_tiles.py \
    'indexer_topk:decode_b64_n128k:{"dequant":"shared","tiles_per_cta":4}' \
    'indexer_topk:decode_b64_n128k:{"dequant":"lut","threads":128,"stages":1,"tiles_per_cta":4,"select_threads":512}' \
    indexer_topk:decode_b64_n128k \
    'indexer_topk:decode_b64_n128k:{"dequant":"fragment_bits","stages":4}' \
    'indexer_topk:decode_b64_n128k:{"dequant":"bits","threads":128,"tiles_per_cta":16}' \
    'compressor:prefill_r2_s64k:{"load":"direct","k_chunk":64}' compressor:prefill_r2_s64k \
    'compressor:prefill_r1_s64k:{"load":"direct","k_chunk":64}' compressor:prefill_r1_s64k \
    --compile-jobs 14 --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
  note "profile rc=$?"
}

phase_fp4() {  # FP4 tiles: structural sweep at bulk_1m (old and new mappings / code paths), checked bit-exactly first
  mkdir -p "$OUT/fp4"
  FP4_SWEEP_ONLY=${FP4_SWEEP_ONLY:-1} FP4_DEADLINE=$(( $(date +%s) + ${FP4_S:-120} - 10 )) \
    timeout "${FP4_S:-120}" python3 -m gpu.fp4_bench "$OUT/fp4" > "$OUT/fp4.log" 2>&1
  note "fp4 rc=$?"
}

phase_ncu() {  # Nsight Compute on the attention prefill default (NCU_CONFIG: a JSON override): where the warps stall (if ncu is installed)
  if ! command -v ncu > /dev/null; then note "ncu: not installed"; return; fi
  timeout "${NCU_S:-120}" ncu --kernel-name regex:main --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
    python3 gpu/attn_probe.py "${NCU_TILE:-sparse_attn_prefill}" "${NCU_SHAPE:-prefill_s4k}" "${NCU_CONFIG:-{\}}" > "$OUT/${NCU_NAME:-ncu}.log" 2>&1
  note "ncu rc=$?"
}

phase_ncu-source() {  # per-instruction stall sampling of a tile (default: the attention prefill default): which warps wait, on what
  # NCU_TILE / NCU_SHAPE / NCU_CONFIG (a JSON override of the default config) / NCU_KERNEL (kernel name regex) /
  # NCU_SKIP / NCU_COUNT (matching launches skipped, then profiled: default 1 / 1) /
  # NCU_REP (the report path, without .ncu-rep: one per job when two GPUs profile at once) / NCU_NAME (the output files'
  # prefix, default ncu_source: two profiles in one job)
  if ! command -v ncu > /dev/null; then note "ncu: not installed"; return; fi
  local rep=${NCU_REP:-/tmp/attn_src} pre="$OUT/${NCU_NAME:-ncu_source}"
  timeout "${NCU_S:-120}" ncu --kernel-name "regex:${NCU_KERNEL:-main}" --launch-skip "${NCU_SKIP:-1}" --launch-count "${NCU_COUNT:-1}" --section WarpStateStats --section SourceCounters \
    --section SpeedOfLight --section SchedulerStats --section MemoryWorkloadAnalysis_Tables --section Occupancy --section ComputeWorkloadAnalysis \
    -o "$rep" -f python3 gpu/attn_probe.py "${NCU_TILE:-sparse_attn_prefill}" "${NCU_SHAPE:-prefill_s4k}" "${NCU_CONFIG:-{\}}" > "${pre}_run.log" 2>&1
  note "ncu-source rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "${pre}_details.log" 2>&1
  # per-pipe utilisation (ComputeWorkloadAnalysis's raw metrics: tensor, ALU, FMA, shared pipes ...), one row per metric
  ncu -i "$rep.ncu-rep" --page raw --csv 2> /dev/null \
    | python3 -c 'import csv,sys; r=list(csv.reader(sys.stdin)); [print(f"{n},{u},{v}") for row in r[2:] for n,u,v in zip(r[0],r[1],row) if "pipe" in n or n == "Kernel Name"]' \
    > "${pre}_pipes.csv" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "${pre}_sass.csv" 2>&1 \
    || ncu -i "$rep.ncu-rep" --page raw --csv > "${pre}_raw.csv" 2>&1
}

phase_ncu-ablation() {  # Nsight Compute of the attention default and its timing ablations (gpu/attn_ablation.py): which unit the roles share
  # NCU_VARIANTS: comma-separated, "default" or an ablation name; NCU_TILE / NCU_SHAPE as phase ncu
  if ! command -v ncu > /dev/null; then note "ncu: not installed"; return; fi
  local v cfg rep
  for v in ${NCU_VARIANTS//,/ }; do
    cfg="{\"ablate\": \"$v\"}"
    [ "$v" = default ] && cfg='{}'
    rep=/tmp/ncu_abl_${v}_$$
    timeout "${NCU_S:-120}" ncu --kernel-name regex:main --launch-skip 1 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats -o "$rep" -f \
      python3 gpu/attn_probe.py "${NCU_TILE:-sparse_attn_prefill}" "${NCU_SHAPE:-prefill_s4k}" "$cfg" > "$OUT/ncu_abl_${v}_run.log" 2>&1
    note "ncu-ablation $v rc=$?"
    ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu_abl_${v}.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page raw --csv 2> /dev/null \
      | python3 -c 'import csv,sys; r=list(csv.reader(sys.stdin)); [print(f"{n},{u},{v}") for row in r[2:] for n,u,v in zip(r[0],r[1],row) if any(k in n for k in ("pipe", "l1tex__data", "mio", "lsu", "issue_stalled", "Kernel Name"))]' \
      > "$OUT/ncu_abl_${v}_pipes.csv" 2>&1
  done
}

phase_select() {  # the two-pass select's configs checked exactly and timed (gpu/select_check.py; SELECT_LABELS: names or patterns)
  mkdir -p "$OUT/select"
  timeout "${SELECT_S:-240}" python3 gpu/select_check.py --out "$OUT/select" --labels "${SELECT_LABELS:-default}" > "$OUT/select.log" 2>&1
  note "select rc=$? $(grep -c WRONG "$OUT/select.log") WRONG lines"
}

phase_check-repeats() {  # lab check on this GPU, each cell launched CHECK_REPEATS times that must give the same bits
  # (on a cold TileLang cache --tile all spent more than 220 s compiling in session 16: run prewarm first, or allow more)
  timeout "${CHECK_S:-420}" $LAB check --arch auto --tile "${CHECK_TILES:-all}" --repeats "${CHECK_REPEATS:-5}" --jobs 16 > "$OUT/check_repeats.log" 2>&1
  note "check-repeats rc=$?: $(tail -1 "$OUT/check_repeats.log")"
}

phase_e2e-quick() {
  timeout "${E2E_QUICK_S:-120}" $LAB e2e --preset v4.1-flash --phase decode --ctx 8K --batch 64 --backend "${E2E_BACKENDS:-torch,tiles}" --configs default \
    --runs 5 --out "$OUT/e2e-quick" > "$OUT/e2e-quick.log" 2>&1
  note "e2e-quick rc=$?"
}

phase_tune() {
  timeout "${TUNE_S:-240}" $LAB tune --arch auto --tile "${TUNE_TILES:-sparse_attn_decode}" --shapes "${TUNE_SHAPES:-decode_b64_s1,decode_b128_s2}" \
    --trials "${TUNE_TRIALS:-12}" --timeout "${TUNE_STUDY_S:-60}" --compile-jobs 16 > "$OUT/tune.log" 2>&1
  note "tune rc=$? (results/sm90/*.yaml)"
  # the first tuned tile's first shape (a study the run just wrote; the tile and shape defaults above otherwise)
  local tiles=${TUNE_TILES:-sparse_attn_decode} shapes=${TUNE_SHAPES:-decode_b64_s1,decode_b128_s2}
  COLUMNS=200 timeout 30 $LAB tune --arch sm90 --replay "${tiles%%,*}:sm90:${shapes%%,*}" > "$OUT/replay.log" 2>&1
}

phase_e2e-prefill64k() {  # the 64K prefill: CED on torch and tiles (vs torch), then CED vs non-CED on tiles (a torch non-CED 64K prefill takes minutes)
  E2E_NAME=e2e_ced E2E_PHASES=prefill_ced E2E_CTX=64K E2E_PROMPTS=64K E2E_BATCH=1 E2E_BACKENDS=torch,tiles E2E_CONFIGS=default phase_e2e
  E2E_NAME=e2e_ced_vs_full E2E_PHASES=prefill E2E_CTX=64K E2E_PROMPTS=64K E2E_BATCH=1 E2E_BACKENDS=tiles E2E_CONFIGS=default phase_e2e
}

phase_compressor-waves() {  # the compressor's time against the number of CTA waves (gpu/compressor_waves.py; WAVES_CONFIGS: JSON per line)
  local cfgs=()
  mapfile -t cfgs <<< "${WAVES_CONFIGS:-{\}}"
  timeout "${WAVES_S:-200}" python3 gpu/compressor_waves.py --ratio "${WAVES_RATIO:-2}" --waves "${WAVES:-1,2,2.59,3,3.88,4}" "${cfgs[@]}" \
    --json "$OUT/${WAVES_NAME:-compressor_waves}.json" > "$OUT/${WAVES_NAME:-compressor_waves}.log" 2>&1
  note "compressor-waves rc=$?"
}

phase_compressor-ablation() {  # the compressor with pieces of its pooling made cheaper (gpu/compressor_ablation.py; ABLATION_CONFIGS: JSON per line)
  local cfgs=()
  mapfile -t cfgs <<< "${ABLATION_CONFIGS:-{\}}"
  timeout "${ABLATION_S:-200}" python3 gpu/compressor_ablation.py "${ABLATION_SHAPE:-prefill_r2_s64k}" "${cfgs[@]}" \
    ${ABLATION_VARIANTS:+--variants "$ABLATION_VARIANTS"} --json "$OUT/${ABLATION_NAME:-compressor_ablation}.json" > "$OUT/${ABLATION_NAME:-compressor_ablation}.log" 2>&1
  note "compressor-ablation rc=$?"
}

phase_score-ablation() {  # the indexer's score kernel with its dequant and/or its score stores taken out (gpu/score_ablation.py)
  mkdir -p "$OUT/${SCORE_ABLATION_NAME:-score_ablation}"
  timeout "${SCORE_ABLATION_S:-200}" python3 gpu/score_ablation.py --out "$OUT/${SCORE_ABLATION_NAME:-score_ablation}" \
    --shapes "${SCORE_ABLATION_SHAPES:-decode_b64_n128k}" --variants "${SCORE_ABLATION_VARIANTS:-default,no_dequant,no_store,no_dequant_no_store}" \
    > "$OUT/${SCORE_ABLATION_NAME:-score_ablation}.log" 2>&1
  note "score-ablation rc=$?"
}

phase_e2e() {
  timeout "${E2E_S:-300}" $LAB e2e --preset v4.1-flash --phase "${E2E_PHASES:-decode,prefill}" --ctx "${E2E_CTX:-8K,64K}" --prefill-ctx "${E2E_PROMPTS:-16K}" --batch "${E2E_BATCH:-1,64}" \
    --backend "${E2E_BACKENDS:-torch,tiles}" --configs "${E2E_CONFIGS:-tuned,default}" --runs 10 --repeats "${E2E_REPEATS:-1}" \
    --out "$OUT/${E2E_NAME:-e2e}" > "$OUT/${E2E_NAME:-e2e}.log" 2>&1
  note "e2e ${E2E_NAME:-e2e} rc=$?"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
for phase in "$@"; do "phase_$phase"; done
cp -r results "$OUT/results" 2>/dev/null
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
tar -czf "$FINAL_OUT/session.tgz" -C "$OUT" .
