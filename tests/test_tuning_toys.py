"""Toy tiles for the tuner's tests: a pure-python tile with a synthetic cost, and a real TileLang gather whose configs misbehave on purpose.

The tuner's worker processes find these through ``TILES`` (``test_tuning_toys:<name>``),
the same way they find the lab's own tiles. The tests at the bottom check the toys themselves.
"""

from __future__ import annotations

import math
import os
import re
import time

import pytest
import torch

from tiles.core.arch import Arch, get_arch
from tiles.core.compare import relative_l2
from tiles.core.contract import Comparison, Config, Constraint, Param, SearchSpace, Shape, Tile, TileError, canonical_key, poisoned
from tiles.core.harness import OK, WRONG_RESULT, compile_tile

TOY_SHAPES = [Shape("decode_n4k", "decode", {"N": 4096}), Shape("prefill_n1m", "prefill", {"N": 1 << 20})]


def _smem(config: Config, shape: Shape, arch: Arch) -> str | None:
    need = config["block"] * config["stages"] * 256
    return None if need <= arch.smem_per_block else f"shared memory {need // 1024} KiB > {arch.smem_per_block // 1024} KiB"


class ScaleToy(Tile):
    """Pure python: ``build`` returns the config; :func:`fake_evaluate` gives it a synthetic, deterministic latency."""

    name = "toy_scale"

    def shapes(self) -> list[Shape]:
        return TOY_SHAPES

    def search_space(self, arch: Arch) -> SearchSpace:
        params = (
            Param("block", (64, 128, 256, 512)),
            Param("schedule", ("serial", "pipelined", "ws")),
            Param("stages", (1, 2, 3)),
        )
        return SearchSpace(params, (Constraint("smem", _smem),))

    def default_config(self, arch: Arch) -> Config:
        return {"block": 128, "schedule": "pipelined", "stages": 2}

    def build(self, shape: Shape, config: Config, arch: Arch):
        time.sleep(float(os.environ.get("TOY_BUILD_SLEEP", "0")))  # lets concurrent workers interleave in the distributed test
        return dict(config)


def synthetic_ms(config: Config) -> float:
    """Best at block=256, ws, stages=3 (1.0 ms); the default (128, pipelined, 2) costs 1.5 ms."""
    penalty = {"serial": 0.5, "pipelined": 0.2, "ws": 0.0}[config["schedule"]]
    return 1.0 + 0.2 * abs(math.log2(config["block"] / 256)) + penalty + 0.1 * (3 - config["stages"])


def fake_evaluate(tile_ref: str, shape_name: str, config: dict, arch_name: str, seed: int, runs: int) -> dict:
    """Stands in for the GPU worker on CPU: same signature and Evaluation dict, no GPU.

    ``mode`` (FaultToy) injects failures the way a bad kernel would show them: ``fault``
    kills the worker process like a CUDA abort does, ``hang`` never returns.
    """
    from tuning.workers import load_tile

    tile = load_tile(tile_ref)
    t0 = time.perf_counter()
    kernel, ev = compile_tile(tile, tile.shape(shape_name), config, get_arch(arch_name))
    ev.extra["load_s"] = time.perf_counter() - t0
    if kernel is None:
        return ev.to_dict()
    mode = config.get("mode", "good")
    if mode == "fault":
        os._exit(134)
    if mode == "hang":
        time.sleep(3600)
    if mode == "wrong":
        ev.outcome, ev.error, ev.message = WRONG_RESULT, 0.5, "WRONG (rel_l2<=tol, error 0.5)"
        return ev.to_dict()
    time.sleep(float(os.environ.get("TOY_EVAL_SLEEP", "0")))
    if hasattr(tile, "resolve"):  # AutoToy: the kernel an "auto" config builds
        config = tile.resolve(config, tile.shape(shape_name))
    ev.ms = synthetic_ms(config) if "schedule" in config else {"good_fast": 1.0, "good_slow": 2.0}.get(mode, 3.0)
    ev.outcome = OK
    return ev.to_dict()


def lucky_evaluate(tile_ref: str, shape_name: str, config: dict, arch_name: str, seed: int, runs: int) -> dict:
    """:func:`fake_evaluate` where the serial schedule gets lucky in its study: its trials (seeds below
    ``tuning.rematch.REMATCH_SEED``, the trial numbers) time 1.2 ms under its cost and win the study, its rematch
    evaluations behind the default (1.5 ms): ``TOY_LUCKY=slower`` 0.5 ms over its cost (at least 2.0 ms), ``tie`` 0.5%
    under the default, ``split`` 5% under it in rounds 1 and 3 and 2% over it in round 2 (a median 5% ahead, one
    round lost), ``fails`` wrong results."""
    from tuning.rematch import REMATCH_SEED

    ev = fake_evaluate(tile_ref, shape_name, config, arch_name, seed, runs)
    if ev.get("outcome") == OK and config.get("schedule") == "serial":
        rematch = os.environ.get("TOY_LUCKY", "slower")
        if seed < REMATCH_SEED:
            ev["ms"] -= 1.2
        elif rematch == "fails":
            ev.update(outcome=WRONG_RESULT, error=0.5, message="WRONG (rel_l2<=tol, error 0.5)", ms=None)
        elif rematch == "tie":
            ev["ms"] = 0.995 * 1.5
        elif rematch == "split":  # the challenger's seed in round i is REMATCH_SEED + 2 i
            ev["ms"] = 1.5 * (1.02 if (seed - REMATCH_SEED) // 2 == 1 else 0.95)
        else:
            ev["ms"] += 0.5
    return ev


def recording_compile(tile_ref: str, shape_name: str, config: dict, arch_name: str) -> dict:
    """The pool's compile task, logging every config it is handed to ``$TOY_COMPILE_LOG``."""
    import json

    from tuning.workers import compile_task

    with open(os.environ["TOY_COMPILE_LOG"], "a") as f:
        f.write(json.dumps(config, sort_keys=True) + "\n")
    return compile_task(tile_ref, shape_name, config, arch_name)


class FaultToy(Tile):
    """A real TileLang kernel (``out[i] = 2 * x[idx[i]]``, int64 indices) plus configs that fail in every way a trial can.

    ``good_fast``/``good_slow``: correct (different block sizes); ``compile_error``: the build
    raises; ``fault``: indices far out of bounds, an illegal memory access; ``hang``: the launch
    never returns; ``wrong``: a kernel that adds 1; ``invalid``: rejected by a constraint.
    """

    name = "toy_fault"
    MODES = ("good_fast", "good_slow", "compile_error", "fault", "hang", "wrong", "invalid")

    def shapes(self) -> list[Shape]:
        return [Shape("n64k", "any", {"N": 65536})]

    def search_space(self, arch: Arch) -> SearchSpace:
        return SearchSpace(
            (Param("mode", self.MODES),),
            (Constraint("toy", lambda c, s, a: "mode 'invalid' is rejected before compiling" if c["mode"] == "invalid" else None),),
        )

    def default_config(self, arch: Arch) -> Config:
        return {"mode": "good_slow"}

    def build(self, shape: Shape, config: Config, arch: Arch):
        if config["mode"] == "compile_error":
            raise RuntimeError("injected build failure")
        block = 32 if config["mode"] == "good_slow" else 256
        return config["mode"], _gather_kernel(shape["N"], block, 1.0 if config["mode"] == "wrong" else 0.0, arch)

    def make_inputs(self, shape: Shape, seed: int, device="cuda"):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape["N"], generator=g).to(device)  # [N] float32
        idx = torch.randperm(shape["N"], generator=g).to(device)  # [N] int64
        return {"x": x, "idx": idx}

    def run(self, kernel, inputs):
        mode, k = kernel
        idx = inputs["idx"]
        if mode == "fault":
            # 4 TiB past x: unmapped, so an illegal address. 64-bit indices matter: a 32-bit byte offset would wrap back into x.
            idx = idx + (1 << 40)
        if mode == "hang":
            time.sleep(3600)
        out = poisoned(idx.shape, torch.float32, idx.device)  # [N] float32
        k(inputs["x"], idx, out)
        return {"out": out}

    def reference(self, inputs):
        return {"out": 2 * inputs["x"][inputs["idx"].long()]}

    def compare(self, outputs, expected) -> Comparison:
        return relative_l2(outputs, expected, tol=1e-6)

    def bytes_moved(self, shape: Shape) -> float:
        return shape["N"] * 12.0


def _gather_kernel(n: int, block: int, bias: float, arch: Arch):
    import tilelang
    import tilelang.language as T

    @T.prim_func
    def gather(x: T.Tensor((n,), "float32"), idx: T.Tensor((n,), "int64"), out: T.Tensor((n,), "float32")):
        with T.Kernel(T.ceildiv(n, block), threads=block) as bx:
            for i in T.Parallel(block):
                out[bx * block + i] = x[idx[bx * block + i]] * 2.0 + bias

    # TileLang guards data-dependent loads with a bounds check by default (an out-of-range index reads 0);
    # turning that off lets the ``fault`` config make a genuine illegal memory access.
    return tilelang.compile(gather, target=arch.tilelang_target(), pass_configs={"tl.disable_safe_memory_legalize": True})


class SparseToy(ScaleToy):
    """Three coupled sizes, valid only when equal: 8 of 512 configs (1.6%), like the attention and compressor spaces
    whose structural parameters constrain each other (0.3-0.4% valid for one shape)."""

    name = "toy_sparse"
    SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)

    def search_space(self, arch: Arch) -> SearchSpace:
        def equal(c: Config, s: Shape, a: Arch) -> str | None:
            return None if c["block_m"] == c["block_n"] == c["block_k"] else "block sizes differ"

        return SearchSpace(tuple(Param(n, self.SIZES) for n in ("block_m", "block_n", "block_k")), (Constraint("equal", equal),))

    def default_config(self, arch: Arch) -> Config:
        return {"block_m": 16, "block_n": 16, "block_k": 16}


class AutoToy(ScaleToy):
    """ScaleToy with ``schedule="auto"``, resolved per shape as the attention's "auto" choices are: ws at decode,
    pipelined at prefill. An "auto" config builds the kernel of the config naming what it resolves to."""

    name = "toy_auto"

    def search_space(self, arch: Arch) -> SearchSpace:
        space = super().search_space(arch)
        params = tuple(Param(p.name, (*p.choices, "auto")) if p.name == "schedule" else p for p in space.params)
        return SearchSpace(params, space.constraints)

    def resolve(self, config: Config, shape: Shape) -> Config:
        if config["schedule"] != "auto":
            return dict(config)
        return {**config, "schedule": "ws" if shape.phase == "decode" else "pipelined"}

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        return canonical_key(self.resolve(self.with_defaults(arch, config), shape))

    def build(self, shape: Shape, config: Config, arch: Arch):
        return super().build(shape, self.resolve(config, shape), arch)


TILES = [ScaleToy(), FaultToy(), SparseToy(), AutoToy()]


def test_synthetic_cost_prefers_a_non_default_config():
    toy = ScaleToy()
    sm90 = get_arch("sm90")
    valid = [c for c in toy.search_space(sm90).all_configs() if not toy.search_space(sm90).violations(c, TOY_SHAPES[0], sm90)]
    best = min(valid, key=synthetic_ms)
    assert best == {"block": 256, "schedule": "ws", "stages": 3}
    assert synthetic_ms(toy.default_config(sm90)) > 1.3 * synthetic_ms(best)


def test_fault_toy_compiles_for_sm90a_and_rejects_unknown_modes():
    toy = FaultToy()
    sm90 = get_arch("sm90")
    kernel, ev = compile_tile(toy, toy.shapes()[0], {"mode": "good_fast"}, sm90)
    assert ev.outcome == OK and kernel[0] == "good_fast"
    src = kernel[1].get_kernel_source()
    # good_fast's 256-thread blocks, the int64 indices, and out = 2 x (no bias: only the "wrong" mode adds 1)
    assert "__launch_bounds__(256, 1)" in src and "const int64_t* __restrict__ idx" in src
    assert re.search(r"out\[[^;]*\] = \(x\[idx\[[^;]*\]\] \* 0x1p\+1f(/\*[^*]*\*/)?\);", src), src
    _, ev = compile_tile(toy, toy.shapes()[0], {"mode": "nope"}, sm90)
    assert ev.outcome == "invalid" and "nope" in ev.message
    with pytest.raises(TileError, match="has no shape 'missing': choose one of n64k"):
        toy.shape("missing")
