"""Indexer tiles: indexer_topk, candidate_pool, reindex_topk.

CPU: the default configs compile for sm_90a, constraints prune bad configs, bad inputs give
one-line TileErrors, and the top-k set comparison rule itself. GPU (marked): every tile
against the torch reference on fresh random data (real and odd shapes, n_visible < top-k,
empty rows, heavy ties), outputs poisoned first, two runs bitwise equal (tiles.harness).
"""

import pytest
import torch

from model.ops.indexer import candidate_blocks, topk_positions
from tiles import indexer as ix
from tiles.arch import get_arch
from tiles.contract import Shape, TileError
from tiles.harness import OK, evaluate

SM90 = get_arch("sm90")
IDX = {"Hi": 32, "Di": 128, "K": 512}


def _odd(B: int, S: int, N: int) -> Shape:
    return Shape(f"odd_b{B}_s{S}_n{N}", "decode", {"B": B, "S": S, "N": N, "P": 2048, "block": 8, **IDX})


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("tile", ix.TILES, ids=lambda t: t.name)
def test_default_compiles_sm90(tile):
    shape = tile.shapes()[0]
    assert tile.search_space(SM90).violations(tile.default_config(SM90), shape, SM90) == []
    assert tile.build(shape, tile.default_config(SM90), SM90) is not None


@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.parametrize("dequant", ["shared", "registers", "lut", "bits", "fragment_bits", "prmt"])
def test_dequant_options_compile_sm90(tile, dequant):
    shape = tile.shapes()[0]
    assert tile.build(shape, {**tile.default_config(SM90), "dequant": dequant}, SM90) is not None


def _bits_dequant(codes: torch.Tensor, sbyte: torch.Tensor) -> torch.Tensor:
    """Torch mirror of the "bits" dequant's integer formula (tiles.indexer._dequant_words_bits)."""
    mag, base = codes & 7, (sbyte - 1) << 7
    bits = torch.where(mag == 0, 0, base + torch.where(mag == 1, 0, mag << 6)) | ((codes & 8) << 12)
    return (bits.to(torch.int32) << 16).view(torch.float32)  # bf16 bits as the top half of an fp32


def test_fragment_bits_holds_no_bf16_tile_in_shared_memory():
    """dequant=fragment_bits builds the same bf16 patterns into the wgmma A fragment: the shared-memory budget counts
    no per-stage bf16 tile, so four stages of 256-entry tiles fit where the bits path's do not."""
    # one warpgroup: block_n 256 on two is pruned by the fragment_rows constraint (see the test below)
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), "block_n": 256, "threads": 128, "stages": 4, "tiles_per_cta": 4}
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations({**cfg, "dequant": "fragment_bits"}, shape, SM90) == []
    assert any("shared memory" in r for r in ix.INDEXER_TOPK.search_space(SM90).violations({**cfg, "dequant": "bits"}, shape, SM90))


def _prmt(x: int, y: int, sel: int) -> int:
    """PTX prmt.b32 (default mode) / __byte_perm on Python ints; selector bit 3 (sign replicate) must be clear."""
    src = (x & 0xFFFFFFFF) | ((y & 0xFFFFFFFF) << 32)
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        assert nib < 8, "selector nibble with the sign-replicate bit"
        out |= ((src >> (8 * nib)) & 0xFF) << (8 * n)
    return out


def _prmt_group(words: list[int], sbyte: int) -> list[int]:
    """Line-by-line model of tiles.indexer._PRMT_CUDA (csa2_fp4_group_bf16): 4 words -> 16 bf16x2 words."""
    m32 = 0xFFFFFFFF
    base = ((sbyte - 1) << 7) & m32
    b2 = (base * 0x10001) & m32
    r0, r1, r2, r3 = (base << 16) & m32, (b2 + 0x00C00080) & m32, (b2 + 0x01400100) & m32, (b2 + 0x01C00180) & m32
    lo0, lo1, hi0, hi1 = _prmt(r0, r1, 0x6420), _prmt(r2, r3, 0x6420), _prmt(r0, r1, 0x7531), _prmt(r2, r3, 0x7531)
    out = []
    for w in words:
        m = w & 0x77777777
        mh, w4 = m >> 16, (w << 4) & m32
        l0, l1 = _prmt(lo0, lo1, m & 0xFFFF), _prmt(lo0, lo1, mh)
        h0 = _prmt(hi0, hi1, m & 0xFFFF) | (_prmt(w, w4, 0x1504) & 0x80808080)
        h1 = _prmt(hi0, hi1, mh) | (_prmt(w, w4, 0x3726) & 0x80808080)
        out += [_prmt(l0, h0, 0x5140), _prmt(l0, h0, 0x7362), _prmt(l1, h1, 0x5140), _prmt(l1, h1, 0x7362)]
    return out


def test_prmt_dequant_equals_the_bits_formula():
    """dequant=prmt's byte-permute tables give the bits path's patterns for every code pair at every scale byte 1..252
    (so its scores equal the bits kernel's bitwise), and all-zero words at scale byte 0 (the out-of-range fill) give 0."""
    import random

    rng = random.Random(0)
    for sbyte in range(1, 253):
        words = [rng.getrandbits(32) for _ in range(4)]
        if sbyte % 16 == 1:  # every code at every position at least once
            words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]
        got = _prmt_group(words, sbyte)
        codes = torch.tensor([(w >> (4 * j)) & 0xF for w in words for j in range(8)], dtype=torch.int32)
        want = (_bits_dequant(codes, torch.full_like(codes, sbyte)).view(torch.int32) >> 16) & 0xFFFF
        got_vals = [(g >> (16 * h)) & 0xFFFF for g in got for h in range(2)]
        if sbyte == 1:  # the bits formula's own convention there: code 1 -> +-0 (only all-zero groups use byte 1)
            want = torch.where((codes & 7) == 1, (codes & 8) << 12, want)
        assert got_vals == want.tolist(), sbyte
    assert _prmt_group([0, 0, 0, 0], 0) == [0] * 16


def test_prmt_compiles_with_two_ctas_per_sm():
    """The Hopper default since the H200 profile (profile_indexer_prmt_two_pass.json): byte-permute dequant, two CTAs
    per SM, the two-pass select; the reindex tile too since its own H200 profile (profile_attn_decode_reindex_prmt.json)."""
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "prmt", "min_ctas": 2, "stages": 3}
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    assert ix.INDEXER_TOPK.search_space(SM90).violations(cfg, shape, SM90) == []
    ix.INDEXER_TOPK.build(shape, cfg, SM90)
    src = ix._build_score(SM90, cfg, False, 8).get_kernel_source()
    assert "csa2_fp4_group_bf16" in src and "__launch_bounds__(512, 2)" in src
    default = ix.INDEXER_TOPK.default_config(SM90)
    assert (default["dequant"], default["min_ctas"], default["select_algo"]) == ("prmt", 2, "two_pass")
    reindex = ix.REINDEX_TOPK.default_config(SM90)
    assert (reindex["dequant"], reindex["min_ctas"], reindex["select_algo"]) == ("prmt", 2, "two_pass")
    assert ix.INDEXER_TOPK.default_config(get_arch("sm80"))["dequant"] != "prmt"


def test_min_ctas_counts_shared_memory_per_sm():
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    cfg = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "prmt", "stages": 4}
    assert space.violations({**cfg, "min_ctas": 2}, shape, SM90) == []
    assert any("per SM" in r for r in space.violations({**cfg, "min_ctas": 3}, shape, SM90))


def test_fragment_paths_need_one_mtile_per_warpgroup():
    """block_n 256 on two warpgroups gave each warpgroup's A fragment rows {wg*64 + i*128} but its accumulator rows
    {wg*128 + i*64} (TileLang's layouts; rel err 0.92 on the H200): pruned, one warpgroup or block_n 128 kept."""
    shape = ix.INDEXER_TOPK.shape("decode_b64_n128k")
    space = ix.INDEXER_TOPK.search_space(SM90)
    bad = {**ix.INDEXER_TOPK.default_config(SM90), "dequant": "fragment_bits", "stages": 4, "block_n": 256, "tiles_per_cta": 4}
    assert any("one 64-row wgmma tile" in r for r in space.violations(bad, shape, SM90))
    assert any("one 64-row wgmma tile" in r for r in space.violations({**bad, "dequant": "registers"}, shape, SM90))
    assert space.violations({**bad, "block_n": 128}, shape, SM90) == []
    assert space.violations({**bad, "threads": 128}, shape, SM90) == []
    assert space.violations({**bad, "dequant": "bits", "stages": 2}, shape, SM90) == []  # shared-tile A: no fragment


def test_bits_dequant_formula_is_exact():
    """Every code x every scale byte the formula claims (2..252) decodes as model.formats does."""
    from model import formats

    codes = torch.arange(16, dtype=torch.int32).repeat(251)  # [16 * 251]
    sbyte = torch.arange(2, 253, dtype=torch.int32).repeat_interleave(16)
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(-1, 1)  # one byte per row: codes 2r, 2r+1
    want = formats.fp4_dequantize(packed, sbyte[0::2].to(torch.uint8).view(-1, 1), 2, "e8m0").view(-1)
    got = _bits_dequant(codes, sbyte)
    assert torch.equal(got.view(torch.int32) & ~0x80000000, want.view(torch.int32) & ~0x80000000)  # +-0 aside
    assert torch.equal(got, want)


def test_hopper_default_uses_the_new_score_path():
    cfg = ix.INDEXER_TOPK.default_config(SM90)
    assert cfg["dequant"] == "prmt" and cfg["tiles_per_cta"] == 16
    assert ix.REINDEX_TOPK.default_config(SM90)["dequant"] == "prmt"
    assert ix.INDEXER_TOPK.default_config(get_arch("sm80"))["dequant"] == "shared"


def test_smem_constraint_counts_the_pipelined_dequant_tile():
    """block_n 256 x 3 stages of the lut variant needed 253 KiB on the H200 and failed to launch: it must be pruned."""
    shape = ix.INDEXER_TOPK.shapes()[0]
    big = {**ix.INDEXER_TOPK.default_config(SM90), "block_n": 256, "stages": 3, "dequant": "lut", "tiles_per_cta": 1}
    assert any("shared memory" in v for v in ix.INDEXER_TOPK.search_space(SM90).violations(big, shape, SM90))
    assert ix.INDEXER_TOPK.search_space(SM90).violations(ix.INDEXER_TOPK.default_config(SM90), shape, SM90) == []


def test_constraints_prune():
    space = ix.INDEXER_TOPK.search_space(SM90)
    shape = ix.INDEXER_TOPK.shapes()[0]
    bad = {**ix.INDEXER_TOPK.default_config(SM90), "block_n": 64, "threads": 256}
    assert any("warpgroups" in r for r in space.violations(bad, shape, SM90))
    assert space.violations({**bad, "threads": 128}, shape, SM90) == []
    assert any("not one of" in r for r in space.violations({"radix_bits": 9}, shape, SM90))


def _indexer_args(B=2, S=1, N=100, device="cpu"):
    q = torch.zeros(B, S, 32, 128, dtype=torch.bfloat16, device=device)
    w = torch.zeros(B, S, 32, device=device)
    kp = torch.zeros(B, N, 64, dtype=torch.uint8, device=device)
    ks = torch.full((B, N, 4), 127, dtype=torch.uint8, device=device)
    nv = torch.full((B, S), N, dtype=torch.int32, device=device)
    return q, w, kp, ks, nv


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][..., :64], *a[1:]), "q must have shape"),
        (lambda a: (a[0].half(), *a[1:]), "q must be"),
        (lambda a: (a[0], a[1].double(), *a[2:]), "weights must be"),
        (lambda a: (*a[:2], a[2][..., :32], *a[3:]), "k_packed must have shape"),
        (lambda a: (*a[:3], a[3][..., :2], a[4]), "k_scales must have shape"),
        (lambda a: (*a[:4], a[4].float()), "n_visible must be"),
        (lambda a: a, "CUDA GPU"),
    ],
    ids=["q_dim", "q_dtype", "w_dtype", "k_packed", "k_scales", "n_visible", "cpu"],
)
def test_indexer_topk_rejects(change, message):
    with pytest.raises(TileError, match=message):
        ix.indexer_topk(*change(_indexer_args()), 512)


def test_candidate_pool_and_reindex_reject():
    with pytest.raises(TileError, match="scores must be float32"):
        ix.candidate_pool(torch.zeros(2, 1, 100, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(TileError, match="n_visible must have shape"):
        ix.candidate_pool(torch.zeros(2, 1, 100), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(TileError, match="pool_blocks must be"):
        ix.reindex_topk(*_indexer_args(), torch.zeros(2, 1, 16, dtype=torch.int64), 8, 512)
    with pytest.raises(TileError, match="topk must be positive"):
        ix.indexer_topk(*_indexer_args(), 0)


def test_topk_set_rule():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 3.0, 2.0, float("-inf")]]])  # the 2nd/3rd best tie at 3.0
    ref = topk_positions(scores, 3)
    assert ref.tolist() == [[[0, 2, 3]]]
    swapped = torch.tensor([[[0, 2, 3]]], dtype=torch.int32)
    assert ix.compare_topk_sets(swapped, ref, scores).ok
    tie_ok = torch.tensor([[[0, 3, 4]]], dtype=torch.int32)  # drops 2 (a tie member) for 4 (score 2.0, not a tie)
    assert not ix.compare_topk_sets(tie_ok, ref, scores).ok
    scores2 = torch.tensor([[[5.0, 3.0, 3.0, 3.0]]])
    ref2 = topk_positions(scores2, 2)  # lower position wins the tie: [0, 1]
    assert ref2.tolist() == [[[0, 1]]]
    assert ix.compare_topk_sets(torch.tensor([[[0, 3]]], dtype=torch.int32), ref2, scores2).ok
    assert not ix.compare_topk_sets(torch.tensor([[[3, 0]]], dtype=torch.int32), ref2, scores2).ok  # not ascending
    assert not ix.compare_topk_sets(torch.tensor([[[0, -1]]], dtype=torch.int32), ref2, scores2).ok  # wrong count


def test_random_pool_is_a_valid_pool():
    gen = torch.Generator().manual_seed(0)
    nv = torch.tensor([[0, 13, 1000]], dtype=torch.int32)
    pool = ix._random_pool(nv, 1000, 64, 8, gen)
    assert pool.shape == (1, 3, 64)
    assert (pool[0, 0] == -1).all()
    assert set(pool[0, 1].tolist()) == {0, 1, -1}
    row = pool[0, 2][pool[0, 2] >= 0]
    assert row.numel() == 64 and bool((row[1:] > row[:-1]).all()) and 124 in row.tolist()


# ---------------------------------------------------------------------------------- GPU


def _gpu_shapes(tile):
    real = [s for s in tile.shapes() if s.name in ("decode_b64_n32k", "decode_b1_n128k", "prefill_s4k")]
    return real + [_odd(3, 2, 1000), _odd(2, 1, 77)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ix.TILES, ids=lambda t: t.name)
def test_tile_matches_reference(tile):
    arch = get_arch("sm90")
    for shape in _gpu_shapes(tile):
        ev = evaluate(tile, shape, tile.default_config(arch), arch, seed=1, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


# Every score-path option, the pre-sm90-default path included: scores by relative L2, top-k
# sets exact up to the tie rule (evaluate also requires two runs bitwise equal).
SCORE_OPTIONS = {
    "old_default": {**ix._SCORE_DEFAULT},
    "bits_t1": {"dequant": "bits", "tiles_per_cta": 1},
    "bits_t4_1wg": {"dequant": "bits", "tiles_per_cta": 4, "threads": 128, "stages": 1},
    "bits_t16": {"dequant": "bits", "tiles_per_cta": 16},
    "bits_bn64": {"dequant": "bits", "block_n": 64, "threads": 128, "stages": 3},
    "lut": {"dequant": "lut", "threads": 128, "stages": 1},
    "registers": {"dequant": "registers"},
    "fragment_bits_st4": {"dequant": "fragment_bits", "stages": 4},  # written in session 3 after the device time was spent
    "fragment_bits_t128_bn256": {"dequant": "fragment_bits", "threads": 128, "block_n": 256, "stages": 4, "tiles_per_cta": 4},
    "prmt": {"dequant": "prmt"},
    "prmt_mc2_st3": {"dequant": "prmt", "min_ctas": 2, "stages": 3},
    "prmt_mc3": {"dequant": "prmt", "min_ctas": 3, "threads": 128, "stages": 2, "tiles_per_cta": 4},
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.REINDEX_TOPK], ids=lambda t: t.name)
@pytest.mark.parametrize("option", list(SCORE_OPTIONS), ids=str)
def test_score_options_match_reference(tile, option):
    arch = get_arch("sm90")
    cfg = {**tile.default_config(arch), **SCORE_OPTIONS[option]}
    for shape in [tile.shape("decode_b64_n32k"), _odd(3, 2, 1000), _odd(2, 1, 77)]:
        ev = evaluate(tile, shape, cfg, arch, seed=3, time_it=False)
        assert ev.outcome == OK, f"{option} {shape.name}: {ev.message}"


TWO_PASS_CASES = [
    # (tile, shapes): indexer_topk (its default since session 4), the candidate pool (k = 2048 block maxima on coarse,
    # heavily tied scores, the newest block forced to +inf; compared bit-exactly), Reindex (slots mapped back to
    # cache positions through a position map; unused pool blocks and invisible slots score -inf, never chosen)
    (ix.INDEXER_TOPK, ["decode_b64_n32k", "decode_b1_n128k", "prefill_s4k", _odd(3, 2, 1000), _odd(2, 1, 77)]),
    (ix.CANDIDATE_POOL, ["decode_b64_n32k", "decode_b1_n128k", _odd(2, 3, 1001), _odd(1, 1, 5)]),
    (ix.REINDEX_TOPK, ["decode_b64_n32k", "decode_b1_n128k", _odd(3, 2, 4001), _odd(2, 1, 77)]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,shapes", TWO_PASS_CASES, ids=[t.name for t, _ in TWO_PASS_CASES])
def test_two_pass_select_matches_reference(tile, shapes):
    """select_algo=two_pass (tiles.radix_select) in each tile that selects: the reference's result by its rule."""
    arch = get_arch("sm90")
    cfg = {**tile.default_config(arch), "select_algo": "two_pass"}
    for spec in shapes:
        shape = tile.shape(spec) if isinstance(spec, str) else spec
        ev = evaluate(tile, shape, cfg, arch, seed=5, time_it=False)
        assert ev.outcome == OK, f"two_pass {tile.name} {shape.name}: {ev.message}"


def test_min_ctas_register_cap_is_a_constraint():
    """min_ctas 3 at 256 consumer threads leaves ptxas 40 registers: it cannot assemble the kernel, so the space prunes it."""
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    shape = tile.shape("decode_b64_n128k")
    bad = {**tile.default_config(arch), "dequant": "prmt", "min_ctas": 3}
    assert any("registers per thread" in r for r in tile.search_space(arch).violations(bad, shape, arch))
    ok = {**bad, "threads": 128, "tiles_per_cta": 4}
    assert not any("registers per thread" in r for r in tile.search_space(arch).violations(ok, shape, arch))


def test_two_pass_select_is_in_the_search_space():
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    cfg = {**tile.default_config(arch), "select_algo": "two_pass"}
    assert tile.search_space(arch).violations(cfg, tile.shape("decode_b64_n128k"), arch) == []
    assert tile.build(tile.shape("decode_b64_n128k"), cfg, arch)[0]["select_algo"] == "two_pass"


@pytest.mark.gpu
def test_bits_scores_equal_shared_scores():
    """Both paths feed the same exact bf16 K to the same MMA: the score rows must agree bitwise."""
    inputs = ix._indexer_inputs(4, 1, 5000, 11, "cuda", causal=False)
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    _, a = ix.indexer_topk(*args, 512, return_scores=True, config={**ix._SCORE_DEFAULT, "dequant": "bits"})
    _, b = ix.indexer_topk(*args, 512, return_scores=True, config={**ix._SCORE_DEFAULT, "dequant": "shared"})
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_prmt_scores_equal_bits_scores():
    """dequant=prmt builds the bits path's bf16 patterns by byte permutes: the same K into the same MMA, bitwise."""
    inputs = ix._indexer_inputs(4, 1, 5000, 13, "cuda", causal=False)
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    sm90 = ix._SCORE_DEFAULT_SM90
    _, a = ix.indexer_topk(*args, 512, return_scores=True, config={**sm90, "dequant": "prmt", "min_ctas": 2})
    _, b = ix.indexer_topk(*args, 512, return_scores=True, config={**sm90, "dequant": "bits"})
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_ties_and_wrappers():
    inputs = ix._indexer_inputs(4, 2, 32768, 5, "cuda", causal=False)
    inputs["k_packed"] = inputs["k_packed"][:, :64].repeat(1, 512, 1).contiguous()  # 64 distinct keys: every score repeats
    inputs["k_scales"] = inputs["k_scales"][:, :64].repeat(1, 512, 1).contiguous()
    args = (inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"])
    out, scores = ix.indexer_topk(*args, 512, return_scores=True)
    assert torch.equal(out, topk_positions(scores, 512))  # the select kernel follows the tie rule exactly
    ref_scores = ix._reference_scores(inputs)
    assert ix.compare_topk_sets(out, topk_positions(ref_scores, 512), ref_scores).ok
    pool = ix.candidate_pool(scores, inputs["n_visible"])
    assert torch.equal(pool, candidate_blocks(scores, inputs["n_visible"], 8, 2048))
    got = ix.reindex_topk(*args, pool, 8, 512)
    inputs["pool_blocks"] = pool
    ref = ix.REINDEX_TOPK.reference(inputs)
    assert ix.compare_topk_sets(got, ref["topk"], ref["scores"]).ok


@pytest.mark.parametrize("tile", [ix.CANDIDATE_POOL, ix.REINDEX_TOPK], ids=lambda t: t.name)
def test_pool_and_reindex_select_defaults(tile):
    """Hopper's default is the two-pass select (timed on the H200); other arches keep the multipass select
    (not timed there); both stay in the space and compile."""
    shape = tile.shape("decode_b64_n128k")
    assert tile.default_config(SM90)["select_algo"] == "two_pass"
    assert tile.default_config(get_arch("sm80"))["select_algo"] == "multipass"
    cfg = {**tile.default_config(SM90), "select_algo": "multipass"}
    assert tile.search_space(SM90).violations(cfg, shape, SM90) == []
    assert tile.build(shape, cfg, SM90)[0]["select_algo"] == "multipass"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [ix.INDEXER_TOPK, ix.CANDIDATE_POOL], ids=lambda t: t.name)
def test_65536_query_rows_launch(tile):
    """A 64K prefill has 65536 query rows: grid y stops at 65535, so the score and block-max kernels fold
    the rows into grid x (the first 64K CED prefill on the H200 failed to launch with grid=(16, 65536, 1))."""
    arch = get_arch("sm90")
    ev = evaluate(tile, _odd(1, 65536, 600), tile.default_config(arch), arch, seed=5, time_it=False)
    assert ev.outcome == OK, ev.message


def _select_like_the_kernel(values, n_valid, _blocks, out):
    """The select kernel's contract in torch: per row the k best of columns < n_valid (-inf never chosen),
    ties to the lower position, positions ascending, -1 fill."""
    R, L = values.shape
    k = out.shape[1]
    for r in range(R):
        n = int(min(n_valid[r], L))
        row = values[r, :n]
        cols = [j for j in range(n) if row[j] > float("-inf")]
        cols.sort(key=lambda j: (-float(row[j]), j))
        keep = sorted(cols[:k])
        out[r] = torch.tensor(keep + [-1] * (k - len(keep)), dtype=torch.int32)


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
def test_select_in_parts_equals_one_piece(parts):
    """The split select keeps exactly what one select over the whole row keeps, ties and -inf included."""
    g = torch.Generator().manual_seed(parts)
    R, N, k = 6, 64, 7
    scores = torch.randint(0, 9, (R, N), generator=g).float()  # many ties
    scores[0, 10:] = float("-inf")  # fewer candidates than k in most parts
    scores[1] = 3.0  # one big tie
    nvis = torch.tensor([N, N, 37, 5, 0, N], dtype=torch.int32)
    want = torch.empty(R, k, dtype=torch.int32)
    _select_like_the_kernel(scores, nvis, None, want)
    got = torch.full((R, k), -7, dtype=torch.int32)
    ix._select_in_parts(_select_like_the_kernel, parts, scores, nvis, got)
    assert torch.equal(got, want)


def test_select_split_auto_fills_the_gpu_and_keeps_parts_wide():
    sm90 = get_arch("sm90")  # 132 SMs
    assert ix.resolve_select_split("auto", 64, 131072, 512, sm90) == 8  # decode B=64: 8 x 64 rows >= 2 x 132
    assert ix.resolve_select_split("auto", 128, 131072, 512, sm90) == 4
    assert ix.resolve_select_split("auto", 4096, 4096, 512, sm90) == 1  # prefill rows fill the GPU alone
    assert ix.resolve_select_split("auto", 1, 8192, 512, sm90) == 4  # parts stay >= 4k = 2048 wide
    assert ix.resolve_select_split("auto", 1, 1000, 512, sm90) == 1
    assert ix.resolve_select_split(4, 4096, 4096, 512, sm90) == 4  # an explicit setting is kept


@pytest.mark.gpu
@pytest.mark.parametrize("parts", ["auto", 2, 4, 8])
def test_select_split_matches_reference(parts):
    arch = get_arch("sm90")
    tile = ix.INDEXER_TOPK
    cfg = {**tile.default_config(arch), "select_split": parts}
    for shape in [tile.shape("decode_b64_n32k"), tile.shape("decode_b1_n128k"), _odd(3, 2, 1000), _odd(2, 1, 77)]:
        ev = evaluate(tile, shape, cfg, arch, seed=6, time_it=False)
        assert ev.outcome == OK, f"split {parts} {shape.name}: {ev.message}"
