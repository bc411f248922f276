"""Compressor tile: one pass from kv/gate projections to both FP4 caches.

CPU: the default compiles for sm_90a (both ratios), constraints, input errors, and the
comparison rule itself. GPU (marked): against the torch reference + model.formats on fresh
random data (prefill and decode shapes, G not a multiple of the block), outputs poisoned,
two runs bitwise equal; the decode tail state gives the same entry as the whole group.
"""

import pytest
import torch

from model import formats
from tiles import compressor as cp
from tiles.arch import get_arch
from tiles.contract import Shape, TileError
from tiles.harness import OK, evaluate

SM90 = get_arch("sm90")


def _args(B=2, S=4, G=2, device="cpu"):
    kv = torch.randn(B, S, 512, device=device)
    gate = torch.randn(B, S, 512, device=device)
    rest = (torch.ones(512), torch.ones(G, 32), torch.zeros(G, 32), torch.randn(128, 512), torch.ones(128), 1e-6)
    return kv, gate, rest


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("shape_name", ["prefill_r2_s4k", "decode_r1_b64"])
def test_default_compiles_sm90(shape_name):
    shape = cp.COMPRESSOR.shape(shape_name)
    cfg = cp.COMPRESSOR.default_config(SM90)
    assert cp.COMPRESSOR.search_space(SM90).violations(cfg, shape, SM90) == []
    assert cp.COMPRESSOR.build(shape, cfg, SM90) is not None


def test_staged_load_compiles_sm90_and_is_the_hopper_default():
    cfg = cp.COMPRESSOR.default_config(SM90)
    assert cfg["load"] == "staged"
    assert cp.COMPRESSOR.default_config(get_arch("sm80"))["load"] == "direct"
    for name in ("prefill_r1_s4k", "decode_r2_b64"):
        shape = cp.COMPRESSOR.shape(name)
        assert cp.COMPRESSOR.search_space(SM90).violations(cfg, shape, SM90) == []
        assert cp.COMPRESSOR.build(shape, {**cfg, "block_g": 16, "k_chunk": 64}, SM90) is not None


def test_constraints_prune():
    space = cp.COMPRESSOR.search_space(SM90)
    shape = cp.COMPRESSOR.shapes()[0]
    assert any(
        "shared memory" in r for r in space.violations({"block_g": 64, "threads": 256, "proj": "tf32x3", "k_chunk": 64}, shape, SM90)
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda kv, g, r: cp.compress(kv, g, 3, *r), "ratio must be 1 or 2"),
        (lambda kv, g, r: cp.compress(kv[..., :256], g, 2, *r), "kv must be"),
        (lambda kv, g, r: cp.compress(kv, None, 2, *r), "needs a gate"),
        (lambda kv, g, r: cp.compress(kv.double(), g, 2, *r), "kv must be float32"),
        (lambda kv, g, r: cp.compress(kv, g, 2, r[0], r[1][:1], *r[2:]), "cos must have shape"),
        (lambda kv, g, r: cp.compress(kv, g, 2, *r, tail_kv=kv[:, 0]), "together"),
        (lambda kv, g, r: cp.compress(kv, g, 2, *r), "CUDA GPU"),
    ],
    ids=["ratio", "kv_dim", "gate", "dtype", "cos", "tail", "cpu"],
)
def test_compress_rejects(call, message):
    kv, gate, rest = _args()
    with pytest.raises(TileError, match=message):
        call(kv, gate, rest)


def test_split_tf32_is_exact():
    w = torch.randn(128, 512)
    hi, lo = cp.split_tf32(w)
    assert torch.equal(hi + lo, w)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all()


def test_compare_rule():
    x = torch.randn(3, 500, 512)
    mp, ms = formats.fp4_quantize(x, 16, "e4m3")
    ip, is_ = formats.fp4_quantize(x[..., :128], 32, "e8m0")
    ref = {"main_packed": mp, "main_scales": ms, "idx_packed": ip, "idx_scales": is_}
    assert cp.compare_fp4_caches(ref, ref).ok
    one = dict(ref, main_packed=mp.clone())
    one["main_packed"].view(-1)[0] = (mp.view(-1)[0] & 0xF0) | (((mp.view(-1)[0] & 7).clamp(max=6) + 1) | (mp.view(-1)[0] & 8))
    assert cp.compare_fp4_caches(one, ref).ok  # one code step in one byte of 768,000
    far = dict(ref, main_packed=mp ^ 0x07)  # every code moved by several steps
    assert not cp.compare_fp4_caches(far, ref).ok
    # One E8M0 scale one step up: its 32 codes are requantised (many steps), which the rule allows.
    scales = is_.clone()
    scales.view(-1)[3] += 1
    vals = formats.fp4_dequantize(ip, is_, 32, "e8m0").view(-1, 128)
    row = vals[0].clone()
    grp = slice(96, 128)
    s_new = formats.e8m0_decode(scales.view(-1, 4)[0, 3])
    codes = formats.e2m1_encode(torch.clamp(row[grp] / s_new, -6, 6))
    all_codes = formats.unpack_nibbles(ip.view(-1, 64)[0]).clone()
    all_codes[grp] = codes
    packed = ip.clone()
    packed.view(-1, 64)[0] = formats.pack_nibbles(all_codes)
    assert cp.compare_fp4_caches(dict(ref, idx_packed=packed, idx_scales=scales), ref).ok
    scales2 = is_.clone()
    scales2.view(-1)[3] += 2
    assert not cp.compare_fp4_caches(dict(ref, idx_scales=scales2), ref).ok


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("load", ["direct", "staged"])
@pytest.mark.parametrize("proj", ["tf32x3", "simt"])
def test_compressor_matches_reference(proj, load):
    arch = get_arch("sm90")
    odd = [Shape(f"odd_r{r}", "prefill", {"B": 2, "S": 1002, "ratio": r, "dim": 5120, "D": 512, "Di": 128}) for r in (1, 2)]
    shapes = [cp.COMPRESSOR.shape(n) for n in ("prefill_r2_s4k", "prefill_r1_s4k", "decode_r2_b64", "decode_r1_b64")] + odd
    for shape in shapes:
        cfg = {**cp.COMPRESSOR.default_config(arch), "proj": proj, "load": load}
        ev = evaluate(cp.COMPRESSOR, shape, cfg, arch, seed=2, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["prefill_r2_s4k", "prefill_r1_s4k", "decode_r2_b64"])
@pytest.mark.parametrize("block_g, k_chunk", [(32, 32), (16, 32)])
def test_staged_equals_direct_bitwise(shape_name, block_g, k_chunk):
    """The staged loads change where kv/gate come from, not the arithmetic: caches byte-identical."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    shape = tile.shape(shape_name)
    inputs = tile.make_inputs(shape, 4, "cuda")
    base = {"block_g": block_g, "threads": 256, "proj": "tf32x3", "k_chunk": k_chunk}
    assert tile.search_space(arch).violations({**base, "load": "staged"}, shape, arch) == []
    direct = tile.run(tile.build(shape, {**base, "load": "direct"}, arch), inputs)
    staged = tile.run(tile.build(shape, {**base, "load": "staged"}, arch), inputs)
    for name in direct:
        assert torch.equal(direct[name], staged[name]), name


@pytest.mark.gpu
def test_decode_tail_state():
    tile = cp.COMPRESSOR
    inputs = tile.make_inputs(tile.shape("decode_r2_b64"), 3, "cuda")
    rest = (inputs["norm_weight"], inputs["cos"], inputs["sin"], inputs["wk"], inputs["k_norm_weight"], 1e-6)
    full = cp.compress(inputs["kv"], inputs["gate"], 2, *rest)
    tail = cp.compress(inputs["kv"][:, 1:], inputs["gate"][:, 1:], 2, *rest, tail_kv=inputs["kv"][:, 0], tail_gate=inputs["gate"][:, 0])
    assert all(torch.equal(a, b) for a, b in zip(full, tail))
    names = ("main_packed", "main_scales", "idx_packed", "idx_scales")
    assert cp.compare_fp4_caches(dict(zip(names, full)), tile.reference(inputs)).ok


def test_smem_constraint_refuses_what_the_h200_refused():
    """(16, 64) staged tf32x3 asked for 311 KiB on the H200 and failed to launch; the default fits."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    shape = tile.shape("prefill_r2_s4k")
    space = tile.search_space(arch)
    bad = {"block_g": 16, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "staged"}
    assert any("shared memory" in r for r in space.violations(bad, shape, arch))
    assert space.violations(tile.default_config(arch), shape, arch) == []
