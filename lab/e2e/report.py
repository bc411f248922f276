"""e2e results as files: a run's JSON document (the data), its markdown and PNG plots (``results/<arch>/e2e/``, see
:mod:`lab.results_store`).

``lab report`` re-renders the markdown and plots from the JSON, so a report never holds a
number that is not in a results file produced by a real run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from lab.e2e.breakdown import PARTS, PASS
from tuning.export import write_atomic


def load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable e2e results file ({exc}); re-run `lab e2e` to regenerate it") from None
    if not isinstance(doc, dict) or doc.get("kind") != "csa2-lab/e2e" or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not an e2e results file (expected kind 'csa2-lab/e2e' with rows); re-run `lab e2e`")
    return doc


def _index(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["phase"], r["variant"], r["batch"], r["context"]): r for r in rows}


def speedups(rows: list[dict]) -> list[dict]:
    """Ratios measured in the same run: tiles/tuned over torch and over tiles/default; CED over non-CED prefill."""
    idx, out = _index(rows), []
    for (phase, variant, b, ctx), r in idx.items():
        if r["ms"] is None:
            continue
        if variant.startswith("tiles"):
            base = idx.get((phase, "torch", b, ctx))
            if base and base["ms"]:
                out.append({"what": f"{variant} vs torch", "phase": phase, "batch": b, "context": ctx, "speedup": base["ms"] / r["ms"]})
        if variant == "tiles/tuned":
            dflt = idx.get((phase, "tiles/default", b, ctx))
            if dflt and dflt["ms"]:
                out.append({"what": "tuned vs default", "phase": phase, "batch": b, "context": ctx, "speedup": dflt["ms"] / r["ms"]})
        if phase.startswith("multiturn/") and phase != "multiturn/cold":
            cold = idx.get(("multiturn/cold", variant, b, ctx))
            if cold and cold["ms"]:
                what = f"turn 2 {phase.removeprefix('multiturn/')} vs cold ({variant})"
                out.append({"what": what, "phase": phase, "batch": b, "context": ctx, "speedup": cold["ms"] / r["ms"]})
        if phase == "prefill":
            full = idx.get(("prefill_full", variant, b, ctx))
            if full and full["ms"]:
                out.append(
                    {"what": f"CED vs non-CED ({variant})", "phase": "prefill", "batch": b, "context": ctx, "speedup": full["ms"] / r["ms"]}
                )
    return out


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(doc: dict) -> str:
    meta, rows = doc["meta"], doc["rows"]
    lines = [
        f"# End-to-end: {meta.get('preset')} on {meta.get('gpu', '?')}",
        "",
        (
            f"Measured {meta.get('date')} with torch {meta.get('torch')}, tilelang {meta.get('tilelang')}, CUDA {meta.get('cuda')},"
            f" driver {meta.get('driver')}."
        ),
        "",
        f"Command: `{meta.get('command')}`",
        "",
        "Decode: one token per sequence per step, cache filled synthetically to the context (real FP4/FP8 encodings).",
        "Prefill: batch 1; `prefill` is CED, `prefill_full` runs every layer over every token.",
        "`ms` is the step's latency (`mode`). The parts come from one more pass, eager, with CUDA events around each",
        "backend call and FFN; `breakdown pass` is that pass's total, which the parts and `rest` add up to (it includes",
        "the gaps between launches that a CUDA graph removes; `-` where a run predates it).",
        *(
            [
                "`multiturn/<path>`: turn 2 of a conversation (context = cached prefix + new suffix) started by `model.sessions` on",
                "that path (pure: parked SWA state + HBM pages; replay: HBM pages, bounded replay; disk: pages from the disk tier,",
                "then replay; cold: CED prefill); its logits error is against `multiturn/cold` of the same backend; the note",
                "gives what moved.",
            ]
            if any(r["phase"].startswith("multiturn/") for r in rows)
            else []
        ),
        "",
        "| phase | backend | B | context | ms | mode | peak GiB | KV GiB | logits rel err vs torch | breakdown pass | "
        + " | ".join(PARTS)
        + " | note |",
        "|" + "---|" * (11 + len(PARTS)),
    ]
    for r in rows:
        parts = " | ".join(_fmt(r["breakdown"].get(p), ".2f") for p in PARTS)
        lines.append(
            f"| {r['phase']} | {r['variant']} | {r['batch']} | {r['context']} | {_fmt(r['ms'])} | {r['mode']} | {_fmt(r['peak_gib'], '.1f')}"
            f" | {_fmt(r['kv_gib'], '.2f')} | {_fmt(r['logits_rel_err'], '.2e')} | {_fmt(r['breakdown'].get(PASS), '.2f')} | {parts}"
            f" | {r.get('note', '')} |"
        )
    sp = speedups(rows)
    if sp:
        lines += ["", "## Speedups (same run)", "", "| comparison | phase | B | context | speedup |", "|---|---|---|---|---|"]
        lines += [f"| {s['what']} | {s['phase']} | {s['batch']} | {s['context']} | {s['speedup']:.2f}x |" for s in sp]
    return "\n".join(lines) + "\n"


def _breakdown_total(row: dict) -> float | None:
    """What a row's parts add up to: its breakdown pass's total, or the step's latency in runs that predate it."""
    return row["breakdown"].get(PASS) or row["ms"]


def render_plots(doc: dict, out_dir: Path, prefix: str = "e2e_") -> list[Path]:
    """latency vs context per backend (one panel per phase and batch) and breakdown bars, ``<prefix>latency.png`` and
    ``<prefix>breakdown.png`` in ``out_dir``; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in doc["rows"] if r["ms"] is not None]
    panels = sorted({(r["phase"], r["batch"]) for r in rows})
    written = []
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
        for ax, (phase, b) in zip(axes[0], panels):
            series = defaultdict(list)
            for r in rows:
                if (r["phase"], r["batch"]) == (phase, b):
                    series[r["variant"]].append((r["context"], r["ms"]))
            for variant, pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
            ax.set(title=f"{phase}, B={b}", xlabel="context (tokens)", ylabel="ms", xscale="log", yscale="log")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if rows:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
        labels = [f"{r['phase']}\n{r['variant']}\nB{r['batch']} {r['context'] // 1024}K" for r in rows]
        bottom = [0.0] * len(rows)
        for part in PARTS:
            vals = [r["breakdown"].get(part, 0.0) / total * 100 if (total := _breakdown_total(r)) else 0.0 for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=part)
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), labels, fontsize=5)
        ax.set(ylabel="% of the breakdown pass", title="where the time goes")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}breakdown.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(doc: dict, out_dir: Path) -> list[Path]:
    """Write e2e.json, e2e.md and the plots into ``out_dir``; returns the paths written."""
    write_atomic(out_dir / "e2e.json", json.dumps(doc, indent=1))
    write_atomic(out_dir / "e2e.md", render_markdown(doc))
    return [out_dir / "e2e.json", out_dir / "e2e.md", *render_plots(doc, out_dir)]


def results_markdown(paths: list[Path]) -> str:
    """``results/<arch>/e2e.md`` from the ``e2e/<gpu>.json`` documents in ``paths``: one section per GPU model, each with
    its plots. A :class:`ValueError` names a file that is not an e2e document."""
    from lab.results_store import PLOTS, e2e_plot_prefix

    lines = ["# End-to-end latency", "", "The latest `lab e2e` run on each GPU model.", ""]
    for path in paths:
        doc = load(path)
        lines += ["#" + line if line.startswith("#") else line for line in render_markdown(doc).splitlines()]
        plots = [f"{e2e_plot_prefix(path)}{plot}.png" for plot in PLOTS]
        lines += ["", *(f"![{name}](e2e/{name})" for name in plots if path.with_name(name).exists()), ""]
    return "\n".join(lines) + "\n"


def write_to_results(doc: dict, arch_dir: Path) -> list[Path]:
    """Store a run as ``arch_dir/e2e/<gpu>.json`` with its plots (replacing that GPU model's previous run) and render
    ``arch_dir/e2e.md`` again from every GPU's document; returns the paths written."""
    from lab.results_store import e2e_path, e2e_plot_prefix

    path = e2e_path(arch_dir, doc["meta"].get("gpu"))
    write_atomic(path, json.dumps(doc, indent=1))
    plots = render_plots(doc, path.parent, prefix=e2e_plot_prefix(path))
    write_atomic(arch_dir / "e2e.md", results_markdown(sorted(arch_dir.glob("e2e/*.json"))))
    return [path, *plots, arch_dir / "e2e.md"]
