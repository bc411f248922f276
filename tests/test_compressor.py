"""Compressor tile: one pass from kv/gate projections to both FP4 caches.

CPU: the default compiles for sm_90a (both ratios), constraints, input errors, and the
comparison rule itself. GPU (marked): against the torch reference + model.formats on fresh
random data (prefill and decode shapes, G not a multiple of the block), outputs poisoned,
two runs bitwise equal; the decode tail state gives the same entry as the whole group.
"""

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tilelang
import torch

from model import formats
from tiles import compressor as cp
from tiles.compressor import kernel as cp_kernel
from tiles.compressor import launch as cp_launch
from tiles.compressor import pool_encode as cp_pool_encode
from tiles.compressor import projection as cp_projection
from tiles.compressor import space as cp_space
from tiles.core.arch import get_arch
from tiles.core.contract import Shape, TileError
from tiles.core.harness import OK, evaluate
from tiles.core.ptxas import parse_resource_usage, ptxas_log, resource_usage
from tiles.core.shapes import flash

SM90 = get_arch("sm90")
EPS = flash().norm_eps  # the RMSNorm epsilon the tile's reference uses
# The one-CTA-per-SM kernel (Hopper's default until ctas_per_sm 2): the base of the tests that vary load, proj or encode
ONE_CTA = {
    "ctas_per_sm": 1,
    "k_chunk": 32,
    "wk": "hi_lo",
    "schedule": "ws",
    "kv_load": "slabs",
    "norm_pass": "separate",
}  # kv through slabs


def _default(arch=SM90):
    """The arch's default with the projection's operands through shared memory and the reference's pooling expression:
    the configs these tests vary were written and checked against it (Hopper's default reads the operands from registers
    since session 8, pools by pool_math="fast" and runs three CTAs of 16 groups per SM since session 9, normalises in the
    pooling (norm_pass="in_pool") since session 10 and projects in fp16 (proj="f16x3") since session 29; those have
    their own tests below, against this one as the base)."""
    base = {**cp.COMPRESSOR.default_config(arch), "proj_operands": "smem", "pool_math": "ieee", "norm_pass": "separate", "proj": "tf32x3"}
    return {**base, "block_g": 32, "ctas_per_sm": 2} if arch.family == "hopper" else base  # three CTAs of 16 since session 9


def _args(B=2, S=4, G=2, device="cpu"):
    kv = torch.randn(B, S, 512, device=device)
    gate = torch.randn(B, S, 512, device=device)
    rest = (torch.ones(512), torch.ones(G, 32), torch.zeros(G, 32), torch.randn(128, 512), torch.ones(128), EPS)
    return kv, gate, rest


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("shape_name", ["prefill_r2_s4k", "decode_r1_b64"])
def test_default_compiles_sm90(shape_name):
    """The Hopper default as its config says: CTAs per SM in the launch bounds, the division-free encode, the fp16
    projection from registers; at ratio 2 the gate among the parameters and the fast pooling's exponentials (ratio 1
    pools nothing)."""
    shape = cp.COMPRESSOR.shape(shape_name)
    cfg = cp.COMPRESSOR.default_config(SM90)
    assert cp.COMPRESSOR.search_space(SM90).violations(cfg, shape, SM90) == []
    assert (cfg["encode"], cfg["proj"], cfg["proj_operands"], cfg["pool_math"]) == ("thresholds", "f16x3", "registers", "fast")
    src = cp.COMPRESSOR.build(shape, cfg, SM90).get_kernel_source()
    assert f"__launch_bounds__({cfg['threads']}, {cfg['ctas_per_sm']})" in src
    assert "csa2_e2m1_pair_bounded(" in src and "csa2_proj_f16x3_regs(" in src
    pools = shape["ratio"] == 2
    assert ("const float* __restrict__ gate" in src, "__expf(" in src) == (pools, pools)


@pytest.mark.slow
def test_staged_load_compiles_sm90_and_is_the_hopper_default():
    """load="staged" is Hopper's default, the only load its flat kernel is built for (the builder refuses "direct"
    there); it builds at both ratios, prefill and decode (B and G are dynamic), with the gate a parameter at ratio 2."""
    cfg = cp.COMPRESSOR.default_config(SM90)
    assert cfg["load"] == "staged"
    assert cp.COMPRESSOR.default_config(get_arch("sm80"))["load"] == "direct"
    for name in ("prefill_r1_s4k", "decode_r2_b64"):
        shape = cp.COMPRESSOR.shape(name)
        assert cp.COMPRESSOR.search_space(SM90).violations(cfg, shape, SM90) == []
        src = cp.COMPRESSOR.build(shape, cfg, SM90).get_kernel_source()
        assert f"__launch_bounds__({cfg['threads']}, {cfg['ctas_per_sm']})" in src
        assert ("const float* __restrict__ gate" in src) == (shape["ratio"] == 2)
        with pytest.raises(TileError, match="is built for load=staged"):
            cp.COMPRESSOR.build(shape, {**cfg, "load": "direct"}, SM90)


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


def test_compress_prepares_a_layers_wk_once():
    """compress() keeps each Wk tensor's prepared forms across calls (a layer's constant), makes them again after an
    in-place write to it, and gives another tensor its own."""

    class K:
        csa2_wk = "fragments"

    w = torch.randn(128, 512)
    first = cp_launch.wk_args(K(), w, cp_launch.prepared_forms(w))
    again = cp_launch.wk_args(K(), w, cp_launch.prepared_forms(w))
    assert again[0].data_ptr() == first[0].data_ptr()
    assert torch.equal(first[0], cp.wk_fragment_order(w, 16))
    w.mul_(2.0)  # a weight update in place
    updated = cp_launch.wk_args(K(), w, cp_launch.prepared_forms(w))
    assert torch.equal(updated[0], cp.wk_fragment_order(w, 16)) and not torch.equal(updated[0], first[0])
    other = torch.randn(128, 512)
    assert torch.equal(cp_launch.wk_args(K(), other, cp_launch.prepared_forms(other))[0], cp.wk_fragment_order(other, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("load", ["direct", "staged"])
@pytest.mark.parametrize("proj", ["tf32x3", "simt"])
def test_compressor_matches_reference(proj, load):
    arch = get_arch("sm90")
    odd = [Shape(f"odd_r{r}", "prefill", {"B": 2, "S": 1002, "ratio": r, "dim": 5120, "D": 512, "Di": 128}) for r in (1, 2)]
    shapes = [cp.COMPRESSOR.shape(n) for n in ("prefill_r2_s4k", "prefill_r1_s4k", "decode_r2_b64", "decode_r1_b64")] + odd
    for shape in shapes:
        cfg = {**_default(arch), **ONE_CTA, "proj": proj, "load": load}
        ev = evaluate(cp.COMPRESSOR, shape, cfg, arch, seed=2, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


def _gpu_inputs(shape_name: str, seed: int):
    """(sm90, the compressor, its shape ``shape_name``, fresh inputs of that shape on the GPU from ``seed``)."""
    tile = cp.COMPRESSOR
    shape = tile.shape(shape_name)
    return get_arch("sm90"), tile, shape, tile.make_inputs(shape, seed, "cuda")


def _outputs_bitwise_equal(shape, inputs, config_a, config_b) -> None:
    """Two compressor configs on the same inputs write byte-identical caches (all four outputs, poisoned before each
    launch), and those caches are right against the torch reference (fp4-near-exact rule): two kernels equally wrong
    would pass the byte comparison alone."""
    tile, arch = cp.COMPRESSOR, get_arch("sm90")
    a = tile.run(tile.build(shape, config_a, arch), inputs)
    b = tile.run(tile.build(shape, config_b, arch), inputs)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    cmp = tile.compare(a, tile.reference(inputs))
    assert cmp.ok, f"{shape.name}: {cmp}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["prefill_r2_s4k", "prefill_r1_s4k", "decode_r2_b64"])
@pytest.mark.parametrize("block_g, k_chunk", [(32, 32), (16, 32)])
def test_staged_equals_direct_bitwise(shape_name, block_g, k_chunk):
    """The staged loads change where kv/gate come from, not the arithmetic: caches byte-identical."""
    arch, tile, shape, inputs = _gpu_inputs(shape_name, 4)
    base = {"block_g": block_g, "threads": 256, "proj": "tf32x3", "k_chunk": k_chunk}
    assert tile.search_space(arch).violations({**base, "load": "staged"}, shape, arch) == []
    _outputs_bitwise_equal(shape, inputs, {**base, "load": "direct"}, {**base, "load": "staged"})


@pytest.mark.gpu
def test_decode_tail_state():
    """The public compress with the config it picks: a decode step's tail state gives the whole group's entries, each
    call twice on poisoned outputs, against the reference (:func:`_decode_tail_entries_equal`)."""
    _decode_tail_entries_equal(None)


def test_smem_constraint_refuses_what_the_h200_refused():
    """(16, 64) staged tf32x3 asked for 311 KiB on the H200 and failed to launch; the default fits."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    shape = tile.shape("prefill_r2_s4k")
    space = tile.search_space(arch)
    bad = {"block_g": 16, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "staged"}
    assert any("shared memory" in r for r in space.violations(bad, shape, arch))
    assert space.violations(tile.default_config(arch), shape, arch) == []


# ---------------------------------------------------------------------------------- encode="thresholds" (CPU proofs)
# The kernel's division-free E2M1 codes against the reference (model.formats: clamp(x / s) then the midpoint
# comparisons, IEEE fp32 division on the CPU). Each pass "fl(|x| / s) beyond m_k" and each bound "|x| beyond t_k"
# is monotone in |x|, so the two agree on every fp32 x once they agree on the floats next to t_k: the windows
# below cover every bound of every scale byte the kernel can produce, which makes the check exhaustive.

E4M3_SCALE_BYTES = range(0x01, 0x7F)  # raw = clamp(max(amax, 6 * 2^-9) / 6, max=448): 2^-9 (0x01) .. 448 (0x7E)
WINDOW = 64  # floats on each side of every bound


def _f32_round(r: float, up: bool) -> float:
    """The fp32 neighbour of the real ``r`` (exact in float64) in the given direction: RU or RD."""
    f = np.float32(r)
    if up and float(f) < r:
        f = np.nextafter(f, np.float32(np.inf))
    if not up and float(f) > r:
        f = np.nextafter(f, np.float32(-np.inf))
    return float(f)


def _bounds(s: float) -> tuple[list[float], float]:
    """The kernel's t_k and t_neg for scale s (what __fmaf_rd/__fmaf_ru/__fmul_rd compute: exact product, one rounding)."""
    t = [_f32_round((m + h) * s, up=False) if k % 2 == 0 else _f32_round((m - h) * s, up=True) for k, (m, h) in enumerate(cp.E2M1_BOUNDS)]
    return t, _f32_round(s * 2.0**-150, up=False)


def _window(center: float) -> torch.Tensor:
    """fp32 values at and next to ``center`` (>= 0): WINDOW floats on each side in bit order, both signs."""
    bits = int(np.float32(center).view(np.int32))
    b = torch.arange(max(bits - WINDOW, 0), bits + WINDOW + 1, dtype=torch.int64).to(torch.int32)
    x = b.view(torch.float32)
    return torch.cat([x, -x])


def _specials() -> torch.Tensor:
    vals = [
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        3.4028234663852886e38,
        -3.4028234663852886e38,
        1e-45,
        -1e-45,
        1.1754942e-38,
    ]
    rand = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=torch.Generator().manual_seed(7), dtype=torch.int64).to(torch.int32)
    return torch.cat(
        [
            torch.tensor(vals, dtype=torch.float32),
            rand.view(torch.float32),
            torch.randn(4096, generator=torch.Generator().manual_seed(8)) * 30,
        ]
    )


def _code_bounded(x: torch.Tensor, t: list[float], t_neg: float) -> torch.Tensor:
    """Python mirror of csa2_e2m1_bounded (tiles/compressor/pool_encode.py, bounds_cuda): the 3-level search."""
    a = x.abs()
    tt = torch.tensor(t, dtype=torch.float32)
    ge4 = a >= tt[3]
    ge2 = a >= torch.where(ge4, tt[5], tt[1])
    odd = a > torch.where(ge4, torch.where(ge2, tt[6], tt[4]), torch.where(ge2, tt[2], tt[0]))
    return (ge4.to(torch.uint8) * 4) | (ge2.to(torch.uint8) * 2) | odd.to(torch.uint8) | ((x < -t_neg).to(torch.uint8) * 8)


def test_threshold_encode_equals_reference_for_every_e4m3_scale():
    for byte in E4M3_SCALE_BYTES:
        s_t = formats.e4m3_decode(torch.tensor([byte], dtype=torch.uint8))
        s = float(s_t)
        t, t_neg = _bounds(s)
        assert all(a < b for a, b in itertools.pairwise(t)), (byte, t)  # the search needs increasing bounds
        centers = [*t, t_neg, *(m * s for m, _ in cp.E2M1_BOUNDS)]
        x = torch.cat([_window(c) for c in centers] + [_specials()])
        q = torch.clamp(x / s_t, -6.0, 6.0)
        # Per bound: the kernel's comparison equals the reference's rounded comparison (monotone, so everywhere).
        for k, (m, _) in enumerate(cp.E2M1_BOUNDS):
            ref = (q.abs() > m) if k % 2 == 0 else (q.abs() >= m)
            got = (x.abs() > t[k]) if k % 2 == 0 else (x.abs() >= t[k])
            assert torch.equal(ref, got), (byte, k)
        assert torch.equal(q < 0, x < -t_neg), byte
        assert torch.equal(_code_bounded(x, t, t_neg), formats.e2m1_encode(q)), byte


def test_bounds_cuda_matches_the_model():
    """The generated CUDA spells the same m_k, h_k and rounding directions the Python proof uses."""
    src = cp_pool_encode.bounds_cuda()
    for k, (m, h) in enumerate(cp.E2M1_BOUNDS):
        fn, sign = ("__fmaf_rd", "") if k % 2 == 0 else ("__fmaf_ru", "-")
        assert f"t[{k}] = {fn}(s, {m!r}f, s * {sign}{h.hex()}f);" in src
    assert "__fmul_rd(s * 0x1p-126f, 0x1p-24f)" in src


def test_e8m0_inverse_multiply_equals_division():
    """Index cache: x * 2^(127 - b) (the kernel's inverse bits) is x / 2^(b - 127) bit for bit, and the 3-level
    search on it equals e2m1_encode(clamp(.)) (the clamp changes no code)."""
    mids = [m for m, _ in cp.E2M1_BOUNDS]
    for byte in range(1, 255):
        inv_bits = (254 - byte) << 23 if byte <= 253 else 0x00400000
        inv = torch.tensor([inv_bits], dtype=torch.int32).view(torch.float32)
        s = formats.e8m0_decode(torch.tensor([byte], dtype=torch.uint8))
        assert float(inv) * float(s) == 1.0
        x = torch.cat([_window(min(m * float(s), 3.4e38)) for m in mids] + [_specials(), _window(float(s) * 2.0**-149)])
        v = x * inv
        d = x / s
        assert torch.equal(torch.isnan(v), torch.isnan(d)), byte
        assert torch.equal(v[~torch.isnan(v)].view(torch.int32), d[~torch.isnan(d)].view(torch.int32)), byte
        a = v.abs()
        ge4 = a >= 1.75
        ge2 = a >= torch.where(ge4, torch.tensor(3.5), torch.tensor(0.75))
        odd = a > torch.where(
            ge4, torch.where(ge2, torch.tensor(5.0), torch.tensor(2.5)), torch.where(ge2, torch.tensor(1.25), torch.tensor(0.25))
        )
        code = (ge4.to(torch.uint8) * 4) | (ge2.to(torch.uint8) * 2) | odd.to(torch.uint8) | ((v < 0).to(torch.uint8) * 8)
        assert torch.equal(code, formats.e2m1_encode(torch.clamp(x / s, -6.0, 6.0))), byte


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.slow
def test_threshold_encode_compiles_sm90_and_is_in_the_space(ratio):
    shape = cp.COMPRESSOR.shape(f"prefill_r{ratio}_s4k")
    space = cp.COMPRESSOR.search_space(SM90)
    assert "thresholds" in {p.name: p.choices for p in space.params}["encode"]
    cfg = {**_default(), "encode": "thresholds"}
    assert cp.COMPRESSOR.default_config(SM90)["encode"] == "thresholds"  # Hopper's default since the H200 timing
    assert cp.COMPRESSOR.default_config(get_arch("sm80"))["encode"] == "divide"  # not timed elsewhere
    assert space.violations(cfg, shape, SM90) == []
    kernel = cp.COMPRESSOR.build(shape, cfg, SM90)
    src = kernel.get_kernel_source()
    assert "csa2_e2m1_pair_bounded" in src and "__fmaf_rd" in src
    # No IEEE division left in the FP4 encodes: the only divisions are the pooling's softmax (ratio 2), the
    # RMSNorm means and the amax / 6 of the scales.
    assert " / sc" not in src


def test_unknown_encode_is_refused():
    with pytest.raises(TileError, match="unknown encode"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 32, "staged", "bogus")


@pytest.mark.gpu
@pytest.mark.parametrize("load", ["direct", "staged"])
def test_threshold_encode_matches_reference(load):
    """encode="thresholds" against the torch reference at the tile's shapes and odd shapes (G not a multiple of the block)."""
    arch = get_arch("sm90")
    odd = [Shape(f"odd_r{r}", "prefill", {"B": 2, "S": 1002 + r, "ratio": r, "dim": 5120, "D": 512, "Di": 128}) for r in (1, 2)]
    names = ("prefill_r2_s4k", "prefill_r1_s4k", "prefill_r2_s64k", "prefill_r1_s64k", "decode_r2_b64", "decode_r1_b64")
    for shape in [cp.COMPRESSOR.shape(n) for n in names] + odd:
        cfg = {**_default(arch), **ONE_CTA, "load": load, "encode": "thresholds"}
        ev = evaluate(cp.COMPRESSOR, shape, cfg, arch, seed=5, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["prefill_r2_s4k", "prefill_r1_s4k", "decode_r2_b64"])
def test_threshold_encode_equals_divide_bitwise(shape_name):
    """Same latent and index key, codes by bounds instead of division: all four outputs byte-identical."""
    arch, _, shape, inputs = _gpu_inputs(shape_name, 6)
    inputs["kv"][0, :8] *= 1e-39  # tiny latents (RMSNorm keeps them ~1e-36): the smallest scales and bounds
    base = {**_default(arch), **ONE_CTA}
    _outputs_bitwise_equal(shape, inputs, {**base, "encode": "divide"}, {**base, "encode": "thresholds"})


# ---------------------------------------------------------------------------------- ctas_per_sm > 1 (several CTAs per SM)
# The Hopper default is one warp-specialised CTA per SM (384 threads x 168 registers, 228 KB shared memory): HBM idles
# while it normalises, encodes and projects. ctas_per_sm 2-3 cut registers and shared memory so that CTAs share an SM.

# (ratio, block_g, ctas_per_sm, wk): the builds checked with ptxas.
MULTI_CTA = [
    (2, 32, 2, "hi_lo"),
    (1, 32, 2, "hi_lo"),
    (2, 16, 3, "hi_lo"),
    (1, 16, 3, "hi_lo"),
    (2, 32, 2, "fp32"),
    (1, 32, 2, "fp32"),
    (2, 16, 3, "fp32"),
    (1, 16, 3, "fp32"),
]
TL_ROOT = Path(tilelang.__file__).parent


def _multi_cta_config(block_g, ctas, wk="hi_lo"):
    """The two/three-CTA builds as written in session 5: kv and gate through the slabs (the default's kv_load=direct
    came in session 7, and spills at three CTAs per SM at ratio 2)."""
    cfg = {**_default(), "block_g": block_g, "k_chunk": 16, "ctas_per_sm": ctas, "wk": wk}
    return {**cfg, "kv_load": "slabs"}


def _dynamic_smem(kernel, threads) -> int:
    """The dynamic shared memory the host code launches ``kernel`` with (the argument after the block dims)."""
    try:
        path = kernel.adapter._host_kernel_source_path  # a kernel loaded from TileLang's cache
    except AttributeError:
        path = None
    host = Path(path).read_text() if path else kernel.get_host_source()
    vals = [int(v) for v in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\)", host)]
    hits = [vals[j + 3] for j in range(len(vals) - 3) if vals[j : j + 3] == [threads, 1, 1]]
    assert len(hits) == 1, hits
    return hits[0]


def _ptxas(src: str, tmp_path) -> tuple[int, int]:
    """(registers, spill bytes) of the kernel source for sm_90a (:func:`tiles.core.ptxas.resource_usage`)."""
    return resource_usage(src, tmp_path)


def _build_without_producer(ratio: int, cfg: dict, ctas: int):
    """Build ``cfg`` at the 64K prefill shape of ``ratio`` after checking the space accepts it there and at decode (the
    same kernel serves both); assert it launches ``ctas`` CTAs per SM and has no producer warpgroup. (kernel, source)."""
    space = cp.COMPRESSOR.search_space(SM90)
    shape = cp.COMPRESSOR.shape(f"prefill_r{ratio}_s64k")
    assert space.violations(cfg, shape, SM90) == []
    assert space.violations(cfg, cp.COMPRESSOR.shape(f"decode_r{ratio}_b64"), SM90) == []
    kernel = cp.COMPRESSOR.build(shape, cfg, SM90)
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__(256, {ctas})" in src
    assert "warpgroup_reg_alloc" not in src
    return kernel, src


@pytest.mark.parametrize("ratio, block_g, ctas, wk", MULTI_CTA)
@pytest.mark.slow
def test_multi_cta_compiles_sm90_and_fits(ratio, block_g, ctas, wk, tmp_path):
    """Compiles at the 64K shapes (the same kernel serves every B and G, decode included), launch bounds ask for
    ``ctas`` CTAs, no producer warpgroup, the shared-memory model equals what the host code launches with, and
    ptxas keeps the registers within 65536 / (256 x ctas) without spilling."""
    cfg = _multi_cta_config(block_g, ctas, wk)
    assert ctas in {p.name: p.choices for p in cp.COMPRESSOR.search_space(SM90).params}["ctas_per_sm"]
    kernel, src = _build_without_producer(ratio, cfg, ctas)
    assert ("wk_lo[" in src) == (wk == "hi_lo")  # wk=fp32 reads Wk itself through the wk_hi argument
    assert kernel.csa2_wk == wk
    # The shared-memory model is exact for these builds (it is what refuses the ones that do not fit).
    smem = _dynamic_smem(kernel, 256)
    gate = cp.MULTI_CTA_STAGES * 2 * block_g * cp.MULTI_CTA_CHUNK * 4 if ratio == 2 else 0
    assert smem == block_g * 512 * 4 + gate + 4 * 128 * 16 * 4 + 8 * block_g * 16 + 512
    assert ctas * (smem + 1024) <= SM90.smem_per_sm
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: registers and spills not checked")
    regs, spills = _ptxas(src, tmp_path)
    assert spills == 0 and regs * 256 * ctas <= SM90.registers_per_sm, (regs, spills)


@pytest.mark.parametrize("schedule", ["two_ctas", "flat_bg64"])
@pytest.mark.slow
def test_the_early_main_cache_stores_are_waited_for(schedule):
    """The main cache is stored by bulk copies before the projection and its buffers are reused for the Wk stages
    (two CTAs per SM, and the flat kernel at block_g 64): a CTA-wide barrier must sit between the electing thread's
    wait for those stores and the first Wk copy."""
    config, first_wk = {"two_ctas": (_multi_cta_config(32, 2), "wk_lo["), "flat_bg64": (_flat_config(64, 1), "wk_hi[")}[schedule]
    src = cp.COMPRESSOR.build(cp.COMPRESSOR.shape("prefill_r2_s64k"), config, SM90).get_kernel_source()
    store = src.index("tl::tma_store(main_scales_desc")
    between = src[store : src.index(first_wk, store)]
    wait = between.index("tl::tma_store_wait<0, true>();")
    assert "__syncthreads();" in between[wait:]


def test_multi_cta_constraints_refuse():
    arch, space = SM90, cp.COMPRESSOR.search_space(SM90)
    shape = cp.COMPRESSOR.shape("prefill_r2_s64k")
    base = _multi_cta_config(32, 2)
    assert any("shared memory" in r for r in space.violations({**base, "k_chunk": 32}, shape, arch))  # 154,112 B compiled
    assert any("occupancy" in r for r in space.violations({**base, "load": "direct"}, shape, arch))
    assert any("occupancy" in r for r in space.violations({**base, "threads": 512}, shape, arch))
    assert any("shared memory" in r for r in space.violations({**base, "ctas_per_sm": 3}, shape, arch))
    assert any("occupancy" in r for r in space.violations({**base, "block_g": 64}, shape, arch))
    assert any("Hopper" in r for r in space.violations(base, shape, get_arch("sm80")))
    # Hopper's default since the H200 profile (profile_compressor_multi_cta_indexer_prmt_rs.json), three CTAs of 16
    # groups since session 9 (profile_compressor_three_ctas_session9.json); one CTA elsewhere
    default = cp.COMPRESSOR.default_config(arch)
    assert (default["ctas_per_sm"], default["block_g"], default["k_chunk"], default["wk"]) == (3, 16, 16, "fp32")
    assert space.violations(default, shape, arch) == []
    assert cp.COMPRESSOR.default_config(get_arch("sm80"))["ctas_per_sm"] == 1
    with pytest.raises(TileError, match="ctas_per_sm"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 16, "direct", "thresholds", 2)
    one_cta = {**default, **ONE_CTA, "block_g": 32, "proj_operands": "smem", "proj": "tf32x3"}  # the warp-specialised kernel
    assert space.violations(one_cta, shape, arch) == []
    assert any("wk=fp32" in r for r in space.violations({**one_cta, "wk": "fp32"}, shape, arch))
    assert any("k_chunk 16" in r for r in space.violations({**one_cta, "k_chunk": 16}, shape, arch))
    with pytest.raises(TileError, match="wk="):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 32, "staged", "thresholds", 1, "fp32")


def test_wk_args():
    """What the launchers pass as (wk_hi, wk_lo): the split by default, Wk itself (no copy) for wk=fp32; a ``prepared``
    dict keeps the split across calls."""

    class K:
        csa2_wk = "fp32"

    w = torch.randn(128, 512)
    hi, lo = cp_launch.wk_args(object(), w)
    assert torch.equal(hi + lo, w) and torch.equal(hi, cp.split_tf32(w)[0])
    a, b = cp_launch.wk_args(K(), w)
    assert a.data_ptr() == w.data_ptr() and b.data_ptr() == w.data_ptr()
    prepared = {}  # a launcher's per-layer cache: the split is made once
    first = cp_launch.wk_args(object(), w, prepared)
    assert cp_launch.wk_args(object(), w, prepared)[0].data_ptr() == first[0].data_ptr() and list(prepared) == ["hi_lo"]


@pytest.mark.gpu
@pytest.mark.parametrize("block_g, ctas, wk", [(32, 2, "hi_lo"), (32, 2, "fp32"), (16, 3, "hi_lo")])
def test_multi_cta_matches_reference(block_g, ctas, wk):
    """ctas_per_sm > 1 against the torch reference at the tile's shapes (64K included) and odd shapes (G not a
    multiple of the block). Not byte-compared with the default: its RMSNorm sums the squares in another order."""
    arch = get_arch("sm90")
    odd = [Shape(f"odd_r{r}", "prefill", {"B": 2, "S": 1002 + r, "ratio": r, "dim": 5120, "D": 512, "Di": 128}) for r in (1, 2)]
    names = ("prefill_r2_s4k", "prefill_r1_s4k", "prefill_r2_s64k", "prefill_r1_s64k", "decode_r2_b64", "decode_r1_b64")
    cfg = _multi_cta_config(block_g, ctas, wk)
    for shape in [cp.COMPRESSOR.shape(n) for n in names] + odd:
        ev = evaluate(cp.COMPRESSOR, shape, cfg, arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"


_TORCH_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is poisoned (tiles.core.contract.poisoned's rule for the buffers compress allocates
    itself): all bits set for bytes, NaN for floats."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.dtype == torch.uint8:
        t.fill_(0xFF)
    elif t.dtype == torch.float32:
        t.fill_(float("nan"))
    return t


def _call_twice(call) -> tuple[torch.Tensor, ...]:
    """``call()`` of the public compress (it allocates its caches) twice, every torch.empty inside poisoned: the first
    caches, after requiring the second call's to be byte-identical. A byte never written stays 0xFF, which the reference
    comparison refuses (0xFF is a NaN scale); a race shows as two different results."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        first, second = call(), call()
    for name, a, b in zip(("main_packed", "main_scales", "idx_packed", "idx_scales"), first, second, strict=True):
        assert torch.equal(a, b), f"two calls differ in {name}"
    return first


def _decode_tail_entries_equal(cfg) -> None:
    """Compress decode_r2_b64 whole and with its first position given as the tail state of an unfinished group, each
    call twice on poisoned outputs (:func:`_call_twice`): the same entries, right against the torch reference
    (fp4-near-exact rule)."""
    tile = cp.COMPRESSOR
    inputs = tile.make_inputs(tile.shape("decode_r2_b64"), 3, "cuda")
    rest = (inputs["norm_weight"], inputs["cos"], inputs["sin"], inputs["wk"], inputs["k_norm_weight"], EPS)
    full = _call_twice(lambda: cp.compress(inputs["kv"], inputs["gate"], 2, *rest, config=cfg))
    tail = _call_twice(
        lambda: cp.compress(
            inputs["kv"][:, 1:], inputs["gate"][:, 1:], 2, *rest, config=cfg, tail_kv=inputs["kv"][:, 0], tail_gate=inputs["gate"][:, 0]
        )
    )
    assert all(torch.equal(a, b) for a, b in zip(full, tail, strict=True))
    cmp = tile.compare(dict(zip(("main_packed", "main_scales", "idx_packed", "idx_scales"), full)), tile.reference(inputs))
    assert cmp.ok, str(cmp)


def _two_runs_bitwise_equal(shape, cfg) -> None:
    """Two runs of ``cfg`` at ``shape`` on the same inputs give the same bytes (a race would show here)."""
    tile, arch = cp.COMPRESSOR, get_arch("sm90")
    big = tile.make_inputs(shape, 8, "cuda")
    kernel = tile.build(shape, cfg, arch)
    first, second = tile.run(kernel, big), tile.run(kernel, big)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{shape.name}: {name}"


@pytest.mark.gpu
def test_multi_cta_decode_tail_and_repeatable():
    """ctas_per_sm 2: the decode tail state gives the same entries as the whole group (and matches the reference), and
    two runs at 64K are bitwise equal (a race on the reused shared memory would show as run-to-run differences)."""
    cfg = {**_default(), "block_g": 32, "k_chunk": 16, "ctas_per_sm": 2}
    _decode_tail_entries_equal(cfg)
    _two_runs_bitwise_equal(cp.COMPRESSOR.shape("prefill_r2_s64k"), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", ["prefill_r2_s64k", "prefill_r1_s64k", "decode_r2_b64"])
def test_multi_cta_wk_fp32_equals_hi_lo_bitwise(shape_name):
    """wk=fp32 splits Wk in the kernel into the bits split_tf32 gives on the host: all four outputs byte-identical."""
    arch, _, shape, inputs = _gpu_inputs(shape_name, 9)
    base = {**_default(arch), "block_g": 32, "k_chunk": 16, "ctas_per_sm": 2}
    _outputs_bitwise_equal(shape, inputs, {**base, "wk": "hi_lo"}, {**base, "wk": "fp32"})


def test_one_cta_choices_without_ctas_per_sm_get_the_one_cta_kernel():
    """with_defaults: {"load": "direct"} alone stays a valid config after two CTAs per SM became Hopper's default."""
    tile, shape = cp.COMPRESSOR, cp.COMPRESSOR.shape("prefill_r2_s64k")
    space = tile.search_space(SM90)
    assert tile.with_defaults(SM90, {}) == tile.default_config(SM90)
    for picked in ({"load": "direct"}, {"proj": "simt"}, {"k_chunk": 32}, {"block_g": 64, "k_chunk": 64}, {"threads": 512}):
        cfg = tile.with_defaults(SM90, picked)
        assert cfg["ctas_per_sm"] == 1 and cfg["wk"] == "hi_lo", picked
        assert cfg["k_chunk"] == picked.get("k_chunk", 32)
    assert space.violations(tile.with_defaults(SM90, {"load": "direct"}), shape, SM90) == []
    # naming ctas_per_sm keeps it, so an impossible pick is refused with its reason, not silently changed
    forced = tile.with_defaults(SM90, {"load": "direct", "ctas_per_sm": 2})
    assert forced["ctas_per_sm"] == 2 and any("occupancy" in r for r in space.violations(forced, shape, SM90))


# ---------------------------------------------------------------------------------- the flat kernel at one CTA per SM, Wk pipeline depth, ratio-1 kv load
# schedule="flat" runs the kernel of ctas_per_sm > 1 at one CTA per SM so that block_g 64 (rot_s 128 KiB) fits: one pass
# over Wk per 64 groups. wk_stages keeps more Wk chunks (L2 round trips) in flight; kv_load="whole" (ratio 1) copies the
# block's kv rows into rot_s at once instead of 32 slab round trips.

# (ratio, block_g, ctas_per_sm, wk, wk_stages, kv_load): the builds checked with ptxas.
FLAT_BUILDS = [
    (1, 64, 1, "fp32", 2, "slabs"),
    (2, 64, 1, "fp32", 2, "slabs"),
    (1, 64, 1, "fp32", 4, "whole"),
    (2, 64, 1, "fp32", 4, "slabs"),
    (1, 64, 1, "hi_lo", 3, "slabs"),
    (1, 32, 2, "fp32", 3, "whole"),
    (2, 32, 2, "fp32", 2, "direct"),
    (1, 32, 2, "fp32", 2, "direct"),
    (2, 64, 1, "fp32", 4, "direct"),
]


def _flat_config(block_g, ctas, wk="fp32", wk_stages=2, kv_load="slabs"):
    """A flat-kernel config over the Hopper default (staged tf32x3, 256 threads, k_chunk 16, thresholds)."""
    cfg = {**_default(), "block_g": block_g, "ctas_per_sm": ctas, "wk": wk}
    return {**cfg, "schedule": "flat", "wk_stages": wk_stages, "kv_load": kv_load}


def _assert_flat_build_fits(kernel, src: str, cfg, ratio: int, ctas: int, tmp_path) -> str:
    """A flat-kernel build launches with the shared memory the model says, ``ctas`` of them fit an SM, and ptxas keeps
    256 x ``ctas`` threads' registers within the SM without spilling (skipped without nvcc). Returns ptxas's log."""
    smem = _dynamic_smem(kernel, 256)
    assert smem == cp_space.smem_flat(cfg, ratio)
    assert ctas * (smem + 1024) <= SM90.smem_per_sm and smem <= SM90.smem_per_block
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: registers and spills not checked")
    log = ptxas_log(src, tmp_path)
    regs, spills = parse_resource_usage(log)
    assert spills == 0 and regs * 256 * ctas <= SM90.registers_per_sm, (regs, spills)
    return log


@pytest.mark.parametrize("ratio, block_g, ctas, wk, stages, kv_load", FLAT_BUILDS)
@pytest.mark.slow
def test_flat_compiles_sm90_and_fits(ratio, block_g, ctas, wk, stages, kv_load, tmp_path):
    """Compiles at the 64K shape (the same kernel serves decode), no producer warpgroup, the Wk pipeline is ``stages``
    deep, the shared-memory model equals the launch, and ptxas keeps the registers within the occupancy, no spills."""
    cfg = _flat_config(block_g, ctas, wk, stages, kv_load)
    kernel, src = _build_without_producer(ratio, cfg, ctas)
    assert f"cp_async_wait<{stages - 1}>" in src  # the Wk loop waits with stages - 1 chunks still in flight
    if kv_load in ("whole", "direct"):
        assert "kv_s" not in src and "gate_s" not in src  # no slab buffer: kv goes straight into rot_s
    _assert_flat_build_fits(kernel, src, cfg, ratio, ctas, tmp_path)


def test_flat_constraints_refuse():
    space, shape = cp.COMPRESSOR.search_space(SM90), cp.COMPRESSOR.shape("prefill_r2_s64k")
    r1 = cp.COMPRESSOR.shape("prefill_r1_s64k")
    params = {p.name: p.choices for p in space.params}
    assert params["schedule"] == ("ws", "flat") and params["wk_stages"] == (2, 3, 4)
    assert params["kv_load"] == ("slabs", "whole", "direct")

    def why(cfg, sh=shape):
        return " | ".join(space.violations(cfg, sh, SM90))

    assert "shared memory" in why(_flat_config(64, 2))  # rot_s alone is 128 KiB: block_g 64 is one CTA per SM
    assert "occupancy" in why({**_flat_config(32, 2), "schedule": "ws"})  # several CTAs are always the flat kernel
    assert "ratio 1 only" in why(_flat_config(64, 1, kv_load="whole"))
    assert "occupancy" in why(_flat_config(16, 1))
    assert "occupancy" in why({**_flat_config(64, 1), "k_chunk": 32})
    assert "shared memory" in why(_flat_config(32, 2, wk_stages=3))  # ratio 2: 123,392 B > 115,712 B
    assert "shared memory" in why(_flat_config(32, 2, wk_stages=4), r1)  # 119,296 B
    assert "shared memory" in why(_flat_config(32, 2, wk="hi_lo", wk_stages=3), r1)  # hi_lo stages cost two tiles
    assert why(_flat_config(32, 2, wk_stages=3, kv_load="whole"), r1) == ""  # 111,104 B: still two CTAs per SM
    assert why(_flat_config(64, 1, wk_stages=4)) == ""  # 215,552 B
    one_cta = {**_default(), **ONE_CTA}
    assert "flat kernel" in why({**one_cta, "wk_stages": 3})
    assert "flat kernel" in why({**one_cta, "kv_load": "whole"}, r1)
    assert any("Hopper" in r for r in space.violations(_flat_config(64, 1), shape, get_arch("sm80")))
    with pytest.raises(TileError, match="'whole' only at ratio 1"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 16, "staged", "thresholds", 2, "fp32", "flat", 2, "whole")
    with pytest.raises(TileError, match="only in the flat kernel"):
        cp_kernel.compress_kernel("sm_90a", 1, 32, 256, "tf32x3", 32, "staged", "thresholds", 1, "hi_lo", "ws", 3)
    with pytest.raises(TileError, match="unknown schedule"):
        cp_kernel.compress_kernel("sm_90a", 1, 32, 256, "tf32x3", 16, "staged", "thresholds", 1, "fp32", "bogus")


def test_flat_with_defaults():
    """{"schedule": "flat", "block_g": 64} alone: the flat kernel at one CTA per SM with the default's k_chunk and wk;
    the new keys alone keep the default's CTAs per SM; {"block_g": 32} alone gets two (three do not fit); a config
    without the new keys builds the same kernel as before."""
    tile, r1 = cp.COMPRESSOR, cp.COMPRESSOR.shape("prefill_r1_s64k")
    space = tile.search_space(SM90)
    cfg = tile.with_defaults(SM90, {"schedule": "flat", "block_g": 64})
    assert (cfg["ctas_per_sm"], cfg["k_chunk"], cfg["wk"]) == (1, 16, "fp32")
    assert space.violations(cfg, r1, SM90) == []
    cfg = tile.with_defaults(SM90, {"wk_stages": 3, "kv_load": "whole"})
    assert cfg["ctas_per_sm"] == tile.default_config(SM90)["ctas_per_sm"] and space.violations(cfg, r1, SM90) == []
    cfg = tile.with_defaults(SM90, {"block_g": 32})
    assert cfg["ctas_per_sm"] == 2 and space.violations(cfg, r1, SM90) == []
    # the reference's pooling alone: three CTAs with the direct loads would spill at ratio 2, so two CTAs of 32
    cfg = tile.with_defaults(SM90, {"pool_math": "ieee"})
    assert (cfg["block_g"], cfg["ctas_per_sm"]) == (32, 2)
    assert space.violations(cfg, tile.shape("prefill_r2_s64k"), SM90) == []
    assert cp_launch.kernel_schedule(tile.default_config(SM90)) == "flat" and cp_launch.kernel_schedule(ONE_CTA) == "ws"
    # The default names the new keys (the tuner's first trial must be the default); schedule and wk_stages with the
    # values that build exactly the kernel of a config without them (kv_load: "direct" since session 7).
    default = tile.default_config(SM90)
    assert (default["schedule"], default["wk_stages"], default["kv_load"]) == ("flat", 2, "direct")
    without = {k: v for k, v in default.items() if k not in ("schedule", "wk_stages")}
    assert tile.build(r1, default, SM90) is tile.build(r1, without, SM90)


# Configs run on the GPU: (label, block_g, ctas, wk, wk_stages, kv_load).
FLAT_GPU = [
    ("bg64", 64, 1, "fp32", 2, "slabs"),
    ("bg64_st4", 64, 1, "fp32", 4, "slabs"),
    ("bg64_hilo_st3", 64, 1, "hi_lo", 3, "slabs"),
    ("bg64_st4_whole", 64, 1, "fp32", 4, "whole"),
    ("mc2_st3_whole", 32, 2, "fp32", 3, "whole"),
    ("mc2_direct", 32, 2, "fp32", 2, "direct"),
    ("bg64_st4_direct", 64, 1, "fp32", 4, "direct"),
]
ODD = [Shape(f"odd_r{r}", "prefill", {"B": 2, "S": 1002 + r, "ratio": r, "dim": 5120, "D": 512, "Di": 128}) for r in (1, 2)]


def _flat_shapes(kv_load):
    """The tile's 64K, 4K and decode shapes and odd ones (G not a multiple of the block); kv_load=whole: ratio 1 only."""
    names = ("prefill_r2_s4k", "prefill_r1_s4k", "prefill_r2_s64k", "prefill_r1_s64k", "decode_r2_b64", "decode_r1_b64")
    shapes = [cp.COMPRESSOR.shape(n) for n in names] + ODD
    return [s for s in shapes if kv_load != "whole" or s["ratio"] == 1]


@pytest.mark.gpu
@pytest.mark.parametrize("label, block_g, ctas, wk, stages, kv_load", FLAT_GPU, ids=[c[0] for c in FLAT_GPU])
def test_flat_matches_reference(label, block_g, ctas, wk, stages, kv_load):
    """Against the torch reference (fp4-near-exact rule), and against the Hopper default (two CTAs, block_g 32):
    the main cache byte-identical (same latent arithmetic: the same RMSNorm lanes, RoPE and encode); at block_g 32
    all four outputs (wk_stages and kv_load change where bytes come from, not the arithmetic). At block_g 64 the
    index key's k_norm sums its squares over another fragment layout, so the index cache may differ by a code step."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    cfg = _flat_config(block_g, ctas, wk, stages, kv_load)
    for shape in _flat_shapes(kv_load):
        ev = evaluate(tile, shape, cfg, arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"
        inputs = tile.make_inputs(shape, 11, "cuda")
        base = tile.run(tile.build(shape, _default(arch), arch), inputs)
        new = tile.run(tile.build(shape, cfg, arch), inputs)
        same = ("main_packed", "main_scales") if block_g == 64 else tuple(base)
        for name in same:
            assert torch.equal(base[name], new[name]), f"{shape.name}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("label, block_g, ctas, wk, stages, kv_load", FLAT_GPU, ids=[c[0] for c in FLAT_GPU])
def test_flat_decode_tail_and_repeatable(label, block_g, ctas, wk, stages, kv_load):
    """The decode tail state (ratio 2) gives the same entries as the whole group, and two runs at 64K are bitwise
    equal (a race on the reused shared memory or the deeper pipelines would show as run-to-run differences)."""
    tile = cp.COMPRESSOR
    cfg = _flat_config(block_g, ctas, wk, stages, kv_load)
    if kv_load != "whole":
        _decode_tail_entries_equal(cfg)
    for shape in [tile.shape(n) for n in ("prefill_r2_s64k", "prefill_r1_s64k")]:
        if kv_load == "whole" and shape["ratio"] == 2:
            continue
        _two_runs_bitwise_equal(shape, cfg)


def test_direct_constraints_refuse():
    """kv_load=direct: the flat kernel only, not at 3 CTAs per SM at ratio 2 (ptxas spills there), unknown values refused
    with a reason; the kernel builder refuses it outside the flat kernel. Hopper's default since session 7's H200 run."""
    space, r2, r1 = cp.COMPRESSOR.search_space(SM90), cp.COMPRESSOR.shape("prefill_r2_s64k"), cp.COMPRESSOR.shape("prefill_r1_s64k")

    def why(cfg, sh=r2):
        return " | ".join(space.violations(cfg, sh, SM90))

    assert cp.COMPRESSOR.default_config(SM90)["kv_load"] == "direct"
    assert why(_flat_config(32, 2, kv_load="direct")) == "" and why(_flat_config(32, 2, kv_load="direct"), r1) == ""
    assert why(_flat_config(64, 1, wk_stages=4, kv_load="direct")) == ""
    assert "spills" in why(_flat_config(16, 3, kv_load="direct"))
    assert why(_flat_config(16, 3, kv_load="direct"), r1) == ""  # ratio 1 holds half the registers: 64, no spills
    assert "unknown kv_load" in why(_flat_config(32, 2, kv_load="bogus"))
    one_cta = {**_default(), **ONE_CTA}
    assert "flat kernel" in why({**one_cta, "kv_load": "direct"})
    assert any("Hopper" in r for r in space.violations(_flat_config(32, 2, kv_load="direct"), r2, get_arch("sm80")))
    # The gate slabs are gone: ratio 2 needs ratio 1's shared memory.
    assert cp_space.smem_flat(_flat_config(32, 2, kv_load="direct"), 2) == cp_space.smem_flat(_flat_config(32, 2), 1) == 102_912
    with pytest.raises(TileError, match="only in the flat kernel"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 32, "staged", "thresholds", 1, "hi_lo", "ws", 2, "direct")
    with pytest.raises(TileError, match="256 threads"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 512, "tf32x3", 16, "staged", "thresholds", 1, "fp32", "flat", 2, "direct")


def test_direct_pools_without_barriers():
    """kv_load=direct at ratio 2: the pooling is register loads of DIRECT_ROWS groups then the same softmax expression
    as the slabs' (staged_pool), with no shared staging; the Wk pipeline is unchanged (cp.async, wk_stages deep)."""
    cfg = _flat_config(32, 2, kv_load="direct")
    kernel = cp.COMPRESSOR.build(cp.COMPRESSOR.shape("prefill_r2_s64k"), cfg, SM90)
    src = kernel.get_kernel_source()
    body = src[src.index("__launch_bounds__(256, 2)") :]
    pool = body[: body.index("tl::AllReduce")]  # everything before the RMSNorm's reduction
    assert "kv_s" not in pool and "gate_s" not in pool and "cp_async" not in pool
    assert pool.count("__syncthreads()") == 1  # the one before the RMSNorm reads rot_s: none per slab
    assert f"for (int r = 0; r < {32 // cp.DIRECT_ROWS}; ++r)" in pool
    assert "expf(" in pool and "cp_async_wait<1>" in body  # the Wk loop's pipeline (wk_stages 2)


# ---------------------------------------------------------------------------------- proj_operands="registers"
# The tf32x3 projection out of registers (PROJ_REGS_CUDA): each warp owns 16 output columns, reads its latent words
# from rot_s (rows padded to 516 words) and its Wk words from L2 in the host's fragment order, splits each word once
# and issues the MMAs of T.gemm in T.gemm's order; no Wk stages, split tiles, cp.async or barriers in the loop.

# (ratio, block_g, ctas_per_sm, kv_load): the builds checked with ptxas.
PROJ_REG_BUILDS = [
    (2, 32, 2, "direct"),
    (1, 32, 2, "direct"),
    (2, 16, 3, "slabs"),
    (1, 16, 3, "direct"),
    (2, 64, 1, "direct"),
    (1, 64, 1, "slabs"),
]


def _proj_registers_config(block_g, ctas, kv_load="direct"):
    """proj_operands=registers over the Hopper default (flat kernel, wk=fp32, wk_stages 2)."""
    return {**_flat_config(block_g, ctas, "fp32", 2, kv_load), "proj_operands": "registers"}


@pytest.mark.parametrize("ratio, block_g, ctas, kv_load", PROJ_REG_BUILDS)
@pytest.mark.slow
def test_proj_registers_compiles_sm90_and_fits(ratio, block_g, ctas, kv_load, tmp_path):
    """Compiles at the 64K shape (the same kernel serves decode), one call of the register projection and no T.gemm,
    ldmatrix or Wk copies, the shared-memory model equals the launch, and ptxas keeps the registers within the
    occupancy without spilling."""
    cfg = _proj_registers_config(block_g, ctas, kv_load)
    kernel, src = _build_without_producer(ratio, cfg, ctas)
    assert kernel.csa2_wk == "fragments"
    assert src.count(f"csa2_proj_tf32x3_regs<{block_g // 16}, {512 + cp.ROT_PAD}>(") == 1
    assert "mma_sync<" not in src and "ldmatrix" not in src and "wk_lo[" not in src
    assert ("cp_async" in src) == (kv_load == "slabs")  # the Wk stages are gone; only the kv/gate slabs copy
    _assert_flat_build_fits(kernel, src, cfg, ratio, ctas, tmp_path)


def test_proj_registers_constraints_refuse():
    """Flat kernel, wk=fp32, no kv_load=whole, wk_stages 2, Hopper; unknown values refused with a reason; the kernel
    builder refuses the same; Hopper's default reads the operands from registers (session 8), a config that cannot falls back to shared memory."""
    space, r2, r1 = cp.COMPRESSOR.search_space(SM90), cp.COMPRESSOR.shape("prefill_r2_s64k"), cp.COMPRESSOR.shape("prefill_r1_s64k")
    assert {p.name: p.choices for p in space.params}["proj_operands"] == ("smem", "registers", "wgmma")
    assert cp.COMPRESSOR.default_config(SM90)["proj_operands"] == "registers"

    def why(cfg, sh=r2):
        return " | ".join(space.violations(cfg, sh, SM90))

    for ratio, block_g, ctas, kv_load in PROJ_REG_BUILDS:
        assert why(_proj_registers_config(block_g, ctas, kv_load), cp.COMPRESSOR.shape(f"decode_r{ratio}_b64")) == ""
    assert why(cp.COMPRESSOR.with_defaults(SM90, {"proj_operands": "registers"})) == ""
    # a config that picks what the register operands lack, without naming them, gets the shared-memory operands
    for picked in ({"wk": "hi_lo"}, {"wk_stages": 3}, {"load": "direct"}, {"schedule": "ws"}, {"kv_load": "whole"}):
        cfg = cp.COMPRESSOR.with_defaults(SM90, picked)
        assert cfg["proj_operands"] == "smem" and "proj_operands" not in why(cfg, r1), picked
    assert "unknown proj_operands" in why(_proj_registers_config(32, 2) | {"proj_operands": "bogus"})
    assert "wk=fp32" in why(_proj_registers_config(32, 2) | {"wk": "hi_lo"})
    assert "kv_load=whole" in why(_proj_registers_config(32, 2, "whole"), r1)
    assert "wk_stages" in why(_proj_registers_config(32, 2) | {"wk_stages": 3})
    assert "shared memory" in why(_proj_registers_config(32, 3))  # 84,992 B: two CTAs per SM
    assert "spills" in why(_proj_registers_config(16, 3))  # kv_load=direct at ratio 2, three CTAs
    one_cta = {**_default(), **ONE_CTA, "proj_operands": "registers"}
    assert "flat kernel" in why(one_cta)
    assert any("Hopper" in r for r in space.violations(_proj_registers_config(32, 2), r2, get_arch("sm80")))
    # the kernel builder: (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load)
    base = ("sm_90a", 2, 32, 256, "tf32x3", 16, "staged", "thresholds", 2, "fp32", "flat", 2, "direct")
    with pytest.raises(TileError, match="unknown proj_operands"):
        cp_kernel.compress_kernel(*base, "bogus")
    with pytest.raises(TileError, match="wk=fp32"):
        cp_kernel.compress_kernel(*base[:9], "hi_lo", *base[10:], "registers")
    with pytest.raises(TileError, match="no Wk stages"):
        cp_kernel.compress_kernel(*base[:11], 3, "direct", "registers")
    with pytest.raises(TileError, match="flat kernel"):
        cp_kernel.compress_kernel("sm_90a", 2, 32, 256, "tf32x3", 32, "staged", "thresholds", 1, "hi_lo", "ws", 2, "slabs", "registers")


def test_wk_fragment_order_is_what_the_kernel_reads():
    """The kernel's Wk addressing, restated: lane 4g + t of warp w reads float4s (w * 32 + c) * 64 + lane * 2 + n of
    chunk c, whose word ks * 2 + h must be Wk[16w + 8n + g, 16c + 8ks + 4h + t] (its B fragment: b0 = k t, b1 = k t + 4);
    and the launchers pass the reordered Wk in both slots."""
    w = torch.randn(128, 512)
    f = cp.wk_fragment_order(w).reshape(-1)
    assert torch.equal(f.sort().values, w.reshape(-1).sort().values)
    for warp, c, lane, n, ks, h in itertools.product(range(8), (0, 5, 31), range(32), range(2), range(2), range(2)):
        g, t = lane // 4, lane % 4
        word = (((warp * 32 + c) * 64) + lane * 2 + n) * 4 + ks * 2 + h
        assert f[word] == w[16 * warp + 8 * n + g, 16 * c + 8 * ks + 4 * h + t]

    class K:
        csa2_wk = "fragments"

    a, b = cp_launch.wk_args(K(), w)
    assert torch.equal(a, cp.wk_fragment_order(w)) and b.data_ptr() == a.data_ptr()


def test_proj_registers_fragment_reads_are_conflict_free():
    """The A fragment words a warp reads at once (rows g, columns t, +8 rows, +4 columns) sit in 32 distinct banks with
    rot_s's padded row stride (they all sat in 4 banks at 512 words), and the CUDA uses that stride."""
    rs = 512 + cp.ROT_PAD
    for dr, dc in itertools.product((0, 8), (0, 4)):
        banks = {((g + dr) * rs + t + dc) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32
    assert len({(g * 512 + t) % 32 for g in range(8) for t in range(4)}) == 4
    assert "g * RS + t" in cp_projection.PROJ_REGS_CUDA and "__syncthreads" not in cp_projection.PROJ_REGS_CUDA


# Configs run on the GPU: (label, block_g, ctas, kv_load).
PROJ_REG_GPU = [
    ("preg_mc2", 32, 2, "direct"),
    ("preg_mc3_slabs", 16, 3, "slabs"),
    ("preg_bg64", 64, 1, "direct"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("label, block_g, ctas, kv_load", PROJ_REG_GPU, ids=[c[0] for c in PROJ_REG_GPU])
def test_proj_registers_matches_reference(label, block_g, ctas, kv_load):
    """Against the torch reference (fp4-near-exact rule) at prefill 4K and 64K (both ratios), decode and odd shapes,
    and against the Hopper default: the main cache byte-identical (the latent's arithmetic is the default's; only
    rot_s's row stride differs), the index cache within the same rule of the default's (the projection issues the
    default's MMAs on the same operand bits in the same order; the k_norm sums its squares from k_s in another order)."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    cfg = _proj_registers_config(block_g, ctas, kv_load)
    for shape in _flat_shapes(kv_load):
        ev = evaluate(tile, shape, cfg, arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"
        inputs = tile.make_inputs(shape, 11, "cuda")
        base = tile.run(tile.build(shape, _default(arch), arch), inputs)
        new = tile.run(tile.build(shape, cfg, arch), inputs)
        for name in ("main_packed", "main_scales"):
            assert torch.equal(base[name], new[name]), f"{shape.name}: {name}"
        near = cp.compare_fp4_caches(new, base)
        assert near.ok, f"{shape.name}: {near}"


@pytest.mark.gpu
@pytest.mark.parametrize("label, block_g, ctas, kv_load", PROJ_REG_GPU, ids=[c[0] for c in PROJ_REG_GPU])
def test_proj_registers_decode_tail_and_repeatable(label, block_g, ctas, kv_load):
    """The decode tail state (ratio 2) gives the same entries as the whole group (and matches the reference), and two
    runs at 64K (both ratios) are bitwise equal."""
    tile = cp.COMPRESSOR
    cfg = _proj_registers_config(block_g, ctas, kv_load)
    _decode_tail_entries_equal(cfg)
    for shape in [tile.shape(n) for n in ("prefill_r2_s64k", "prefill_r1_s64k")]:
        _two_runs_bitwise_equal(shape, cfg)


def test_one_cta_shared_memory_keeps_clear_of_the_limit_below_256_threads():
    """block_g 32, k_chunk 32, staged, one CTA: fitted at 230,400 B; at 128 threads the kernel asked for 231,936 B and
    failed to launch on the H200 (results/sm90/tune_session8*/), at 256 threads the same size launches."""
    space, shape = cp.COMPRESSOR.search_space(SM90), cp.COMPRESSOR.shape("prefill_r2_s64k")
    cfg = {**_default(), **ONE_CTA, "load": "staged", "encode": "divide"}
    assert not [r for r in space.violations(cfg, shape, SM90) if "shared memory" in r]
    assert any("shared memory" in r for r in space.violations({**cfg, "threads": 128}, shape, SM90))


# ---------------------------------------------------------------------------------- pool_math
# Ratio 2's softmax over a group's two tokens: "ieee" (two accurate expf and two IEEE divisions, the reference's
# expression) or "fast" (t = __expf(min - max), one approximate reciprocal of 1 + t for both weights).

# (label, config over the Hopper default): the pooling's three load paths (direct registers, staged slabs, the one-CTA
# warp-specialised kernel's slabs).
POOL_FAST = [
    ("default", {"pool_math": "fast"}),  # Hopper's default: three CTAs of 16 groups, direct loads (session 9)
    ("two_ctas", {"pool_math": "fast", "block_g": 32, "ctas_per_sm": 2}),
    ("flat_slabs", {"pool_math": "fast", "kv_load": "slabs", "block_g": 32, "ctas_per_sm": 2}),
    ("one_cta", {**ONE_CTA, "pool_math": "fast", "proj_operands": "smem"}),
]


def test_pool_math_in_the_space_and_refused_when_unknown():
    """pool_math is a search-space parameter; Hopper's default is "fast" (measured on the H200, session 9), the archs
    where it was not measured keep the reference's expression; the kernel builder refuses an unknown value."""
    assert {p.name: p.choices for p in cp.COMPRESSOR.search_space(SM90).params}["pool_math"] == cp.POOL_MATHS
    assert cp.COMPRESSOR.default_config(SM90)["pool_math"] == "fast"
    for arch in ("sm80", "sm89"):
        assert cp.COMPRESSOR.default_config(get_arch(arch))["pool_math"] == "ieee"
    with pytest.raises(TileError, match="unknown pool_math"):
        cp.COMPRESSOR.build(cp.COMPRESSOR.shape("prefill_r2_s4k"), {"pool_math": "bogus"}, SM90)


@pytest.mark.parametrize("label, over", POOL_FAST, ids=[c[0] for c in POOL_FAST])
@pytest.mark.slow
def test_fast_pool_compiles_sm90_without_accurate_exp_or_division(label, over):
    """At ratio 2 the fast pooling has no expf and no IEEE division left in the kernel (the only ones were the
    pooling's), only __expf and __fdividef; at ratio 1 (nothing to pool) the source is the ieee build's."""
    tile = cp.COMPRESSOR
    r2, r1 = tile.shape("prefill_r2_s64k"), tile.shape("prefill_r1_s64k")
    assert tile.search_space(SM90).violations(tile.with_defaults(SM90, over), r2, SM90) == []
    full = tile.with_defaults(SM90, over)  # the layout named, so that pool_math alone differs
    ieee = tile.build(r2, {**full, "pool_math": "ieee"}, SM90).get_kernel_source()
    fast = tile.build(r2, full, SM90).get_kernel_source()
    assert re.search(r"[^_]expf\(", ieee) and "__expf(" not in ieee
    assert not re.search(r"[^_]expf\(", fast) and "__expf(" in fast and "__fdividef(" in fast
    same = [tile.build(r1, {**full, "pool_math": pm}, SM90).get_kernel_source() for pm in cp.POOL_MATHS]
    assert same[0] == same[1]
    if label == "flat_slabs":
        # TileLang's allocator overlaps the gate slabs with the projection's buffers here (12 KiB less than the ieee build,
        # which the model matches exactly): the model stays an upper bound, so the constraint refuses nothing that fits.
        cfg = tile.with_defaults(SM90, over)
        assert _dynamic_smem(tile.build(r2, cfg, SM90), 256) <= cp_space.smem_flat(cfg, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", POOL_FAST, ids=[c[0] for c in POOL_FAST])
def test_fast_pool_matches_reference(label, over):
    """Against the torch reference (fp4-near-exact rule) at ratio 2 (4K, 64K, decode, odd G), and against the same
    config with the reference's expression: within the same rule, with at most 1e-4 of the main cache's bytes
    different (a latent a few ulps off changes a code only on a rounding boundary)."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    shapes = [tile.shape(n) for n in ("prefill_r2_s4k", "prefill_r2_s64k", "decode_r2_b64")] + [s for s in ODD if s["ratio"] == 2]
    for shape in shapes:
        ev = evaluate(tile, shape, tile.with_defaults(arch, over), arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"
        inputs = tile.make_inputs(shape, 11, "cuda")
        base = tile.run(tile.build(shape, {**tile.with_defaults(arch, over), "pool_math": "ieee"}, arch), inputs)
        new = tile.run(tile.build(shape, over, arch), inputs)
        near = cp.compare_fp4_caches(new, base)
        assert near.ok, f"{shape.name}: {near}"
        differ = float((new["main_packed"] != base["main_packed"]).float().mean())
        assert differ <= 1e-4, f"{shape.name}: {differ:.2e} of the main cache's bytes differ"


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", POOL_FAST, ids=[c[0] for c in POOL_FAST])
def test_fast_pool_decode_tail_and_repeatable(label, over):
    """The decode tail state gives the same entries as the whole group (and matches the reference); two runs at 64K
    are bitwise equal."""
    cfg = cp.COMPRESSOR.with_defaults(SM90, over)
    _decode_tail_entries_equal(cfg)
    _two_runs_bitwise_equal(cp.COMPRESSOR.shape("prefill_r2_s64k"), cfg)


@pytest.mark.slow
def test_fast_pool_fits_three_ctas_with_direct_loads(tmp_path):
    """kv_load=direct at ratio 2 and 3 CTAs per SM: refused with the reference's pooling (ptxas spilled 36-40 bytes at
    the 80-register cap), accepted with pool_math=fast, whose build launches with the modelled shared memory and fits
    80 registers without spilling."""
    tile, shape = cp.COMPRESSOR, cp.COMPRESSOR.shape("prefill_r2_s64k")
    cfg = tile.with_defaults(SM90, {"block_g": 16, "ctas_per_sm": 3})
    assert cfg["kv_load"] == "direct" and cfg["pool_math"] == "fast" and cfg["proj_operands"] == "registers"
    why = tile.search_space(SM90).violations({**cfg, "pool_math": "ieee"}, shape, SM90)
    assert any("spills at 3 CTAs" in r for r in why), why
    kernel, src = _build_without_producer(2, cfg, 3)
    _assert_flat_build_fits(kernel, src, cfg, 2, 3, tmp_path)


# ---------------------------------------------------------------------------------- proj_accumulators
# The register projection with the small products (lo*hi, hi*lo) in a second accumulator: two independent MMA chains per
# output tile (at block_g 16 a warp has two tiles, each a chain of six dependent MMAs per k chunk with one accumulator).

SPLIT_ACC = [  # the tf32x3 projection's layouts (f16x3's: F16X3 below)
    ("default", {"proj_accumulators": "split", "proj": "tf32x3"}),  # three CTAs of 16 groups
    ("two_ctas", {"proj_accumulators": "split", "block_g": 32, "ctas_per_sm": 2, "proj": "tf32x3"}),
]


def test_split_accumulator_source_is_the_shared_template_with_a_second_accumulator():
    """The split variant is the shared template with only the accumulator lines changed: the same loads, splits and MMA
    operands in the same order, the small products into acc_s, both added at the store."""
    shared, split = cp_projection.PROJ_REGS_CUDA, cp_projection.split_accumulator_cuda()
    body = shared[shared.index("// rot: fp32") :]
    changed = [(a, b) for a, b in zip(body.splitlines(), split.splitlines()) if a != b]
    assert len(body.splitlines()) == len(split.splitlines())
    assert len(changed) == 7, changed  # name, declaration, zeroing, two MMA lines, two stores
    assert split.count("csa2_mma_tf32(acc_s[m][n]") == 2 and split.count("csa2_mma_tf32(acc[m][n]") == 1
    assert "csa2_split_tf32(float" not in split  # the helpers come once, from the shared template


@pytest.mark.parametrize("label, over", SPLIT_ACC, ids=[c[0] for c in SPLIT_ACC])
@pytest.mark.slow
def test_split_accumulators_compile_sm90_and_fit(label, over, tmp_path):
    """In the space at both ratios, refused without the register projection (and by the builder), the split function
    called, the shared memory as modelled and ptxas within the occupancy's registers without spilling."""
    tile = cp.COMPRESSOR
    cfg = tile.with_defaults(SM90, over)
    space = tile.search_space(SM90)
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        assert src.count(f"csa2_proj_tf32x3_regs_split<{cfg['block_g'] // 16}, {512 + cp.ROT_PAD}>(") == 1
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)
    smem_cfg = {**_default(), "proj_accumulators": "split"}
    assert any("proj_accumulators=split" in r for r in space.violations(smem_cfg, tile.shape("prefill_r2_s64k"), SM90))
    with pytest.raises(TileError, match="proj_accumulators"):
        tile.build(tile.shape("prefill_r2_s4k"), smem_cfg, SM90)


def _variant_matches_reference_and_base(cfg, base_over: dict, two_run_shapes=("prefill_r2_s64k",)) -> None:
    """A projection variant ``cfg`` (GPU): against the torch reference (fp4-near-exact rule) at 4K, 64K (both ratios),
    decode and odd shapes; the main cache byte-identical to ``cfg | base_over``'s (the projection does not touch it),
    the index cache within the rule of it; the decode tail state; two runs bitwise equal at ``two_run_shapes``."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    for shape in _flat_shapes("direct"):
        ev = evaluate(tile, shape, cfg, arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"
        inputs = tile.make_inputs(shape, 11, "cuda")
        base = tile.run(tile.build(shape, {**cfg, **base_over}, arch), inputs)
        new = tile.run(tile.build(shape, cfg, arch), inputs)
        for name in ("main_packed", "main_scales"):
            assert torch.equal(base[name], new[name]), f"{shape.name}: {name}"
        assert cp.compare_fp4_caches(new, base).ok, shape.name
    _decode_tail_entries_equal(cfg)
    for name in two_run_shapes:
        _two_runs_bitwise_equal(tile.shape(name), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", SPLIT_ACC, ids=[c[0] for c in SPLIT_ACC])
def test_split_accumulators_match_reference(label, over):
    """Against the torch reference and the shared accumulator's caches (the main cache byte-identical), the decode tail
    state and two runs bitwise equal (:func:`_variant_matches_reference_and_base`)."""
    _variant_matches_reference_and_base(cp.COMPRESSOR.with_defaults(get_arch("sm90"), over), {"proj_accumulators": "shared"})


# ---------------------------------------------------------------------------------- proj_operands="wgmma"
# The transposed projection on wgmma (PROJ_WGMMA_CUDA, sm_90a, block_g 16): Wk from registers as the register
# projection reads and splits it, the latent split once per CTA into wgmma's no-swizzle K-major shared layout (its high
# part over rot_s, its remainder in a [16, 512] buffer that k_s reuses), three wgmmas per k step of 8.

WGMMA = {"proj_operands": "wgmma"}  # over the Hopper default: three CTAs of 16 groups, direct loads


def test_proj_wgmma_in_the_space_and_refused_where_not_built():
    """In the space at both ratios over the default; refused (with the reason) at block_g 32, with split accumulators,
    without the flat kernel's register-projection prerequisites and off Hopper; the builder refuses the same."""
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2, r1 = tile.shape("prefill_r2_s64k"), tile.shape("prefill_r1_s64k")
    assert "wgmma" in {p.name: p.choices for p in space.params}["proj_operands"]
    cfg = tile.with_defaults(SM90, WGMMA)
    assert cfg["block_g"] == 16 and cfg["ctas_per_sm"] == 3

    def why(c, sh=r2, arch=SM90):
        return " | ".join(space.violations(c, sh, arch))

    assert why(cfg) == "" and why(cfg, r1) == ""
    assert "block_g 16" in why({**cfg, "block_g": 32, "ctas_per_sm": 2})
    assert "register projection only" in why({**cfg, "proj_accumulators": "split"})
    assert "wk=fp32" in why({**cfg, "wk": "hi_lo"}) and "wk_stages" in why({**cfg, "wk_stages": 3})
    assert "Hopper" in why(cfg, arch=get_arch("sm80"))
    assert "wgmma" in why(tile.with_defaults(get_arch("sm80"), WGMMA), arch=get_arch("sm80"))  # the one-CTA kernel there
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands, pool, acc)
    base = ["sm_90a", 2, 16, 256, "tf32x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct", "wgmma", "fast", "shared"]
    for i, value, message in ((2, 32, "block_g 16"), (0, "sm_89", "sm_90a"), (15, "split", "register projection only")):
        with pytest.raises(TileError, match=message):
            cp_kernel.compress_kernel(*base[:i], value, *base[i + 1 :])


def test_proj_wgmma_split_layout_is_what_the_descriptor_addresses():
    """The split's store offset of latent word (n, k) equals the address the wgmma descriptor gives it: no-swizzle
    K-major core matrices of 8 rows x 16 bytes, rows 16 B apart, 8-row blocks SBO = 128 B apart, k quads LBO = 16 N
    bytes apart, +32 N bytes per k step of 8; every word of the [16, 512] latent lands once."""
    n_groups = 16
    src = cp_projection.PROJ_WGMMA_CUDA
    assert "off = (((i / N) * (N / 8) + n / 8) * 8 + n % 8) * 4" in src and "csa2_wgmma_desc(rot, 16 * N)" in src
    assert "(uint64_t)" not in src and "(unsigned long long)(128 >> 4) << 32" in src
    assert "const unsigned long long step = (unsigned long long)((2 * c + ks) * 2 * N)" in src
    seen = set()
    for p, tid in itertools.product(range(n_groups * 128 // 256), range(256)):
        i = p * 256 + tid
        n, quad = i % n_groups, i // n_groups
        off_bytes = 4 * ((quad * (n_groups // 8) + n // 8) * 8 + n % 8) * 4
        for e in range(4):
            k = 4 * quad + e
            step, kk = divmod(k, 8)  # k step of the wgmma, column inside it
            desc = step * 32 * n_groups + (kk // 4) * 16 * n_groups + (n // 8) * 128 + (n % 8) * 16 + (kk % 4) * 4
            assert off_bytes + 4 * e == desc
            seen.add(desc)
    assert seen == set(range(0, n_groups * 512 * 4, 4))


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.slow
def test_proj_wgmma_compiles_sm90_and_fits(ratio, tmp_path):
    """Compiles at both ratios: one call of the wgmma projection, no mma.sync or ldmatrix, the latent's remainder and
    k_s in one buffer (the shared memory as modelled: 68,352 B, three CTAs per SM), ptxas within 80 registers without
    spilling and without serialising the wgmmas."""
    tile = cp.COMPRESSOR
    cfg = tile.with_defaults(SM90, WGMMA)
    kernel, src = _build_without_producer(ratio, cfg, 3)
    assert kernel.csa2_wk == "fragments"
    assert src.count("csa2_proj_tf32x3_wgmma<16, 516, 512>(") == 1
    assert "mma_sync<" not in src and "ldmatrix" not in src
    assert cp_space.smem_flat(cfg, ratio) == 68352
    log = _assert_flat_build_fits(kernel, src, cfg, ratio, 3, tmp_path)
    assert "Potential Performance Loss" not in log, log  # e.g. "wgmma.mma_async instructions are serialized"


@pytest.mark.gpu
@pytest.mark.parametrize("over", [WGMMA], ids=["default_layout"])
def test_proj_wgmma_matches_reference(over):
    """Against the torch reference and the register projection's caches (the main cache byte-identical; the index keys
    are the same products summed in the tensor cores' order), the decode tail state and two runs bitwise equal at both
    ratios (:func:`_variant_matches_reference_and_base`)."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), over)
    _variant_matches_reference_and_base(cfg, {"proj_operands": "registers"}, ("prefill_r2_s64k", "prefill_r1_s64k"))


# ---------------------------------------------------------------------------------- norm_pass="in_pool"
# kv_load=direct: the RMSNorm on the pooled rows in registers (one warp per row: lane l holds columns 128 j + 4 l..+3,
# a shuffle reduction) so that rot_s is written once, normalised, instead of a sum-of-squares pass over rot_s, a barrier
# and a read-scale-write pass.

IN_POOL = [
    ("default", {"norm_pass": "in_pool"}),  # three CTAs of 16 groups
    ("two_ctas", {"norm_pass": "in_pool", "block_g": 32, "ctas_per_sm": 2}),
]


def test_norm_in_pool_in_the_space_and_refused_without_direct_loads():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2, r1 = tile.shape("prefill_r2_s64k"), tile.shape("prefill_r1_s64k")
    assert {p.name: p.choices for p in space.params}["norm_pass"] == ("separate", "in_pool")
    assert cp.COMPRESSOR.default_config(SM90)["norm_pass"] == "in_pool"  # since session 10 (H200: faster at every shape)
    assert cp.COMPRESSOR.default_config(get_arch("sm80"))["norm_pass"] == "separate"
    for picked in ({"kv_load": "slabs"}, {"schedule": "ws"}, {"load": "direct"}):  # no direct loads: the separate passes
        assert tile.with_defaults(SM90, picked)["norm_pass"] == "separate", picked
    cfg = tile.with_defaults(SM90, {"norm_pass": "in_pool"})
    assert space.violations(cfg, r2, SM90) == [] and space.violations(cfg, r1, SM90) == []
    assert any("kv_load=direct" in r for r in space.violations({**cfg, "kv_load": "slabs"}, r2, SM90))
    assert any("unknown norm_pass" in r for r in space.violations({**cfg, "norm_pass": "bogus"}, r2, SM90))
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands, pool, acc)
    base = ["sm_90a", 2, 16, 256, "tf32x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "slabs", "registers", "fast", "shared"]
    with pytest.raises(TileError, match="kv_load='direct'"):
        cp_kernel.compress_kernel(*base, "in_pool")
    with pytest.raises(TileError, match="unknown norm_pass"):
        cp_kernel.compress_kernel(*base[:12], "direct", *base[13:], "bogus")


@pytest.mark.parametrize("label, over", IN_POOL, ids=[c[0] for c in IN_POOL])
@pytest.mark.slow
def test_norm_in_pool_compiles_sm90_and_fits(label, over, tmp_path):
    """Both ratios: the row sums are one warp-wide shuffle reduction per pooled row (no all-reduce through shared
    memory), the norm's own passes and their barrier are gone, and the build fits its CTAs (shared memory as modelled,
    ptxas within the occupancy's registers, no spills)."""
    tile = cp.COMPRESSOR
    cfg = tile.with_defaults(SM90, over)
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        _, separate = _build_without_producer(ratio, {**cfg, "norm_pass": "separate"}, cfg["ctas_per_sm"])
        assert "ss_f[0] = tl::AllReduce<tl::SumOp, 32, 1, 0" in src and "workspace" not in src
        assert src.count("__syncthreads()") == separate.count("__syncthreads()") - 1
        assert "inv_s" in separate and "inv_s" not in src
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", IN_POOL, ids=[c[0] for c in IN_POOL])
def test_norm_in_pool_matches_reference(label, over):
    """Against the torch reference (fp4-near-exact rule) at 4K, 64K (both ratios), decode and odd shapes, and within the
    same rule of the separate norm's caches (another summation order of the squares: the latent moves by a few ulps);
    the decode tail state and two runs bitwise equal."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    cfg = tile.with_defaults(arch, over)
    for shape in _flat_shapes("direct"):
        ev = evaluate(tile, shape, cfg, arch, seed=7, time_it=False)
        assert ev.outcome == OK, f"{shape.name}: {ev.message}"
        inputs = tile.make_inputs(shape, 11, "cuda")
        base = tile.run(tile.build(shape, {**cfg, "norm_pass": "separate"}, arch), inputs)
        assert cp.compare_fp4_caches(tile.run(tile.build(shape, cfg, arch), inputs), base).ok, shape.name
    _decode_tail_entries_equal(cfg)
    for shape in [tile.shape(n) for n in ("prefill_r2_s64k", "prefill_r1_s64k")]:
        _two_runs_bitwise_equal(shape, cfg)


# ---------------------------------------------------------------------------------- proj_k_split=2
# The register projection with K split between the CTA's two halves (PROJ_REGS_K2_CUDA): warp w covers k in
# [256 (w / 4), +256) for output columns [32 (w % 4), +32), reading and splitting half the latent (every warp read all
# of it), its Wk words in wk_fragment_order(Wk, 32); half 1 stores its sums into k_s, half 0 adds its own.

K_SPLIT = [  # the tf32x3 projection's layouts (f16x3's: F16X3 below)
    ("default", {"proj_k_split": 2, "proj": "tf32x3"}),  # three CTAs of 16 groups
    ("two_ctas", {"proj_k_split": 2, "block_g": 32, "ctas_per_sm": 2, "proj": "tf32x3"}),
]


def test_proj_k_split_in_the_space_and_refused_outside_the_register_projection():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    assert {p.name: p.choices for p in space.params}["proj_k_split"] == (1, 2)
    cfg = tile.with_defaults(SM90, {"proj_k_split": 2, "proj": "tf32x3"})

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    assert why(cfg) == ""
    assert "proj_k_split=2" in why({**cfg, "proj_accumulators": "split"})
    assert "proj_k_split=2" in why({**cfg, "proj_operands": "wgmma"})
    assert "unknown proj_k_split" in why({**cfg, "proj_k_split": 4})
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands, pool, acc, norm)
    base = ["sm_90a", 2, 16, 256, "tf32x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct", "registers", "fast", "split"]
    with pytest.raises(TileError, match="proj_k_split 2"):
        cp_kernel.compress_kernel(*base, "in_pool", 2)


def test_wk_fragment_order_k_split_is_what_the_kernel_reads():
    """The k-split kernel's Wk addressing, restated: lane 4g + t of column group cg reads float4s (cg * 32 + c) * 128 +
    lane * 4 + n of chunk c, whose word ks * 2 + h must be Wk[32 cg + 8n + g, 16c + 8ks + 4h + t]; the launchers pass it."""
    w = torch.randn(128, 512)
    f = cp.wk_fragment_order(w, 32).reshape(-1)
    for cg, c, lane, n, ks, h in itertools.product(range(4), (0, 15, 16, 31), range(32), range(4), range(2), range(2)):
        g, t = lane // 4, lane % 4
        word = ((cg * 32 + c) * 128 + lane * 4 + n) * 4 + ks * 2 + h
        assert f[word] == w[32 * cg + 8 * n + g, 16 * c + 8 * ks + 4 * h + t]
    src = cp_projection.PROJ_REGS_K2_CUDA
    assert "wp = reinterpret_cast<const float4*>(wkf) + cg * 32 * 128 + lane * 4" in src and "wp + nc * 128 + n" in src

    class K:
        csa2_wk = "fragments_k2"

    a, b = cp_launch.wk_args(K(), w)
    assert torch.equal(a, cp.wk_fragment_order(w, 32)) and b.data_ptr() == a.data_ptr()


@pytest.mark.parametrize("label, over", K_SPLIT, ids=[c[0] for c in K_SPLIT])
@pytest.mark.slow
def test_proj_k_split_compiles_sm90_and_fits(label, over, tmp_path):
    """Both ratios: the k-split function called once with the Wk in its order, the shared memory as modelled, ptxas
    within the occupancy's registers without spilling."""
    tile = cp.COMPRESSOR
    cfg = tile.with_defaults(SM90, over)
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        assert kernel.csa2_wk == "fragments_k2"
        assert src.count(f"csa2_proj_tf32x3_regs_k2<{cfg['block_g'] // 16}, {512 + cp.ROT_PAD}>(") == 1
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", K_SPLIT, ids=[c[0] for c in K_SPLIT])
def test_proj_k_split_matches_reference(label, over):
    """Against the torch reference and the one-half projection's caches (the main cache byte-identical), the decode tail
    state and two runs bitwise equal at both ratios (:func:`_variant_matches_reference_and_base`)."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), over)
    _variant_matches_reference_and_base(cfg, {"proj_k_split": 1}, ("prefill_r2_s64k", "prefill_r1_s64k"))


# ---------------------------------------------------------------------------------- main_pass="in_pool"
# With norm_pass="in_pool" the normalised rows are in registers (one warp per row): csa2_main_from_rows applies the RoPE,
# writes rot_s the final latent and encodes the main cache from them (the group max by two xor shuffles), replacing the
# RoPE, amax, scale and code passes over rot_s and their barriers. NOT yet run on a GPU (gpu/session.sh queued).

MAIN_IN_POOL = {"main_pass": "in_pool"}


def test_main_pass_in_the_space_and_refused_without_the_rows_in_registers():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    assert {p.name: p.choices for p in space.params}["main_pass"] == ("separate", "in_pool")
    assert tile.default_config(SM90)["main_pass"] == "separate"
    cfg = tile.with_defaults(SM90, MAIN_IN_POOL)

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    assert why(cfg) == ""
    assert "main_pass=in_pool" in why({**cfg, "norm_pass": "separate"}) and "main_pass=in_pool" in why({**cfg, "encode": "divide"})
    assert "unknown main_pass" in why({**cfg, "main_pass": "bogus"})
    assert tile.with_defaults(SM90, {"main_pass": "in_pool", "kv_load": "slabs"})["norm_pass"] == "separate"  # then refused
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands, pool, acc,
    #  norm, k_split)
    base = ["sm_90a", 2, 16, 256, "tf32x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct", "registers", "fast", "shared"]
    with pytest.raises(TileError, match="main_pass"):
        cp_kernel.compress_kernel(*base, "separate", 1, "in_pool")


def test_main_pass_in_pool_stores_the_latent_before_rope():
    """The index-K projection reads rot_s: csa2_main_from_rows (and its f16-split form) must store the row there before it
    rotates the RoPE pairs for the main cache (the official order: index keys from the unrotated latent)."""
    for src, store in (
        (cp_pool_encode.MAIN_FROM_ROWS_CUDA, "*reinterpret_cast<float4*>(rot_row"),
        (cp_pool_encode.main_from_rows_f16_split_cuda(), "csa2_store_f16_split(rot_row"),
    ):
        body = src[src.index("void csa2_main_from_rows") :]
        assert body.count(store) == 1 and body.index(store) < body.index("__fmaf_rn(ev, c0")


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.slow
def test_main_pass_in_pool_compiles_sm90_and_fits(ratio, tmp_path):
    """One call of csa2_main_from_rows per 8-row batch, the RoPE and encode passes gone (four barriers fewer than the
    separate passes: three between them, one before they restore the pre-RoPE dims), bytes_m stored unswizzled in one TMA store, the build within the default's shared memory and 80
    registers, no spills."""
    tile = cp.COMPRESSOR
    cfg = tile.with_defaults(SM90, MAIN_IN_POOL)
    kernel, src = _build_without_producer(ratio, cfg, 3)
    _, separate = _build_without_producer(ratio, {**cfg, "main_pass": "separate"}, 3)
    assert src.count("csa2_main_from_rows((&(pooled_f[0]))") == 1
    # the RoPE rounded as the separate pass's compiles (left to nvcc it fused the other product: rare code differences)
    assert "__fmaf_rn(od, c0, __fmul_rn(ev, s0))" in src and "__fmaf_rn(ev, c0, -__fmul_rn(od, s0))" in src
    assert "csa2_e2m1_pair_bounded(((float*)rot_s)" in separate and "csa2_e2m1_pair_bounded(((float*)rot_s)" not in src
    assert src.count("__syncthreads()") == separate.count("__syncthreads()") - 4
    assert src.count("tl::tma_store(main_packed_desc") == 1
    _assert_flat_build_fits(kernel, src, cfg, ratio, 3, tmp_path)


MAIN_IN_POOL_LAYOUTS = [("three_ctas_of_16", {}), ("two_ctas_of_32_k_split", {"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2})]


@pytest.mark.gpu
@pytest.mark.parametrize("label, layout", MAIN_IN_POOL_LAYOUTS, ids=[c[0] for c in MAIN_IN_POOL_LAYOUTS])
def test_main_pass_in_pool_matches_reference(label, layout):
    """Against the torch reference and the separate passes' caches (the main cache expected byte-identical: the same
    RoPE, max, scale and code expressions, rounded alike), the decode tail state and two runs bitwise equal at both
    ratios; in the default layout and in the two-CTA k-split one (a tuning candidate)."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), {**layout, **MAIN_IN_POOL})
    _variant_matches_reference_and_base(cfg, {"main_pass": "separate"}, ("prefill_r2_s64k", "prefill_r1_s64k"))


# ---------------------------------------------------------------------------------- proj="f16x3"
# The register projection's three products in fp16 on m16n8k16 (PROJ_F16X3_CUDA): the latent split into fp16 pairs in
# the kernel, Wk scaled by a power of two and split on the host (wk_fragment_order_f16), half the MMAs of tf32x3.

F16X3 = [
    ("three_ctas_of_16", {"proj": "f16x3"}),
    ("two_ctas_of_32_k_split_main_in_pool", {"proj": "f16x3", "block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2, "main_pass": "in_pool"}),
    ("two_ctas_of_32_split_accumulators", {"proj": "f16x3", "block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split"}),
]


@pytest.mark.parametrize("columns", [16, 32])
def test_wk_fragment_order_f16_is_what_the_kernel_reads(columns):
    """The kernel's Wk addressing, restated: lane 4g + t of column group cg reads uint4 ((cg * 32 + c) * NT + n) * 32 +
    lane of chunk c and n tile n, whose halves (part, j, p) must be part (hi, lo) of W[columns cg + 8n + g, 16c + 8j + 2t + p], W = Wk
    2^e with max |W| in [2^13, 2^14); hi + lo is W to 2^-22; the unscale is 2^-e; the launchers pass both."""
    w = torch.randn(128, 512) * 3e-3  # small weights: unscaled, their fp16 remainders would be subnormal
    frags, unscale = cp_projection.wk_fragment_order_f16(w, columns)
    assert frags.shape == (128, 512) and frags.dtype == torch.float32 and unscale.shape == (128, 512)
    e = -int(torch.log2(unscale[0, 0]))
    assert torch.all(unscale == unscale[0, 0]) and 2**13 <= float(w.abs().max()) * 2**e < 2**14
    halves = frags.reshape(-1).view(torch.float16)
    nt = columns // 8
    scaled = w * 2.0**e
    for cg, c, lane, n, j, p in itertools.product(range(128 // columns), (0, 17, 31), range(32), range(nt), range(2), range(2)):
        g, t = lane // 4, lane % 4
        base = (((cg * 32 + c) * nt + n) * 32 + lane) * 8 + j * 2 + p  # part hi; lo is 4 halves further
        x = scaled[columns * cg + 8 * n + g, 16 * c + 8 * j + 2 * t + p]
        hi, lo = halves[base], halves[base + 4]
        assert hi == x.half() and lo == (x - hi.float()).half()
    recon = (halves.view(-1, 2, 2, 2)[:, 0].float() + halves.view(-1, 2, 2, 2)[:, 1].float()).reshape(-1)
    assert torch.allclose(recon.sort().values, scaled.reshape(-1).sort().values, rtol=2.0**-21, atol=0)
    src = cp_projection.PROJ_F16X3_CUDA
    assert "reinterpret_cast<const uint4*>(wkf) + cg * 32 * NT * 32 + lane;" in src and "wp + (nc * NT + n) * 32" in src
    zero, u0 = cp_projection.wk_fragment_order_f16(torch.zeros(128, 512), columns)
    assert torch.all(zero == 0) and float(u0[0, 0]) == 1.0

    class K:
        csa2_wk = "fragments_f16_k2" if columns == 32 else "fragments_f16"

    a, b = cp_launch.wk_args(K(), w)
    assert torch.equal(a, frags) and torch.equal(b, unscale)


def _emulated_projection(latent: torch.Tensor, wk: torch.Tensor, proj: str) -> torch.Tensor:
    """latent fp32 [G, 512] @ wk^T fp32 [128, 512] with the operands the tensor cores see, products summed in fp64."""
    if proj == "tf32x3":

        def tf32(t):  # the 19 bits the tensor core reads
            return (t.view(torch.int32) & -8192).view(torch.float32)

        ah, bh = tf32(latent), tf32(wk)
        al, bl = tf32(latent - ah), tf32(wk - bh)
        unscale = 1.0
    else:
        frags, u = cp_projection.wk_fragment_order_f16(wk, 16)
        unscale = float(u[0, 0])
        halves = frags.reshape(-1).view(torch.float16).view(128 // 16, 32, 2, 8, 4, 2, 2, 2)  # (cg, c, n, g, t, part, j, p)
        parts = halves.permute(5, 0, 2, 3, 1, 6, 4, 7).reshape(2, 128, 512)  # (part, cg, n, g, c, j, t, p): W's rows, k
        bh, bl = parts[0], parts[1]
        ah = latent.half()
        al = (latent - ah.float()).half()
    a_hi, a_lo, b_hi, b_lo = (x.double() for x in (ah, al, bh, bl))
    return (a_lo @ b_hi.t() + a_hi @ b_lo.t() + a_hi @ b_hi.t()) * unscale


@pytest.mark.parametrize("wk_std", [512**-0.5, 1e-3, 30.0])
def test_f16x3_projection_as_accurate_as_tf32x3(wk_std):
    """The operands of proj="f16x3" (emulated on the CPU: the fp16 split, the host's scaled Wk fragments read back in
    the kernel's order) give index keys at least as close to the fp64 product as tf32x3's, at Wk scales where an
    unscaled fp16 remainder would be subnormal (1e-3) or the high part large (30), and the same index codes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 512, generator=gen)
    latent = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * (1 + 0.1 * torch.randn(512, generator=gen))
    wk = torch.randn(128, 512, generator=gen) * wk_std
    exact = latent.double() @ wk.double().t()
    err = {p: float((_emulated_projection(latent, wk, p) - exact).norm() / exact.norm()) for p in ("tf32x3", "f16x3")}
    assert err["f16x3"] <= err["tf32x3"] and err["f16x3"] < 2e-7, err
    codes = {p: formats.fp4_quantize(_emulated_projection(latent, wk, p).float(), 32, "e8m0")[0] for p in ("tf32x3", "f16x3")}
    ref = formats.fp4_quantize(exact.float(), 32, "e8m0")[0]
    assert float((codes["f16x3"] != ref).float().mean()) <= max(float((codes["tf32x3"] != ref).float().mean()), 1e-5)


def test_f16x3_in_the_space_and_refused_outside_the_register_projection():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    assert {p.name: p.choices for p in space.params}["proj"] == ("tf32x3", "f16x3", "simt")

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    for _, over in F16X3:
        assert why(tile.with_defaults(SM90, over)) == "", over
    cfg = tile.with_defaults(SM90, {"proj": "f16x3"})
    assert "proj=f16x3" in why({**cfg, "proj_operands": "smem"}) and "proj=f16x3" in why({**cfg, "proj_operands": "wgmma"})
    assert "proj=f16x3" in why({**_default(), **ONE_CTA, "proj": "f16x3"})
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands)
    base = ["sm_90a", 2, 16, 256, "f16x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct"]
    for operands in ("smem", "wgmma"):
        with pytest.raises(TileError, match="proj='f16x3'"):
            cp_kernel.compress_kernel(*base, operands)


@pytest.mark.parametrize("label, over", F16X3, ids=[c[0] for c in F16X3])
@pytest.mark.slow
def test_f16x3_compiles_sm90_and_fits(label, over, tmp_path):
    """Both ratios: the f16x3 projection called once with its layout's template arguments, no TF32 MMA left, the Wk in its
    fp16 fragment order, the shared memory as modelled (rows padded to 520 words), ptxas within the occupancy's
    registers without spilling."""
    cfg = cp.COMPRESSOR.with_defaults(SM90, over)
    k_split, split = cfg["proj_k_split"], "true" if cfg["proj_accumulators"] == "split" else "false"
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        assert kernel.csa2_wk == ("fragments_f16_k2" if k_split == 2 else "fragments_f16")
        assert (
            src.count(f"csa2_proj_f16x3_regs<{cfg['block_g'] // 16}, {512 + cp_projection.ROT_PAD_F16X3}, {k_split}, {split}, false>(") == 1
        )
        assert "m16n8k8" not in src and "m16n8k16.row.col.f32.f16.f16.f32" in src
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label, over", F16X3, ids=[c[0] for c in F16X3])
def test_f16x3_matches_reference(label, over):
    """Against the torch reference and tf32x3's caches in the same layout (the main cache byte-identical: the projection
    does not touch it; the index cache within the rule), the decode tail state and two runs bitwise equal at both
    ratios (:func:`_variant_matches_reference_and_base`)."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), over)
    _variant_matches_reference_and_base(cfg, {"proj": "tf32x3"}, ("prefill_r2_s64k", "prefill_r1_s64k"))


# ---------------------------------------------------------------------------------- proj_latent="f16_split"
# The main pass (main_pass="in_pool") stores the final latent once as fp16 high parts and remainders; the f16x3
# projection reads them by ldmatrix instead of every warp splitting the fp32 words it reads.

F16_SPLIT = {"proj": "f16x3", "proj_latent": "f16_split", "main_pass": "in_pool"}
F16_SPLIT_LAYOUTS = [
    ("three_ctas_of_16", {}),
    ("two_ctas_of_32", {"block_g": 32, "ctas_per_sm": 2}),
    ("two_ctas_of_32_k_split", {"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2}),
    ("two_ctas_of_32_split_accumulators", {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split"}),
]


def test_f16_split_in_the_space_and_refused_without_its_prerequisites():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    assert {p.name: p.choices for p in space.params}["proj_latent"] == ("fp32", "f16_split")
    assert tile.default_config(SM90)["proj_latent"] == "fp32"

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    for _, layout in F16_SPLIT_LAYOUTS:
        assert why(tile.with_defaults(SM90, {**layout, **F16_SPLIT})) == "", layout
    cfg = tile.with_defaults(SM90, F16_SPLIT)
    assert "proj_latent=f16_split" in why({**cfg, "main_pass": "separate"})
    assert "proj_latent=f16_split" in why({**cfg, "proj": "tf32x3"})
    assert "unknown proj_latent" in why({**cfg, "proj_latent": "bf16"})
    # (target, ratio, block_g, threads, proj, k_chunk, load, encode, ctas, wk, schedule, stages, kv_load, operands, pool, acc,
    #  norm, k_split, main_pass, proj_latent)
    base = ["sm_90a", 2, 16, 256, "f16x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct", "registers", "fast", "shared"]
    with pytest.raises(TileError, match="proj_latent"):
        cp_kernel.compress_kernel(*base, "in_pool", 1, "separate", "f16_split")
    with pytest.raises(TileError, match="proj_latent"):
        cp_kernel.compress_kernel(*base[:4], "tf32x3", *base[5:], "in_pool", 1, "in_pool", "f16_split")


@pytest.mark.parametrize("label, layout", F16_SPLIT_LAYOUTS, ids=[c[0] for c in F16_SPLIT_LAYOUTS])
@pytest.mark.slow
def test_f16_split_compiles_sm90_and_fits(label, layout, tmp_path):
    """Both ratios: the main pass's split store and the projection's ldmatrix reads (PRESPLIT), no split left in the
    projection's call, rows of 516 words (1032 halves), the shared memory as modelled, ptxas within the occupancy without
    spilling."""
    cfg = cp.COMPRESSOR.with_defaults(SM90, {**layout, **F16_SPLIT})
    split = "true" if cfg["proj_accumulators"] == "split" else "false"
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        assert src.count("csa2_main_from_rows_f16((&(pooled_f[0]))") == 1 and "csa2_main_from_rows((&" not in src
        assert src.count(f"csa2_proj_f16x3_regs<{cfg['block_g'] // 16}, 516, {cfg['proj_k_split']}, {split}, true>(") == 1
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)
    rows = cp_pool_encode.main_from_rows_f16_split_cuda()
    assert "csa2_store_f16_split(rot_row, 128 * j + 4 * lane" in rows and "float4*>(rot_row" not in rows


@pytest.mark.gpu
@pytest.mark.parametrize("label, layout", F16_SPLIT_LAYOUTS, ids=[c[0] for c in F16_SPLIT_LAYOUTS])
def test_f16_split_equals_the_per_warp_split(label, layout):
    """Both caches bit-identical to proj_latent="fp32" in the same layout (the same split of the same words, the same
    MMAs in the same order), at both ratios' 4K and 64K shapes and the decode shapes; and against the reference."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), {**layout, **F16_SPLIT})
    _assert_caches_equal_to(cfg, {**cfg, "proj_latent": "fp32"})


def _assert_caches_equal_to(cfg: dict, base_cfg: dict) -> None:
    """``cfg`` right against the reference and its four caches bit-identical to ``base_cfg``'s on the same inputs, at both
    ratios' 4K and 64K prefill shapes and the decode shapes (whose last CTA has rows past G)."""
    arch, tile = get_arch("sm90"), cp.COMPRESSOR
    for name in ("prefill_r2_s4k", "prefill_r2_s64k", "prefill_r1_s64k", "decode_r2_b64", "decode_r1_b64"):
        shape = tile.shape(name)
        ev = evaluate(tile, shape, cfg, arch, seed=5, time_it=False)
        assert ev.outcome == OK, f"{name}: {ev.message}"
        inputs = tile.make_inputs(shape, 13, "cuda")
        base = tile.run(tile.build(shape, base_cfg, arch), inputs)
        new = tile.run(tile.build(shape, cfg, arch), inputs)
        for out in ("main_packed", "main_scales", "idx_packed", "idx_scales"):
            assert torch.equal(base[out], new[out]), f"{name}: {out}"


# ---------------------------------------------------------------------------------- proj_out / main_store
# proj_out="rot_s": the f16x3 projection writes the index keys over rot_s's first 128 columns after a barrier (no k_s);
# main_store="registers": the main pass writes the main cache's bytes and scales from registers into the caches (no
# bytes_m / sbyte_m, no bulk stores). Together they fit three CTAs of 32 groups an SM.

COMPACT = {"proj_out": "rot_s", "main_store": "registers"}
COMPACT_LAYOUTS = [
    ("three_ctas_of_32", {"block_g": 32, "ctas_per_sm": 3, **F16_SPLIT, **COMPACT}),
    ("three_ctas_of_32_fp32_latent", {"block_g": 32, "ctas_per_sm": 3, "main_pass": "in_pool", **COMPACT}),
    ("two_ctas_of_32_main_store", {"block_g": 32, "ctas_per_sm": 2, **F16_SPLIT, "main_store": "registers"}),
    ("two_ctas_of_32_proj_out", {"block_g": 32, "ctas_per_sm": 2, **F16_SPLIT, "proj_out": "rot_s"}),
    ("three_ctas_of_16", {**F16_SPLIT, **COMPACT}),
]


def test_compact_options_in_the_space_and_refused_without_their_prerequisites():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    choices = {p.name: p.choices for p in space.params}
    assert choices["proj_out"] == ("k_s", "rot_s") and choices["main_store"] == ("bulk", "registers")
    assert {k: tile.default_config(SM90)[k] for k in COMPACT} == {"proj_out": "k_s", "main_store": "bulk"}

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    for _, layout in COMPACT_LAYOUTS:
        assert why(tile.with_defaults(SM90, layout)) == "", layout
    three = tile.with_defaults(SM90, COMPACT_LAYOUTS[0][1])
    # Either saving alone leaves three CTAs of 32 over the shared memory of an SM.
    assert "shared memory" in why({**three, "proj_out": "k_s"}) and "shared memory" in why({**three, "main_store": "bulk"})
    assert "proj_out=rot_s" in why({**three, "proj": "tf32x3", "proj_latent": "fp32"})
    assert "spill" in why({**three, "proj_accumulators": "split"}) and "spill" in why({**three, "proj_k_split": 2})
    assert "main_store=registers" in why(tile.with_defaults(SM90, {"main_store": "registers"}))
    assert "unknown proj_out" in why({**three, "proj_out": "k"}) and "unknown main_store" in why({**three, "main_store": "tma"})
    base = ["sm_90a", 2, 32, 256, "f16x3", 16, "staged", "thresholds", 3, "fp32", "flat", 2, "direct", "registers", "fast", "shared"]
    with pytest.raises(TileError, match="main_store"):
        cp_kernel.compress_kernel(*base, "in_pool", 1, "separate", "fp32", "k_s", "registers")
    with pytest.raises(TileError, match="proj_out"):
        cp_kernel.compress_kernel(*base[:4], "tf32x3", *base[5:], "in_pool", 1, "in_pool", "fp32", "rot_s", "bulk")


@pytest.mark.parametrize("label, layout", COMPACT_LAYOUTS, ids=[c[0] for c in COMPACT_LAYOUTS])
@pytest.mark.slow
def test_compact_options_compile_sm90_and_fit(label, layout, tmp_path):
    """Both ratios: the projection's OVER_ROT argument exactly when proj_out=rot_s; with main_store=registers the main
    pass's rows go to the caches (no bulk store of the main cache left) and the shared memory is as modelled; ptxas
    within the occupancy's registers (80 at three CTAs of 32) without spilling."""
    cfg = cp.COMPRESSOR.with_defaults(SM90, layout)
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        call = src[src.index("csa2_proj_f16x3_regs<") :].split(">(", 1)[0]
        assert call.count(",") == (5 if cfg["proj_out"] == "rot_s" else 4) and call.endswith("true"), call  # OVER_ROT last
        direct = cfg["main_store"] == "registers"
        assert ("(&(main_packed[" in src) == direct and ("(&(main_scales[" in src) == direct
        assert ("bytes_m" in src) != direct
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label, layout", COMPACT_LAYOUTS, ids=[c[0] for c in COMPACT_LAYOUTS])
def test_compact_options_equal_the_shared_buffers(label, layout):
    """Both caches bit-identical to proj_out=k_s / main_store=bulk in the same layout at two CTAs per SM (the same
    arithmetic; only where the keys and the main bytes are kept differs), at both ratios' 4K and 64K shapes and the
    decode shapes (a last CTA with rows past G: none of them may be stored); and against the reference."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), layout)
    _assert_caches_equal_to(cfg, {**cfg, "proj_out": "k_s", "main_store": "bulk", "ctas_per_sm": 2 if cfg["block_g"] == 32 else 3})


# ---------------------------------------------------------------------------------- proj_pipeline="deep"
# The f16x3 projection over the split-once latent with Wk four chunks ahead in a ring and the latent one chunk ahead
# (PROJ_F16X3_DEEP_CUDA): the same MMAs in the same order as the default schedule.

DEEP = {**F16_SPLIT, "proj_pipeline": "deep"}
DEEP_LAYOUTS = [
    ("two_ctas_of_32", {"block_g": 32, "ctas_per_sm": 2, **DEEP}),
    ("two_ctas_of_32_split_accumulators", {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split", **DEEP}),
    ("three_ctas_of_32", {"block_g": 32, "ctas_per_sm": 3, **COMPACT, **DEEP}),
    ("three_ctas_of_16", {**COMPACT, **DEEP}),
]


def test_deep_pipeline_in_the_space_and_refused_without_its_prerequisites():
    tile, space = cp.COMPRESSOR, cp.COMPRESSOR.search_space(SM90)
    r2 = tile.shape("prefill_r2_s64k")
    assert {p.name: p.choices for p in space.params}["proj_pipeline"] == ("near", "deep")
    assert tile.default_config(SM90)["proj_pipeline"] == "near"

    def why(c):
        return " | ".join(space.violations(c, r2, SM90))

    for _, layout in DEEP_LAYOUTS:
        assert why(tile.with_defaults(SM90, layout)) == "", layout
    cfg = tile.with_defaults(SM90, DEEP_LAYOUTS[0][1])
    assert "proj_pipeline=deep" in why({**cfg, "proj_latent": "fp32"}) and "proj_pipeline=deep" in why({**cfg, "proj_k_split": 2})
    assert "unknown proj_pipeline" in why({**cfg, "proj_pipeline": "far"})
    base = ["sm_90a", 2, 32, 256, "f16x3", 16, "staged", "thresholds", 2, "fp32", "flat", 2, "direct", "registers", "fast", "shared"]
    with pytest.raises(TileError, match="proj_pipeline"):
        cp_kernel.compress_kernel(*base, "in_pool", 1, "in_pool", "fp32", "k_s", "bulk", "deep")


@pytest.mark.parametrize("label, layout", DEEP_LAYOUTS, ids=[c[0] for c in DEEP_LAYOUTS])
@pytest.mark.slow
def test_deep_pipeline_compiles_sm90_and_fits(label, layout, tmp_path):
    """Both ratios: the deep projection called once in place of the default one, the shared memory as modelled (the same
    buffers), ptxas within the occupancy's registers without spilling (three CTAs included)."""
    cfg = cp.COMPRESSOR.with_defaults(SM90, layout)
    for ratio in (2, 1):
        kernel, src = _build_without_producer(ratio, cfg, cfg["ctas_per_sm"])
        assert (
            src.count(f"csa2_proj_f16x3_regs_deep<{cfg['block_g'] // 16}, 516, ") == 1
            and "csa2_proj_f16x3_regs<" not in src.split("extern")[-1]
        )
        _assert_flat_build_fits(kernel, src, cfg, ratio, cfg["ctas_per_sm"], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("label, layout", DEEP_LAYOUTS, ids=[c[0] for c in DEEP_LAYOUTS])
def test_deep_pipeline_equals_the_near_one(label, layout):
    """Both caches bit-identical to proj_pipeline="near" in the same layout (the same MMAs on the same operands in the
    same order), at both ratios' 4K and 64K shapes and the decode shapes; and against the reference."""
    cfg = cp.COMPRESSOR.with_defaults(get_arch("sm90"), layout)
    _assert_caches_equal_to(cfg, {**cfg, "proj_pipeline": "near"})


@pytest.mark.parametrize("ratio", [2, 1])
@pytest.mark.slow
def test_direct_rows_stream_past_l1_at_two_ctas_an_sm_only(ratio):
    """kv_load="direct" with norm_pass="in_pool": at two CTAs an SM every kv/gate row loads through
    csa2_load_row_stream (ld.global.nc.L1::no_allocate; none of TileLang's plain float4 loads of kv or gate is left);
    at three CTAs an SM the plain loads stay (the helper made ptxas spill within 80 registers at ratio 2, H200 session
    31). The registers and spills of these builds are checked by the compile-and-fit tests above."""
    tile = cp.COMPRESSOR
    shape = tile.shape(f"prefill_r{ratio}_s64k")
    two = tile.with_defaults(SM90, {"block_g": 32, "ctas_per_sm": 2, "main_pass": "in_pool", "proj_latent": "f16_split"})
    three = tile.with_defaults(SM90, {})
    assert two["kv_load"] == three["kv_load"] == "direct" and two["norm_pass"] == three["norm_pass"] == "in_pool"
    assert (two["ctas_per_sm"], three["ctas_per_sm"]) == (2, 3)
    rows = 4 if ratio == 2 else 1  # row loads per warp and batch: kv and gate of the group's two tokens; ratio 1: one kv row
    plain_load = re.compile(r"\*\(float4\*\)\((kv|gate) \+")
    streamed = tile.build(shape, two, SM90).get_kernel_source().split("extern")[-1]
    assert streamed.count("csa2_load_row_stream(") == rows and not plain_load.search(streamed)
    plain = tile.build(shape, three, SM90).get_kernel_source()
    assert "csa2_load_row_stream" not in plain and len(plain_load.findall(plain)) == rows
