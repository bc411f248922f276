"""GPU check and timing of the two-pass radix top-k (tiles/radix_select.py) against the indexer's select.

For every label (a radix_select config) and every case of ``tiles.radix_select.CASES`` at the shapes
below (plus odd ones), the output (poisoned with 12345 first) must equal the torch reference exactly:
same inputs, so the tie rule leaves no freedom. The existing path (``tiles.indexer.launch._select_in_parts``
with the indexer tile's default select config and its ``select_split`` rule) is checked the same way.
Then both are timed per shape: CUDA-graph replay (device time, the scores L2-resident as they are right
after the score kernel) and, beside it, rotating input sets past L2 (cold) and eager per-call time.

    source .devbundle/prelude.sh && python3 gpu/select_check.py --out $OUT [--labels default,p1,...] [--no-time]

Prints a table and rewrites ``select_check.json`` (rows + environment + command) under --out after
every row. Without a CUDA GPU it exits with status 2.
"""

import argparse
import fnmatch
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K = 512  # v4.1-flash index_topk
SHAPES = [(64, 131072), (1, 131072), (4096, 8192)]  # decode B=64 x 128K, one long row, prefill-like rows
ODD = [(3, 1000), (5, 77), (2, 600), (7, 70001)]
LABELS = {"default": {}}  # overrides of tiles.radix_select.DEFAULT_CONFIG
for _t in (256, 512, 1024):
    for _p in (1, 2, 4, 8, 32):
        LABELS[f"t{_t}_p{_p}"] = {"threads": _t, "parts": _p}
LABELS.update(
    agg={"agg": True},  # warp-aggregated histogram atomics (match.any)
    agg_t1024_l16={"agg": True, "threads": 1024, "loads": 16},  # the first design point
    loads4={"loads": 4},
    loads16={"loads": 16},
    hb12={"hist_bits": 12},
    cap8k={"cap": 8192},
    # stage="shared": the part copied into shared memory once, both passes read it there (session 12)
    staged={"stage": "shared"},
    staged_p16={"stage": "shared", "parts": 16},
    staged_cap2k={"stage": "shared", "cap": 2048},
    staged_t512={"stage": "shared", "threads": 512},
    staged_t1024={"stage": "shared", "threads": 1024},
    staged_loads16={"stage": "shared", "loads": 16},
    # compaction: the candidates to shared memory by one ballot per load (compact_pass, the default since session 16)
    # or by the general ordered pass (the default before)
    ordered={"compaction": "ordered_pass"},
    compact={"compaction": "compact_pass"},
    compact_t512={"compaction": "compact_pass", "threads": 512},
    compact_t1024={"compaction": "compact_pass", "threads": 1024},
    compact_loads16={"compaction": "compact_pass", "loads": 16},
    compact_staged_t512={"compaction": "compact_pass", "stage": "shared", "threads": 512},
)


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    """'64x131072,1x131072' -> [(64, 131072), (1, 131072)] (rows x row length)."""
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes must be RxN[,RxN...] with positive R and N, got {text!r}")
    return shapes


def _compile_job(job):
    """Worker: build the kernels of one label (every (parts, rows) the shapes resolve to) so TileLang's disk cache
    holds them. Returns (label, seconds, error)."""
    label, launches = job
    from tiles import radix_select as rs
    from tiles.arch import get_arch

    t0 = time.time()
    try:
        cfg = rs.check_config(LABELS[label], K)
        for parts, rows in launches:
            rs._kernels(get_arch("sm90"), K, cfg, parts, rows)
        return label, time.time() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported in the table, never fatal
        return label, time.time() - t0, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-400:]


def _old_launcher(R: int, N: int, arch):
    """The indexer's select as ``_launch_topk`` runs it: default select config, ``select_split`` resolved per shape."""
    from tiles import indexer as ix
    from tiles.indexer import launch as ix_launch
    from tiles.indexer import select_kernel as ix_select_kernel

    cfg = ix.INDEXER_TOPK.default_config(arch)
    select = ix_select_kernel._select_kernel(arch.nvcc_arch, K, cfg["select_threads"], cfg["radix_bits"], 0)
    parts = ix.resolve_select_split(cfg.get("select_split", 1), R, N, K, arch)
    return (lambda scores, nvis, out: ix_launch._select_in_parts(select, parts, scores, nvis, out)), parts


def _dump(out_dir: Path, rows: list[dict], cmd: str, env: dict | None = None) -> None:
    """Rewrite the results file after every row, so a run cut short still leaves what it measured."""
    (out_dir / "select_check.json").write_text(json.dumps({"environment": env, "command": cmd, "rows": rows}, indent=1, default=str))


def _check(launch, R: int, N: int, seed: int) -> tuple[bool, str]:
    """Every case at (R, N): output poisoned, launched, compared with the reference exactly."""
    import torch

    from tiles import radix_select as rs

    bad = []
    for case in rs.CASES:
        scores, nvis = rs.make_case(case, R, N, K, seed, "cuda")
        out = torch.full((R, K), 12345, dtype=torch.int32, device="cuda")  # [R, K] poisoned
        launch(scores, nvis, out)
        want = rs.reference_topk(scores, nvis, K)
        if not torch.equal(out, want):
            rows_bad = int((out != want).any(1).sum())
            bad.append(f"{case}: {rows_bad}/{R} rows differ")
    return not bad, "; ".join(bad)


def _time(launch, sets: list, out) -> dict:
    """Milliseconds per call of ``launch(scores, n_valid, out)``: CUDA-graph replay on set 0 (L2-resident when it
    fits), graph replay rotating all sets (past L2), eager events on set 0."""
    from tiles.timing import time_cuda, time_cuda_graph

    try:
        warm = time_cuda_graph(lambda i: launch(*sets[0], out), n_sets=1)
        cold = time_cuda_graph(lambda i: launch(*sets[i], out), n_sets=len(sets))
        eager = time_cuda(lambda i: launch(*sets[0], out), warmup=3, runs=20, min_time_ms=5)
    except Exception as exc:  # noqa: BLE001 - a failed timing is a row, not the end of the run
        return {"message": "".join(traceback.format_exception_only(type(exc), exc)).strip()[-400:]}
    return {
        "graph_ms": warm.median_ms if warm else None,
        "graph_cold_ms": cold.median_ms if cold else None,
        "cold_sets": len(sets),
        "eager_ms": eager.median_ms,
    }


def _ms(x) -> str:
    return f"{x:8.4f}" if x is not None else f"{'-':>8s}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--labels", default=",".join(LABELS), help="radix_select configs to check and time (names or fnmatch patterns, comma-separated)"
    )
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--no-time", action="store_true", help="checks only")
    parser.add_argument(
        "--shapes", type=_parse_shapes, default=SHAPES, help="the timed shapes, RxN comma-separated (default: 64x131072,1x131072,4096x8192)"
    )
    args = parser.parse_args()
    pats = [pat for pat in args.labels.split(",") if pat]
    labels = [lab for lab in LABELS if any(fnmatch.fnmatchcase(lab, pat) for pat in pats)]
    unknown = [pat for pat in pats if not any(fnmatch.fnmatchcase(lab, pat) for lab in LABELS)]
    if unknown:
        parser.error(f"unknown labels {unknown}: known are {list(LABELS)}")
    cmd = "python3 gpu/select_check.py " + " ".join(sys.argv[1:])

    import torch

    if not torch.cuda.is_available():
        print("select_check: no CUDA GPU here; run it on a GPU machine (see the module docstring)", file=sys.stderr)
        return 2

    from tiles import radix_select as rs
    from tiles.arch import detect
    from tiles.timing import describe_environment, input_sets_for_l2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = detect()
    env = describe_environment()
    all_shapes = args.shapes + ODD
    rows: list[dict] = []

    # --- compile (spawn pool: TileLang's disk cache then serves this process) ----------------------
    t0 = time.time()
    jobs = []
    for lab in labels:
        cfg = {**rs.DEFAULT_CONFIG, **LABELS[lab]}
        jobs.append((lab, sorted({(rs.resolve_parts(cfg["parts"], R, N, K, arch), R) for R, N in all_shapes})))
    compile_err = {}
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        for lab, secs, err in pool.map(_compile_job, jobs):
            if err:
                compile_err[lab] = err
            print(f"compiled {lab:10s} {secs:6.1f}s {'ERR ' + err if err else ''}", flush=True)
    print(f"compile phase {time.time() - t0:.1f}s", flush=True)

    # --- correctness ------------------------------------------------------------------------------
    ok_labels = []
    for R, N in all_shapes:
        launch, parts = _old_launcher(R, N, arch)
        ok, msg = _check(launch, R, N, seed=R * 7 + N)
        rows.append({"kind": "check", "label": "old_select", "R": R, "N": N, "parts": parts, "ok": ok, "message": msg})
        print(f"check old_select R={R:5d} N={N:6d} parts={parts:2d} {'ok' if ok else 'WRONG ' + msg}", flush=True)
    for lab in labels:
        good = lab not in compile_err
        for R, N in all_shapes:
            row = {"kind": "check", "label": lab, "R": R, "N": N, "config": {**rs.DEFAULT_CONFIG, **LABELS[lab]}}
            if lab in compile_err:
                row.update(ok=False, message="compile error: " + compile_err[lab])
            else:
                try:
                    row["parts"] = rs.resolve_parts(row["config"]["parts"], R, N, K, arch)
                    launch = rs.select_launcher(R, N, K, "cuda", arch=arch, config=LABELS[lab])
                    ok, msg = _check(launch, R, N, seed=R * 7 + N)
                    torch.cuda.synchronize()
                    row.update(ok=ok, message=msg)
                except Exception as exc:  # noqa: BLE001 - a faulting config is a row, not the end of the run
                    row.update(ok=False, message="".join(traceback.format_exception_only(type(exc), exc)).strip()[-400:])
            good &= row["ok"]
            rows.append(row)
            _dump(out_dir, rows, cmd, env)
            print(
                f"check {lab:10s} R={R:5d} N={N:6d} parts={row.get('parts', '-')!s:>2s} {'ok' if row['ok'] else 'WRONG ' + row['message']}",
                flush=True,
            )
        if good:
            ok_labels.append(lab)

    # --- timing -----------------------------------------------------------------------------------
    if not args.no_time:
        for R, N in args.shapes:
            n_cold = input_sets_for_l2(R * N * 4, arch.l2_bytes)
            sets = [rs.make_case("random", R, N, K, 1000 + j, "cuda") for j in range(n_cold)]
            out = torch.empty(R, K, dtype=torch.int32, device="cuda")  # [R, K]
            old, old_parts = _old_launcher(R, N, arch)
            cands = [("old_select", old, old_parts)]
            for lab in ok_labels:
                parts = rs.resolve_parts({**rs.DEFAULT_CONFIG, **LABELS[lab]}["parts"], R, N, K, arch)
                cands.append((lab, rs.select_launcher(R, N, K, "cuda", arch=arch, config=LABELS[lab]), parts))
            for lab, launch, parts in cands:
                row = {"kind": "time", "label": lab, "R": R, "N": N, "parts": parts, **_time(launch, sets, out)}
                rows.append(row)
                _dump(out_dir, rows, cmd, env)
            del sets
            torch.cuda.empty_cache()

    _dump(out_dir, rows, cmd, env)
    print("\n== checks (exact equality with the reference over cases: " + ", ".join(rs.CASES) + ")")
    for lab in ["old_select"] + labels:
        mine = [r for r in rows if r["kind"] == "check" and r["label"] == lab]
        fails = [f"R={r['R']} N={r['N']}: {r['message']}" for r in mine if not r["ok"]]
        print(f"{lab:12s} {'ok' if not fails else 'FAIL'} {' | '.join(fails)[:400]}")
    print("\n== timings, ms per call (graph: CUDA-graph replay, scores L2-resident; cold: rotating sets past L2; eager: events per call)")
    print(f"{'label':12s} {'R':>5s} {'N':>7s} {'parts':>5s} {'graph':>8s} {'cold':>8s} {'eager':>8s} {'vs old':>7s}")
    for R, N in args.shapes:
        mine = [r for r in rows if r["kind"] == "time" and (r["R"], r["N"]) == (R, N)]
        base = next((r.get("graph_ms") for r in mine if r["label"] == "old_select"), None)
        for r in mine:
            g, c, e = r.get("graph_ms"), r.get("graph_cold_ms"), r.get("eager_ms")
            speed = f"{base / g:6.2f}x" if (base and g) else "      -"
            print(f"{r['label']:12s} {R:5d} {N:7d} {r['parts']:5d} {_ms(g)} {_ms(c)} {_ms(e)} {speed} {r.get('message', '')}")
    print(f"\n{env}\ncommand: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
