"""`lab sources`: the CUDA source of every kernel a tile's config compiles to, hashed or written out (no GPU needed).

A new option must leave the default's kernels byte-identical, and a refactor every config's: hash before and after,

    lab sources --arch sm90,sm80 > before.txt      # change the code, then
    lab sources --arch sm90,sm80 | diff before.txt -

(TileLang can rename or reorder shared buffers in the generated source after a change that looks like a no-op, e.g. a
local Python binding inside a macro.) ``--out DIR`` writes each source as DIR/ARCH/TILE/SHAPE/KERNEL.cu, e.g. for a
ptxas register/spill check with nvcc.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from lab.cli import LabError
from lab.commands.bench import parse_config
from tiles.arch import ArchError, get_arch
from tiles.contract import TileError
from tiles.registry import select


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tile", default="all", help="'all' or comma-separated tile names")
    parser.add_argument("--arch", default="sm90", help="comma-separated archs (sm80,sm89,sm90,sm100)")
    parser.add_argument("--shapes", default="first", help="'first' (default), 'all', or comma-separated shape names")
    parser.add_argument("--config", default=None, help="config over each tile's default: JSON or key=value,... (as lab bench)")
    parser.add_argument("--out", default=None, metavar="DIR", help="also write each source as DIR/ARCH/TILE/SHAPE/KERNEL.cu")


def _shapes(tile, spec: str):
    if spec == "first":
        return tile.shapes()[:1]
    if spec == "all":
        return tile.shapes()
    return [tile.shape(name.strip()) for name in spec.split(",") if name.strip()]


def run(args: argparse.Namespace) -> int:
    config = parse_config(args.config)
    try:
        archs = [get_arch(name.strip()) for name in args.arch.split(",") if name.strip()]
        tiles = select(args.tile)
    except (ArchError, TileError) as exc:
        raise LabError(str(exc)) from None
    if not archs:
        raise LabError("--arch is empty: name archs such as sm80,sm90")
    for arch in archs:
        for tile in tiles:
            if tile.support_reason(arch):
                print(f"{arch.name} {tile.name} - - unsupported: {tile.support_reason(arch)}")
                continue
            try:
                shapes = _shapes(tile, args.shapes)
            except TileError as exc:
                raise LabError(str(exc)) from None
            for shape in shapes:
                full = tile.with_defaults(arch, config)
                invalid = tile.search_space(arch).violations(full, shape, arch)
                if invalid:
                    print(f"{arch.name} {tile.name} {shape.name} - invalid: {'; '.join(invalid)}")
                    continue
                for kernel, src in sorted(tile.kernel_sources(shape, config, arch).items()):
                    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
                    print(f"{arch.name} {tile.name} {shape.name} {kernel} {digest} {src.count(chr(10))} lines")
                    if args.out:
                        path = Path(args.out) / arch.name / tile.name / shape.name / f"{kernel}.cu"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(src)
    return 0
