"""The four FP4 tiles as the harness and the tuner see them: kernels for a full config, inputs with every special value
of the formats, the torch reference and the bit-exact comparison."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from model import formats
from tiles.core.arch import Arch
from tiles.core.contract import Comparison, Config, Inputs, SearchSpace, Shape, Tile, poisoned
from tiles.core.shapes import fp4_rows
from tiles.fp4.kernel import INDEX_DIM, MAIN_DIM, SCALE_GROUP, build_dequant, build_quant
from tiles.fp4.space import fp4_default_config, fp4_search_space


def quant_kernel(dim: int, scale_format: str, in_dtype: str, c: Config, arch: Arch):
    """:func:`build_quant` for a full config; float32 inputs always divide (the threshold argument needs bf16)."""
    code = c["code"] if in_dtype == "bfloat16" else "divide"
    return build_quant(
        dim, scale_format, in_dtype, c["staging"], c["groups_per_thread"], c["threads"], c["grid"], arch.nvcc_arch,
        mapping=c["mapping"], code=code, chunks_per_thread=c["chunks_per_thread"],
    )  # fmt: skip


def dequant_kernel(dim: int, scale_format: str, out_dtype: str, c: Config, arch: Arch):
    """:func:`build_dequant` for a full config."""
    return build_dequant(
        dim, scale_format, out_dtype, c["staging"], c["groups_per_thread"], c["threads"], c["grid"], arch.nvcc_arch,
        mapping=c["mapping"], chunks_per_thread=c["chunks_per_thread"],
    )  # fmt: skip


def _edge_rows(dim: int, scale_format: str, generator: torch.Generator) -> torch.Tensor:
    """Rows that hit every special case of the format, float32 [8, dim].

    Row 0: exact E2M1 midpoints (ties) and grid points, at a scale the group's amax pins
    exactly. Row 1: zeros and -0. Row 2: tiny values incl. denormals. Row 3: huge values.
    Row 4: NaN, +-Inf mixed with normal values. Row 5: an all-NaN group next to a one-Inf group.
    Rows 6-7: random signs at magnitudes spread over 2^-140..2^120.
    """
    group = SCALE_GROUP[scale_format]
    n_groups = dim // group
    rows = torch.empty(8, dim)  # [8, dim]
    mids = torch.tensor(formats.E2M1_MIDPOINTS + formats.E2M1_VALUES)
    for g in range(n_groups):
        scale = 2.0 ** (g % 24 - 12) * (1.0 + (g % 8) / 8 if scale_format == "e4m3" else 1.0)  # an exact E4M3/E8M0 value
        vals = mids[torch.arange(group) % len(mids)] * scale
        vals[0] = 6.0 * scale  # amax = 6 s pins the stored scale to s exactly
        sign = torch.where(torch.rand(group, generator=generator) < 0.5, -1.0, 1.0)
        rows[0, g * group : (g + 1) * group] = vals * sign
    rows[1] = 0.0
    rows[1, 1::2] = -0.0
    rows[1, : dim // 2] = torch.where(torch.arange(dim // 2) % 3 == 0, torch.tensor(1e-3), torch.tensor(0.0))
    rows[2] = torch.randn(dim, generator=generator) * 1e-39  # denormal in fp32 and bf16
    rows[2, ::4] = -1e-45
    rows[3] = torch.randn(dim, generator=generator) * 1e37
    rows[3, ::5] = 3.0e38
    rows[4] = torch.randn(dim, generator=generator)
    rows[4, ::7] = float("nan")
    rows[4, 3::11] = float("inf")
    rows[4, 5::13] = float("-inf")
    rows[5] = torch.randn(dim, generator=generator)
    rows[5, :group] = float("nan")
    rows[5, group + 1] = float("-inf")
    exps = torch.randint(-140, 120, (2, dim), generator=generator).float()
    rows[6:8] = torch.randn(2, dim, generator=generator).sign() * torch.exp2(exps)
    return rows


def _generator(seed: int, device) -> torch.Generator:
    # random data is made where it is used: a 1M-row CPU randn would dominate a benchmark run
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def quant_inputs(rows: int, dim: int, scale_format: str, seed: int, device, dtype: torch.dtype = torch.bfloat16) -> Inputs:
    """x [rows, dim] ``dtype``: N(0, 1) per element times a log-uniform per-row magnitude, special rows first."""
    gen = _generator(seed, device)
    x = torch.randn(rows, dim, generator=gen, device=device)  # [rows, dim]
    x *= torch.exp2(torch.empty(rows, 1, device=device).uniform_(-8, 8, generator=gen))  # [rows, 1]
    n_edge = min(rows, 8)
    x[:n_edge] = _edge_rows(dim, scale_format, torch.Generator().manual_seed(seed))[:n_edge].to(device)
    return {"x": x.to(dtype)}


def dequant_inputs(rows: int, dim: int, scale_format: str, seed: int, device) -> Inputs:
    """packed uint8 [rows, dim // 2] (every byte value), scales uint8 [rows, dim // group] (every byte value, NaN codes too)."""
    gen = _generator(seed, device)
    packed = torch.randint(0, 256, (rows, dim // 2), generator=gen, dtype=torch.uint8, device=device)  # [rows, dim // 2]
    scales = torch.randint(
        0, 256, (rows, dim // SCALE_GROUP[scale_format]), generator=gen, dtype=torch.uint8, device=device
    )  # [rows, dim // group]
    return {"packed": packed, "scales": scales}


def bit_exact_nan_canonical(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
    """Byte-for-byte equality where every NaN counts as one NaN (GPU converts emit a canonical payload, torch keeps another)."""
    from tiles.core.compare import bit_exact

    def canon(t: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t) if t.is_floating_point() else t

    return bit_exact({k: canon(v) for k, v in outputs.items()}, {k: canon(v.to(outputs[k].device)) for k, v in expected.items()})


# --------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------
class FP4QuantTile(Tile):
    """bf16 [rows, dim] -> packed FP4 uint8 [rows, dim // 2] + scale bytes uint8 [rows, dim // group]."""

    def __init__(self, name: str, dim: int, scale_format: str):
        self.name, self.dim, self.scale_format = name, dim, scale_format
        self.group = SCALE_GROUP[scale_format]
        self.description = f"FP4 quantise [rows, {dim}] bf16, group {self.group}, {scale_format.upper()} scales"

    def shapes(self) -> list[Shape]:
        return fp4_rows(self.dim)

    def search_space(self, arch: Arch) -> SearchSpace:
        return fp4_search_space(self.scale_format, value_bytes=2)

    def default_config(self, arch: Arch) -> Config:
        return fp4_default_config(self.scale_format)

    def fit_call(self, config: Config, shape: Shape, arch: Arch) -> Config:
        """A row width the picked vector does not divide runs one group per thread."""
        if self.search_space(arch).violations(config, shape, arch):
            return {**config, "groups_per_thread": 1}
        return config

    def build(self, shape: Shape, config: Config, arch: Arch):
        c = self.with_defaults(arch, config)
        return quant_kernel(shape["dim"], self.scale_format, "bfloat16", c, arch)

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        return quant_inputs(shape["rows"], shape["dim"], self.scale_format, seed, device)

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        packed = poisoned((x.shape[0], x.shape[1] // 2), torch.uint8, x.device)  # [rows, dim // 2]
        scales = poisoned((x.shape[0], x.shape[1] // self.group), torch.uint8, x.device)  # [rows, dim // group]
        return {"packed": packed, "scales": scales}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kernel(inputs["x"], outputs["packed"], outputs["scales"])

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.fp4.api import fp4_quantize

        return lambda: fp4_quantize(inputs["x"], self.group, self.scale_format, config=config)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        packed, scales = formats.fp4_quantize(inputs["x"], self.group, self.scale_format)
        return {"packed": packed, "scales": scales}

    def compare(self, outputs, expected) -> Comparison:
        return bit_exact_nan_canonical(outputs, expected)

    def bytes_moved(self, shape: Shape) -> float:
        rows, dim = shape["rows"], shape["dim"]
        return rows * (dim * 2 + dim // 2 + dim // self.group)


class FP4DequantTile(FP4QuantTile):
    """packed FP4 uint8 [rows, dim // 2] + scale bytes uint8 [rows, dim // group] -> bf16 [rows, dim] (fp32 through the public function)."""

    def __init__(self, name: str, dim: int, scale_format: str):
        super().__init__(name, dim, scale_format)
        self.description = f"FP4 dequantise to [rows, {dim}] bf16, group {self.group}, {scale_format.upper()} scales"

    def search_space(self, arch: Arch) -> SearchSpace:
        return fp4_search_space(self.scale_format, value_bytes=2, quantise=False)

    def default_config(self, arch: Arch) -> Config:
        return fp4_default_config(self.scale_format, quantise=False)

    def build(self, shape: Shape, config: Config, arch: Arch):
        c = self.with_defaults(arch, config)
        return dequant_kernel(shape["dim"], self.scale_format, "bfloat16", c, arch)

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        return dequant_inputs(shape["rows"], shape["dim"], self.scale_format, seed, device)

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        packed = inputs["packed"]
        return {"out": poisoned((packed.shape[0], packed.shape[1] * 2), torch.bfloat16, packed.device)}  # [rows, dim]

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kernel(inputs["packed"], inputs["scales"], outputs["out"])

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.fp4.api import fp4_dequantize

        return lambda: fp4_dequantize(inputs["packed"], inputs["scales"], self.group, self.scale_format, config=config)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        out = formats.fp4_dequantize(inputs["packed"], inputs["scales"], self.group, self.scale_format)
        return {"out": out.to(torch.bfloat16)}


TILES = [
    FP4QuantTile("fp4_quant_main", MAIN_DIM, "e4m3"),
    FP4QuantTile("fp4_quant_index", INDEX_DIM, "e8m0"),
    FP4DequantTile("fp4_dequant_main", MAIN_DIM, "e4m3"),
    FP4DequantTile("fp4_dequant_index", INDEX_DIM, "e8m0"),
]
