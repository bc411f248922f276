"""FP4 quantise/dequantise tiles: compile for sm80/sm89/sm90 on the CPU, the threshold and decode arithmetic checked
exhaustively on the CPU; bit-exact with model.formats on the GPU for every structural option."""

from __future__ import annotations

import contextlib
import inspect
import re
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch
from cuda_source import cuda_function as _cuda_function
from cuda_source import source_text as _source_text

from model import formats
from tiles import fp4
from tiles.core.arch import detect, get_arch
from tiles.core.contract import Shape, TileError
from tiles.core.registry import get_tile

FP4_TILES = ["fp4_quant_main", "fp4_quant_index", "fp4_dequant_main", "fp4_dequant_index"]
FORMATS = [(16, "e4m3", fp4.MAIN_DIM), (32, "e8m0", fp4.INDEX_DIM)]


# The structural options each GPU test runs: every mapping, code and chunk count (the other params at their defaults).
QUANT_OPTIONS = [{"mapping": "lanes", "code": code, "chunks_per_thread": chunks} for code in fp4.CODES for chunks in (1, 2, 4)] + [
    {"mapping": "thread", "code": code} for code in ("thresholds", "divide")
]
DEQUANT_OPTIONS = [{"mapping": "lanes", "chunks_per_thread": chunks} for chunks in (1, 2, 4)] + [{"mapping": "thread"}]


def _options(name: str) -> list[dict]:
    if name == "fp4_quant_index":  # code='packed' is E4M3-only
        return [c for c in QUANT_OPTIONS if c["code"] != "packed"]
    return QUANT_OPTIONS if name.startswith("fp4_quant") else DEQUANT_OPTIONS


def _option_id(config: dict) -> str:
    return "-".join(str(v) for v in config.values())


TILE_OPTIONS = [pytest.param(name, c, id=f"{name}-{_option_id(c)}") for name in FP4_TILES for c in _options(name)]


def _small(tile) -> Shape:
    return tile.shape("decode_b64")


def _kernel_body(src: str) -> str:
    """The CUDA source from the kernel definition on, comments dropped."""
    return re.sub(r"/\*.*?\*/", "", src[src.index("__global__ void __launch_bounds__") :])


def _float_divisions(body: str) -> list[str]:
    """Divisions other than the scale's ``amax / 6`` and integer index arithmetic."""
    return re.findall(r" / (?!0x1\.8p\+2f\b|\(?\d+\)?\b)[^;]*", body)


def _assert_body_follows_config(tile, config: dict, body: str) -> None:
    """The kernel ``body`` (:func:`_kernel_body`) is the one ``config`` (a full config) describes: its block size, its
    grid (a grid-stride loop when persistent), its staging (buffers in shared memory and barriers, or neither), the
    groups or chunks each thread loops over, and for the lanes mapping the shuffles and vector moves it is for; for a
    quantiser, the code's own instructions (the packed helper, the seven thresholds, or IEEE division for E4M3)."""
    assert f"__launch_bounds__({config['threads']}, 1)" in body
    persistent = re.search(r"for \(int step = 0; step < \(\(rows \+ \d+\) / \d+\); \+\+step\)", body)
    assert bool(persistent) == (config["grid"] == "persistent"), "a persistent grid strides over the rows"
    shared = config["staging"] == "shared"
    assert ("buf_dyn_shmem" in body, "__syncthreads()" in body) == (shared, shared), "staging=shared: shared buffers and barriers"
    lanes, quant = config["mapping"] == "lanes", "code" in config
    per_thread = config["chunks_per_thread"] if lanes else config["groups_per_thread"]
    assert re.findall(r"for \(int g = 0; g < (\d+); \+\+g\)", body) == ([str(per_thread)] if per_thread > 1 else [])
    if lanes:
        # the group amax over 2 (E4M3) or 4 (E8M0) lanes: one or two butterfly steps; dequant needs no exchange
        assert body.count("__shfl_xor_sync") == ((tile.group // fp4.LANE_VALUES).bit_length() - 1 if quant else 0)
        wide = r"\*\(uint4\*\)\(xin \+ .*\) = \*\(uint4\*\)\(X " if quant else r"\*\(uint4\*\)\(Y .*\) = \*\(uint4\*\)\(yo "
        assert re.search(wide, body), "the bf16 side moves as one 16-byte vector per lane and chunk"
        packed = r"\*\(uint\*\)\(P .*\) = \*\(uint\*\)\(pk " if quant else r"\*\(uint\*\)\(pk .*\) = \*\(uint\*\)\(P "
        assert re.search(packed, body), "the 4 packed bytes of a chunk move as one 32-bit word"
    if quant:
        # E8M0's divide path multiplies by the exact 2^-e already; E4M3's divides per value
        divides = config["code"] == "divide" and tile.scale_format == "e4m3"
        assert bool(_float_divisions(body)) == divides, _float_divisions(body)
        assert ("csa2_fp4_codes8_bf16(" in body) == (config["code"] == "packed")
        assert ("thr[7]" in body) == (config["code"] == "thresholds")


# --- CPU: compile, search space, inputs, argument checks --------------------------------
@pytest.mark.parametrize("arch", ["sm90", "sm89", "sm80"])
@pytest.mark.parametrize("name", FP4_TILES)
def test_compiles_default_config(name, arch):
    tile, a = get_tile(name), get_arch(arch)
    kernel = tile.build(_small(tile), tile.default_config(a), a)
    src = kernel.get_kernel_source()
    # exactness needs IEEE division and kept denormals: no fast-math intrinsics in the source
    assert "__fdividef" not in src and "__frcp" not in src and "__expf" not in src
    _assert_body_follows_config(tile, tile.default_config(a), _kernel_body(src))


@pytest.mark.parametrize("arch", ["sm90", "sm89", "sm80"])
@pytest.mark.parametrize("name, option", TILE_OPTIONS)
@pytest.mark.slow
def test_compiles_every_option(name, option, arch):
    """Each new option compiles per arch, and the source has what it is for: shuffles, 16-byte vectors, the code's own
    instructions, the loop over its chunks (:func:`_assert_body_follows_config`)."""
    tile, a = get_tile(name), get_arch(arch)
    config = {**tile.default_config(a), **option}
    assert tile.search_space(a).violations(config, _small(tile), a) == []
    _assert_body_follows_config(tile, config, _kernel_body(tile.build(_small(tile), config, a).get_kernel_source()))


@pytest.mark.parametrize(
    "name, config",
    [
        (
            "fp4_quant_main",
            {"mapping": "thread", "code": "thresholds", "staging": "shared", "groups_per_thread": 4, "threads": 128, "grid": "persistent"},
        ),
        ("fp4_dequant_index", {"mapping": "thread", "staging": "shared", "groups_per_thread": 2, "threads": 64, "grid": "persistent"}),
    ],
    ids=["quant-main-shared-persistent", "dequant-index-shared-persistent"],
)
@pytest.mark.slow
def test_compiles_structural_variants(name, config):
    """Staging in shared memory, a persistent grid, several groups per thread and a small block: each in the source."""
    tile, a = get_tile(name), get_arch("sm90")
    assert tile.search_space(a).violations(config, _small(tile), a) == []
    src = tile.build(_small(tile), config, a).get_kernel_source()
    _assert_body_follows_config(tile, {**tile.default_config(a), **config}, _kernel_body(src))


@pytest.mark.parametrize("name", FP4_TILES)
def test_default_config_is_valid_everywhere(name):
    tile = get_tile(name)
    for arch in ("sm80", "sm89", "sm90", "sm100"):
        a = get_arch(arch)
        for shape in tile.shapes():
            assert tile.search_space(a).violations(tile.default_config(a), shape, a) == []


def test_default_moves_16_byte_vectors():
    for group, fmt, _ in FORMATS:
        c = fp4.fp4_default_config(fmt)
        assert c["mapping"] == "lanes" and fp4.LANE_VALUES * 2 == 16  # 16 B of bf16 per lane
        # E4M3 divides no more; E8M0's "divide" is the exact multiply by 2^-e, measured the faster of the two
        assert c["code"] == ("packed" if fmt == "e4m3" else "divide")
        # the thread mapping, when picked, keeps the first kernel's 16-byte packed vectors
        assert c["groups_per_thread"] * group // 2 == 16 and c["staging"] == "registers"
        assert "code" not in fp4.fp4_default_config(fmt, quantise=False)


def test_constraints_refuse_invalid_combinations():
    main, dequant = get_tile("fp4_quant_main"), get_tile("fp4_dequant_main")
    sm90 = get_arch("sm90")
    shared_lanes = {**main.default_config(sm90), "staging": "shared"}
    assert any("shared staging goes with mapping=thread" in r for r in main.search_space(sm90).violations(shared_lanes, _small(main), sm90))
    fp32 = fp4.fp4_search_space("e4m3", value_bytes=4)
    assert any("exact for bf16 inputs only" in r for r in fp32.violations(main.default_config(sm90), _small(main), sm90))
    assert fp32.violations({**main.default_config(sm90), "code": "divide"}, _small(main), sm90) == []
    assert "code" not in dequant.search_space(sm90).names()
    # the size a mapping ignores stays at its default: one spelling per kernel, no duplicate trials
    index = get_tile("fp4_quant_index")
    bad = index.search_space(sm90).violations({**index.default_config(sm90), "groups_per_thread": 8}, _small(index), sm90)
    assert any("groups_per_thread is unused with mapping=lanes" in r for r in bad)
    thread4 = {**main.default_config(sm90), "mapping": "thread", "chunks_per_thread": 1}
    assert any(
        "chunks_per_thread is unused with mapping=thread" in r for r in main.search_space(sm90).violations(thread4, _small(main), sm90)
    )


def test_configs_stored_before_the_new_options_are_stale():
    """A stored fp4_quant_main winner either names every parameter of today's space (re-tuned: session 12's file) or,
    stored before mapping/code/chunks_per_thread existed, won nothing over those options, so the default runs
    (tiles.core.config_store.load_winner; tests/test_results.py builds such files); and the space counts each kernel once."""
    import itertools

    from tiles.core.config_store import load_winner

    main, sm90 = get_tile("fp4_quant_main"), get_arch("sm90")
    config, source = load_winner(main.name, sm90, main.shape("decode_b64"))
    if source.startswith("tuned:"):
        assert set(main.search_space(sm90).names()) <= set(config)
    elif source != "default":
        assert source.startswith("default (stale:") and config == main.default_config(sm90)
    space = main.search_space(sm90)
    grid = [dict(zip(space.names(), c)) for c in itertools.product(*(p.choices for p in space.params))]
    # 176 kernels of thresholds/divide, plus code=packed: lanes only, 3 chunk counts x 4 thread counts x 2 grids
    assert len([c for c in grid if not space.violations(c, _small(main), sm90)]) == 176 + 24


def test_builders_refuse_invalid_structures():
    with pytest.raises(TileError, match="code='packed' needs mapping='lanes' and E4M3 scales"):
        fp4.build_quant(128, "e8m0", "bfloat16", "registers", 1, 256, "tiles", "sm_90a", mapping="lanes", code="packed")
    with pytest.raises(TileError, match="code='packed' needs mapping='lanes'"):
        fp4.build_quant(512, "e4m3", "bfloat16", "registers", 2, 256, "tiles", "sm_90a", mapping="thread", code="packed")
    index, sm90 = get_tile("fp4_quant_index"), get_arch("sm90")
    assert "packed" not in next(p for p in index.search_space(sm90).params if p.name == "code").choices
    with pytest.raises(TileError, match="exact for bf16 inputs only"):
        fp4.build_quant(512, "e4m3", "float32", "registers", 2, 256, "tiles", "sm_90a", mapping="lanes", code="thresholds")
    with pytest.raises(TileError, match="use staging='registers'"):
        fp4.build_dequant(512, "e4m3", "bfloat16", "shared", 2, 256, "tiles", "sm_90a", mapping="lanes")
    with pytest.raises(TileError, match="unknown mapping 'warp'"):
        fp4.build_dequant(512, "e4m3", "bfloat16", "registers", 2, 256, "tiles", "sm_90a", mapping="warp")


# --- CPU: the emulations, tied to the shipped source ------------------------------------
# A CPU mirror of kernel code proves nothing about the kernel unless it is that code: the TileLang element helpers run
# here as they are, on torch tensors (_tilelang_as_torch); the CUDA snippets and the statements inside the kernel builders
# are mirrored in Python and every mirrored statement is looked up in the shipped source, so a changed constant,
# comparison or shift there fails a CPU test.


def _python_function(fn) -> str:
    """The source of the Python function ``fn`` (unwrapped from functools.cache; see :func:`_source_text`)."""
    return _source_text(inspect.getsource(fn), "#")


@contextlib.contextmanager
def _tilelang_as_torch():
    """While active, fp4's TileLang element helpers compute on torch tensors: the tilelang.language calls they make
    (abs, if_then_else, uint32, float32, reinterpret) done by torch, uint32 values held in int64 tensors."""
    import tilelang.language as T

    def reinterpret(bits, dtype: str) -> torch.Tensor:
        assert dtype == "float32", dtype
        u = torch.as_tensor(bits, dtype=torch.int64) & 0xFFFFFFFF
        return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(torch.float32)

    with mock.patch.multiple(T, abs=torch.abs, if_then_else=torch.where, uint32=int, float32=float, reinterpret=reinterpret):
        yield


def _bf16_patterns() -> torch.Tensor:
    """Every bf16 bit pattern (NaNs, +-Inf, +-0, denormals included) as float32 [65536]."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _threshold_codes(x: torch.Tensor, s: torch.Tensor, scale_format: str) -> torch.Tensor:
    """The kernel's ``code='thresholds'`` path on the CPU, fp32 throughout: build_quant's thresholds and negative bound
    (mirrored: _THRESHOLD_STATEMENTS) and the shipped search, fp4.kernel.e2m1_code_search, itself."""
    thr = s * torch.tensor(fp4.kernel._MIDPOINTS)  # [7]
    if scale_format == "e8m0":
        thr = torch.minimum(thr, torch.tensor(fp4.FLT_MAX))
        neg = -(s * 2.0**-75) * 2.0**-75
    else:
        neg = torch.zeros(1)
    with _tilelang_as_torch():
        return fp4.kernel.e2m1_code_search(x, thr, neg, 0).to(torch.uint8)


# build_quant's statements that _threshold_codes mirrors (the scale itself is checked by the GPU tests)
_THRESHOLD_STATEMENTS = (
    *(f"thr[{k}] = s * T.float32(_MIDPOINTS[{k}])" for k in range(7)),
    'if scale_format == "e8m0": for k in T.unroll(7): thr[k] = T.min(thr[k], T.float32(FLT_MAX))',
    'neg = T.float32(0.0) else: bits = T.reinterpret(raw, "uint32")',  # E4M3's bound ends its branch, E8M0's follows
    "neg = -(s * T.float32(2.0**-75)) * T.float32(2.0**-75)",
    'pk[g * seg // 2 + j] = T.cast( e2m1_code_search(v_lo, thr, neg, 0) | e2m1_code_search(v_hi, thr, neg, 4), "uint8" )',
)


def test_thresholds_emulation_follows_build_quant():
    """_threshold_codes computes the thresholds, the negative bound and the nibble shifts as build_quant does, in these
    statements, and its search is the shipped one."""
    src = _python_function(fp4.build_quant)
    for stmt in _THRESHOLD_STATEMENTS:
        assert stmt in src, stmt
    assert fp4.kernel._MIDPOINTS == formats.E2M1_MIDPOINTS


@pytest.mark.parametrize("scale_format, scale_bytes", [("e4m3", range(1, 0x7F)), ("e8m0", range(1, 255))], ids=["e4m3", "e8m0"])
def test_thresholds_match_division_on_every_bf16(scale_format, scale_bytes):
    """The exactness argument of code='thresholds', checked: every bf16 pattern against every scale a group can get."""
    x = _bf16_patterns()
    decode = formats.e4m3_decode if scale_format == "e4m3" else formats.e8m0_decode
    for b in scale_bytes:
        s = decode(torch.tensor([b], dtype=torch.uint8))  # [1]
        expected = formats.e2m1_encode(torch.clamp(x / s, -formats.FP4_MAX, formats.FP4_MAX))
        got = _threshold_codes(x, s, scale_format)
        assert torch.equal(got, expected), f"scale byte {b:#04x}: x={x[got != expected][:4].tolist()}"


def test_e4m3_scale_decode_by_bits_is_exact():
    """fp4.kernel._e4m3_scale_value_bits, run on the CPU: the byte's bits as a tiny fp32, * 2^120; all 256 bytes."""
    b = torch.arange(256, dtype=torch.int64)
    with _tilelang_as_torch():
        got = fp4.kernel._e4m3_scale_value_bits(b)  # [256] float32
    assert fp4.bit_exact_nan_canonical({"s": got}, {"s": formats.e4m3_decode(b.to(torch.uint8))}).ok


@pytest.mark.parametrize("scale_format", ["e4m3", "e8m0"])
def test_e2m1_decode_by_bits_is_exact(scale_format):
    """fp4.kernel._e2m1_times, run on the CPU: code bits as a tiny fp32, * 2^126, * s; every code against every scale
    byte."""
    codes = torch.arange(16, dtype=torch.int64)
    scale_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    s = formats.e4m3_decode(scale_bytes) if scale_format == "e4m3" else formats.e8m0_decode(scale_bytes)  # [256]
    with _tilelang_as_torch():
        got = fp4.kernel._e2m1_times(codes, s[:, None])  # [256, 16]
    expected = formats.e2m1_decode(codes.to(torch.uint8))[None, :] * s[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        assert fp4.bit_exact_nan_canonical({"y": got.to(dtype)}, {"y": expected.to(dtype)}).ok


def _round_f32(x: Fraction) -> Fraction:
    """Round a positive rational to the nearest fp32 (ties to even mantissa), exactly."""
    f = np.float32(float(x))
    candidates = [np.nextafter(f, np.float32(0)), f, np.nextafter(f, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))
    return Fraction(float(best))


# fp4.kernel._div6_bf16, statement by statement, as the test below mirrors it with exact rationals
_DIV6_STATEMENTS = (
    "q = a * T.float32(SIXTH)",
    'r = T.call_extern("float32", "__fmaf_rn", -q, T.float32(formats.FP4_MAX), a)',
    'return T.min(T.call_extern("float32", "__fmaf_rn", r, T.float32(SIXTH), q), T.float32(FLT_MAX))',
)


def test_division_free_sixth_emulation_follows_div6_bf16():
    src = _python_function(fp4.kernel._div6_bf16)
    for stmt in _DIV6_STATEMENTS:
        assert stmt in src, stmt


def test_division_free_sixth_is_ieee_division_on_every_bf16():
    """fp4._div6_bf16 (q = a * RN(1/6), FMA residual, FMA correction) equals IEEE a / 6 for every bf16 a the scale
    computation divides: finite, >= 6 * 2^-126 (the E8M0 minimum; the E4M3 one is larger)."""
    patterns = torch.arange(0x0000, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    a_values = [Fraction(v) for v in patterns.tolist() if v >= 6 * 2.0**-126]
    sixth, six = Fraction(fp4.SIXTH), Fraction(formats.FP4_MAX)
    assert _round_f32(Fraction(1, 6)) == sixth
    for a in a_values:
        q = _round_f32(a * sixth)
        r = a - q * six  # exact in fp32: the FMA's single rounding leaves it unchanged
        assert _round_f32(abs(r)) * (1 if r >= 0 else -1) == r if r else True
        q2 = _round_f32(q + r * sixth) if q + r * sixth > 0 else Fraction(0)
        assert q2 == _round_f32(a / six), f"a={float(a)!r}: {float(q2)!r} != {float(_round_f32(a / six))!r}"


def _packed_pair(w: torch.Tensor, t: list[int]) -> torch.Tensor:
    """CPU mirror of csa2_e2m1_pair (fp4.kernel._PACKED_CODES_CUDA; _PACKED_STATEMENTS), word for word: int64 pair
    words [N] -> code bytes [N].

    The bf16x2 compares are emulated per half on the bf16 values (NaN compares false), giving 0xFFFF per true half."""

    def halves(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def val(h):
            return (h & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16).float()

        return val(u), val(u >> 16)

    def mask(cmp, u, v):
        (ul, uh), (vl, vh) = halves(u), halves(v)
        return torch.where(cmp(ul, vl), 0xFFFF, 0) | torch.where(cmp(uh, vh), 0xFFFF0000, 0)

    def select(m, x, y):
        return (m & x) | (~m & y & 0xFFFFFFFF)

    def const(c):
        return torch.full_like(w, c)

    a = w & 0x7FFF7FFF
    ge4 = mask(torch.ge, a, const(t[3]))
    ge2 = mask(torch.ge, a, select(ge4, const(t[5]), const(t[1])))
    odd = mask(torch.gt, a, select(ge4, select(ge2, const(t[6]), const(t[4])), select(ge2, const(t[2]), const(t[0]))))
    neg = mask(torch.gt, a, const(0)) & w & 0x80008000
    nib = (ge4 & 0x00040004) | (ge2 & 0x00020002) | (odd & 0x00010001) | (neg >> 12)
    return (nib | (nib >> 12)) & 0xFF


# The statements of _PACKED_CODES_CUDA that _packed_pair and the test below mirror, by helper
_PACKED_STATEMENTS = {
    "csa2_as_bf162": ("return *reinterpret_cast<__nv_bfloat162*>(&u);",),
    "csa2_select": ("return (m & a) | (~m & b);",),
    "csa2_e2m1_pair": (
        "const __nv_bfloat162 a = csa2_as_bf162(w & 0x7FFF7FFFu);",
        "const unsigned ge4 = __hge2_mask(a, csa2_as_bf162(t[3]));",
        "const unsigned ge2 = __hge2_mask(a, csa2_as_bf162(csa2_select(ge4, t[5], t[1])));",
        "const unsigned odd = __hgt2_mask(a, csa2_as_bf162(csa2_select(ge4, csa2_select(ge2, t[6], t[4]), csa2_select(ge2, t[2], t[0]))));",
        "const unsigned neg = __hgt2_mask(a, csa2_as_bf162(0u)) & w & 0x80008000u;",
        "const unsigned nib = (ge4 & 0x00040004u) | (ge2 & 0x00020002u) | (odd & 0x00010001u) | (neg >> 12);",
        "return (nib | (nib >> 12)) & 0xFFu;",
    ),
    "csa2_fp4_codes8_bf16": (
        "const __nv_bfloat162 s2 = __float2bfloat162_rn(s);",
        "for (int k = 0; k < 7; ++k) t[k] = csa2_bits(__hmul2(s2, __float2bfloat162_rn(mids[k])));",
        "csa2_e2m1_pair(x.x, t) | (csa2_e2m1_pair(x.y, t) << 8) | (csa2_e2m1_pair(x.z, t) << 16) | (csa2_e2m1_pair(x.w, t) << 24);",
    ),
}


def _packed_midpoints() -> list[float]:
    """The midpoints csa2_fp4_codes8_bf16 scales into its thresholds, read from its table in _PACKED_CODES_CUDA."""
    table = re.search(r"const float mids\[7\] = \{([^}]*)\};", fp4.kernel._PACKED_CODES_CUDA)
    assert table, "csa2_fp4_codes8_bf16 has no mids table"
    return [float(v.strip().removesuffix("f")) for v in table.group(1).split(",")]


@pytest.mark.parametrize("helper", list(_PACKED_STATEMENTS))
def test_packed_codes_emulation_follows_the_cuda_source(helper):
    """_packed_pair and the thresholds the test below gives it are _PACKED_CODES_CUDA's, statement by statement."""
    src = _cuda_function(fp4.kernel._PACKED_CODES_CUDA, helper)
    for stmt in _PACKED_STATEMENTS[helper]:
        assert stmt in src, stmt


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("scale_byte", range(1, 0x7F))
def test_packed_codes_match_division_on_every_bf16(scale_byte):
    """code='packed': the bf16x2 thresholds m_k * s are exact bf16 values and the pair-word search gives the reference
    code for every bf16 pattern in either half of a word, for every E4M3 scale byte a group can get."""
    s = formats.e4m3_decode(torch.tensor([scale_byte], dtype=torch.uint8))  # [1]
    mids = torch.tensor(_packed_midpoints())  # [7], the kernel's table: the reference below has its own
    assert torch.equal((s * mids).to(torch.bfloat16).float(), s * mids), "m_k * s is not a bf16 value"
    t = [_bf16_bits(v) * 0x10001 for v in (s * mids).tolist()]  # both halves
    x = _bf16_patterns()  # [65536]
    expected = formats.e2m1_encode(torch.clamp(x / s, -formats.FP4_MAX, formats.FP4_MAX)).long()
    bits = torch.arange(1 << 16, dtype=torch.int64)
    partner = bits.flip(0)  # every pattern beside a different one: the halves must not leak into each other
    got = _packed_pair(bits | (partner << 16), t)
    assert torch.equal(got & 0xF, expected), f"low half, scale byte {scale_byte:#04x}"
    assert torch.equal(got >> 4, expected.flip(0)), f"high half, scale byte {scale_byte:#04x}"


def test_constraints_prune():
    index, main = get_tile("fp4_quant_index"), get_tile("fp4_quant_main")
    sm89, sm90 = get_arch("sm89"), get_arch("sm90")
    big = {"mapping": "thread", "code": "thresholds", "staging": "shared", "groups_per_thread": 8, "threads": 512, "grid": "tiles"}
    # 4 groups of 32 per index row: 8 groups per thread straddle rows
    assert any("whole groups" in r for r in index.search_space(sm90).violations(big, _small(index), sm90))
    # 512 threads x 128 bf16 values = 128 KiB tile + packed bytes: fits Hopper, not an L40S block
    assert main.search_space(sm90).violations(big, _small(main), sm90) == []
    assert any("shared memory" in r for r in main.search_space(sm89).violations(big, _small(main), sm89))
    # fp32 input doubles the tile: too big even for Hopper
    assert any("shared memory" in r for r in fp4.fp4_search_space("e4m3", value_bytes=4).violations(big, _small(main), sm90))
    n_valid = sum(not main.search_space(sm89).violations(c, _small(main), sm89) for c in main.search_space(sm89).all_configs())
    assert 0 < n_valid < main.search_space(sm89).size()


def test_cost_model():
    q, d = get_tile("fp4_quant_main"), get_tile("fp4_dequant_index")
    shape = q.shape("bulk_1m")
    assert q.flops(shape) == 0 and q.bytes_moved(shape) == (1 << 20) * (512 * 2 + 288)
    assert d.bytes_moved(d.shape("bulk_1m")) == (1 << 20) * (128 * 2 + 68)


@pytest.mark.parametrize("group, fmt, dim", FORMATS, ids=["main", "index"])
def test_inputs_cover_the_special_cases(group, fmt, dim):
    x = fp4.quant_inputs(64, dim, fmt, seed=3, device="cpu", dtype=torch.float32)["x"]
    assert torch.isnan(x).any() and torch.isposinf(x).any() and torch.isneginf(x).any()
    assert (x == 0).any() and (x.abs() < 1e-38).logical_and(x != 0).any() and (x.abs() > 1e30).any()
    packed, _ = formats.fp4_quantize(x, group, fmt)
    codes = formats.unpack_nibbles(packed)
    assert set(codes.unique().tolist()) == set(range(16)), "every E2M1 code appears"
    # row 0 sits on the midpoints: quantising nudged values gives different codes than the ties
    v = x[0].reshape(-1, group) / formats.fp4_scale(x[0].reshape(-1, group).abs().amax(-1), fmt)[1][:, None]
    assert torch.isin(v.abs(), torch.tensor(formats.E2M1_MIDPOINTS)).sum() > dim // 4
    other = fp4.quant_inputs(64, dim, fmt, seed=4, device="cpu", dtype=torch.float32)["x"]
    assert not torch.equal(x[8:], other[8:])


def test_public_functions_refuse_bad_arguments():
    x = torch.randn(4, 512)
    with pytest.raises(TileError, match="goes with group_size=16"):
        fp4.fp4_quantize(x, group_size=32, scale_format="e4m3")
    with pytest.raises(TileError, match="unknown scale_format 'e5m2'"):
        fp4.fp4_quantize(x, scale_format="e5m2")
    with pytest.raises(TileError, match="on cpu: the FP4 kernels run on a CUDA device"):
        fp4.fp4_quantize(x)
    with pytest.raises(TileError, match="on cpu"):
        fp4.fp4_dequantize(torch.zeros(4, 256, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8))


# --- GPU: bit-exact, deterministic, poisoned outputs -------------------------------------
def _run_twice(tile, kernel, inputs):
    out1 = tile.run(kernel, inputs)
    out2 = tile.run(kernel, inputs)
    torch.cuda.synchronize()
    for k in out1:
        assert torch.equal(out1[k].view(torch.uint8), out2[k].view(torch.uint8)), f"two runs differ in {k}"
    return out1


_TORCH_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is poisoned (tiles.core.contract.poisoned's rule for the buffers a public function
    allocates itself): NaN for floats, all bits set for bytes."""
    t = _TORCH_EMPTY(*args, **kwargs)
    if t.dtype in (torch.float32, torch.bfloat16):
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)
    return t


def _call_twice(call):
    """``call()`` of a public function (it allocates its outputs) twice, every torch.empty inside poisoned: the first
    result (a tensor or a tuple of them), after requiring the second to hold the same bytes. An element never written
    stays poisoned, which the bit-exact comparison with model.formats refuses; a race shows as two different results."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        first, second = call(), call()
    for a, b in zip(*((r,) if isinstance(r, torch.Tensor) else r for r in (first, second)), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "two calls differ"
    return first


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 63, 500, 4096], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("name", FP4_TILES)
def test_bit_exact_default(name, rows):
    tile, arch = get_tile(name), detect()
    shape = Shape(f"rows{rows}", "any", {"rows": rows, "dim": tile.dim})
    kernel = tile.build(shape, tile.default_config(arch), arch)
    for seed in (1, 2):
        inputs = tile.make_inputs(shape, seed, "cuda")
        cmp = tile.compare(_run_twice(tile, kernel, inputs), tile.reference(inputs))
        assert cmp.ok, str(cmp)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        {"mapping": "thread", "code": "thresholds", "staging": "shared", "groups_per_thread": 1, "threads": 128, "grid": "tiles"},
        {"mapping": "thread", "code": "thresholds", "staging": "registers", "groups_per_thread": 4, "threads": 64, "grid": "persistent"},
        {"mapping": "thread", "code": "thresholds", "staging": "shared", "groups_per_thread": 2, "threads": 512, "grid": "persistent"},
        {"mapping": "lanes", "chunks_per_thread": 4, "threads": 64, "grid": "persistent"},
        {"mapping": "lanes", "chunks_per_thread": 2, "threads": 512, "grid": "persistent"},
    ],
    ids=[
        "thread-shared-tiles",
        "thread-registers-persistent",
        "thread-shared-persistent",
        "lanes-c4-t64-persistent",
        "lanes-c2-t512-persistent",
    ],
)
@pytest.mark.parametrize("name", FP4_TILES)
def test_bit_exact_structural_variants(name, config):
    tile, arch = get_tile(name), detect()
    shape = Shape("rows333", "any", {"rows": 333, "dim": tile.dim})
    kernel = tile.build(shape, config, arch)
    inputs = tile.make_inputs(shape, 5, "cuda")
    cmp = tile.compare(_run_twice(tile, kernel, inputs), tile.reference(inputs))
    assert cmp.ok, str(cmp)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 333, 4099], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("name, option", TILE_OPTIONS)
def test_bit_exact_every_option(name, option, rows):
    """Every mapping x code x chunks_per_thread, on row counts that leave the last tile, block and warp partial."""
    tile, arch = get_tile(name), detect()
    shape = Shape(f"rows{rows}", "any", {"rows": rows, "dim": tile.dim})
    config = {**tile.default_config(arch), **option}
    assert tile.search_space(arch).violations(config, shape, arch) == []
    kernel = tile.build(shape, config, arch)
    for seed in (3, 4):
        inputs = tile.make_inputs(shape, seed, "cuda")
        cmp = tile.compare(_run_twice(tile, kernel, inputs), tile.reference(inputs))
        assert cmp.ok, str(cmp)


PUBLIC_CONFIGS = [None, {"mapping": "thread", "code": "divide"}, {"mapping": "lanes", "code": "divide", "chunks_per_thread": 1}]


@pytest.mark.gpu
@pytest.mark.parametrize("config", PUBLIC_CONFIGS, ids=["default", "thread-divide", "lanes-divide"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group, fmt, dim", FORMATS, ids=["main", "index"])
def test_public_quantize_matches_formats(group, fmt, dim, dtype, config):
    x = fp4.quant_inputs(3 * 41, dim, fmt, seed=7, device="cuda", dtype=dtype)["x"].reshape(3, 41, dim)
    if dtype == torch.float32:
        x[0, 0, :group] = torch.tensor([-1e-45, 1e-45] * (group // 2))  # denormals that divide to (-)0
    packed, scales = _call_twice(lambda: fp4.fp4_quantize(x, group, fmt, config=config))  # float32: code='divide' whatever the config
    ref_packed, ref_scales = formats.fp4_quantize(x, group, fmt)
    assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("mapping", ["lanes", "thread"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group, fmt, dim", FORMATS, ids=["main", "index"])
def test_public_dequantize_every_byte(group, fmt, dim, out_dtype, mapping):
    # every packed byte against every scale byte: row r carries scale byte r in all its groups
    packed = (torch.arange(256 * dim // 2, device="cuda") % 256).to(torch.uint8).reshape(256, dim // 2)
    scales = torch.arange(256, device="cuda").to(torch.uint8)[:, None].expand(256, dim // group).contiguous()
    out = _call_twice(lambda: fp4.fp4_dequantize(packed, scales, group, fmt, out_dtype=out_dtype, config={"mapping": mapping}))
    ref = formats.fp4_dequantize(packed, scales, group, fmt).to(out_dtype)
    assert fp4.bit_exact_nan_canonical({"y": out}, {"y": ref}).ok


@pytest.mark.gpu
def test_round_trip_and_empty_rows():
    x = torch.randn(5, 512, generator=torch.Generator(device="cuda").manual_seed(11), device="cuda", dtype=torch.bfloat16)
    packed, scales = _call_twice(lambda: fp4.fp4_quantize(x))
    y = _call_twice(lambda: fp4.fp4_dequantize(packed, scales, out_dtype=torch.float32))
    assert torch.equal(y, formats.fp4_fake_quantize(x))
    p, s = fp4.fp4_quantize(torch.empty(0, 128, device="cuda"), 32, "e8m0")
    assert p.shape == (0, 64) and s.shape == (0, 4)


@pytest.mark.gpu
def test_public_refuses_bad_gpu_arguments():
    x = torch.randn(8, 512, device="cuda")
    with pytest.raises(TileError, match="contiguous"):
        fp4.fp4_quantize(x[:, :256])
    with pytest.raises(TileError, match="bfloat16 or float32"):
        fp4.fp4_quantize(x.half())
    with pytest.raises(TileError, match="do not match"):
        fp4.fp4_dequantize(torch.zeros(4, 256, dtype=torch.uint8, device="cuda"), torch.zeros(4, 16, dtype=torch.uint8, device="cuda"))
