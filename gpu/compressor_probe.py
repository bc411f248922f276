"""Where a compressor config's index cache departs from another's: the error of its dequantised index keys per output
column and per group position in the CTA (a wrong operand layout shows as a pattern; a different summation order as
noise at the code-step level).

python3 gpu/compressor_probe.py SHAPE '{"proj_operands": "wgmma"}' ['{"proj_operands": "registers"}']
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:

    from model import formats
    from tiles.arch import detect
    from tiles.compressor import COMPRESSOR, INDEX_GROUP, compare_fp4_caches

    shape = COMPRESSOR.shape(sys.argv[1])
    configs = [json.loads(a) for a in sys.argv[2:4]] + ([{}] if len(sys.argv) < 4 else [])
    arch = detect()
    inputs = COMPRESSOR.make_inputs(shape, seed=5)
    keys, outs = [], []
    for override in configs:
        cfg = COMPRESSOR.with_defaults(arch, override)
        out = COMPRESSOR.run(COMPRESSOR.build(shape, cfg, arch), inputs)
        outs.append(out)
        keys.append(formats.fp4_dequantize(out["idx_packed"], out["idx_scales"], INDEX_GROUP, "e8m0").float())  # [B, G, 128]
    ref = COMPRESSOR.reference(inputs)
    for override, out in zip(configs, outs):
        print(f"{override}: against the reference {compare_fp4_caches(out, ref)}")
    diff = (keys[0] - keys[1]).abs()  # [B, G, 128]
    scale = keys[1].abs().mean().item()
    by_col = diff.mean(dim=(0, 1)) / scale  # [128]
    g = diff.shape[1] - diff.shape[1] % 16
    by_pos = diff[:, :g].reshape(diff.shape[0], g // 16, 16, -1).mean(dim=(0, 1, 3)) / scale  # [16]
    print(f"index keys {configs[0]} vs {configs[1]}: mean |diff| / mean |key| = {diff.mean().item() / scale:.3e}")
    print("per output column (16 per line):")
    for r in range(8):
        print("  " + " ".join(f"{v:.1e}" for v in by_col[16 * r : 16 * r + 16].tolist()))
    print("per group position mod 16: " + " ".join(f"{v:.1e}" for v in by_pos.tolist()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
