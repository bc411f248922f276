"""Bit-exact FP4/FP8 formats (model.formats) against independent constructions."""

from __future__ import annotations

import math

import pytest
import torch

from model import formats

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_by_bits(code: int) -> float:
    """E2M1 from its bits s|ee|m, bias 1: subnormal 0.m x 2^0, else 1.m x 2^(e-1)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def e4m3_by_bits(byte: int) -> float:
    """OCP E4M3 (fn): s|eeee|mmm, bias 7, no infinities, S.1111.111 = NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 0xF and m == 7:
        return math.nan
    mag = m / 8 * 2.0**-6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


E4M3_TABLE = [e4m3_by_bits(b) for b in range(256)]


def e2m1_nearest(v: float) -> int:
    """Nearest E2M1 code by brute force, ties to the even code, |v| > 6 saturates, sign from v < 0."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1_GRID[c] - mag), c % 2))
    return best | (8 if v < 0 else 0)


def e4m3_rne(v: float) -> int:
    """Positive v -> the E4M3 byte nearest to it (ties to an even mantissa), saturating at 448."""
    if v >= 448:
        return 0x7E
    finite = [(b, x) for b, x in enumerate(E4M3_TABLE[:128]) if not math.isnan(x)]
    return min(finite, key=lambda bx: (abs(bx[1] - v), bx[0] & 1))[0]


# -- E2M1 codes -----------------------------------------------------------------------------


def test_e2m1_decode_all_16_codes():
    got = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    want = torch.tensor([e2m1_by_bits(c) for c in range(16)])
    assert torch.equal(got, want)
    assert torch.signbit(got[8]) and got[8] == 0  # code 8 is -0.0


@pytest.mark.parametrize("code", range(16), ids=lambda c: f"code{c:02d}")
def test_e2m1_encode_round_trips_every_code(code):
    v = torch.tensor([e2m1_by_bits(code)])
    want = 0 if code == 8 else code  # +-0 both decode to zero; -0.0 is not < 0, so it encodes as +0
    assert formats.e2m1_encode(v).item() == want


def test_e2m1_ties_round_half_to_even():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    got = formats.e2m1_encode(torch.cat([mids, -mids]))
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6], dtype=torch.uint8)  # the even neighbour of each midpoint
    assert torch.equal(got, torch.cat([want, want | 8]))


def test_e2m1_encode_matches_brute_force_nearest():
    v = torch.cat([torch.arange(-7 * 64, 7 * 64 + 1) / 64.0, torch.randn(2000) * 3])
    got = formats.e2m1_encode(v)
    want = torch.tensor([e2m1_nearest(x) for x in v.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want)


def test_pack_puts_even_element_in_low_nibble_and_round_trips_all_bytes():
    assert formats.pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(formats.pack_nibbles(formats.unpack_nibbles(every)), every)
    assert torch.equal(formats.unpack_nibbles(every)[0::2], every & 0xF)


def test_pack_matches_torch_float4_layout():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    codes = torch.arange(16, dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.view(torch.float4_e2m1fn_x2).view(torch.uint8).tolist() == packed.tolist()
    assert packed[0].item() == 0x10  # elements 0 (low) and 1 (high)


# -- scale bytes ------------------------------------------------------------------------------


def test_e4m3_decode_all_256_bytes():
    got = formats.e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    want = torch.tensor(E4M3_TABLE)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan.sum() == 2
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))


def test_e4m3_encode_round_trips_all_finite_bytes_and_nan():
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = formats.e4m3_decode(bytes_)
    finite = ~torch.isnan(values)
    assert torch.equal(formats.e4m3_encode(values[finite]), bytes_[finite])
    assert formats.e4m3_encode(torch.tensor([math.nan])).item() == 0x7F


def test_e4m3_encode_saturates_and_rounds_to_nearest_even():
    assert formats.e4m3_encode(torch.tensor([1e9, -1e9, math.inf, -math.inf])).tolist() == [0x7E, 0xFE, 0x7E, 0xFE]
    v = torch.rand(3000) * 500
    want = torch.tensor([e4m3_rne(x) for x in v.tolist()], dtype=torch.uint8)
    assert torch.equal(formats.e4m3_encode(v), want)


def test_e8m0_decode_all_256_bytes():
    got = formats.e8m0_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert torch.isnan(got[255])
    want = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)], dtype=torch.float32)
    assert torch.equal(got[:255], want)


@pytest.mark.parametrize("k", [-126, -60, -1, 0, 1, 17, 126], ids=lambda k: f"2^{k}")
def test_e8m0_encode_ceil_powers_and_neighbours(k):
    p = math.ldexp(1.0, k)
    v = torch.tensor([p, p * (1 + 2**-23), p * 1.5], dtype=torch.float32)
    assert formats.e8m0_encode_ceil(v).tolist() == [k + 127, min(k + 128, 254), min(k + 128, 254)]


def test_e8m0_encode_clamps_to_valid_bytes():
    v = torch.tensor([math.inf, 3e38, 1e-45], dtype=torch.float32)
    assert formats.e8m0_encode_ceil(v).tolist() == [254, 254, 1]


# -- FP4 group quantisation ------------------------------------------------------------------


def _reference_fp4(x: torch.Tensor, group: int, scale_format: str) -> tuple[list[int], list[int]]:
    """Codes (unpacked) and scale bytes, element by element in Python."""
    codes, scales = [], []
    for g in x.view(-1, group).tolist():
        amax = max((abs(v) for v in g if not math.isnan(v)), default=0.0)
        if scale_format == "e4m3":
            byte = e4m3_rne(min(max(amax, 6 * 2.0**-9) / 6, 448.0))
            s = E4M3_TABLE[byte]
        else:
            t = max(amax, 6 * 2.0**-126) / 6
            e = 127 if math.isinf(t) else math.ceil(math.log2(t))
            byte = min(max(e + 127, 1), 254)
            s = math.ldexp(1.0, byte - 127)
        scales.append(byte)
        codes += [0 if math.isnan(v) else e2m1_nearest(max(-6.0, min(6.0, v / s))) for v in g]
    return codes, scales


FORMATS = [pytest.param(16, "e4m3", id="main-g16-e4m3"), pytest.param(32, "e8m0", id="index-g32-e8m0")]


@pytest.mark.parametrize(("group", "scale_format"), FORMATS)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 37.0, 1e4, 1e30], ids=lambda m: f"x{m:g}")
def test_fp4_quantize_matches_elementwise_reference(group, scale_format, magnitude):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=g) * magnitude * torch.rand(6, 1, generator=g).add(0.1)
    packed, scales = formats.fp4_quantize(x, group, scale_format)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert packed.shape == (6, 32) and scales.shape == (6, 64 // group)
    codes, ref_scales = _reference_fp4(x, group, scale_format)
    assert scales.flatten().tolist() == ref_scales
    assert formats.unpack_nibbles(packed).flatten().tolist() == codes


@pytest.mark.parametrize(("group", "scale_format"), FORMATS)
def test_fp4_round_trip_is_exact_on_the_grid(group, scale_format):
    s = 0.375 if scale_format == "e4m3" else 0.25  # a value the scale format holds exactly
    grid = torch.tensor([e2m1_by_bits(c) for c in range(16)])
    x = grid[torch.randint(0, 16, (4, group))]
    x[:, 0] = 6.0  # amax = 6 s makes the stored scale exactly s
    x = x * s
    assert torch.equal(formats.fp4_fake_quantize(x, group, scale_format), x)


@pytest.mark.parametrize(("group", "scale_format"), FORMATS)
def test_fp4_ties_round_half_to_even(group, scale_format):
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.zeros(group)
    x[0] = 6.0  # scale 1 in both formats
    x[1:8], x[8:15] = mids, -mids
    codes = formats.unpack_nibbles(formats.fp4_quantize(x, group, scale_format)[0])
    assert codes[1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert codes[8:15].tolist() == [8, 10, 10, 12, 12, 14, 14]


@pytest.mark.parametrize(("group", "scale_format", "zero_scale"), [(16, "e4m3", 0x01), (32, "e8m0", 1)], ids=["e4m3", "e8m0"])
def test_fp4_all_zero_group_uses_the_floor_scale(group, scale_format, zero_scale):
    packed, scales = formats.fp4_quantize(torch.zeros(2, group), group, scale_format)
    assert scales.flatten().tolist() == [zero_scale, zero_scale]  # 2^-9 (E4M3 subnormal) / 2^-126
    assert packed.eq(0).all()


@pytest.mark.parametrize(("group", "scale_format", "max_scale"), [(16, "e4m3", 0x7E), (32, "e8m0", 254)], ids=["e4m3", "e8m0"])
def test_fp4_nan_and_inf_rules(group, scale_format, max_scale):
    x = torch.linspace(-2, 2, group)
    x[3] = math.nan
    nan_free = x.clone()
    nan_free[3] = 0.0
    packed, scales = formats.fp4_quantize(x, group, scale_format)
    ref_packed, ref_scales = formats.fp4_quantize(nan_free, group, scale_format)
    assert torch.equal(scales, ref_scales)  # NaN takes no part in amax
    assert formats.unpack_nibbles(packed)[3] == 0 and torch.equal(packed, ref_packed)

    y = torch.linspace(-2, 2, group)
    y[1], y[2] = math.inf, -math.inf
    packed, scales = formats.fp4_quantize(y, group, scale_format)
    codes = formats.unpack_nibbles(packed)
    assert scales.item() == max_scale
    assert codes[1] == 7 and codes[2] == 15


def test_fp4_dequantize_rejects_non_uint8():
    with pytest.raises(TypeError, match="uint8"):
        formats.fp4_dequantize(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.uint8))


# -- FP8 window KV -----------------------------------------------------------------------------


def test_fp8_round_trip_exact_for_every_e4m3_value():
    values = torch.tensor([v for v in E4M3_TABLE if not math.isnan(v)])  # 254 values
    x = torch.cat([values, values.new_full((2,), 448.0)]).view(8, 32)
    x[:, 0] = 448.0  # every group's amax is 448: scale 2^0
    for k in (-20, 0, 9):
        xs = x * 2.0**k
        codes, scales = formats.fp8_quantize(xs)
        assert scales.eq(127 + k).all()
        assert torch.equal(formats.fp8_dequantize(codes, scales), xs)


@pytest.mark.parametrize("magnitude", [1e-35, 1e-2, 3.0, 1e6, 1e36], ids=lambda m: f"x{m:g}")
def test_fp8_scale_rule_and_relative_error(magnitude):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * magnitude
    codes, scales = formats.fp8_quantize(x)
    amax = x.view(5, 2, 32).abs().amax(-1)
    floor = float(torch.tensor(1e-4, dtype=torch.float32))  # the official amax floor, as float32
    want = [min(max(math.ceil(math.log2(max(a, floor) / 448)) + 127, 1), 254) for a in amax.flatten().tolist()]
    assert scales.flatten().tolist() == want
    back = formats.fp8_dequantize(codes, scales)
    if magnitude < 1e-30:  # far below the floor the scale stays 2^-22 and the group flushes to zero, as the official one does
        assert scales.eq(105).all() and back.eq(0).all()
        return
    big = x.abs() > amax.repeat_interleave(32, -1).view(5, 64) * 2**-5
    assert ((back - x).abs() <= x.abs() * 2**-4)[big].all()  # 3 mantissa bits: half-ulp is 2^-4 relative


def test_fp8_nan_inf_and_zero_rules():
    x = torch.linspace(-1, 1, 32)
    x[5] = math.nan
    codes, scales = formats.fp8_quantize(x)
    assert codes[5].item() == 0x7F
    assert scales.item() == formats.fp8_quantize(torch.nan_to_num(x, nan=0.0))[1].item()
    y = torch.linspace(-1, 1, 32)
    y[0], y[1] = math.inf, -math.inf
    codes, scales = formats.fp8_quantize(y)
    assert scales.item() == 254 and codes[:2].tolist() == [0x7E, 0xFE]
    codes, scales = formats.fp8_quantize(torch.zeros(32))
    assert scales.item() == 105 and codes.eq(0).all()  # amax floored at 1e-4: 2^ceil(log2(1e-4 / 448)) = 2^-22
