"""`lab sources`: the CUDA source of every kernel a tile's config compiles to, hashed or written out (no GPU needed).

A new option must leave the default's kernels unchanged, and a refactor every config's: hash before and after,

    lab sources --arch sm90,sm80 > before.txt      # change the code, then
    lab sources --arch sm90,sm80 | diff before.txt -

Each line has two digests: the source's, and the ``masked`` one (:func:`masked_source`: shared buffer names, their
shared-memory offsets, local names and the order of local declarations blanked) that the comparison is about. TileLang 0.1.15 names and places equal-sized shared
buffers (the KV buffers, the reduction workspaces) differently from one process to the next: the same kernel of the
same tree gave two source digests in two processes, with PYTHONHASHSEED fixed too (90da144). ``--out DIR`` writes
each source as DIR/ARCH/TILE/SHAPE/KERNEL.cu, e.g. for a ptxas register/spill check with nvcc.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

from lab.cli import LabError
from lab.commands.bench import parse_config
from tiles.core.arch import ArchError, get_arch
from tiles.core.contract import TileError
from tiles.core.registry import select


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tile", default="all", help="'all' or comma-separated tile names")
    parser.add_argument("--arch", default="sm90", help="comma-separated archs (sm80,sm89,sm90,sm100)")
    parser.add_argument("--shapes", default="first", help="'first' (default), 'all', or comma-separated shape names")
    parser.add_argument("--config", default=None, help="config over each tile's default: JSON or key=value,... (as lab bench)")
    parser.add_argument("--out", default=None, metavar="DIR", help="also write each source as DIR/ARCH/TILE/SHAPE/KERNEL.cu")


# a shared buffer's name with TileLang's uniquifying suffix (buf_2, workspace_1, KV_r_1, S_shared, ...), and an offset
# into the dynamic shared memory
_SHARED_NAME = re.compile(r"\b(buf|workspace|KV[01]?_[lr]|Q_[lr]|[A-Za-z0-9]+_shared)(_\d+)?\b")
_SHARED_OFFSET = re.compile(r"buf_dyn_shmem \+ \d+")


# a local array's declaration (TileLang declares each fragment and local buffer at the top of the kernel)
_LOCAL_ARRAY = re.compile(r"^[ \t]*([A-Za-z_][\w:]*(?: [A-Za-z_]\w*)?) ([A-Za-z_]\w*)\[(\d+)\];[ \t]*$", re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)  # the generated CUDA holds no string literal with // or /*


def masked_source(src: str) -> str:
    """``src`` with what does not change the program blanked: comments, every shared buffer's suffix and every dynamic
    shared-memory offset (whichever of several equal buffers each instruction touches), the order of the local array
    declarations (kept as a sorted list of types and sizes), and every identifier's spelling (each renamed by its first
    use). A refactor that only renames TileLang's locals, e.g. a macro's parameters, or rewords a comment of the CUDA it
    imports keeps the masked source; a changed instruction, operand, constant or declaration does not."""
    src = _COMMENT.sub("", src)
    text = _SHARED_OFFSET.sub("buf_dyn_shmem + OFFSET", _SHARED_NAME.sub(lambda m: m.group(1), src))
    declarations = sorted(f"{m.group(1)} [{m.group(3)}]" for m in _LOCAL_ARRAY.finditer(text))
    names: dict[str, str] = {}
    body = _IDENTIFIER.sub(lambda m: names.setdefault(m.group(0), f"v{len(names)}"), _LOCAL_ARRAY.sub("", text))
    return "\n".join(declarations) + "\n" + body


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
                    masked = hashlib.sha256(masked_source(src).encode()).hexdigest()[:16]
                    print(f"{arch.name} {tile.name} {shape.name} {kernel} {digest} masked={masked} {src.count(chr(10))} lines")
                    if args.out:
                        path = Path(args.out) / arch.name / tile.name / shape.name / f"{kernel}.cu"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(src)
    return 0
