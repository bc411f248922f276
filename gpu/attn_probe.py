"""Launch one attention tile config a few times, for a profiler to attach to (gpu/session.sh phase ncu).

python3 gpu/attn_probe.py TILE SHAPE ['{"ptxas_level": 10}']

An ``"ablate"`` key (one of tiles.sparse_attn.ABLATIONS) builds that timing ablation of the config instead (see
gpu/attn_ablation.py): wrong results by design, for comparing where the time goes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from tiles.arch import detect
    from tiles.registry import get_tile

    tile_name, shape_name = sys.argv[1], sys.argv[2]
    override = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    arch, tile = detect(), get_tile(tile_name)
    shape = tile.shape(shape_name)
    ablate = override.pop("ablate", "")
    if ablate:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from attn_ablation import _kernel

        kernel = _kernel(tile, shape, arch, ablate, override)
    else:
        kernel = tile.build(shape, tile.with_defaults(arch, override), arch)
    inputs = tile.make_inputs(shape, seed=3)
    outputs = tile.alloc_outputs(kernel, inputs)
    for _ in range(3):
        tile.launch(kernel, inputs, outputs)
    torch.cuda.synchronize()
    print(f"{tile_name} {shape_name} {override}: launched 3 times")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
