"""The compressor's time against the prefill length: does the last, partly filled wave of CTAs cost it?

    python3 gpu/compressor_waves.py --ratio 2 --waves 1,2,2.59,3,3.88,4 \\
        '{"block_g": 32, "ctas_per_sm": 2}' '{"block_g": 32, "ctas_per_sm": 3, ...}' --json $OUT/waves.json

For each config (the tile's default for this GPU with the JSON's keys over it) and each wave count w, the prefill
length S is chosen so that the grid holds ``w * SMs * ctas_per_sm`` CTAs (rounded to whole CTAs). Each point is
checked against the torch reference on fresh inputs and timed like ``lab bench`` (``tiles.harness.evaluate``: CUDA-graph
replay); the JSON carries the environment and the command. The table gives ms, ms per wave and the rate in groups per microsecond: on a schedule with no tail cost the rate
is flat in S; a tail shows as a lower rate at fractional waves than at the whole wave counts around them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="JSON overrides of the tile's default, one per config")
    parser.add_argument("--ratio", type=int, choices=(1, 2), default=2)
    parser.add_argument("--waves", default="1,2,2.59,3,3.88,4", help="comma-separated wave counts (CTAs / resident CTAs)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU: this script times kernels", file=sys.stderr)
        return 2
    from tiles.arch import detect
    from tiles.compressor import COMPRESSOR
    from tiles.contract import Shape
    from tiles.harness import evaluate
    from tiles.timing import describe_environment

    arch = detect()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = COMPRESSOR.shape(f"prefill_r{args.ratio}_s64k")
    rows = []
    print(f"{'config':<60} {'waves':>6} {'CTAs':>6} {'S':>7} {'ms':>9} {'ms/wave':>8} {'groups/us':>9}  check")
    for raw in args.configs:
        override = json.loads(raw)
        cfg = COMPRESSOR.with_defaults(arch, override)
        resident = sms * cfg["ctas_per_sm"]
        for w in (float(x) for x in args.waves.split(",")):
            ctas = max(1, round(w * resident))
            S = ctas * cfg["block_g"] * args.ratio
            shape = Shape(f"prefill_r{args.ratio}_s{S}", "prefill", {**base.dims, "S": S})
            ev = evaluate(COMPRESSOR, shape, cfg, arch, seed=3)
            groups = S // args.ratio
            row = {"config": override, "waves": ctas / resident, "ctas": ctas, "S": S, "outcome": ev.outcome, "ms": ev.ms}
            rows.append(row)
            if ev.ok and ev.ms:
                per_wave = ev.ms / math.ceil(ctas / resident)
                print(
                    f"{json.dumps(override)[:60]:<60} {ctas / resident:6.2f} {ctas:6d} {S:7d} {ev.ms:9.5f} {per_wave:8.5f} {groups / (ev.ms * 1e3):9.1f}  ok"
                )
            else:
                print(f"{json.dumps(override)[:60]:<60} {ctas / resident:6.2f} {ctas:6d} {S:7d}  {ev.outcome}: {ev.message[:120]}")
    if args.json:
        command = " ".join(["python3", *sys.argv])
        doc = {"environment": describe_environment(), "command": command, "sms": sms, "ratio": args.ratio, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
