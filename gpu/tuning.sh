#!/usr/bin/env bash
# GPU check of the tuner (one device call): fault injection with real kernels, then a small real tuning run of an FP4 tile.
#   source .devbundle/prelude.sh && bash gpu/tuning.sh        (writes logs, the study and results under $OUT)
set -uo pipefail
OUT="${OUT:-gpu-out}"; mkdir -p "$OUT"
PY="${PY:-python3}"
TILE="${TUNE_TILE:-fp4_quant_main}"
export TILELANG_CACHE_DIR="$OUT/tl-cache"   # fresh cache: the pool really compiles, the GPU worker really loads

t0=$(date +%s)
timeout 75 "$PY" -m pytest -q -m gpu tests/test_tuning.py -k fault_injection -p no:cacheprovider >"$OUT/fault.log" 2>&1
fault_rc=$?
t1=$(date +%s)
timeout 70 "$PY" -m lab tune --arch auto --tile "$TILE" --shapes decode --trials 12 --timeout 25 --trial-timeout 30 \
  --compile-jobs "$(nproc)" --storage "sqlite:///$OUT/tune.db" --results "$OUT/results" >"$OUT/tune.log" 2>&1
tune_rc=$?
t2=$(date +%s)
"$PY" - "$OUT" "$TILE" <<'PYEOF' >"$OUT/summary.txt" 2>&1
import sys, optuna, statistics
from collections import Counter
out, tile = sys.argv[1], sys.argv[2]
optuna.logging.set_verbosity(optuna.logging.WARNING)
url = f"sqlite:///{out}/tune.db"
for name in optuna.get_all_study_names(url):
    st = optuna.load_study(study_name=name, storage=url)
    tr = [t for t in st.trials if t.user_attrs.get("outcome")]
    kinds = Counter(t.user_attrs["outcome"] for t in tr)
    comp = [t.user_attrs["compile_s"] for t in tr if t.user_attrs.get("compile_s") and "repeat_of" not in t.user_attrs]
    load = [t.user_attrs["load_s"] for t in tr if t.user_attrs.get("load_s") and "repeat_of" not in t.user_attrs]
    ok = [t for t in tr if t.user_attrs["outcome"] == "ok" and "repeat_of" not in t.user_attrs]
    d = next((t.user_attrs["ms"] for t in ok if t.user_attrs.get("source") == "default"), None)
    b = min(ok, key=lambda t: t.value) if ok else None
    print(f"{name}: trials={len(tr)} {dict(kinds)} median compile_s={statistics.median(comp) if comp else None} "
          f"median load_s={statistics.median(load) if load else None} default_ms={d} best_ms={b.value if b else None} "
          f"speedup={(d / b.value) if b and d else None} best={b.params if b else None}")
PYEOF
{
  echo "== fault injection (rc=$fault_rc, $((t1 - t0)) s)"; tail -n 5 "$OUT/fault.log"
  echo "== lab tune $TILE decode (rc=$tune_rc, $((t2 - t1)) s)"; tail -n 25 "$OUT/tune.log"
  echo "== studies"; cat "$OUT/summary.txt"
} | tee "$OUT/report.txt"
