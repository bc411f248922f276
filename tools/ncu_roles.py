"""Stall samples of a warp-specialised kernel per warp role, from an Nsight Compute SASS export.

    python3 tools/ncu_roles.py ncu_sass.csv[.gz] [--top 8]

Input: ``ncu -i REPORT --page source --csv --print-source sass`` (tools/gpu_session.sh phase ncu writes it as
ncu_sass.csv; gzipped files are read too). Each role of a ws kernel starts with its own
``setmaxnreg`` (SASS ``USETMAXREG``), and ptxas lays the role branches out one after another, so cutting the
address-sorted SASS at those instructions splits the samples by role: prologue, then one segment per role
in code order (for the sparse attention kernel: producer, consumer warpgroup 1, consumer warpgroup 0).

Samples are taken per warp at a fixed interval, so a role's share of the samples is its share of warp time,
and within a role the stall reasons say what its warps were waiting for. Prints per segment: the samples, the
top stall reasons, and the instructions with the most samples (with the two instructions before each, which
name the barrier or load it waits on). Runs anywhere (no GPU needed).

``--against OTHER`` compares two exports of the same kernel built two ways (two configs, or a build with one role's
work cut out from outside the kernel): per role, both sample counts and each stall reason's change, largest first.
Samples come at one fixed interval per warp in both runs, so the counts are warp time in the same unit: what a role
waits on longer in the first profile is what the other roles' work costs it (how the attention producer's block cycle
was found stretched by the consumers, notes/sparse_attn.md):

    python3 tools/ncu_roles.py default_sass.csv.gz --against other_sass.csv.gz

``--cut barrier`` splits a kernel without roles (the compressor's flat kernel) into its phases instead: the code
between block-wide barriers (SASS ``BAR``), and also prints each phase's share of the executed instructions and
its commonest opcodes (weighted by executions), which name the phase (MUFU/FFMA: the pooling, HMMA: the projection,
FSETP/SEL: an FP4 encode):

    python3 tools/ncu_roles.py compressor_sass.csv.gz --cut barrier --top 0
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import itertools
from pathlib import Path


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rows = list(csv.reader(io.StringIO(raw.decode())))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    data = [r for r in rows[start + 1 :] if len(r) == len(header)]
    data.sort(key=lambda r: int(r[0], 16))
    return header, data


def _num(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text not in ("", "-") else 0.0


def _opcode(sass: str) -> str:
    """The opcode of a SASS line without its modifiers or predicate ("@!P0 LDG.E.128 R4, ..." -> "LDG")."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def _segment_cuts(data: list[list[str]], cut: str) -> list[int]:
    """Row indices where the segments start (and the end): at each ``setmaxnreg`` (a role) or after each ``BAR``."""
    if cut == "barrier":  # a segment ends with its barrier
        return [0] + [i + 1 for i, r in enumerate(data) if _opcode(r[1]).startswith("BAR")] + [len(data)]
    return [0] + [i for i, r in enumerate(data) if "USETMAXREG" in r[1]] + [len(data)]


def _stall_reasons(header: list[str], seg: list[list[str]]) -> collections.Counter:
    """Stall samples of a segment by reason (the ``stall_*`` columns, issued and not)."""
    why = collections.Counter()
    for r in seg:
        for i, c in enumerate(header):
            if c.startswith("stall_") and "Not Issued" not in c:
                why[c[len("stall_") :]] += _num(r[i])
    return why


def compare(path: Path, other: Path, cut: str = "setmaxnreg") -> int:
    """Print, per segment, the samples of ``path`` and ``other`` and each stall reason's change, largest first."""
    runs = []
    for f in (path, other):
        header, data = _rows(f)
        samples = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
        segs = [data[lo:hi] for lo, hi in itertools.pairwise(_segment_cuts(data, cut))]
        runs.append(
            [(seg[0][1].strip()[:48] if seg else "", sum(_num(r[samples]) for r in seg), _stall_reasons(header, seg)) for seg in segs]
        )
    if len(runs[0]) != len(runs[1]):
        raise SystemExit(f"{path.name} has {len(runs[0])} segments, {other.name} {len(runs[1])}: not the same kernel layout")
    print(f"A = {path.name}\nB = {other.name}")
    for (name, n_a, why_a), (_, n_b, why_b) in zip(*runs):
        if not n_a and not n_b:
            continue
        grow = n_a - n_b
        print(f"\n== {name}: A {n_a:.0f} samples, B {n_b:.0f} ({grow:+.0f}, {100 * grow / n_b if n_b else 0:+.0f}%)")
        for k in sorted(set(why_a) | set(why_b), key=lambda k: -(why_a[k] - why_b[k])):
            if why_a[k] or why_b[k]:
                d = why_a[k] - why_b[k]
                share = f"{100 * d / grow:5.0f}% of the change" if grow > 0 and d > 0 else ""
                print(f"  {k:20s} {why_a[k]:8.0f} {why_b[k]:8.0f} {d:+8.0f}  {share}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass export (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=8, help="instructions listed per role")
    parser.add_argument("--cut", choices=("setmaxnreg", "barrier"), default="setmaxnreg", help="segment at roles or at block-wide barriers")
    parser.add_argument("--against", type=Path, help="a second export of the same kernel layout: print each segment's stall changes")
    args = parser.parse_args()
    if args.against:
        return compare(args.csv, args.against, args.cut)
    header, data = _rows(args.csv)
    samples = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    executed = header.index("Instructions Executed")
    total = sum(_num(r[samples]) for r in data)
    total_executed = sum(_num(r[executed]) for r in data) or 1.0
    # shared-memory wavefronts (the L1/TEX pipe's work for LDS/STS and the tensor cores' shared operand reads), if exported
    wavefronts = header.index("L1 Wavefronts Shared") if "L1 Wavefronts Shared" in header else None
    total_wavefronts = sum(_num(r[wavefronts]) for r in data) if wavefronts is not None else 0.0
    cuts = _segment_cuts(data, args.cut)
    print(f"{args.csv.name}: {len(data)} SASS lines, {total:.0f} samples, {total_executed:.0f} warp instructions executed")
    if total_wavefronts:
        print(f"{total_wavefronts:.0f} shared-memory wavefronts")
    for lo, hi in itertools.pairwise(cuts):
        seg = data[lo:hi]
        n = sum(_num(r[samples]) for r in seg)
        if not n:
            continue
        why = _stall_reasons(header, seg)
        top_reasons = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in why.most_common(5) if v)
        line = f"\n== {seg[0][1].strip()[:48]} ({hi - lo} lines): {100 * n / total:.1f}% of samples"
        if args.cut == "barrier":
            ops, seg_executed = collections.Counter(), sum(_num(r[executed]) for r in seg)
            for r in seg:
                ops[_opcode(r[1])] += _num(r[executed])
            common = ", ".join(f"{k} {100 * v / seg_executed:.0f}%" for k, v in ops.most_common(5) if v)
            line += f", {100 * seg_executed / total_executed:.1f}% of instructions ({common})"
            if total_wavefronts:
                line += f", {100 * sum(_num(r[wavefronts]) for r in seg) / total_wavefronts:.1f}% of shared wavefronts"
        print(f"{line} | {top_reasons}")
        order = sorted(range(len(seg)), key=lambda k: -_num(seg[k][samples]))[: args.top]
        for k in order:
            before = " ; ".join(r[1].strip()[:40] for r in seg[max(0, k - 2) : k])
            print(f"  {100 * _num(seg[k][samples]) / n:5.1f}%  {seg[k][1].strip()[:48]:48s} after: {before}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
