"""Bit-exact reference for the CSA2 storage formats (spec section 3).

FP4 E2M1 values, two per byte, even element in the low nibble (the layout of torch's
``float4_e2m1fn_x2``), with one scale per group:

==============  =====  ======  ===================================================
tensor          group  scale   scale rule (fp32)
==============  =====  ======  ===================================================
main KV latent  16     E4M3    ``s = e4m3_rne(min(max(amax, 6*2^-9) / 6, 448))``
index K and Q   32     E8M0    ``s = 2^ceil(log2(max(amax, 6*2^-126) / 6))``
==============  =====  ======  ===================================================

Values: ``code = e2m1_rne(clamp(x / s, -6, 6))`` with ``s`` the *stored* scale, ties to
the even code. The SWA window KV uses FP8 E4M3 values with one E8M0 scale per 32:
``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``code = e4m3_rne(x / s)`` (saturating at 448),
the official V4.1 activation quantiser's rule (its amax floor 1e-4 as float32).

Both E8M0 rules divide by the maximum where the official kernels multiply by its float32
reciprocal (``amax * fp32(1/6)``, ``amax * fp32(1/448)``); the two give the same scale byte for
every float32 amax (tests/test_conformance.py checks every significand at several exponents).

Special values, the same in every kernel that claims bit-exactness:

* NaN elements do not take part in a group's ``amax`` (a NaN-ignoring max, as CUDA's
  ``fmaxf``); a NaN element encodes as code 0 (+0) in FP4 and as the E4M3 NaN byte 0x7F in FP8.
* +-Inf saturates: the group scale becomes the largest (448 for E4M3, 2^127 for E8M0) and
  the element encodes as +-6 (FP4) / +-448 (FP8).
* The FP4 sign bit is set iff ``x < 0``; a negative value that rounds to zero encodes as
  code 8 (-0), which decodes to -0.0.

Scale bytes are the raw codes: E4M3 as ``float8_e4m3fn`` bits, E8M0 as ``exponent + 127``.
"""

from __future__ import annotations

import torch

FP4_MAX = 6.0
E4M3_MAX = 448.0
# E2M1 magnitudes for codes 0..7; code | 8 is the negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a value on a midpoint goes to the even code.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

SCALE_FORMATS = {"e4m3": 16, "e8m0": 32}  # scale format -> the group size it is used with


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """All 16 E2M1 code values as float32 [16], index = code.

    Built on the device from the codes' bits (no host-to-device copy, so it may run inside a
    CUDA graph capture): magnitude ``2^(e-1) * (1 + m/2)`` for exponent bits ``e > 0``,
    ``m / 2`` for ``e == 0``.
    """
    code = torch.arange(16, device=device)
    e, m = (code >> 1) & 3, (code & 1).float()
    mags = torch.where(e > 0, torch.exp2(e.float() - 1) * (1 + m / 2), m / 2)
    return torch.where(code >= 8, -mags, mags)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values already divided by their scale to E2M1 codes (uint8, 0..15).

    ``|v|`` above 6 saturates to code 7; ties go to the even code; NaN gives code 0.
    """
    mag = v.abs()
    code = torch.zeros_like(v, dtype=torch.uint8)
    for k, mid in enumerate(E2M1_MIDPOINTS):
        # code k+1 is odd when k is even: a tie stays on the lower (even) code k.
        above = (mag > mid) if k % 2 == 0 else (mag >= mid)
        code += above.to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) to float32 values. Code 8 decodes to -0.0."""
    mags = e2m1_table(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mags, mags)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N] -> bytes [..., N//2], element 2i in the low nibble."""
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., N//2] -> uint8 codes [..., N]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _nan_ignoring_amax(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(dim=-1)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 bytes (uint8), round to nearest even, saturating at +-448, NaN -> 0x7F."""
    sat = x.clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    return sat.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) -> float32."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_encode_ceil(v: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 ``v`` -> E8M0 byte of ``2^ceil(log2(v))``, clamped to [1, 254].

    Read off the fp32 bits: exponent field ``e`` and mantissa ``m``; ``ceil(log2 v)`` is
    ``e - 127`` when ``m == 0`` and ``e - 126`` otherwise. +Inf gives 254 (2^127).
    """
    bits = v.contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    byte = exp_field + has_mantissa.to(torch.int32)  # = ceil(log2 v) + 127
    return byte.clamp(1, 254).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``2^(code - 127)``. Byte 255 (NaN in OCP MX) decodes to NaN."""
    exp = codes.to(torch.int32) - 127
    out = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return torch.where(codes == 255, torch.full_like(out, float("nan")), out)


def _check_groups(x: torch.Tensor, group_size: int, scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"unknown scale_format {scale_format!r}: use one of {sorted(SCALE_FORMATS)}")
    if x.shape[-1] % group_size != 0 or group_size % 2 != 0:
        raise ValueError(f"last dim {x.shape[-1]} must be a multiple of group_size={group_size} (an even number)")


def fp4_scale(amax: torch.Tensor, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group amax (float32, NaN-free) -> (scale byte uint8, stored scale float32)."""
    if scale_format == "e4m3":
        raw = torch.clamp(torch.clamp(amax, min=FP4_MAX * 2.0**-9) / FP4_MAX, max=E4M3_MAX)
        code = e4m3_encode(raw)
        return code, e4m3_decode(code)
    if scale_format == "e8m0":
        code = e8m0_encode_ceil(torch.clamp(amax, min=FP4_MAX * 2.0**-126) / FP4_MAX)
        return code, e8m0_decode(code)
    raise ValueError(f"unknown scale_format {scale_format!r}: use 'e4m3' or 'e8m0'")


def fp4_quantize(x: torch.Tensor, group_size: int = 16, scale_format: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 E2M1 with one scale per group.

    Args:
        x: float tensor [..., N]; computed in float32.
        group_size: 16 with ``"e4m3"`` (main KV), 32 with ``"e8m0"`` (index K/Q).
    Returns:
        packed uint8 [..., N//2] (even element in the low nibble) and
        scales uint8 [..., N//group_size] (raw E4M3 or E8M0 codes).
    """
    _check_groups(x, group_size, scale_format)
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)  # [..., G, gs]
    scale_code, scale = fp4_scale(_nan_ignoring_amax(xg), scale_format)
    v = torch.clamp(xg / scale.unsqueeze(-1), -FP4_MAX, FP4_MAX)
    codes = e2m1_encode(v).reshape(x.shape)
    return pack_nibbles(codes), scale_code


def fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, group_size: int = 16, scale_format: str = "e4m3") -> torch.Tensor:
    """Inverse of :func:`fp4_quantize`: packed [..., N//2], scales [..., N//group_size] -> float32 [..., N]."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    n = packed.shape[-1] * 2
    _check_groups(torch.empty(n, device="meta"), group_size, scale_format)
    if scales.shape[-1] * group_size != n:
        raise ValueError(f"{scales.shape[-1]} scales per row do not cover {n} values with group_size={group_size}")
    values = e2m1_decode(unpack_nibbles(packed)).reshape(*packed.shape[:-1], n // group_size, group_size)
    scale = e4m3_decode(scales) if scale_format == "e4m3" else e8m0_decode(scales)
    return (values * scale.unsqueeze(-1)).reshape(*packed.shape[:-1], n)


def fp4_fake_quantize(x: torch.Tensor, group_size: int = 16, scale_format: str = "e4m3") -> torch.Tensor:
    """Round-trip through FP4 (quantise then dequantise), float32 [..., N]."""
    return fp4_dequantize(*fp4_quantize(x, group_size, scale_format), group_size, scale_format)


FP8_GROUP = 32
FP8_AMAX_FLOOR = 1e-4  # the official activation quantiser's clamp of a group's amax (float32), before its E8M0 scale


def fp8_quantize(x: torch.Tensor, group_size: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to FP8 E4M3 with one E8M0 (power-of-two) scale per group (SWA window KV).

    Args:
        x: float tensor [..., N], N a multiple of group_size; computed in float32.
    Returns:
        codes uint8 [..., N] (E4M3 bytes) and scales uint8 [..., N//group_size] (E8M0 bytes).
    """
    if x.shape[-1] % group_size != 0:
        raise ValueError(f"last dim {x.shape[-1]} must be a multiple of group_size={group_size}")
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = _nan_ignoring_amax(xg)
    scale_code = e8m0_encode_ceil(torch.clamp(amax, min=FP8_AMAX_FLOOR) / E4M3_MAX)
    codes = e4m3_encode(xg / e8m0_decode(scale_code).unsqueeze(-1))
    return codes.reshape(x.shape), scale_code


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int = FP8_GROUP) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: codes [..., N], scales [..., N//group_size] -> float32 [..., N]."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    n = codes.shape[-1]
    values = e4m3_decode(codes).reshape(*codes.shape[:-1], n // group_size, group_size)
    return (values * e8m0_decode(scales).unsqueeze(-1)).reshape(codes.shape)


def fp8_fake_quantize(x: torch.Tensor, group_size: int = FP8_GROUP) -> torch.Tensor:
    """Round-trip through FP8 E4M3 with E8M0 group scales, float32 [..., N]."""
    return fp8_dequantize(*fp8_quantize(x, group_size), group_size)
