"""Markdown summaries of stored results: `lab bench --json` documents and tuned-config files.

``lab report`` writes them next to the data (``results/<arch>/bench.md``, ``tuning.md``), so
every figure in a summary is read from a file a real run produced.
"""

from __future__ import annotations

import math
from pathlib import Path


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def bench_markdown(paths: list[Path]) -> str:
    """One table over the bench files in ``paths`` (:mod:`lab.results_store`): a row per tile x shape x GPU x config
    kind, the latest run of each."""
    from lab.results_store import read_bench

    lines = [
        "# Tile benchmarks",
        "",
        "Each row: the latest `lab bench` of one tile at one shape on one GPU model, with the tile's default config or the",
        "shape's stored winner (`tuned`). Kernel time by CUDA events, median over rotating input sets; the torch reference",
        "timed in the same run; `of copy` = GB/s over the device copy bandwidth measured at the start of that run.",
        "`timing`: `cuda-graph` = device time per launch replayed from a CUDA graph (kernel and torch reference alike),",
        "`eager` = each launch between its own events, the host's launch overhead included; `per-call ms` is the eager",
        "time beside it. `host us`: CPU time per call of the tile's public function (checks, config, allocation, launch),",
        "in brackets a plain TileLang kernel call's in the same run (`tiles.core.hostcost`). A row whose check failed has no speed.",
        "",
        "| tile | shape | GPU | config | ms | timing | per-call ms | host us | TFLOPS | GB/s | of copy | torch ms | vs torch | check | date | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    environments = {}
    for path in sorted(paths):
        doc = read_bench(path)
        kind = "tuned" if path.stem.endswith("_tuned") else "default"
        for r in doc["rows"]:
            env = r["environment"]
            if str(env.get("date")) >= (environments.get(env.get("gpu"), {}).get("date") or ""):
                environments[env.get("gpu")] = env
            speed = r.get("outcome") == "ok"
            host = _f(r.get("host_us") if speed else None, ".1f")
            if host != "-" and r.get("tilelang_call_us") is not None:
                host += f" ({r['tilelang_call_us']:.1f})"
            lines.append(
                f"| {doc.get('tile')} | {r['shape']} | {env.get('gpu')} | {kind} | {_f(r.get('ms') if speed else None, '.4f')}"
                f" | {r.get('timing') or '-'} | {_f(r.get('eager_ms') if speed else None, '.4f')} | {host} | {_f(r.get('tflops'), '.1f')}"
                f" | {_f(r.get('gbps'), '.0f')} | {_f(r.get('copy_fraction'), '.0%')} | {_f(r.get('ref_ms'), '.3f')}"
                f" | {_f(r.get('speedup'), '.1f')}x | {r.get('check')} | {env.get('date')} | `{r.get('command')}` |"
            )
    lines.append("")
    for gpu, env in sorted(environments.items(), key=lambda kv: str(kv[0])):
        lines.append(
            f"{gpu}: driver {env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, tilelang {env.get('tilelang')}"
            " (the latest row's environment; every row's own is in its bench file)."
        )
    return "\n".join(lines) + "\n"


def _stale(tile_name: str | None, arch_name: str | None, entry: dict) -> list[str]:
    """What a stored winner predates: search-space parameters it does not name, or the current default
    (``tiles.core.config_store.stale_params``); [] for unknown tiles."""
    from tiles.core.arch import get_arch
    from tiles.core.config_store import stale_params
    from tiles.core.contract import TileError
    from tiles.core.registry import get_tile

    try:
        return stale_params(get_tile(tile_name), get_arch(arch_name), entry.get("config", {}), entry.get("default_config"))
    except (TileError, ValueError, TypeError):
        return []


def tuning_markdown(paths: list[Path]) -> str:
    """Winners against defaults from ``results/<arch>/tuned/<gpu>/<tile>.yaml`` files: one section per GPU model,
    each with the geometric mean speedup of its winners."""
    lines = [
        "# Tuned configs",
        "",
        "Winner vs the tile's default config, both timed by the tuner in the same study on the GPU model of the section",
        "(correctness-gated: a trial that is wrong, faults, hangs or is nondeterministic is never a winner). At run time a",
        "GPU uses its own model's winners, else those of the nearest model of its arch (`tiles.core.gpu`).",
    ]
    commands: set[str] = set()
    by_gpu: dict[str, list[Path]] = {}
    for path in sorted(paths):
        by_gpu.setdefault(path.parent.name, []).append(path)
    for slug, group in by_gpu.items():
        lines += _tuning_section(slug, group, commands)
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in sorted(c for c in commands if c)]
    return "\n".join(lines) + "\n"


def _tuning_section(slug: str, paths: list[Path], commands: set[str]) -> list[str]:
    """The table of one GPU model's results files (``commands`` collects the commands that made them); a file that does
    not pass :func:`tiles.core.config_store.read_results` is a :class:`LabError` naming it and its bad key."""
    from lab.cli import LabError
    from tiles.core.arch import ArchError
    from tiles.core.config_store import ResultsError, read_results

    docs = []
    for path in paths:
        try:
            docs.append((path, read_results(path, path.stem, path.parents[2].name)))
        except ArchError:
            raise LabError(f"{path}: not under a results/<arch>/tuned/<gpu>/ folder of a known arch") from None
        except ResultsError as exc:
            raise LabError(str(exc)) from None
    gpus = sorted({str(doc.get("environment", {}).get("gpu") or slug) for _, doc in docs})
    lines = [
        "",
        f"## {', '.join(gpus)} (`tuned/{slug}/`)",
        "",
        "| tile | shape | trials | outcomes | default ms | best ms | speedup | winner | date |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    speedups, n_stale = [], 0
    for _, doc in docs:
        env = doc.get("environment", {})
        for name, entry in sorted(doc.get("shapes", {}).items()):
            # an entry kept from an earlier run carries that run's date and command
            commands.add(entry.get("command", env.get("command")))
            stale = _stale(doc.get("tile"), doc.get("arch"), entry)
            sp = entry.get("speedup")
            if sp and not stale:
                speedups.append(sp)
            n_stale += bool(stale)
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(entry.get("outcomes", {}).items()))
            cfg = ", ".join(f"{k}={v}" for k, v in sorted(entry.get("config", {}).items()))
            cfg += f" (**stale**: predates {', '.join(stale)}; the default runs)" if stale else ""
            lines.append(
                f"| {doc.get('tile')} | {name} | {entry.get('trials')} | {outcomes} | {_f(entry.get('default_ms'), '.4f')}"
                f" | {_f(entry.get('ms'), '.4f')} | {_f(sp, '.2f')}x | {cfg} | {entry.get('date', env.get('date'))} |"
            )
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        lines += [
            "",
            f"Geometric mean speedup of the current winners over the defaults: {geo:.2f}x over {len(speedups)} shape{'s' * (len(speedups) != 1)}.",
        ]
    if n_stale:
        lines += ["", f"{n_stale} stale winners (tuned against an older default and search space) are left out of the mean."]
    return lines
