"""Profile tiles kernel by kernel with torch.profiler: where does a tile's time go?

    python3 tools/profile_tiles.py indexer_topk:decode_b64_n128k compressor:prefill_r2_s64k \\
        'indexer_topk:decode_b64_n128k:{"dequant": "lut"}' --json $OUT/profile.json

Each ``TILE:SHAPE[:CONFIG_JSON]`` is built through the tile registry (the tile's default config
for the GPU present, with the JSON's keys overriding it), run once on fresh inputs and checked
against the tile's torch reference (ok / WRONG and the comparison's error), then launched
``--runs`` times under torch.profiler (CUDA activity only). Per kernel name it prints calls,
total and average CUDA time and the share of the tile's time; then the tile's floor, i.e. the
larger of bytes_moved / 4.2 TB/s and flops / 790 TFLOP/s, against the measured time per call.
A tile whose check fails gets no timing (house rule: no speed for a wrong kernel).

Runs from the repo root on a GPU machine; without a CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HBM_BYTES_PER_S = 4.2e12  # H200 device copy, measured (spec section 6)
TENSOR_FLOPS = 7.9e14  # H200 dense bf16 tensor-core rate, measured (spec section 6)


@dataclass
class Spec:
    tile: str
    shape: str
    config: dict

    @property
    def label(self) -> str:
        return f"{self.tile}:{self.shape}" + (f":{json.dumps(self.config, sort_keys=True)}" if self.config else "")


@dataclass
class KernelRow:
    name: str
    calls: int
    total_us: float
    avg_us: float
    share: float


@dataclass
class Profile:
    spec: str
    config: dict = field(default_factory=dict)
    check: str = ""  # "ok" | "WRONG" | "error"
    error: float | None = None
    detail: str = ""
    launches: int = 0
    ms_per_call: float | None = None
    floor_ms: float | None = None
    floor_bytes_ms: float | None = None
    floor_flops_ms: float | None = None
    of_floor: float | None = None  # floor / measured: 1.0 = at the floor
    kernels: list[KernelRow] = field(default_factory=list)


def parse_spec(text: str) -> Spec:
    """``TILE:SHAPE`` or ``TILE:SHAPE:{json}`` (the JSON may itself contain colons)."""
    tile, sep, rest = text.partition(":")
    if not sep or not tile or not rest:
        raise SystemExit(f"error: {text!r} is not TILE:SHAPE[:CONFIG_JSON], e.g. indexer_topk:decode_b64_n128k")
    shape, sep, raw = rest.partition(":")
    config = {}
    if sep:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: the config of {text!r} is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(config, dict):
            raise SystemExit(f"error: the config of {text!r} must be a JSON object such as '{{\"threads\": 128}}'")
    return Spec(tile, shape, config)


def validate(specs: list[Spec]) -> None:
    """Unknown tiles, shapes and config keys fail here, before any GPU work (works on a CPU machine)."""
    from tiles.core.contract import TileError
    from tiles.core.registry import get_tile

    for spec in specs:
        try:
            tile = get_tile(spec.tile)
            tile.shape(spec.shape)
        except TileError as exc:
            raise SystemExit(f"error: {exc}") from None
        unknown = set(spec.config) - {p.name for p in tile.search_space(_any_arch()).params}
        if unknown:
            raise SystemExit(f"error: {spec.label}: unknown config keys {sorted(unknown)}")


def _any_arch():
    from tiles.core.arch import get_arch

    return get_arch("sm90")


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU is present: tools/profile_tiles.py profiles kernels on the GPU machine (run it there)", file=sys.stderr)
        raise SystemExit(2)


def kernel_rows(prof, launches: int) -> list[KernelRow]:
    """GPU kernels (and copies/fills) of a profile, largest total first."""
    rows = []
    for evt in prof.key_averages():
        total = getattr(evt, "self_device_time_total", None)
        if total is None:  # torch < 2.4 names it after CUDA
            total = getattr(evt, "self_cuda_time_total", 0.0)
        if total and total > 0:
            rows.append(KernelRow(evt.key, evt.count, float(total), float(total) / max(1, evt.count), 0.0))
    grand = sum(r.total_us for r in rows) or 1.0
    for r in rows:
        r.share = r.total_us / grand
    return sorted(rows, key=lambda r: -r.total_us)


def _compile_spec(spec: Spec) -> str:
    """Build one spec's kernels for the GPU present (fills TileLang's disk cache); '' or the error."""
    from tiles.core.arch import detect
    from tiles.core.registry import get_tile

    try:
        arch = detect()
        tile = get_tile(spec.tile)
        shape = tile.shape(spec.shape)
        config = tile.with_defaults(arch, spec.config)
        if not tile.search_space(arch).violations(config, shape, arch):
            tile.build(shape, config, arch)
        return ""
    except Exception as exc:  # noqa: BLE001 -- reported again, with its context, when the spec is profiled
        return f"{type(exc).__name__}: {exc}"[:200]


def precompile(specs: list[Spec], jobs: int) -> None:
    """Compile every spec in ``jobs`` processes before the profiling, which then loads each kernel from TileLang's
    disk cache instead of compiling them one after another (5-15 s each)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        for spec, err in zip(specs, pool.map(_compile_spec, specs), strict=True):
            print(f"compiled {spec.label}" + (f": {err}" if err else ""), flush=True)


def profile_one(spec: Spec, runs: int, seed: int) -> Profile:
    """Build, check once, then profile ``runs`` launches of one (tile, shape, config)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tiles.core.arch import detect
    from tiles.core.registry import get_tile
    from tiles.core.timing import input_sets_for_l2

    arch = detect()
    tile = get_tile(spec.tile)
    shape = tile.shape(spec.shape)
    config = tile.with_defaults(arch, spec.config)
    out = Profile(spec.label, config)
    reasons = tile.search_space(arch).violations(config, shape, arch)
    if reasons:
        out.check, out.detail = "error", "invalid config: " + "; ".join(reasons)
        return out
    try:
        kernel = tile.build(shape, config, arch)
        inputs = tile.make_inputs(shape, seed, "cuda")
        cmp = tile.compare(tile.run(kernel, inputs), tile.reference(inputs))
    except Exception as exc:  # noqa: BLE001 -- a compile error or fault is reported, the next spec still runs
        out.check, out.detail = "error", f"{type(exc).__name__}: {exc}"[:600]
        return out
    out.check, out.error, out.detail = ("ok" if cmp.ok else "WRONG"), cmp.error, str(cmp)
    floor_b = tile.bytes_moved(shape) / HBM_BYTES_PER_S * 1e3
    floor_f = tile.flops(shape) / TENSOR_FLOPS * 1e3
    out.floor_bytes_ms, out.floor_flops_ms, out.floor_ms = floor_b, floor_f, max(floor_b, floor_f)
    if not cmp.ok:
        return out
    # Rotate input sets so L2 does not hold a small tile's inputs between launches.
    n_sets = input_sets_for_l2(tile.bytes_moved(shape), arch.l2_bytes, max_sets=3)
    sets = [inputs] + [tile.make_inputs(shape, seed + 1 + i, "cuda") for i in range(n_sets - 1)]
    outs = [tile.alloc_outputs(kernel, s) for s in sets] if tile.times_launch_only() else None

    def launch(i: int) -> None:
        if outs is None:
            tile.run(kernel, sets[i % n_sets])
        else:
            tile.launch(kernel, sets[i % n_sets], outs[i % n_sets])

    for i in range(3):  # warm-up: module loads and first-launch costs stay out of the profile
        launch(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(runs):
            launch(i)
        torch.cuda.synchronize()
    out.launches = runs
    out.kernels = kernel_rows(prof, runs)
    out.ms_per_call = sum(r.total_us for r in out.kernels) / runs / 1e3
    out.of_floor = out.floor_ms / out.ms_per_call if out.ms_per_call else None
    return out


def print_profile(p: Profile) -> None:
    print(f"\n== {p.spec}")
    print(f"   config: {json.dumps(p.config, sort_keys=True)}")
    print(f"   check : {p.check}" + (f" (error {p.error:.3g})" if p.error is not None else "") + (f"  {p.detail}" if p.detail else ""))
    if not p.kernels:
        return
    print(f"   {'kernel':<60} {'calls':>6} {'total us':>10} {'avg us':>9} {'share':>6}")
    for r in p.kernels:
        name = r.name if len(r.name) <= 60 else r.name[:57] + "..."
        print(f"   {name:<60} {r.calls:>6} {r.total_us:>10.1f} {r.avg_us:>9.2f} {r.share:>6.1%}")
    print(
        f"   per call: {p.ms_per_call:.4f} ms measured vs floor {p.floor_ms:.4f} ms "
        f"(bytes {p.floor_bytes_ms:.4f} ms at 4.2 TB/s, flops {p.floor_flops_ms:.4f} ms at 790 TFLOP/s): "
        f"{p.of_floor:.1%} of the floor"
    )


def environment() -> dict:
    import datetime
    import platform

    import torch

    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import tilelang

        env["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001 -- recorded as unknown, never fatal
        env["tilelang"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", metavar="TILE:SHAPE[:CONFIG_JSON]", help="tile, shape and optional config overrides")
    parser.add_argument("--runs", type=int, default=20, help="profiled launches per spec (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the check and profile inputs")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results, GPU, versions, date and command here")
    parser.add_argument(
        "--compile-jobs", type=int, default=1, help="compile the specs in this many processes first (default 1: as profiled)"
    )
    args = parser.parse_args(argv)
    specs = [parse_spec(s) for s in args.specs]
    validate(specs)
    require_gpu()
    if args.compile_jobs > 1:
        precompile(specs, args.compile_jobs)
    results = []
    for spec in specs:
        p = profile_one(spec, args.runs, args.seed)
        print_profile(p)
        results.append(p)
    if args.json:
        doc = {"environment": environment(), "hbm_bytes_per_s": HBM_BYTES_PER_S, "tensor_flops": TENSOR_FLOPS}
        doc["results"] = [asdict(p) for p in results]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {args.json}")
    return 0 if all(p.check == "ok" for p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
