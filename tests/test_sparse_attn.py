"""Sparse gather attention tiles: compile matrix and constraints on the CPU, the kernels against the torch
reference on the GPU (v4.1-flash shapes and odd ones; NaN-poisoned outputs, never inf/NaN, two runs bitwise
equal, all -1 rows exactly zero, repeated indices, out-of-range indices rejected on request).

Error bound: relative L2 <= 1e-2 against the fp32 reference on the same dequantised inputs (P and the
output are rounded to bf16 in the kernel)."""

import itertools
import re

import pytest
import torch

import tiles.sparse_attn as sa
from model.formats import fp4_dequantize, fp4_quantize, fp8_dequantize, fp8_quantize
from model.ops import sparse_attention as ref_attention
from tiles.core.arch import get_arch
from tiles.core.compare import relative_l2
from tiles.core.contract import Shape, TileError
from tiles.core.ptxas import parse_resource_usage, ptxas_log
from tiles.core.registry import all_tiles
from tiles.sparse_attn import dequant
from tiles.sparse_attn import space as sa_space

SM90 = get_arch("sm90")
SCALE = 512**-0.5


def _shape(name: str, phase: str, **dims) -> Shape:
    return Shape(name, phase, {"H": 64, "D": 512, "W": 128, "K": 512, **dims})


def _gathering_default(tile) -> dict:
    """The tile's Hopper default with its own gathering producer: the prefill tile's default expands the caches
    (kv_staging), so the tests of the FP4/FP8 producer pin kv_staging=gather there."""
    return {**tile.default_config(SM90), **({"kv_staging": "gather"} if tile is sa.PREFILL_TILE else {})}


# --------------------------------------------------------------------------------------------
# CPU: registry, search spaces, constraints, compile, wrapper validation
# --------------------------------------------------------------------------------------------
def test_tiles_registered():
    names = set(all_tiles())
    assert {"sparse_attn_decode", "sparse_attn_prefill", "sparse_attn_bf16"} <= names


@pytest.mark.parametrize("tile", sa.TILES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch_name", ["sm80", "sm86", "sm89", "sm90"])
def test_default_config_valid_everywhere(tile, arch_name):
    arch = get_arch(arch_name)
    for shape in tile.shapes():
        assert tile.search_space(arch).violations(tile.default_config(arch), shape, arch) == []


@pytest.mark.parametrize("tile", sa.TILES, ids=lambda t: t.name)
def test_search_space_has_structural_choices(tile):
    """Both schedules are valid points of the Hopper space at the tile's first shape: its default (the warp-specialised
    kernel) and Ampere's default there (the pipelined one). Two configs, not an enumeration of millions."""
    space, shape = tile.search_space(SM90), tile.shapes()[0]
    assert {"schedule", "block_I", "num_stages", "threads", "heads_per_block"} <= set(space.names())
    assert ("dequant" in space.names()) == (tile.kv_format == "fp4")
    hopper, ampere = tile.with_defaults(SM90, {}), tile.with_defaults(SM90, tile.default_config(get_arch("sm80")))
    assert (hopper["schedule"], ampere["schedule"]) == ("ws", "pipelined")
    assert space.violations(hopper, shape, SM90) == [] and space.violations(ampere, shape, SM90) == []


def test_constraints_prune():
    tile = sa.DECODE_TILE
    shape = tile.shape("decode_b64_s1")
    base = {**tile.default_config(SM90), "schedule": "pipelined"}
    space = tile.search_space(SM90)
    ws = {**base, "schedule": "ws"}
    assert space.violations(ws, shape, SM90) == []
    assert any("wgmma" in r for r in tile.search_space(get_arch("sm80")).violations(ws, shape, get_arch("sm80")))
    assert any("dequant=direct" in r for r in space.violations({**ws, "dequant": "staged"}, shape, SM90))
    assert any("threads=128" in r for r in space.violations({**base, "heads_per_block": 32, "threads": 256}, shape, SM90))
    assert any("registers" in r for r in space.violations({**base, "threads": 128}, shape, SM90))
    sm89 = get_arch("sm89")
    assert any("shared memory" in r for r in space.violations(base, shape, sm89))
    odd = _shape("short", "decode", B=1, S=1, Nc=64, Nw=8, W=8, K=64)
    assert any("splits" in r for r in space.violations({**base, "n_split": 8, "block_I": 64}, odd, SM90))
    assert tile.support_reason(get_arch("sm100"))


def test_resolve_split_fills_the_gpu():
    assert sa.resolve_split("auto", 64, 1, 64, 64, SM90) == 8
    assert sa.resolve_split("auto", 128, 2, 64, 64, SM90) == 2
    assert sa.resolve_split("auto", 1, 4096, 64, 64, SM90) == 1
    assert sa.resolve_split(4, 1, 1, 64, 64, SM90) == 4
    # ws holds one block per SM: the most splits that fit one wave of 132
    assert sa.resolve_split("auto", 64, 1, 64, 64, SM90, "ws") == 2
    assert sa.resolve_split("auto", 128, 2, 64, 64, SM90, "ws") == 1
    assert sa.resolve_split("auto", 1, 1, 64, 64, SM90, "ws") == 8


def test_cost_model():
    shape = sa.PREFILL_TILE.shape("prefill_s4k")
    assert sa.PREFILL_TILE.flops(shape) == 4 * 4096 * 64 * 640 * 512
    fp4_kv = 128 * (512 + 16) + 512 * (256 + 32)
    assert sa.PREFILL_TILE.bytes_moved(shape) == 4096 * (2 * 64 * 512 * 2 + fp4_kv + 640 * 4)
    assert sa.BF16_TILE.bytes_moved(shape) == 4096 * (2 * 64 * 512 * 2 + 640 * 512 * 2 + 640 * 4)


@pytest.mark.parametrize(
    "tile,shape_name",
    [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k"), (sa.BF16_TILE, "decode_b128_s2")],
    ids=["decode_b64_s1", "prefill_s4k", "bf16_decode_b128_s2"],
)
def test_default_compiles_for_sm90(tile, shape_name):
    shape = tile.shape(shape_name)
    kernel = tile.build(shape, tile.default_config(SM90), SM90)
    src = kernel.main.get_kernel_source()
    assert "wgmma" in src
    assert (kernel.combine is not None) == (kernel.n_split > 1)
    if kernel.combine is not None:  # profilers must tell the combine from the attention kernel
        assert "combine_kernel" in kernel.combine.get_kernel_source() and "main_kernel" in src
    # io=staged: Q arrives in 16-byte vectors per consumer warpgroup, never as 2-byte element copies (the
    # 384-thread copy that Nsight Compute found taking a third of the prefill kernel's stall samples)
    # (the prefill and bf16 tiles: io="auto", per call; every CTA's first Q is staged). wg0_scores stages Q in two
    # halves (Q_l, Q_r); the paired consumers (the prefill default, consumers="auto") each its own half (Q_own)
    assert tile.default_config(SM90)["io"] == ("staged" if tile is sa.DECODE_TILE else "auto")
    consumers = tile.resolve_call(tile.default_config(SM90), shape, SM90)["consumers"]
    assert consumers == ("paired_halves" if tile is sa.PREFILL_TILE else "wg0_scores")
    for name in ("Q_own",) if consumers == "paired_halves" else ("Q_l", "Q_r"):
        assert re.search(rf"\*\(uint4\*\)\(\(\(bfloat16_t\*\){name}(_\d+)?\)", src), name
    assert not re.search(r"\(\(bfloat16_t\*\)Q_\w+\)\[[^;]*\] = Q\[", src)


@pytest.mark.parametrize(
    "tile,shape_name", [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k")], ids=["decode", "prefill"]
)
@pytest.mark.slow
def test_prefetch_producer_compiles_for_sm90(tile, shape_name):
    """produce=prefetch (unmeasured so far: its GPU check is in GPU_CASES) compiles, and is refused for bf16 KV."""
    config = {**_gathering_default(tile), "produce": "prefetch"}
    assert tile.search_space(SM90).violations(config, tile.shape(shape_name), SM90) == []
    assert "wgmma" in tile.build(tile.shape(shape_name), config, SM90).main.get_kernel_source()
    bf16 = {**sa.BF16_TILE.default_config(SM90), "produce": "prefetch"}
    assert any("FP4 main KV only" in r for r in sa.BF16_TILE.search_space(SM90).violations(bf16, sa.BF16_TILE.shape("prefill_s4k"), SM90))


@pytest.mark.parametrize("consumers", ["balanced", "balanced_overlap"])
@pytest.mark.parametrize(
    "tile,shape_name", [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k")], ids=["decode", "prefill"]
)
@pytest.mark.slow
def test_balanced_consumers_compile_for_sm90(tile, shape_name, consumers):
    """consumers=balanced[_overlap] (GPU checks in GPU_CASES): both consumer warpgroups issue QK^T over half of the
    block's rows (N = block_I / 2) and exchange row maxima; overlap leaves P V in flight (no wgmma wait after it)."""
    shape = tile.shape(shape_name)
    config = tile.with_defaults(SM90, {"consumers": consumers})  # fp32 split partials (bf16 is wg0_scores')
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    half_s = re.findall(r"wgmma_ss<[^>]*, 64, 32, 16,[^>]*>\([^;]*\(\(uint32_t\*\)\((\w+) \+ 0\)\)", src)
    assert len(set(half_s)) == 2, "both warpgroups compute a 64 x 32 block of S, each in its own fragment"
    assert "rowmax_shared" in src and "bar_max" in src
    pv_waits = re.findall(r"acc_o(?:_1)? \+ 0\)\), 1\);\s*\}\s*tl::warpgroup_commit_batch\(\);\s*tl::warpgroup_wait<0>", src)
    assert (len(pv_waits) == 0) == (consumers == "balanced_overlap")
    pipelined = {**config, "schedule": "pipelined"}
    assert any("schedule=ws" in r for r in tile.search_space(SM90).violations(pipelined, shape, SM90))


@pytest.mark.parametrize(
    "tile,shape_name",
    [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k"), (sa.BF16_TILE, "decode_b128_s2")],
    ids=["decode", "prefill", "bf16"],
)
@pytest.mark.slow
def test_seesaw_consumers_compile_for_sm90(tile, shape_name, tmp_path):
    """consumers=seesaw (GPU checks in GPU_CASES): each consumer warpgroup issues the whole QK^T of its own blocks
    (N = block_I) from its own buffer, hands P over in its own tile, leaves the taken block's P V in flight under its
    softmax (wgmma wait 1), and fits its registers: ptxas without spills at the level the tile compiles with."""
    shape = tile.shape(shape_name)
    config = tile.with_defaults(SM90, {"consumers": "seesaw"})
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    full_s = re.findall(r"wgmma_ss<[^>]*, 64, 64, 16,[^>]*>\([^;]*\(\(uint32_t\*\)\((__\d+) \+ 0\)\)", src)
    assert len(set(full_s)) == 2, "each warpgroup computes a 64 x 64 block of S in its own fragment"
    assert "P1_shared" in src and "S_shared" in src and "handed_shared" in src
    assert src.count("tl::wait_wgmma<1>();") == 2, "both warpgroups wait for S only while the taken P V runs"
    assert src.count(f"tl::warpgroup_reg_alloc<{sa.SEESAW_NREG}>();") == 2
    assert f"tl::warpgroup_reg_dealloc<{504 - 2 * sa.SEESAW_NREG}>();" in src
    log = ptxas_log(src, tmp_path, ptxas_options=(f"--register-usage-level={config['ptxas_level']}",))
    assert parse_resource_usage(log)[1] == 0, "no spills"
    serial = {**config, "produce": "serial"}
    assert any("produce=batched or prefetch" in r for r in tile.search_space(SM90).violations(serial, shape, SM90))


@pytest.mark.parametrize(
    "tile,shape_name",
    [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k"), (sa.BF16_TILE, "decode_b128_s2")],
    ids=["decode", "prefill", "bf16"],
)
@pytest.mark.slow
def test_paired_consumers_compile_for_sm90(tile, shape_name, tmp_path):
    """consumers=paired (FlashMLA's sparse prefill schedule; GPU checks in GPU_CASES): each warpgroup computes a whole
    64 x 64 S of its own block, adds its own block to its half of O by an RS wgmma from its P fragment and the other's
    block by an SS wgmma from the other's P tile, hands the running max over in both directions, and fits: ptxas
    without spills; refused with the serial producer and the fused combine."""
    shape = tile.shape(shape_name)
    config = tile.with_defaults(SM90, {"consumers": "paired"})
    space = tile.search_space(SM90)
    assert space.violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    full_s = re.findall(r"wgmma_ss<[^>]*, 64, 64, 16,[^>]*>\([^;]*\(\(uint32_t\*\)\((__\d+) \+ 0\)\)", src)
    assert len(set(full_s)) == 2, "each warpgroup computes a 64 x 64 block of S in its own fragment"
    own_pv = re.findall(r"wgmma_rs<[^>]*, 64, 256, 16,[^>]*>\(reinterpret_cast<const uint32_t\*>\((P[01]_frag) \+", src)
    assert sorted(set(own_pv)) == ["P0_frag", "P1_frag"], "each warpgroup's own P V from its P fragment"
    assert len(re.findall(r"wgmma_ss<[^>]*, 64, 256, 16,", src)) == 2, "each takes the other's block from shared memory"
    assert "bar_m0" in src and "bar_m1" in src and "handed_shared" in src
    assert src.count(f"tl::warpgroup_reg_alloc<{sa.PAIRED_NREG}>();") == 2
    assert f"tl::warpgroup_reg_dealloc<{504 - 2 * sa.PAIRED_NREG}>();" in src
    log = ptxas_log(src, tmp_path, ptxas_options=(f"--register-usage-level={config['ptxas_level']}",))
    assert parse_resource_usage(log)[1] == 0, "no spills"
    for bad, why in (({"produce": "serial"}, "produce=batched or prefetch"), ({"combine": "fused", "n_split": 2}, "combine=fused")):
        assert any(why in r for r in space.violations({**config, **bad}, shape, SM90)), bad


def test_paired_halves_hand_each_buffer_over_in_halves():
    """consumers=paired_halves: four more barriers (each buffer's right half ready and free, one warpgroup freeing
    each half); the producer fills the halves in FlashMLA's order (buffer 0 left, buffer 1 right, buffer 0 right,
    buffer 1 left) and each warpgroup's QK^T waits first for its own half; refused on FP4 rows, with the serial
    producer and several tokens per CTA unless io=overlapped."""
    tile, shape = sa.BF16_TILE, sa.BF16_TILE.shape("prefill_s4k")
    config = tile.with_defaults(SM90, {"consumers": "paired_halves"})
    space = tile.search_space(SM90)
    assert space.violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    for name in ("bar_k0r_ready", "bar_k1r_ready", "bar_k0r_free", "bar_k1r_free"):
        assert f"{name}[0].init(128)" in src or re.search(rf"{name}\[0\]\.init\(128\)", src), name
    fills = re.findall(r"mbarrier_cp_async_arrive_noinc\((bar_k[01]r?_ready)\[0\]\)", src)
    assert fills == ["bar_k0_ready", "bar_k1r_ready", "bar_k0r_ready", "bar_k1_ready"], fills
    waits = re.findall(r"(bar_k[01]r?_ready)\[0\]\.wait", src)
    assert waits[:2] == ["bar_k0_ready", "bar_k0r_ready"] and waits[2:4] == ["bar_k1r_ready", "bar_k1_ready"], waits
    prefill = sa.PREFILL_TILE
    assert space.violations(config, prefill.shape("prefill_s4k"), SM90) == []  # expanded: bf16 rows
    refusals = (
        (prefill, {"kv_staging": "gather"}),
        (tile, {"produce": "serial"}),
        (tile, {"tokens_per_cta": 2, "io": "staged"}),  # several tokens per CTA: io=overlapped only
    )
    for t, over in refusals:
        why = t.search_space(SM90).violations(
            {**t.with_defaults(SM90, {"consumers": "paired_halves"}), **over}, t.shape("prefill_s4k"), SM90
        )
        assert why, over
    with pytest.raises(ValueError, match="paired_halves"):
        sa.sparse_attn_kernel(
            64, 512, 128, 512, 0.04, kv_format="bf16", schedule="ws", produce="batched", consumers="paired_halves", tokens_per_cta=2
        )


@pytest.mark.slow
def test_paired_halves_overlapped_loads_q_ahead_and_stores_o_through_the_p_tiles(tmp_path):
    """paired_halves with io="overlapped" (the prefill default since session 22, consumers="auto"): io="auto" picks it
    for the paired_halves config at prefill 4K (8 tokens per CTA) and not at decode B=64/S=1 (two splits); each warpgroup cp.asyncs its Q half for the next token and stores
    its O half through its own P tile in four chunks of 64 columns (16-byte vectors), its own 128-arrival barrier
    between them; the producer stores nothing; ptxas without spills at PAIRED_OVL_NREG; refused where a token's blocks
    do not make whole pairs."""
    tile, shape = sa.BF16_TILE, sa.BF16_TILE.shape("prefill_s4k")
    space = tile.search_space(SM90)
    config = tile.with_defaults(SM90, {"consumers": "paired_halves"})
    resolved = tile.resolve_call(config, shape.dims, SM90)
    assert (resolved["io"], resolved["tokens_per_cta"]) == ("overlapped", 8)
    decode = tile.resolve_call(config, tile.shape("decode_b64_s1").dims, SM90)
    assert (decode["io"], decode["tokens_per_cta"]) == ("staged", 1)
    assert space.violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    assert src.count(f"tl::warpgroup_reg_alloc<{sa.PAIRED_OVL_NREG}>();") == 2
    assert src.count("cp_async_barrier_noinc(bar_q") + src.count("mbarrier_cp_async_arrive_noinc(bar_q") == 2
    assert len(re.findall(r"\*\(uint4\*\)\(Out \+", src)) == 2, "each warpgroup's O half in 16-byte vectors"
    assert len(re.findall(r"bar_own(_1)?\[0\]\.wait\([01]\)", src)) == 4, "per warpgroup: chunk written, chunk read"
    log = ptxas_log(src, tmp_path, ptxas_options=(f"--register-usage-level={config['ptxas_level']}",))
    assert parse_resource_usage(log)[1] == 0, "no spills"
    w37 = _shape("w37", "prefill", B=1, S=4096, Nc=4096, Nw=4096, W=37)  # 1 + 8 blocks a token
    odd = {**config, "io": "overlapped", "n_split": 1, "tokens_per_cta": 8}
    assert any("whole pairs" in r for r in space.violations(odd, w37, SM90))
    assert tile.resolve_call(config, w37.dims, SM90)["io"] == "staged"  # auto: not for odd counts


@pytest.mark.slow
def test_bf16_partials_compile_for_sm90():
    """partials=bf16 (GPU checks in GPU_CASES): the split CTAs store their partial O as bf16 in 16-byte vectors through
    the freed Q halves (fp32 partials: 8-byte fragment stores), the combine kernel reads bf16; refused where it is not
    built (balanced or seesaw consumers, the fused combine, the pipelined schedule)."""
    tile, shape = sa.DECODE_TILE, sa.DECODE_TILE.shape("decode_b64_s1")
    space = tile.search_space(SM90)
    config = tile.with_defaults(SM90, {"partials": "bf16"})
    assert space.violations(config, shape, SM90) == []
    kernel = tile.build(shape, config, SM90)
    src = kernel.main.get_kernel_source()
    assert "Out" in src and len(re.findall(r"\*\(uint4\*\)\(Out \+", src)) == 2, "both halves staged in 16-byte vectors"
    assert "bfloat16_t* __restrict__ OPart" in kernel.combine.get_kernel_source()
    fp32 = tile.build(shape, tile.with_defaults(SM90, {"partials": "fp32"}), SM90)
    assert "float* __restrict__ OPart" in fp32.combine.get_kernel_source() and "uint4*)(Out +" not in fp32.main.get_kernel_source()
    for other in ({"consumers": "balanced"}, {"consumers": "seesaw"}, {"combine": "fused"}, {"schedule": "pipelined"}):
        refused = tile.with_defaults(SM90, {**other, "partials": "bf16"})
        assert any("partials=bf16" in r for r in space.violations(refused, shape, SM90)), other
        # the Hopper default (bf16) gives way when a config picks what it is not built for without naming it
        assert (
            tile.with_defaults(SM90, other)["partials"] == "fp32" and space.violations(tile.with_defaults(SM90, other), shape, SM90) == []
        )
    assert tile.default_config(SM90)["partials"] == "bf16" and tile.default_config(get_arch("sm80"))["partials"] == "fp32"


@pytest.mark.slow
def test_seesaw_guards_own_blocks_of_short_splits():
    """At 8 splits of 10 blocks (1 or 2 per split), warpgroup 1's own block (the second) exists only in the 2-block
    splits: its wait on the buffer is guarded in the generated CUDA (TileLang had replaced a loop of trip count 0 or 1
    by one unguarded pass, and the H200 hung there)."""
    tile = sa.DECODE_TILE
    config = tile.with_defaults(SM90, {"consumers": "seesaw", "n_split": 8})
    src = tile.build(tile.shape("decode_b64_s1"), config, SM90).main.get_kernel_source()
    waits = re.findall(r"(.*)\n\s*bar_ready_1\[0\]\.wait", src)
    assert waits and all(w.strip().startswith("if (") for w in waits), waits


@pytest.mark.parametrize(
    "tile,shape_name", [(sa.DECODE_TILE, "decode_b64_s1"), (sa.PREFILL_TILE, "prefill_s4k")], ids=["decode", "prefill"]
)
@pytest.mark.slow
def test_wg1_rows_compiles_for_sm90(tile, shape_name):
    """wg1_rows=16 (GPU checks in GPU_CASES): consumer warpgroup 1 dequantises the last 16 rows of each main block,
    so both it and the producer arrive on the buffers' ready barriers (256 arrivals); refused with other producers."""
    shape = tile.shape(shape_name)
    config = {**_gathering_default(tile), "wg1_rows": 16}
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    assert len(re.findall(r"bar_ready(_1)?\[0\]\.init\(256\)", src)) == 2
    default_src = tile.build(shape, _gathering_default(tile), SM90).main.get_kernel_source()
    assert len(re.findall(r"bar_ready(_1)?\[0\]\.init\(128\)", default_src)) == 2
    for other in ({"produce": "prefetch"}, {"consumers": "balanced"}):
        assert any("wg1_rows" in r for r in tile.search_space(SM90).violations({**config, **other}, shape, SM90))


def test_early_handoff_compiles_for_sm90():
    """handoff=before_pv (GPU checks in GPU_CASES): warpgroup 0 fences its P stores for the async proxy and hands P to
    warpgroup 1 before its own P V; the default hands it over after. Refused outside ws + wg0_scores."""
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    staged = {**tile.default_config(SM90), "io": "staged"}  # one token per CTA (io="auto" overlaps several at 4K)
    config = {**staged, "handoff": "before_pv"}
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    assert "tl::fence_proxy_async();\n        bar_s_ready[0].arrive();" in src
    default_src = tile.build(shape, staged, SM90).main.get_kernel_source()
    assert "tl::fence_proxy_async();\n        bar_s_ready[0].arrive();" not in default_src
    for other in ({"consumers": "balanced"}, {"schedule": "pipelined"}):
        assert any("handoff" in r for r in tile.search_space(SM90).violations({**config, **other}, shape, SM90))


def _kv_store_conflict_ways(src: str) -> list[int]:
    """Worst shared-memory bank-conflict degree of each 16-byte store of dequantised values into a KV buffer in a
    generated ws kernel: the store's address expression evaluated for the 8 producer lanes of each quarter-warp
    (one wavefront serves 8 lanes x 16 B), over every 0/1 value of the loop variables in it. 1 = conflict-free."""
    ways = []
    for line in src.splitlines():
        m = re.search(r"\(\(bfloat16_t\*\)buf\w*\) \+ (.*)\) = \*\(uint4\*\)\(vals \+ 0\);", line)
        if not m:
            continue
        expr = m.group(1).replace("((int)threadIdx.x)", "tx")
        loop_vars = sorted(set(re.findall(r"\b([A-Za-z_]\w*)\b", expr)) - {"tx"})
        worst = 0
        for values in itertools.product(range(2), repeat=len(loop_vars)):
            env = dict(zip(loop_vars, values))
            for first in range(256, 384, 8):  # the producer warpgroup's quarter-warps
                chunks = {eval(expr, {}, {**env, "tx": tx}) * 2 // 16 % 8 for tx in range(first, first + 8)}
                worst = max(worst, 8 // len(chunks))
        ways.append(worst)
    return ways


@pytest.mark.slow
def test_column_lanes_store_without_bank_conflicts():
    """lanes=column (GPU checks in GPU_CASES): a quarter-warp's producer lanes store the same columns of 8 rows, which
    the KV buffer's 128-byte swizzle spreads over all 32 banks; the default (a quarter-warp on one row) stores 4-way
    conflicted, as Nsight Compute measured (4x the ideal wavefronts per STS.128). Read from the generated source, so a
    layout or mapping change that brings the conflicts back fails here. Refused outside ws."""
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    config = {**_gathering_default(tile), "lanes": "column"}
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    column = _kv_store_conflict_ways(tile.build(shape, config, SM90).main.get_kernel_source())
    row = _kv_store_conflict_ways(tile.build(shape, {**config, "lanes": "row"}, SM90).main.get_kernel_source())
    assert len(column) == len(row) > 0  # the FP8 window and FP4 main stores, in (partly unrolled) loops
    assert set(column) == {1}
    assert set(row) == {4}
    assert any("lanes" in r for r in tile.search_space(SM90).violations({**config, "schedule": "pipelined"}, shape, SM90))


# fp4_decode=prmt: the packed FP4 main-KV dequant by byte-permute lookups. The CUDA helpers, emulated bit for bit
# (uint32 words as int64 tensors): prmt.b32 in its default mode, __byte_perm (selector bits 2:0 of each nibble), and
# fma.rn.bf16x2 with a -0 addend (the exact product rounded to nearest even; bf16 x bf16 is exact in float64).
_M32 = 0xFFFFFFFF


def _prmt(a, b, sel, replicate=True):
    """prmt.b32 d, a, b, sel: byte n of d is byte (sel nibble n) & 7 of {b, a}, or (replicate, nibble bit 3 set) that
    byte's bit 7 copied to all 8 bits. ``replicate=False`` is __byte_perm (which reads bits 2:0 only)."""
    a, b, sel = (torch.as_tensor(x, dtype=torch.int64) for x in (a, b, sel))
    a, b, sel = torch.broadcast_tensors(a, b, sel)
    pool = torch.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)], -1)
    out = torch.zeros_like(a)
    for n in range(4):
        s = (sel >> (4 * n)) & 0xF
        byte = pool.gather(-1, (s & 7).unsqueeze(-1)).squeeze(-1)
        if replicate:
            byte = torch.where((s & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * n)
    return out


def _bf16_to_f64(h):
    x = (h & 0xFFFF) << 16
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32).view(torch.float32).double()


def _f64_to_bf16(d):
    f = d.float()
    assert torch.equal(f.double()[~d.isnan()], d[~d.isnan()]), "bf16 x bf16 products fit float32 exactly"
    bits = f.view(torch.int32).long() & _M32
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _bf16x2_mul(a, b):
    """csa2_bf16x2_mul: fma.rn.bf16x2(a, b, -0) per 16-bit half."""
    a, b = torch.broadcast_tensors(torch.as_tensor(a, dtype=torch.int64), torch.as_tensor(b, dtype=torch.int64))
    halves = [_f64_to_bf16(_bf16_to_f64(a >> s) * _bf16_to_f64(b >> s) + (-0.0)) for s in (0, 16)]
    return halves[0] | (halves[1] << 16)


def _e4m3_scale2(b):
    """csa2_e4m3_scale2 (the E4M3 scale byte as a bf16x2 pair)."""
    y = b & 0xFF
    x = _bf16x2_mul(((y << 4) & 0x07F007F0) | ((y << 8) & 0x80008000), 0x7B807B80) & 0xFFFF
    return x | (x << 16)


def _fp4x8_fma(u, scale2):
    """csa2_fp4x8_bf16 (fp4_decode=fma): the 8 bf16 bit patterns [..., 8] of word u, in order."""
    t = []
    for k in range(4):
        y = (u >> (4 * k)) & _M32
        pattern = ((y << 6) & 0x01C001C0) | ((y << 12) & 0x80008000)
        t.append(_bf16x2_mul(_bf16x2_mul(pattern, 0x7E807E80), scale2))
    o = [_prmt(t[0], t[1], 0x5410, False), _prmt(t[2], t[3], 0x5410, False)]
    o += [_prmt(t[0], t[1], 0x7632, False), _prmt(t[2], t[3], 0x7632, False)]
    return torch.stack([h for w in o for h in (w & 0xFFFF, w >> 16)], -1)


def _fp4x8_prmt(u, scale2):
    """csa2_fp4x8_bf16_prmt (fp4_decode=prmt), line by line: the 8 bf16 bit patterns [..., 8] of word u, in order."""
    m = u & 0x77777777
    mh = m >> 16
    u4 = (u << 4) & _M32
    lo0, lo1, hi0, hi1 = 0xC0800000, 0xC0804000, 0x3F3F3F00, 0x40404040
    l0, l1 = _prmt(lo0, lo1, m), _prmt(lo0, lo1, mh)
    h0 = _prmt(hi0, hi1, m) | (_prmt(u, u4, 0x1504, False) & 0x80808080)
    h1 = _prmt(hi0, hi1, mh) | (_prmt(u, u4, 0x3726, False) & 0x80808080)
    o = [_prmt(l0, h0, 0x5140, False), _prmt(l0, h0, 0x7362, False), _prmt(l1, h1, 0x5140, False), _prmt(l1, h1, 0x7362, False)]
    o = [_bf16x2_mul(w, scale2) for w in o]
    return torch.stack([h for w in o for h in (w & 0xFFFF, w >> 16)], -1)


def test_prmt_emulation_follows_the_cuda_source():
    """The emulation above is the helper in dequant._FP4_PRMT_CUDA: its tables, masks and selectors, in these statements."""
    src = " ".join(dequant._FP4_PRMT_CUDA.split())
    for stmt in (
        "const unsigned m = u & 0x77777777u;",
        'asm("shr.b32 %0, %1, 16;" : "=r"(mh) : "r"(m));',
        "const unsigned u4 = u << 4;",
        "const unsigned l0 = csa2_prmt(0xC0800000u, 0xC0804000u, m);",
        "const unsigned l1 = csa2_prmt(0xC0800000u, 0xC0804000u, mh);",
        "const unsigned h0 = csa2_prmt(0x3F3F3F00u, 0x40404040u, m) | (__byte_perm(u, u4, 0x1504) & 0x80808080u);",
        "const unsigned h1 = csa2_prmt(0x3F3F3F00u, 0x40404040u, mh) | (__byte_perm(u, u4, 0x3726) & 0x80808080u);",
        "o.x = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x5140), scale2);",
        "o.y = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x7362), scale2);",
        "o.z = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x5140), scale2);",
        "o.w = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x7362), scale2);",
        'asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));',
    ):
        assert stmt in src, stmt
    fma = " ".join(dequant._DEQUANT_CUDA.split())  # and the fma path's helpers as _fp4x8_fma / _e4m3_scale2 emulate them
    for stmt in (
        "return ((y << 6) & 0x01C001C0u) | ((y << 12) & 0x80008000u);",
        "return ((y << 4) & 0x07F007F0u) | ((y << 8) & 0x80008000u);",
        "unsigned x = csa2_bf16x2_mul(csa2_e4m3x2(b & 0xFFu), 0x7B807B80u) & 0xFFFFu;",
        "t[k] = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e2m1x2(u >> (4 * k)), 0x7E807E80u), scale2);",
        'asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));',
        "o.x = __byte_perm(t[0], t[1], 0x5410); o.y = __byte_perm(t[2], t[3], 0x5410);",
        "o.z = __byte_perm(t[0], t[1], 0x7632); o.w = __byte_perm(t[2], t[3], 0x7632);",
    ):
        assert stmt in fma, stmt


@pytest.mark.slow
def test_prmt_fp4_decode_is_bit_identical_to_fma_for_every_code_and_scale():
    """fp4_decode=prmt gives csa2_fp4x8_bf16's bf16 bits for every code in every nibble position (all 2^16 codes of
    the low four nibbles with varied high ones, and the same with the halves swapped: every code next to every
    neighbour) times every one of the 256 E4M3 scale bytes, -0 included; and both equal model.formats' dequant (value x
    scale, exact in bf16) for every non-NaN scale byte (0x7F / 0xFF, which the quantiser writes only for NaN input,
    decode as +-480 in both kernels' helpers)."""
    lo = torch.arange(65536, dtype=torch.int64)
    hi = (lo * 40503 + 12345) & 0xFFFF
    words = torch.cat([lo | (hi << 16), hi | (lo << 16)])  # [131072]
    packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)  # [N, 4], code 2i low nibble
    one = torch.ones(2, dtype=torch.int64)
    assert torch.equal(_fp4x8_prmt(words[:2], _e4m3_scale2(0x38 * one)), _fp4x8_fma(words[:2], _e4m3_scale2(0x38 * one)))
    pmt_1, fma_1 = _fp4x8_prmt(words, 0x3F803F80), _fp4x8_fma(words, 0x3F803F80)  # scale 1: the bare code values
    assert torch.equal(pmt_1, fma_1)
    for sbyte in range(256):
        s2 = _e4m3_scale2(torch.tensor(sbyte, dtype=torch.int64))
        got = _bf16x2_mul(pmt_1, s2) & 0xFFFF  # the helper ends in this multiply (x 1 above: the lookup itself)
        assert torch.equal(_fp4x8_prmt(words[:4096], s2), got[:4096]), sbyte
        want = _fp4x8_fma(words, s2)
        assert torch.equal(got, want), f"scale byte {sbyte:#04x}"
        if sbyte & 0x7F == 0x7F:
            continue
        scales = torch.full((words.numel() // 2, 1), sbyte, dtype=torch.uint8)
        ref = fp4_dequantize(packed.view(-1, 8), scales, 16, "e4m3").view(-1, 8)  # [N, 8] float32
        ref_bits = ref.bfloat16().view(torch.int16).long() & 0xFFFF
        assert torch.equal(ref.bfloat16().float(), ref), "value x scale is exact in bf16"
        assert torch.equal(want, ref_bits), f"scale byte {sbyte:#04x}"
    # the signed zeros: code 8 (-0) stays -0 at a positive scale, code 0 +0
    assert int(fma_1[0, 0]) == 0 and int(_fp4x8_prmt(torch.tensor([8]), 0x3F803F80)[0, 0]) == 0x8000


@pytest.mark.slow
def test_prmt_fp4_decode_compiles_for_sm90_and_is_refused_elsewhere():
    """fp4_decode=prmt (GPU checks in GPU_CASES): the ws producer's FP4 main words go through csa2_fp4x8_bf16_prmt, in
    the batched and prefetch producers and warpgroup 1's wg1_rows share; the FP8 window path keeps its helper. Refused
    for bf16 KV, outside ws, with the serial producer, and on the archs without ws."""
    for tile, shape_name, extra in (
        (sa.DECODE_TILE, "decode_b64_s1", {}),
        (sa.DECODE_TILE, "decode_b128_s2", {"produce": "prefetch", "n_split": 4}),
        (sa.DECODE_TILE, "decode_b64_s1", {"wg1_rows": 16}),
        (sa.PREFILL_TILE, "prefill_s4k", {}),
        (sa.PREFILL_TILE, "prefill_s4k", {"lanes": "column"}),
    ):
        shape = tile.shape(shape_name)
        config = {**_gathering_default(tile), "fp4_decode": "prmt", **extra}
        assert tile.search_space(SM90).violations(config, shape, SM90) == []
        src = tile.build(shape, config, SM90).main.get_kernel_source()
        assert "wgmma" in src
        calls = re.findall(r"(?<!void )\b(csa2_fp4x8_bf16(?:_prmt)?)\(", src)  # calls, not the helpers' definitions
        assert len(calls) >= 2 and set(calls) == {"csa2_fp4x8_bf16_prmt"}
        assert "csa2_e4m3x4_bf16(" in src  # the FP8 window words: unchanged
    # Hopper's default since session 8; fma stays one config away, and a config that picks the serial producer or
    # the pipelined schedule without naming fp4_decode gets fma
    assert sa.PREFILL_TILE.default_config(SM90)["fp4_decode"] == "prmt" == sa.DECODE_TILE.default_config(SM90)["fp4_decode"]
    fma_cfg = {**_gathering_default(sa.PREFILL_TILE), "fp4_decode": "fma"}
    fma_src = sa.PREFILL_TILE.build(sa.PREFILL_TILE.shape("prefill_s4k"), fma_cfg, SM90)
    assert "prmt" not in fma_src.main.get_kernel_source()
    tile, shape = sa.DECODE_TILE, sa.DECODE_TILE.shape("decode_b64_s1")
    for other in ({"produce": "serial"}, {"schedule": "pipelined"}):
        cfg = tile.with_defaults(SM90, other)
        assert cfg["fp4_decode"] == "fma" and tile.search_space(SM90).violations(cfg, shape, SM90) == [], other
    config = {**tile.default_config(SM90), "fp4_decode": "prmt"}
    for other in ({"produce": "serial"}, {"schedule": "pipelined"}):
        cfg = tile.with_defaults(SM90, {"fp4_decode": "prmt", **other})
        assert any("fp4_decode=prmt" in r for r in tile.search_space(SM90).violations(cfg, shape, SM90)), other
    for arch_name in ("sm80", "sm86", "sm89"):
        arch = get_arch(arch_name)
        reasons = tile.search_space(arch).violations({**tile.default_config(arch), "fp4_decode": "prmt"}, shape, arch)
        assert any("fp4_decode=prmt" in r for r in reasons), arch_name
    bf16 = {**sa.BF16_TILE.default_config(SM90), "fp4_decode": "prmt"}
    reasons = sa.BF16_TILE.search_space(SM90).violations(bf16, sa.BF16_TILE.shape("prefill_s4k"), SM90)
    assert any("FP4 main KV" in r for r in reasons)
    assert "fp4_decode" not in sa.BF16_TILE.search_space(SM90).names()


def test_kv_staging_is_a_prefill_choice_resolved_per_call():
    """kv_staging (GPU checks in GPU_CASES): the prefill tile's only; "auto" expands from EXPAND_MIN_TOKENS tokens
    reading each cache row EXPAND_MIN_READS times or more (every prefill shape), gathers otherwise (every decode shape)."""
    assert "kv_staging" in sa.PREFILL_TILE.search_space(SM90).names()
    for tile in (sa.DECODE_TILE, sa.BF16_TILE):
        assert "kv_staging" not in tile.search_space(SM90).names()

    def resolve(choice, shape):
        return sa.resolve_kv_staging(choice, shape)

    for shape in sa.PREFILL_TILE.shapes():
        assert resolve("auto", shape) == "expand", shape.name
    for shape in sa.DECODE_TILE.shapes():
        assert resolve("auto", shape) == "gather", shape.name
    chunk = _shape("chunk", "prefill", B=1, S=300, Nc=1 << 20, Nw=300)  # a short prompt chunk over a long cache
    assert resolve("auto", chunk) == "gather"
    # the measured bounds: 512 tokens and 8 reads per row
    assert resolve("auto", _shape("s512", "prefill", B=1, S=512, Nc=32768, Nw=512)) == "expand"  # 9.8 reads per row
    assert resolve("auto", _shape("s400", "prefill", B=1, S=400, Nc=400, Nw=400)) == "gather"  # 320 reads, 400 tokens
    assert resolve("auto", _shape("s2k_long", "prefill", B=1, S=2048, Nc=262144, Nw=2048)) == "gather"  # 5 reads
    assert resolve("expand", chunk) == "expand" and resolve("gather", sa.PREFILL_TILE.shape("prefill_s4k")) == "gather"
    with pytest.raises(ValueError, match="resolve_kv_staging"):
        sa.compiled(64, 512, 128, 512, SCALE, "fp4", {**sa.PREFILL_TILE.default_config(SM90), "kv_staging": "auto"}, SM90)


def test_kv_staging_expand_refuses_the_fp4_only_producer_choices():
    tile, space = sa.PREFILL_TILE, sa.PREFILL_TILE.search_space(SM90)
    shape = tile.shape("prefill_s4k")
    chunk = _shape("chunk", "prefill", B=1, S=300, Nc=1 << 20, Nw=300)
    for other in ({"produce": "prefetch"}, {"wg1_rows": 16}, {"schedule": "pipelined", "dequant": "staged", "num_stages": 1}):
        for staging in ("expand", "auto"):
            cfg = tile.with_defaults(SM90, {"kv_staging": staging, **other})
            assert any("kv_staging=expand" in r for r in space.violations(cfg, shape, SM90)), (staging, other)
        # auto gathers at the chunk shape, where the producer's choices stand
        assert space.violations(tile.with_defaults(SM90, {"kv_staging": "auto", **other}), chunk, SM90) == [], other
    for other in ({}, {"fp4_decode": "fma"}, {"consumers": "seesaw"}, {"schedule": "pipelined"}, {"tokens_per_cta": 2}):
        cfg = tile.with_defaults(SM90, {"kv_staging": "expand", **other})
        assert space.violations(cfg, shape, SM90) == [], other


@pytest.mark.slow
def test_unused_rows_zeros_predicates_the_bf16_copies():
    """unused_rows=zeros (GPU checks in GPU_CASES; Hopper's default): every cp.async of the ws batched producer's bf16
    rows carries the slot's used flag as its predicate (zero-fill, no read); row0 copies row 0 unpredicated. Refused
    where bf16 rows are copied by another producer; no effect on the FP4/FP8 rows the producer decodes."""
    # io=staged: io="auto" overlaps at 4K, and its Q copies are cp.async too
    for tile, extra in ((sa.BF16_TILE, {"io": "staged"}), (sa.PREFILL_TILE, {"kv_staging": "expand", "io": "staged"})):
        shape = tile.shape("prefill_s4k")
        cfg = tile.with_defaults(SM90, {**extra, "unused_rows": "zeros"})
        assert tile.search_space(SM90).violations(cfg, shape, SM90) == []
        src = tile.build(shape, cfg, SM90).main.get_kernel_source()
        assert src.count("cp_async_gs_conditional<16>") == 8 and "cp_async_gs<16>" not in src
        assert tile.default_config(SM90)["unused_rows"] == "zeros"  # Hopper's default since session 18
        row0 = tile.build(shape, tile.with_defaults(SM90, {**extra, "unused_rows": "row0"}), SM90).main.get_kernel_source()
        assert row0.count("cp_async_gs<16>") == 8 and "cp_async_gs_conditional" not in row0
    # FP4 rows decoded by the producer (the prefill tile gathering): the key does not apply, the kernel is the same
    gather = sa.PREFILL_TILE.with_defaults(SM90, {"kv_staging": "gather"})
    shape = sa.PREFILL_TILE.shape("prefill_s4k")
    assert gather["unused_rows"] == "zeros" and sa.PREFILL_TILE.search_space(SM90).violations(gather, shape, SM90) == []
    sources = {sa.PREFILL_TILE.build(shape, {**gather, "unused_rows": u}, SM90).main.get_kernel_source() for u in sa.UNUSED_ROWS}
    assert len(sources) == 1
    # a config that leaves the ws batched producer gets row0 unless it names zeros, which is then refused
    for other in ({"produce": "serial"}, {"schedule": "pipelined"}):
        assert sa.BF16_TILE.with_defaults(SM90, other)["unused_rows"] == "row0", other
    for arch_name in ("sm80", "sm86", "sm89"):
        assert sa.BF16_TILE.default_config(get_arch(arch_name))["unused_rows"] == "row0"
    refused = (
        (sa.PREFILL_TILE, {"kv_staging": "expand", "produce": "serial"}),
        (sa.BF16_TILE, {"produce": "serial"}),
        (sa.BF16_TILE, {"schedule": "pipelined"}),
    )
    for tile, extra in refused:
        cfg = tile.with_defaults(SM90, {**extra, "unused_rows": "zeros"})
        assert any("unused_rows" in r for r in tile.search_space(SM90).violations(cfg, tile.shape("prefill_s4k"), SM90)), extra
    assert "unused_rows" not in sa.DECODE_TILE.search_space(SM90).names()


def test_kernel_key_is_what_the_auto_choices_resolve_to():
    """Tile.kernel_key keys a config by the config it resolves to at the shape, so the tuner measures an "auto"
    config and the config naming its resolution once (the prefill 4K space: 14,224 valid configs, 4,200 kernels)."""
    for tile, shape_name in ((sa.PREFILL_TILE, "prefill_s4k"), (sa.BF16_TILE, "decode_b128_s2"), (sa.DECODE_TILE, "decode_b64_s1")):
        shape = tile.shape(shape_name)
        resolved = tile.resolve_call(tile.with_defaults(SM90, {}), shape, SM90)
        assert tile.kernel_key(shape, {}, SM90) == tile.kernel_key(shape, resolved, SM90)
        assert tile.kernel_key(shape, {}, SM90) != tile.kernel_key(shape, {"block_I": 32}, SM90)
    shape = sa.PREFILL_TILE.shape("prefill_s4k")
    halves8 = {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 8}
    assert sa.PREFILL_TILE.kernel_key(shape, {}, SM90) == sa.PREFILL_TILE.kernel_key(shape, halves8, SM90)
    assert sa.PREFILL_TILE.kernel_key(shape, {}, SM90) != sa.PREFILL_TILE.kernel_key(shape, {"consumers": "wg0_scores"}, SM90)
    # the bf16 rows' copy keys build nothing different where the producer decodes FP4/FP8 rows (as CompiledAttention)
    key = sa.PREFILL_TILE.kernel_key
    gather, expand = {"kv_staging": "gather"}, {"kv_staging": "expand"}
    assert key(shape, {**gather, "unused_rows": "zeros"}, SM90) == key(shape, {**gather, "unused_rows": "row0"}, SM90)
    assert key(shape, {**expand, "unused_rows": "zeros"}, SM90) != key(shape, {**expand, "unused_rows": "row0"}, SM90)


@pytest.mark.parametrize("arch_name", ["sm80", "sm86", "sm89", "sm90"])
@pytest.mark.slow
def test_kv_staging_expand_compiles_everywhere(arch_name):
    """The expansion calls the gathering producer's own decode helpers (so the bf16 rows are its bits), and the
    attention behind it is the bf16 tile's kernel for the same config."""
    arch = get_arch(arch_name)
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    cfg = tile.with_defaults(arch, {"kv_staging": "expand"})
    assert tile.search_space(arch).violations(cfg, shape, arch) == []
    kernel = tile.build(shape, cfg, arch)
    assert isinstance(kernel, sa.ExpandedAttention)
    src = kernel.expand.get_kernel_source()
    fp4_word = dequant.FP4X8_FUNCTIONS[cfg["fp4_decode"]]
    assert re.search(rf"(?<!void )\b{fp4_word}\(", src) and re.search(r"(?<!void )\bcsa2_e4m3x4_bf16\(", src)
    assert re.search(r"(?<!void )\bcsa2_e4m3_scale2\(", src) and re.search(r"(?<!void )\bcsa2_e8m0_scale2\(", src)
    bf16_cfg = {k: v for k, v in cfg.items() if k not in sa.FP4_ONLY_KEYS}
    bf16 = sa.BF16_TILE.build(shape, bf16_cfg, arch)  # its n_split resolves to 1 here: one kernel, no combine
    assert bf16.combine is None and kernel.attend.main.get_kernel_source() == bf16.main.get_kernel_source()


@pytest.mark.parametrize("tpc", [2, 4])
@pytest.mark.slow
def test_tokens_per_cta_compiles_for_sm90(tpc):
    """tokens_per_cta (GPU checks in GPU_CASES): each CTA loops over tpc (token, head block) items, the barrier phases
    running on across them; the grid shrinks by tpc. Refused with the producers and consumers it does not cover."""
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    config = {**tile.default_config(SM90), "io": "staged", "tokens_per_cta": tpc}
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    assert f"for (int j = 0; j < {tpc}; ++j)" in src and "bar_q[0].wait((j & 1))" in src
    for other in ({"produce": "prefetch"}, {"consumers": "balanced"}, {"wg1_rows": 16}, {"io": "direct"}):
        assert any("tokens_per_cta" in r for r in tile.search_space(SM90).violations({**config, **other}, shape, SM90))


@pytest.mark.parametrize("tpc", [2, 4, 8])
@pytest.mark.slow
def test_overlapped_io_compiles_for_sm90_without_spills(tpc, tmp_path):
    """io="overlapped" (GPU checks in test_overlapped_io_odd_shapes and gpu/sparse_attn_check.py): warpgroup 1 copies
    the next token's Q by cp.async onto the Q barrier, the consumers stage O into the token's last KV buffer and only
    the producer stores O, from each buffer it is about to refill and from the last tokens' at its end."""
    tile, shape = sa.BF16_TILE, sa.BF16_TILE.shape("prefill_s4k")
    config = tile.with_defaults(SM90, {"io": "overlapped", "tokens_per_cta": tpc, "n_split": 1})
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    assert src.count("tl::mbarrier_cp_async_arrive_noinc(bar_q[0]);") == 1  # warpgroup 1, under the last block
    producer = src.index("tl::warpgroup_reg_dealloc<96>();")
    stores = [m.start() for m in re.finditer(re.escape("*(uint4*)(Out +"), src)]
    # both halves, in the loop and at the end: with 10 blocks per token a token's last block is always in buffer 1,
    # so TileLang folds away the buffer-0 copies
    assert len(stores) == 4 and min(stores) > producer, "O leaves only from the producer"
    log = ptxas_log(src, tmp_path, ptxas_options=(f"--register-usage-level={config['ptxas_level']}",))
    assert parse_resource_usage(log)[1] == 0, "no spills"


def test_overlapped_io_is_refused_where_it_cannot_stage_o():
    """One token per CTA (nothing to overlap), split partials, FP4 rows (the gathering producer: its own lane map,
    and spills) and 32-row blocks are refused with the reason."""
    bf16, shape = sa.BF16_TILE, sa.BF16_TILE.shape("prefill_s4k")
    base = {"io": "overlapped", "tokens_per_cta": 4, "n_split": 1}
    for other, why in (({"tokens_per_cta": 1}, "tokens_per_cta > 1"), ({"n_split": 2}, "n_split=1"), ({"block_I": 32}, "block_I=64")):
        config = bf16.with_defaults(SM90, {**base, **other})
        assert any(why in r for r in bf16.search_space(SM90).violations(config, shape, SM90)), other
    prefill, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    over = {"io": "overlapped", "tokens_per_cta": 4}
    assert prefill.search_space(SM90).violations(prefill.with_defaults(SM90, over), shape, SM90) == []  # expands at 4K
    gather = prefill.with_defaults(SM90, {**over, "kv_staging": "gather"})
    assert any("bf16 KV" in r for r in prefill.search_space(SM90).violations(gather, shape, SM90))
    with pytest.raises(ValueError, match="bf16 KV"):
        sa.sparse_attn_kernel(64, 512, 128, 512, 0.04, kv_format="fp4", schedule="ws", produce="batched", io="overlapped", tokens_per_cta=4)
    with pytest.raises(ValueError, match="unknown io"):
        sa.sparse_attn_kernel(64, 512, 128, 512, 0.04, kv_format="bf16", schedule="ws", produce="batched", io="prefetched")


def test_io_auto_overlaps_where_the_call_has_bf16_rows_and_the_waves_of_tokens_cost_least():
    """io="auto" (the prefill and bf16 tiles' Hopper default) resolves per call (sa.resolve_io): where the rows are
    bf16, overlapped with 8, 4 or 2 tokens per CTA or staged with one, whichever leaves the busiest SM the least work
    (tiles.sparse_attn.policy._io_cost: waves of CTAs x (tokens per CTA + IO_CTA_COST), staged tokens weighing IO_STAGED_TOKEN_COST); else
    staged with the config's own tokens per CTA (kept whenever it names more than one). The kernel refuses an
    unresolved "auto"."""

    def resolved(tile, dims, over=None):
        cfg = tile.resolve_call(tile.with_defaults(SM90, over or {}), dims, SM90)
        return cfg["io"], cfg["tokens_per_cta"]

    prefill = sa.PREFILL_TILE
    assert resolved(prefill, prefill.shape("prefill_s4k")) == ("overlapped", 8)  # 4 waves x 8.12 against 8 x 4.12
    assert resolved(prefill, prefill.shape("prefill_s64k")) == ("overlapped", 8)  # 63 x 8.12 against 249 x 2.12
    s777 = _shape("s777", "prefill", B=1, S=777, Nc=777, Nw=777)
    assert resolved(prefill, s777) == ("overlapped", 2)  # 3 waves x 2.12 against 2 x 4.12, 1 x 8.12, 6 x 1.09
    # one wave of 4 or 8 tokens a CTA against two of 2 or 4 (the tie goes to the fewer CTAs, as measured); a second wave
    # half full costs a full one (768: 2 per CTA, as measured); below 512 tokens the prefill gathers FP4 rows
    for s, tokens in ((500, 1), (512, 4), (768, 2), (1024, 8), (1536, 4), (2048, 8), (16384, 8)):
        io = "staged" if tokens == 1 else "overlapped"
        assert resolved(prefill, _shape(f"s{s}", "prefill", B=1, S=s, Nc=s, Nw=s)) == (io, tokens), s
    assert resolved(prefill, prefill.shape("prefill_s4k"), {"kv_staging": "gather"}) == ("staged", 1)  # FP4 rows
    assert resolved(prefill, prefill.shape("prefill_s4k"), {"consumers": "seesaw"}) == ("staged", 1)
    assert resolved(prefill, prefill.shape("prefill_s4k"), {"io": "staged", "tokens_per_cta": 4}) == ("staged", 4)
    assert resolved(prefill, prefill.shape("prefill_s4k"), {"tokens_per_cta": 4}) == ("overlapped", 4)  # named: kept
    assert resolved(prefill, prefill.shape("prefill_s4k"), {"tokens_per_cta": 4, "kv_staging": "gather"}) == ("staged", 4)
    bf16 = sa.BF16_TILE
    assert resolved(bf16, bf16.shape("prefill_s4k")) == ("overlapped", 8)
    # 128 tokens: one wave staged (1.09) against one of 2 per CTA (2.12); 256: one wave of 2 per CTA (2.12) against two
    # staged (2.18); 384: three staged (3.27) against one wave of 4 per CTA (4.12); 500: 4.12 against 2 x 2.12, 4 x 1.09
    for s, expected in ((128, ("staged", 1)), (256, ("overlapped", 2)), (384, ("staged", 1)), (500, ("overlapped", 4))):
        assert resolved(bf16, _shape(f"s{s}", "prefill", B=1, S=s, Nc=s, Nw=s)) == expected, s
    assert resolved(bf16, bf16.shape("decode_b128_s2")) == ("overlapped", 2)  # 256 items: one wave of 2 per CTA
    assert resolved(bf16, bf16.shape("decode_b64_s1")) == ("staged", 1)  # two splits
    assert sa.DECODE_TILE.default_config(SM90)["io"] == "staged"
    with pytest.raises(ValueError, match="resolved per call"):
        sa.sparse_attn_kernel(64, 512, 128, 512, 0.04, kv_format="bf16", schedule="ws", produce="batched", io="auto")


def test_consumers_auto_pairs_the_blocks_where_io_auto_overlaps_a_prefill():
    """consumers="auto" (the prefill and bf16 tiles' Hopper default) resolves per call (sa.resolve_consumers):
    paired_halves where io="auto" overlaps the call's tokens and the call rereads its rows (a prefill), the rest of the
    config allowing it; else wg0_scores. The bf16 tile's bf16 partials stay the default (wg0_scores wherever there are
    splits). The kernel refuses an unresolved "auto"."""

    def consumers(tile, dims, over=None):
        config = tile.with_defaults(SM90, over or {})
        assert tile.search_space(SM90).violations(config, dims, SM90) == []
        return tile.resolve_call(config, dims, SM90)["consumers"]

    prefill, bf16 = sa.PREFILL_TILE, sa.BF16_TILE
    s4k = prefill.shape("prefill_s4k")
    assert prefill.default_config(SM90)["consumers"] == bf16.default_config(SM90)["consumers"] == "auto"
    assert sa.DECODE_TILE.default_config(SM90)["consumers"] == "wg0_scores"
    assert consumers(prefill, s4k) == consumers(bf16, s4k) == "paired_halves"
    assert bf16.resolve_call(bf16.default_config(SM90), s4k, SM90)["partials"] == "fp32"  # one split: no partials
    assert consumers(prefill, _shape("s384", "prefill", B=1, S=384, Nc=384, Nw=384)) == "wg0_scores"  # FP4 rows
    assert consumers(prefill, s4k, {"io": "staged"}) == "wg0_scores"  # io named: no overlap to pair with
    assert consumers(prefill, s4k, {"io": "overlapped", "tokens_per_cta": 4}) == "wg0_scores"  # io named
    assert consumers(prefill, s4k, {"handoff": "before_pv"}) == "wg0_scores"  # wg0_scores' option
    w37 = _shape("w37", "prefill", B=1, S=4096, Nc=4096, Nw=4096, W=37)  # 9 blocks a token: no whole pairs
    assert consumers(prefill, w37) == "wg0_scores"
    # decode: rows read about once (paired_halves overlapped lost at B=128/S=2), or split
    assert consumers(bf16, bf16.shape("decode_b128_s2")) == "wg0_scores"
    assert bf16.resolve_call(bf16.default_config(SM90), bf16.shape("decode_b64_s1"), SM90)["partials"] == "bf16"
    assert "wgmma" in prefill.build(s4k, prefill.default_config(SM90), SM90).main.get_kernel_source()
    with pytest.raises(ValueError, match="resolved per call"):
        sa.sparse_attn_kernel(64, 512, 128, 512, 0.04, kv_format="bf16", schedule="ws", produce="batched", consumers="auto")


def test_constraints_resolve_consumers_auto_once_per_config_and_shape(monkeypatch):
    """The constraints that read ``consumers`` judge "auto" as it resolves at the shape, resolving it once for the
    constraints of one config and shape (the tuner enumerates millions of configs), and again for another shape."""
    calls = []
    real = sa.resolve_consumers
    monkeypatch.setattr(sa_space, "resolve_consumers", lambda c, s, a, k: calls.append(s["W"]) or real(c, s, a, k))
    tile = sa.BF16_TILE
    space, config = tile.search_space(SM90), tile.with_defaults(SM90, {})
    s4k, w37 = tile.shape("prefill_s4k"), _shape("w37", "prefill", B=1, S=4096, Nc=4096, Nw=4096, W=37)
    for shape in (s4k, s4k, w37, s4k):
        assert space.violations(config, shape, SM90) == []
    assert calls == [128, 37, 128]  # s4k (the second check of it: remembered), w37, s4k again
    assert space.violations({**config, "consumers": "wg0_scores"}, s4k, SM90) == [] and len(calls) == 3
    # the resolution is what the constraints see: paired_halves at 4K needs whole pairs, so an odd top-k block count
    # resolves to wg0_scores and stays valid; named, paired_halves with io=overlapped is refused there
    odd = _shape("odd", "prefill", B=1, S=4096, Nc=4096, Nw=4096, K=448)  # 2 + 7 blocks
    assert space.violations(config, odd, SM90) == []
    named = {**config, "consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 8, "partials": "fp32"}
    assert any("whole pairs" in r for r in space.violations(named, odd, SM90))


@pytest.mark.slow
def test_pipelined_softmax_workspace_is_fenced_before_p_is_stored():
    """With 32 heads over 4 warps the pipelined schedule's row max and sum cross warps through a shared workspace that
    TileLang places on S_shared's bytes (checked here too): every store of P into S_shared must come after a barrier,
    or a fast warp overwrites the workspace a slow warp is still reading (a run-to-run race on the H200, session 15)."""
    tile, shape = sa.DECODE_TILE, sa.DECODE_TILE.shape("decode_b64_s1")
    config = tile.with_defaults(SM90, {"schedule": "pipelined", **_ADA_LAYOUT, "n_split": 2})
    src = tile.build(shape, config, SM90).main.get_kernel_source()
    offsets = _buffer_offsets(src)
    assert any(name.startswith("workspace") and off == offsets["S_shared"] for name, off in offsets.items())
    lines = [line.strip() for line in src.splitlines()]
    stores = [i for i, line in enumerate(lines) if "stmatrix" in line and "S_shared" in line]
    assert stores and all(lines[i - 1] == "__syncthreads();" for i in stores)


@pytest.mark.slow
def test_the_prefill_kernels_producer_and_consumers_move_what_they_should():
    """The default FP4 prefill kernel's producer, in the generated CUDA (two buffer-parity copies): 8 FP4 main-word
    decodes, 4 FP8 window-word decodes and 10 16-byte row stores each; the bf16 kernel's consumers (wg0_scores, staged
    Q/O) one 16-byte Q loop and one O loop per warpgroup, and with paired_halves + io=overlapped the next token's Q by
    cp.async and O out in 16-byte stores."""
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    cfg = tile.resolve_call(tile.with_defaults(SM90, {"kv_staging": "gather", "io": "staged"}), shape, SM90)
    src = sa.CompiledAttention(shape["H"], shape["D"], shape["W"], shape["K"], 0.04, "fp4", cfg, SM90).main.get_kernel_source()
    counts = (src.count("csa2_fp4x8_bf16_prmt((&(vals[0]))"), src.count("csa2_e4m3x4_bf16((&"), src.count("*(uint4*)(((bfloat16_t*)buf"))
    assert counts == (16, 8, 20)
    tile, shape = sa.BF16_TILE, sa.BF16_TILE.shape("prefill_s4k")
    cfg = tile.resolve_call(tile.with_defaults(SM90, {"n_split": 1, "io": "staged"}), shape, SM90)  # wg0_scores
    src = sa.CompiledAttention(shape["H"], shape["D"], shape["W"], shape["K"], 0.04, "bf16", cfg, SM90).main.get_kernel_source()
    assert (src.count("*(uint4*)(Q +"), src.count("*(uint4*)(Out +"), src.count("wgmma"), src.count("fence_proxy_async")) == (2, 2, 27, 4)
    halves = {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 8}
    cfg = tile.resolve_call(tile.with_defaults(SM90, halves), shape, SM90)
    src = sa.CompiledAttention(shape["H"], shape["D"], shape["W"], shape["K"], 0.04, "bf16", cfg, SM90).main.get_kernel_source()
    assert (src.count("cp_async_gs<16>"), src.count("*(uint4*)(Out +")) == (2, 2)


FUSED = {"combine": "fused", "partials": "fp32"}  # the fused combine merges fp32 partials (the Hopper default is bf16)
H128 = _shape("h128", "decode", B=3, S=2, Nc=5000, Nw=130, H=128)
W37 = _shape("w37", "decode", B=5, S=1, Nc=700, Nw=38, W=37)


@pytest.mark.parametrize(
    "shape,extra,n_split",
    [
        (sa.DECODE_TILE.shape("decode_b64_s1"), {}, 2),
        (sa.DECODE_TILE.shape("decode_b64_s1"), {"n_split": 4}, 4),
        (W37, {}, 8),  # auto: 5 tokens fill 8 splits
        (H128, {"n_split": 2}, 2),
    ],
    ids=["b64_s1", "b64_s1_split4", "w37_split8", "h128_split2"],
)
@pytest.mark.slow
def test_fused_combine_compiles_for_sm90(shape, extra, n_split):
    """combine=fused (GPU checks in GPU_CASES, unmeasured): no combine kernel; each split CTA stores its partial,
    fences, and thread 0 counts the CTA in with an acq_rel atomic that returns the old value; the last CTA resets the
    counter and writes bf16 Out itself."""
    tile = sa.DECODE_TILE
    config = {**tile.default_config(SM90), **FUSED, **extra}
    assert tile.search_space(SM90).violations(config, shape, SM90) == []
    kernel = tile.build(shape, config, SM90)
    assert kernel.fused and kernel.combine is None and kernel.n_split == n_split
    src = kernel.main.get_kernel_source()
    assert "bfloat16_t* __restrict__ Out" in src and "float* __restrict__ OPart" in src and "int* __restrict__ Counter" in src
    assert src.count("csa2_fence_gpu();") == 2, "each consumer warpgroup fences its partial stores"
    assert re.search(r"last_shared\[0\] = AtomicAddRet\(\(&\(Counter\[[^;]*\]\)\), 1, 4\);", src), "acq_rel (4) fetch-add"
    assert re.search(rf"if \(last_shared\[0\] == {n_split - 1}\) \{{\s*Counter\[[^;]*\] = 0;", src), "the last CTA resets"
    assert "bar_last[0].init(1)" in src and "bar_arrived[0].init(256)" in src
    assert "__syncthreads();" not in src.split("bar_last[0].wait")[1], "the producer warpgroup has left: no CTA-wide barrier"


def test_fused_combine_refused_where_it_does_not_apply():
    tile, space = sa.DECODE_TILE, sa.DECODE_TILE.search_space(SM90)
    b64, b128 = tile.shape("decode_b64_s1"), tile.shape("decode_b128_s2")
    fused = {**tile.default_config(SM90), **FUSED}
    assert "combine" in space.names() and tile.default_config(SM90)["combine"] == "separate"
    assert "combine" in sa.BF16_TILE.search_space(SM90).names() and "combine" not in sa.PREFILL_TILE.search_space(SM90).names()
    assert any("nothing to combine" in r for r in space.violations({**fused, "n_split": 1}, b64, SM90))
    assert any("nothing to combine" in r for r in space.violations(fused, b128, SM90))  # ws auto: one split at B=128/S=2
    assert space.violations({**fused, "n_split": 2}, b128, SM90) == []
    for other in ({"schedule": "pipelined"}, {"tokens_per_cta": 2, "io": "staged"}):
        assert any("schedule=ws, tokens_per_cta=1" in r for r in space.violations({**fused, **other}, b64, SM90))
    assert any("wg1_rows=0" in r for r in space.violations({**fused, "wg1_rows": 16}, b64, SM90))
    with pytest.raises(ValueError, match="combine='fused'"):
        sa.sparse_attn_kernel(64, 512, 128, 512, SCALE, n_split=1, schedule="ws", combine="fused")


def test_fused_counter_allocated_once_and_grown():
    """The arrival counters: zeroed int32 [B, S, REP] views of one buffer per device, replaced only when a call has
    more tokens (the kernel leaves them zero, so they are never cleared again)."""
    kernel = object.__new__(sa.CompiledAttention)
    kernel.rep, kernel.counters = 2, {}
    cpu = torch.device("cpu")
    c1 = kernel.counter(4, 1, cpu)
    assert c1.shape == (4, 1, 2) and c1.dtype == torch.int32 and not c1.any()
    buf = kernel.counters[cpu]
    assert kernel.counter(2, 2, cpu).data_ptr() == buf.data_ptr()  # same size: same buffer
    c3 = kernel.counter(8, 2, cpu)
    assert c3.shape == (8, 2, 2) and kernel.counters[cpu].numel() >= 32 and not c3.any()


def test_ws_only_choices_fall_back_for_other_schedules():
    """{"schedule": "pipelined"} alone is valid: produce and io are the ws schedule's choices and fall back."""
    cfg = sa.DECODE_TILE.with_defaults(SM90, {"schedule": "pipelined"})
    assert cfg["produce"] == "serial" and cfg["io"] == "direct" and cfg["consumers"] == "wg0_scores"
    assert sa.DECODE_TILE.search_space(SM90).violations(cfg, sa.DECODE_TILE.shape("decode_b64_s1"), SM90) == []
    assert sa.DECODE_TILE.with_defaults(SM90, {})["io"] == "staged"


def _cpu_inputs(B=2, S=3, H=64, W=16, K=32, Nw=20, Nc=40):
    q = torch.randn(B, S, H, 512).bfloat16()  # [B, S, H, D]
    wc, ws = fp8_quantize(torch.randn(B, Nw, 512))  # [B, Nw, D], [B, Nw, D/32]
    mp, ms = fp4_quantize(torch.randn(B, Nc, 512))  # [B, Nc, D/2], [B, Nc, D/16]
    wi = torch.randint(0, Nw, (B, S, W), dtype=torch.int32)  # [B, S, W]
    ti = torch.randint(0, Nc, (B, S, K), dtype=torch.int32)  # [B, S, K]
    return [q, wc, ws, wi, mp, ms, ti, torch.randn(H)]


@pytest.mark.parametrize(
    "position,bad,message",
    [
        (0, lambda t: t.float(), "q must be torch.bfloat16"),
        (0, lambda t: t[..., :256].contiguous(), "head dim must be 512"),
        (0, lambda t: t[:, :, :32].contiguous(), "multiple of 64"),
        (0, lambda t: t.transpose(1, 2), "must be contiguous"),
        (1, lambda t: t[:, :, :256].contiguous(), "window_codes must have shape"),
        (2, lambda t: t.float(), "window_scales must be torch.uint8"),
        (3, lambda t: t.long(), "window_idx must be torch.int32"),
        (3, lambda t: torch.zeros(2, 3, 129, dtype=torch.int32), "1..128"),
        (4, lambda t: t[:, :, :128].contiguous(), "main_packed must have shape"),
        (6, lambda t: t[:1].contiguous(), "topk_idx must have shape"),
        (7, lambda t: t.double(), "sink must be torch.float32"),
        (7, lambda t: t[:10].contiguous(), "sink must have shape"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_sparse_attention_rejects_bad_input(position, bad, message):
    args = _cpu_inputs()
    args[position] = bad(args[position])
    with pytest.raises(TileError, match=message):
        sa.sparse_attention(*args, scale=SCALE)


def test_sparse_attention_rejects_out_of_range_indices_on_request():
    args = _cpu_inputs()
    args[6][0, 0, 0] = 40  # the main cache has 40 entries
    with pytest.raises(TileError, match="topk_idx holds values outside"):
        sa.sparse_attention(*args, scale=SCALE, check_indices=True)
    with pytest.raises(TileError, match="CUDA device"):  # unchecked: only the device stops it here
        sa.sparse_attention(*args, scale=SCALE)


def test_sparse_attention_accepts_swa_only_and_no_sink():
    q, wc, ws, wi, *_ = _cpu_inputs()
    no_main = torch.zeros(2, 0, 256, dtype=torch.uint8), torch.zeros(2, 0, 32, dtype=torch.uint8)  # [B, 0, D/2], [B, 0, D/16]
    no_topk = torch.zeros(2, 3, 0, dtype=torch.int32)  # [B, S, 0]
    with pytest.raises(TileError, match="CUDA device"):  # every check passed: only the device is left
        sa.sparse_attention(q, wc, ws, wi, *no_main, no_topk, None, SCALE, check_indices=True)


def test_sparse_attention_bf16_rejects_bad_input():
    q, *_ = _cpu_inputs()
    wi = torch.zeros(2, 3, 16, dtype=torch.int32)
    ti = torch.zeros(2, 3, 32, dtype=torch.int32)
    with pytest.raises(TileError, match="main_kv must be torch.bfloat16"):
        sa.sparse_attention_bf16(q, torch.randn(2, 20, 512).bfloat16(), wi, torch.randn(2, 40, 512), ti, torch.randn(64), SCALE)


# --------------------------------------------------------------------------------------------
# GPU: against the reference
# --------------------------------------------------------------------------------------------
def _check(tile, shape, config=None, seed=0):
    if tile is sa.PREFILL_TILE and config and "kv_staging" not in config:
        config = {**config, "kv_staging": "gather"}  # an option of the gathering producer (the default expands the caches)
    config = tile.with_defaults(SM90, config or {})  # the defaults give way where config picks what they exclude
    kernel = tile.build(shape, config, SM90)
    inputs = tile.make_inputs(shape, seed, "cuda")
    out1 = tile.run(kernel, inputs)["out"]  # poisoned with NaN before the launch
    out2 = tile.run(kernel, inputs)["out"]
    ref = tile.reference(inputs)
    cmp = tile.compare({"out": out1}, ref)
    assert cmp.ok, str(cmp)
    assert torch.isfinite(out1).all()
    assert torch.equal(out1.view(torch.int16), out2.view(torch.int16)), "two runs differ"
    return kernel, inputs


_ADA_LAYOUT = {"block_I": 32, "heads_per_block": 32, "threads": 128, "num_stages": 1, "io": "direct", "ptxas_level": 0}

GPU_CASES = [
    (sa.DECODE_TILE, "decode_b64_s1", None),
    (sa.DECODE_TILE, "decode_b128_s2", None),
    (sa.DECODE_TILE, "decode_b1_s1", None),
    (sa.DECODE_TILE, "decode_b64_s1", {"produce": "serial"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"produce": "prefetch"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"produce": "prefetch", "n_split": 4}),  # CTAs that start on a main block
    (sa.DECODE_TILE, "decode_b64_s1", {"n_split": 2, "block_I": 32}),
    (sa.PREFILL_TILE, "prefill_s4k", {"tokens_per_cta": 2}),
    (sa.PREFILL_TILE, "prefill_s4k", {"tokens_per_cta": 8}),
    (sa.DECODE_TILE, "decode_b128_s2", {"tokens_per_cta": 2}),
    (sa.DECODE_TILE, "decode_b64_s1", {"tokens_per_cta": 4, "n_split": 2}),  # one token per batch: items past S idle
    (sa.BF16_TILE, "prefill_s4k", {"tokens_per_cta": 4}),  # io=auto: overlapped with 4 tokens per CTA
    (sa.BF16_TILE, "prefill_s4k", {"tokens_per_cta": 4, "io": "staged"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"wg1_rows": 16}),
    (sa.DECODE_TILE, "decode_b128_s2", {"wg1_rows": 16}),
    (sa.DECODE_TILE, "decode_b128_s2", {"wg1_rows": 16, "n_split": 4}),  # CTAs that start on a main block
    (sa.DECODE_TILE, "decode_b64_s1", {"wg1_rows": 16, "block_I": 32}),
    (sa.PREFILL_TILE, "prefill_s4k", {"wg1_rows": 16}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "balanced"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "balanced"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "balanced_overlap"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "balanced_overlap", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "balanced", "block_I": 32, "io": "direct"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "balanced_overlap", "produce": "prefetch"}),
    # partials=bf16: the split partials of O stored and combined as bf16 (2, 4 and 8 splits, H=128 via ODD_SHAPES)
    (sa.DECODE_TILE, "decode_b64_s1", {"partials": "bf16"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"partials": "bf16", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"partials": "bf16", "n_split": 8}),
    (sa.BF16_TILE, "decode_b64_s1", {"partials": "bf16"}),
    # consumers=seesaw: the warpgroups take whole blocks in turn (odd and even block counts per split, a taken last
    # block, one block per split, 32-row blocks with io=direct, the prefetch producer, bf16 KV)
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "seesaw"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "seesaw"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "seesaw", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "seesaw", "n_split": 8}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "seesaw", "block_I": 32, "io": "direct"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "seesaw", "produce": "prefetch"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "seesaw"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "seesaw", "lanes": "column"}),
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "seesaw"}),
    (sa.BF16_TILE, "decode_b64_s1", {"consumers": "seesaw"}),
    # consumers=paired: the two blocks of a pair at once (even and odd block counts per split, warpgroup 1 without a
    # block in the last pair, one block per split, 32-row blocks with io=direct, the prefetch producer, bf16 KV)
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "paired"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "paired", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "paired", "n_split": 8}),
    (sa.DECODE_TILE, "decode_b64_s1", {"consumers": "paired", "block_I": 32, "io": "direct"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"consumers": "paired", "produce": "prefetch"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "paired"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "paired", "kv_staging": "gather", "lanes": "column"}),
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "paired"}),
    (sa.BF16_TILE, "decode_b128_s2", {"consumers": "paired", "unused_rows": "zeros"}),
    # consumers=paired_halves: each KV buffer handed over in halves (bf16 rows; odd counts and short splits)
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "paired_halves", "kv_staging": "expand"}),  # expanded at every case
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "paired_halves"}),
    (sa.BF16_TILE, "decode_b128_s2", {"consumers": "paired_halves", "n_split": 4}),
    (sa.BF16_TILE, "decode_b64_s1", {"consumers": "paired_halves", "n_split": 8}),
    (sa.BF16_TILE, "decode_b64_s1", {"consumers": "paired_halves", "unused_rows": "zeros"}),
    # ... with io=overlapped (the prefill default since session 22): the next token's Q under the last pair, O through the P tiles
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "paired_halves", "io": "overlapped", "n_split": 1, "tokens_per_cta": 8}),
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "paired_halves", "io": "overlapped", "n_split": 1, "tokens_per_cta": 2}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4, "kv_staging": "expand"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"schedule": "pipelined"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"schedule": "pipelined", "n_split": 4}),
    # the Ada default's layout (32 heads over 4 warps: the softmax reduces across warps through a shared workspace
    # that shares S_shared's bytes; its outputs changed run to run until _attend's barrier, session 15)
    (sa.DECODE_TILE, "decode_b64_s1", {"schedule": "pipelined", **_ADA_LAYOUT, "n_split": 2}),
    (sa.BF16_TILE, "decode_b128_s2", {"schedule": "pipelined", **_ADA_LAYOUT, "n_split": 2}),
    (sa.PREFILL_TILE, "prefill_s4k", {"schedule": "pipelined", **_ADA_LAYOUT}),
    (sa.DECODE_TILE, "decode_b16_s2", {"schedule": "pipelined", "dequant": "staged", "n_split": 1}),
    (sa.PREFILL_TILE, "prefill_s4k", None),
    (sa.PREFILL_TILE, "prefill_s4k", {"produce": "serial"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"produce": "prefetch"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "balanced"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"consumers": "balanced_overlap"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"schedule": "pipelined"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"schedule": "pipelined", "dequant": "staged"}),
    (sa.BF16_TILE, "decode_b64_s1", None),
    (sa.BF16_TILE, "prefill_s4k", None),
    (sa.BF16_TILE, "prefill_s4k", {"produce": "serial"}),
    (sa.BF16_TILE, "prefill_s4k", {"consumers": "balanced_overlap"}),
    (sa.BF16_TILE, "decode_b128_s2", {"consumers": "balanced"}),
    (sa.BF16_TILE, "decode_b64_s1", {"schedule": "pipelined"}),
    # handoff=before_pv: P handed to warpgroup 1 before warpgroup 0's own P V
    (sa.DECODE_TILE, "decode_b64_s1", {"handoff": "before_pv"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"handoff": "before_pv", "n_split": 4}),
    (sa.PREFILL_TILE, "prefill_s4k", {"handoff": "before_pv"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"handoff": "before_pv", "tokens_per_cta": 2}),
    (sa.BF16_TILE, "prefill_s4k", {"handoff": "before_pv"}),
    # lanes=column: a quarter-warp's producer lanes store 8 rows (conflict-free on the swizzled KV buffer)
    (sa.DECODE_TILE, "decode_b64_s1", {"lanes": "column"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"lanes": "column", "n_split": 4}),  # CTAs that start on a main block
    (sa.DECODE_TILE, "decode_b64_s1", {"lanes": "column", "wg1_rows": 16}),  # warpgroup 1 fills rows by the same map
    (sa.DECODE_TILE, "decode_b64_s1", {"lanes": "column", "produce": "serial"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"lanes": "column", "produce": "prefetch"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"lanes": "column"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"lanes": "column", "tokens_per_cta": 2}),
    (sa.BF16_TILE, "prefill_s4k", {"lanes": "column"}),
    # fp4_decode=prmt (Hopper's default since session 8): the producer's FP4 main words by byte-permute lookups
    (sa.DECODE_TILE, "decode_b64_s1", {"fp4_decode": "prmt"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"fp4_decode": "prmt", "produce": "prefetch", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"fp4_decode": "prmt", "wg1_rows": 16}),
    (sa.PREFILL_TILE, "prefill_s4k", {"fp4_decode": "prmt"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"fp4_decode": "prmt", "lanes": "column", "handoff": "before_pv"}),
    # combine=fused (not yet run on a GPU): the last split CTA merges the partials
    (sa.DECODE_TILE, "decode_b64_s1", {"combine": "fused"}),
    (sa.DECODE_TILE, "decode_b128_s2", {"combine": "fused", "n_split": 2}),
    (sa.DECODE_TILE, "decode_b64_s1", {"combine": "fused", "n_split": 4}),
    (sa.DECODE_TILE, "decode_b64_s1", {"combine": "fused", "n_split": 8}),
    (sa.DECODE_TILE, "decode_b64_s1", {"combine": "fused", "io": "direct", "produce": "serial"}),
    (sa.DECODE_TILE, "decode_b64_s1", {"combine": "fused", "consumers": "balanced"}),
    (sa.BF16_TILE, "decode_b64_s1", {"combine": "fused"}),
    # kv_staging=expand: both caches expanded to bf16 once, then the bf16 kernel of the same config gathers them
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "fp4_decode": "fma"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "consumers": "seesaw"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "lanes": "column", "tokens_per_cta": 2}),
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "schedule": "pipelined"}),
    # unused_rows=zeros: an unused slot's bf16 row zero-filled by the cp.async predicate instead of copied from row 0
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "unused_rows": "zeros"}),
    (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "expand", "unused_rows": "zeros", "tokens_per_cta": 2}),
    (sa.BF16_TILE, "prefill_s4k", {"unused_rows": "zeros"}),
    (sa.BF16_TILE, "decode_b64_s1", {"unused_rows": "zeros"}),
    (sa.BF16_TILE, "decode_b128_s2", {"unused_rows": "zeros", "consumers": "seesaw"}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,shape_name,config", GPU_CASES, ids=lambda x: x.name if hasattr(x, "name") else str(x))
def test_tile_matches_reference(tile, shape_name, config):
    _check(tile, tile.shape(shape_name), config)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tile,shape_name,extra",
    [
        (sa.DECODE_TILE, "decode_b64_s1", {}),
        (sa.DECODE_TILE, "decode_b64_s1", {"wg1_rows": 16}),
        (sa.DECODE_TILE, "decode_b128_s2", {"produce": "prefetch", "n_split": 4}),
        (sa.PREFILL_TILE, "prefill_s4k", {"kv_staging": "gather"}),
    ],
    ids=["decode_b64_s1", "decode_b64_s1_wg1", "decode_b128_s2_prefetch", "prefill_s4k"],
)
def test_prmt_fp4_decode_output_equals_fma_bitwise(tile, shape_name, extra):
    """fp4_decode=prmt writes the same bf16 KV bits as fma (the CPU emulation test) and changes nothing else: the
    attention output equals the fma kernel's bit for bit on the same inputs."""
    shape = tile.shape(shape_name)
    kernel, inputs = _check(tile, shape, {"fp4_decode": "prmt", **extra})
    fma = tile.build(shape, {**tile.default_config(SM90), **extra, "fp4_decode": "fma"}, SM90)
    got, want = tile.run(kernel, inputs)["out"], tile.run(fma, inputs)["out"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


ODD_SHAPES = [
    _shape("h128", "decode", B=3, S=2, Nc=5000, Nw=130, H=128),
    _shape("w37", "decode", B=5, S=1, Nc=700, Nw=38, W=37),
    _shape("k100", "decode", B=2, S=1, Nc=300, Nw=129, K=100),
    _shape("s777", "prefill", B=1, S=777, Nc=777, Nw=777),
    _shape("s63", "prefill", B=1, S=63, Nc=63, Nw=63),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tile", [sa.DECODE_TILE, sa.BF16_TILE], ids=lambda t: t.name)
def test_tile_odd_shapes(tile, shape):
    _check(tile, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tpc", [2, 4])
def test_tokens_per_cta_odd_shapes(tpc, shape):
    """Several tokens per CTA with S (x head blocks) not a multiple of it (S=777, S=63), H=128 (two head blocks per
    token, consecutive items), odd block counts per token (W=37, K=100: the buffer parity runs on across tokens)."""
    tile = sa.PREFILL_TILE if shape.phase == "prefill" else sa.DECODE_TILE
    _check(tile, shape, {"tokens_per_cta": tpc})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tpc", [2, 4])
def test_overlapped_io_odd_shapes(tpc, shape):
    """io="overlapped" (the bf16 tile) with S (x head blocks) not a multiple of the tokens per CTA (S=777, S=63; B=5
    and B=2 with one token each: every CTA's only token stored at the end), H=128 (two head blocks per token), odd
    block counts per token (W=37, K=100: the buffer of a token's last block alternates)."""
    _check(sa.BF16_TILE, shape, {"io": "overlapped", "tokens_per_cta": tpc, "n_split": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
def test_wg1_rows_odd_shapes(shape):
    """Warpgroup 1's rows with partial blocks (W=37, K=100: its rows past the list are -1), H=128, odd S."""
    tile = sa.PREFILL_TILE if shape.phase == "prefill" else sa.DECODE_TILE
    _check(tile, shape, {"wg1_rows": 16})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("consumers", ["balanced", "balanced_overlap"])
def test_balanced_consumers_odd_shapes(consumers, shape):
    """The split S (half a block per warpgroup) with partial blocks (W=37, K=100), H=128, odd S, -1 rows."""
    tile = sa.PREFILL_TILE if shape.phase == "prefill" else sa.DECODE_TILE
    _check(tile, shape, {"consumers": consumers})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in ODD_SHAPES if s.phase == "decode"], ids=lambda s: s.name)
def test_bf16_partials_odd_shapes(shape):
    """bf16 split partials at H=128, W=37 and K=100 (auto splits: 8 over 4-10 blocks, some splits empty)."""
    _check(sa.DECODE_TILE, shape, {"partials": "bf16"})


# (tile, consumers): paired_halves hands bf16 KV rows over in halves, which the FP4 tiles' gathering producer does not
# make (the space refuses it there: options.halves_refusal); the bf16 tile runs it.
SEESAW_CONSUMERS = [
    (sa.DECODE_TILE, "seesaw"),
    (sa.DECODE_TILE, "paired"),
    (sa.BF16_TILE, "seesaw"),
    (sa.BF16_TILE, "paired"),
    (sa.BF16_TILE, "paired_halves"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tile,consumers", SEESAW_CONSUMERS, ids=[f"{t.name}-{c}" for t, c in SEESAW_CONSUMERS])
def test_seesaw_consumers_odd_shapes(tile, consumers, shape):
    """Whole blocks in turn (seesaw) or in pairs (paired) with partial blocks (W=37, K=100: -1 rows), odd block counts
    (seesaw: the last block taken after the loop; paired: warpgroup 1 without a block in the last pair), H=128 (two
    head blocks per token) and odd S. The FP4 cases run the prefill tile at the prefill shapes."""
    if tile is sa.DECODE_TILE and shape.phase == "prefill":
        tile = sa.PREFILL_TILE
    _check(tile, shape, {"consumers": consumers})


def test_seesaw_consumers_cases_are_valid_and_paired_halves_needs_bf16_rows():
    """Every case of test_seesaw_consumers_odd_shapes is a valid config where it runs (none is skipped), and the one left
    out is refused: paired_halves on the FP4 tiles' gathered rows."""
    for (tile, consumers), shape in itertools.product(SEESAW_CONSUMERS, ODD_SHAPES):
        run = sa.PREFILL_TILE if tile is sa.DECODE_TILE and shape.phase == "prefill" else tile
        extra = {"kv_staging": "gather"} if run is sa.PREFILL_TILE else {}  # as _check pins it
        cfg = run.with_defaults(SM90, {"consumers": consumers, **extra})
        assert run.search_space(SM90).violations(cfg, shape, SM90) == [], (run.name, consumers, shape.name)
    for tile, shape in ((sa.DECODE_TILE, ODD_SHAPES[0]), (sa.PREFILL_TILE, ODD_SHAPES[-1])):
        extra = {"kv_staging": "gather"} if tile is sa.PREFILL_TILE else {}
        cfg = tile.with_defaults(SM90, {"consumers": "paired_halves", **extra})
        assert any("paired_halves hands bf16 KV rows" in r for r in tile.search_space(SM90).violations(cfg, shape, SM90))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in ODD_SHAPES if s.phase == "prefill"], ids=lambda s: s.name)
@pytest.mark.parametrize("unused_rows", ["row0", "zeros"])
def test_kv_staging_expand_odd_shapes(shape, unused_rows):
    _check(sa.PREFILL_TILE, shape, {"kv_staging": "expand", "unused_rows": unused_rows})


@pytest.mark.gpu
def test_expanded_caches_are_the_reference_dequant_in_bf16():
    """The expansion writes, bit for bit, the bf16 of model.formats' dequantisation (both FP4 word decodes), over
    scales spread across 2^-30..2^30 and row counts that leave a CTA partly empty."""
    from tiles.sparse_attn.kv_expand import expand_caches, expand_kernel

    g = torch.Generator(device="cuda").manual_seed(3)

    def spread(n):  # [2, n, 512] float32, each row at its own power-of-two magnitude
        mag = 2.0 ** torch.randint(-30, 31, (2, n, 1), generator=g, device="cuda").float()
        return torch.randn(2, n, 512, generator=g, device="cuda") * mag

    wc, ws = fp8_quantize(spread(37))  # [2, 37, 512], [2, 37, 16]
    mp, ms = fp4_quantize(spread(301))  # [2, 301, 256], [2, 301, 32]
    want_w = fp8_dequantize(wc, ws).bfloat16().view(torch.int16)
    want_m = fp4_dequantize(mp, ms).bfloat16().view(torch.int16)
    for fp4_decode in ("fma", "prmt"):
        kernel = expand_kernel(512, dequant.decode_helpers_cuda(fp4_decode), dequant.FP4X8_FUNCTIONS[fp4_decode], SM90)
        window_kv, main_kv = expand_caches(kernel, wc, ws, mp, ms)
        assert torch.equal(window_kv.view(torch.int16), want_w), fp4_decode
        assert torch.equal(main_kv.view(torch.int16), want_m), fp4_decode


@pytest.mark.gpu
def test_kv_staging_expand_is_the_bf16_kernel_on_the_dequantised_caches():
    """kv_staging=expand changes where the rows are decoded, nothing else: its output equals, bit for bit, the bf16
    tile's kernel of the same config on the reference-dequantised caches."""
    tile, shape = sa.PREFILL_TILE, sa.PREFILL_TILE.shape("prefill_s4k")
    kernel, inputs = _check(tile, shape, {"kv_staging": "expand"})
    bf16_cfg = {k: v for k, v in tile.with_defaults(SM90, {}).items() if k not in sa.FP4_ONLY_KEYS}
    bf16 = sa.BF16_TILE.build(shape, bf16_cfg, SM90)
    bf16_inputs = {
        **inputs,
        "window_kv": fp8_dequantize(inputs["window_codes"], inputs["window_scales"]).bfloat16(),
        "main_kv": fp4_dequantize(inputs["main_packed"], inputs["main_scales"], 16, "e4m3").bfloat16(),
    }
    got, want = tile.run(kernel, inputs)["out"], sa.BF16_TILE.run(bf16, bf16_inputs)["out"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in ODD_SHAPES if s.phase == "decode"], ids=lambda s: s.name)
def test_fused_combine_odd_shapes(shape):
    """combine=fused at H=128 (two counters per token), W=37 and K=100 (8 splits over 4 blocks: some split CTAs have
    no block and arrive with lse = -inf); the counters are zero after the two launches of _check, and the output is
    the separate combine's up to fp32 rounding (the own split is added first, 1 / den is multiplied)."""
    kernel, inputs = _check(sa.DECODE_TILE, shape, FUSED)
    assert not kernel.counters[inputs["q"].device].any(), "the last CTA of each token resets its counter"
    fp32_parts = {"n_split": kernel.n_split, "partials": "fp32"}  # the same partials the fused combine merges
    separate = sa.DECODE_TILE.build(shape, sa.DECODE_TILE.with_defaults(SM90, fp32_parts), SM90)
    cmp = relative_l2(sa.DECODE_TILE.run(kernel, inputs), sa.DECODE_TILE.run(separate, inputs), 1e-3)
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
def test_fused_combine_cuda_graph_replays():
    """A captured launch replays with the counters it left at zero: each replay matches the eager output bitwise, and
    after new inputs are copied in, the reference."""
    tile = sa.DECODE_TILE
    shape = tile.shape("decode_b64_s1")
    kernel, inputs = _check(tile, shape, FUSED)  # eager first: allocates the counters outside the capture
    eager = tile.run(kernel, inputs)["out"]
    outputs = tile.alloc_outputs(kernel, inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tile.launch(kernel, inputs, outputs)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tile.launch(kernel, inputs, outputs)
    for _ in range(3):
        outputs["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outputs["out"].view(torch.int16), eager.view(torch.int16)), "a replay differs from the eager run"
        assert not kernel.counters[inputs["q"].device].any()
    fresh = tile.make_inputs(shape, 1, "cuda")
    for key, value in fresh.items():
        inputs[key].copy_(value)
    graph.replay()
    cmp = tile.compare(outputs, tile.reference(fresh))
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [sa.DECODE_TILE, sa.BF16_TILE], ids=lambda t: t.name)
def test_batched_producer_masks_out_of_range_indices(tile):
    """The ws/batched producer treats an index past the cache like -1 (documented index policy)."""
    shape = tile.shape("decode_b16_s2")
    kernel, inputs = _check(tile, shape, {"schedule": "ws", "produce": "batched"})
    nc, nw = shape["Nc"], shape["Nw"]
    bad = dict(inputs)
    bad["topk_idx"] = inputs["topk_idx"].clone()
    bad["window_idx"] = inputs["window_idx"].clone()
    bad["topk_idx"][0, 0, :2] = torch.tensor([nc, 2**30], dtype=torch.int32)
    bad["window_idx"][1, 1, 5] = nw + 3
    masked = {**bad, "topk_idx": torch.where(bad["topk_idx"] >= nc, -1, bad["topk_idx"])}
    masked["window_idx"] = torch.where(bad["window_idx"] >= nw, -1, bad["window_idx"])
    cmp = tile.compare(tile.run(kernel, bad), tile.reference(masked))
    assert cmp.ok, str(cmp)


def _public_inputs(B, S, H=64, W=128, K=512, Nw=200, Nc=3000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, H, 512, generator=g, device="cuda").bfloat16()  # [B, S, H, D]
    wc, ws = fp8_quantize(torch.randn(B, Nw, 512, generator=g, device="cuda"))  # [B, Nw, D], [B, Nw, D/32]
    mp, ms = fp4_quantize(torch.randn(B, Nc, 512, generator=g, device="cuda"))  # [B, Nc, D/2], [B, Nc, D/16]
    wi = torch.randint(-1, Nw, (B, S, W), generator=g, device="cuda", dtype=torch.int32)  # [B, S, W], some -1
    ti = torch.randint(-1, Nc, (B, S, K), generator=g, device="cuda", dtype=torch.int32)  # [B, S, K], some -1, repeats
    return q, wc, ws, wi, mp, ms, ti, torch.randn(H, generator=g, device="cuda")


def _public_reference(q, wc, ws, wi, mp, ms, ti, sink):
    return ref_attention(q, fp8_dequantize(wc, ws), wi, fp4_dequantize(mp, ms), ti, sink, SCALE)


_TORCH_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is poisoned (tiles.core.contract.poisoned's rule for the buffers a public function
    allocates itself): NaN for floats, the most negative value for signed ints (neither an index nor the -1 fill), all
    bits set for unsigned ones."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t.fill_(float("nan"))
    elif t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        t.fill_(torch.iinfo(t.dtype).min if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return t


def _twice(call):
    """``call()`` of a public function (it allocates its own output) twice, every torch.empty inside poisoned: the first
    result, after requiring the second to hold the same bits. An element never written stays poisoned (NaN, which the
    reference comparison refuses); a race shows as two different results."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        first, second = call(), call()
    assert torch.equal(first.view(torch.int16), second.view(torch.int16)), "two calls differ"
    return first


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,S,config", [(4, 1, None), (1, 300, None), (1, 300, {"kv_staging": "expand"})], ids=["decode", "prefill", "prefill_expand"]
)
def test_sparse_attention_edge_rows(B, S, config):
    q, wc, ws, wi, mp, ms, ti, sink = _public_inputs(B, S)
    wi[0, 0], ti[0, 0] = -1, -1  # no valid index: exact zeros
    ti[-1, -1] = 7  # one entry repeated K times counts K times
    wi[-1, -1] = -1
    out = _twice(lambda: sa.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, SCALE, config=config, check_indices=True))
    ref = _public_reference(q, wc, ws, wi, mp, ms, ti, sink)
    assert (out[0, 0] == 0).all()
    assert torch.isfinite(out).all()
    cmp = relative_l2({"out": out}, {"out": ref}, sa.TOLERANCE)
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(4, 1), (1, 300)], ids=["decode", "prefill"])
def test_sparse_attention_swa_only_without_sink(B, S):
    q, wc, ws, wi, mp, ms, ti, _ = _public_inputs(B, S)
    no_main = mp[:, :0].contiguous(), ms[:, :0].contiguous()  # [B, 0, D/2], [B, 0, D/16]
    no_topk = ti[..., :0].contiguous()  # [B, S, 0]
    wi[0, 0] = -1  # no valid index and no sink: still exact zeros
    out = _twice(lambda: sa.sparse_attention(q, wc, ws, wi, *no_main, no_topk, None, SCALE))
    ref = ref_attention(q, fp8_dequantize(wc, ws), wi, torch.zeros(B, 0, 512, device="cuda"), no_topk, None, SCALE)
    assert (out[0, 0] == 0).all()
    assert torch.isfinite(out).all()
    cmp = relative_l2({"out": out}, {"out": ref}, sa.TOLERANCE)
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
def test_sparse_attention_bf16_matches_reference():
    q, wc, ws, wi, mp, ms, ti, sink = _public_inputs(2, 2)
    wkv, mkv = fp8_dequantize(wc, ws).bfloat16(), fp4_dequantize(mp, ms).bfloat16()
    out = _twice(lambda: sa.sparse_attention_bf16(q, wkv, wi, mkv, ti, sink, SCALE))
    ref = ref_attention(q, wkv, wi, mkv, ti, sink, SCALE)
    assert torch.isfinite(out).all()
    cmp = relative_l2({"out": out}, {"out": ref}, sa.TOLERANCE)
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
def test_sparse_attention_rejects_out_of_range_on_gpu():
    q, wc, ws, wi, mp, ms, ti, sink = _public_inputs(2, 1)
    wi[1, 0, 3] = wc.shape[1]
    with pytest.raises(TileError, match="window_idx holds values outside"):
        sa.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, SCALE, check_indices=True)


@pytest.mark.parametrize("nc", [300, 0], ids=["csa2", "swa_only"])
def test_torch_baseline_gathers_then_dequantises_identically(nc):
    """The baseline reads only the selected packed rows; the result is the dequantise-everything one, bit for bit."""
    from model.ops.sparse_attn import sparse_attention_quantized

    g = torch.Generator().manual_seed(5)
    B, S, H, Nw, K, W = 2, 3, 64, 40, 32, 16
    q = torch.randn(B, S, H, 512, generator=g)
    wc, wsc = fp8_quantize(torch.randn(B, Nw, 512, generator=g))
    mp, ms = fp4_quantize(torch.randn(B, nc, 512, generator=g))
    wi = torch.randint(-1, Nw, (B, S, W), generator=g, dtype=torch.int32)
    ti = torch.randint(-1, nc, (B, S, K), generator=g, dtype=torch.int32) if nc else torch.full((B, S, K), -1, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    got = sparse_attention_quantized(q, wc, wsc, wi, mp, ms, ti, sink, SCALE)
    want = ref_attention(q, fp8_dequantize(wc, wsc), wi, fp4_dequantize(mp, ms), ti, sink, SCALE)
    assert torch.equal(got, want)


# The staged schedules that computed wrong outputs on the H200 (tune session 8: rel_l2 0.28-0.30, five trials in
# results/sm90/tune_session8/tuning.db.gz): (block_I, n_split), two top-k blocks per split, one window block per split.
STAGED_SPLITS = [(64, 4), (32, 8)]


def _buffer_offsets(src: str) -> dict[str, int]:
    """Shared buffers of a generated kernel and their byte offsets in the dynamic shared memory."""
    return {m[1]: int(m[2]) for m in re.finditer(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src)}


@pytest.mark.parametrize("block_I, n_split", STAGED_SPLITS)
@pytest.mark.slow
def test_staged_topk_indices_keep_both_pipeline_versions(block_I, n_split):
    """The cause of the staged/split wrong results: with one window block per split the window loop is not pipelined,
    and TileLang allocated the [block_I] index buffer shared by both loops at one version while the staged top-k loop
    addressed two, so the second block's indices overwrote the first bytes of KV_shared. The top-k loop has its own
    index buffer now: the generated kernel addresses it at +block_I and no buffer other than the reductions'
    workspaces (used after its last read) starts inside its two versions."""
    tile = sa.DECODE_TILE
    shape = tile.shape("decode_b64_s1")
    cfg = tile.with_defaults(SM90, {"schedule": "pipelined", "dequant": "staged", "heads_per_block": 32, "threads": 128})
    cfg = {**cfg, "block_I": block_I, "n_split": n_split}
    assert tile.search_space(SM90).violations(cfg, shape, SM90) == []
    src = tile.build(shape, cfg, SM90).main.get_kernel_source()
    offsets = _buffer_offsets(src)
    start = offsets["idx_k_shared"]
    assert f"idx_k_shared)[(((int)threadIdx.x) + {block_I})]" in src  # the second version is addressed
    inside = [n for n, o in offsets.items() if start < o < start + 2 * block_I * 4 and not n.startswith("workspace")]
    assert not inside, inside
    assert offsets["KV_shared"] >= offsets["idx_shared"] + block_I * 4


@pytest.mark.gpu
@pytest.mark.parametrize("block_I", [64, 32])
def test_staged_dequant_with_two_topk_blocks_without_splits(block_I):
    """The open question of the staged/split wrong results (notes/sparse_attn.md, session 8): with splits each CTA's
    staged top-k loop ran two blocks; K=100 gives two blocks at block_I 64 (and four at 32) without splits. Passing
    here would place the fault in the split offsets; failing, in the two-iteration pipeline (then widen staged_splits)."""
    shape = next(s for s in ODD_SHAPES if s.name == "k100")
    cfg = {"schedule": "pipelined", "dequant": "staged", "heads_per_block": 32, "threads": 128, "block_I": block_I}
    _check(sa.DECODE_TILE, shape, {**cfg, "n_split": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("block_I, n_split", STAGED_SPLITS)
@pytest.mark.parametrize("shape_name", ["decode_b64_s1", "decode_b128_s2"])
def test_staged_dequant_with_splits_matches_reference(shape_name, block_I, n_split):
    """The configs the tuner's correctness gate caught computing wrong outputs (session 8), after the fix of the top-k
    index buffer (session 9): against the reference, NaN-poisoned outputs, two runs bitwise equal."""
    cfg = {"schedule": "pipelined", "dequant": "staged", "heads_per_block": 32, "threads": 128, "block_I": block_I}
    _check(sa.DECODE_TILE, sa.DECODE_TILE.shape(shape_name), {**cfg, "n_split": n_split})
