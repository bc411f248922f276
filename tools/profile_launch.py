"""Launch one tile config a few times, for a profiler (Nsight Compute) to attach to (tools/gpu_session.sh phase ncu).

python3 tools/profile_launch.py TILE SHAPE ['{"ptxas_level": 10}']

The config is the JSON override over the tile's default at that shape; the first launch compiles and warms up, the
profiler is told to skip it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from tiles.core.arch import detect
    from tiles.core.registry import get_tile

    tile_name, shape_name = sys.argv[1], sys.argv[2]
    override = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    arch, tile = detect(), get_tile(tile_name)
    shape = tile.shape(shape_name)
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
