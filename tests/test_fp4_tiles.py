"""FP4 quantise/dequantise tiles: compile for sm80/sm90 on the CPU; bit-exact with model.formats on the GPU."""

from __future__ import annotations

import pytest
import torch

from model import formats
from tiles import fp4
from tiles.arch import detect, get_arch
from tiles.contract import Shape, TileError
from tiles.registry import get_tile

FP4_TILES = ["fp4_quant_main", "fp4_quant_index", "fp4_dequant_main", "fp4_dequant_index"]
FORMATS = [(16, "e4m3", fp4.MAIN_DIM), (32, "e8m0", fp4.INDEX_DIM)]


def _small(tile) -> Shape:
    return tile.shape("decode_b64")


# --- CPU: compile, search space, inputs, argument checks --------------------------------
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("name", FP4_TILES)
def test_compiles_default_config(name, arch):
    tile, a = get_tile(name), get_arch(arch)
    kernel = tile.build(_small(tile), tile.default_config(a), a)
    src = kernel.get_kernel_source()
    # exactness needs IEEE division and kept denormals: no fast-math intrinsics in the source
    assert "__fdividef" not in src and "__frcp" not in src and "__expf" not in src


@pytest.mark.parametrize(
    "name, config",
    [
        ("fp4_quant_main", {"staging": "shared", "groups_per_thread": 4, "threads": 128, "grid": "persistent"}),
        ("fp4_dequant_index", {"staging": "shared", "groups_per_thread": 2, "threads": 64, "grid": "persistent"}),
    ],
    ids=["quant-main-shared-persistent", "dequant-index-shared-persistent"],
)
def test_compiles_structural_variants(name, config):
    tile, a = get_tile(name), get_arch("sm90")
    assert tile.search_space(a).violations(config, _small(tile), a) == []
    src = tile.build(_small(tile), config, a).get_kernel_source()
    assert "__shared__" in src


@pytest.mark.parametrize("name", FP4_TILES)
def test_default_config_is_valid_everywhere(name):
    tile = get_tile(name)
    for arch in ("sm80", "sm89", "sm90", "sm100"):
        a = get_arch(arch)
        for shape in tile.shapes():
            assert tile.search_space(a).violations(tile.default_config(a), shape, a) == []


def test_default_moves_16_bytes_per_packed_access():
    for group, fmt, _ in FORMATS:
        c = fp4.fp4_default_config(fmt)
        assert c["groups_per_thread"] * group // 2 == 16 and c["staging"] == "registers"


def test_constraints_prune():
    index, main = get_tile("fp4_quant_index"), get_tile("fp4_quant_main")
    sm89, sm90 = get_arch("sm89"), get_arch("sm90")
    big = {"staging": "shared", "groups_per_thread": 8, "threads": 512, "grid": "tiles"}
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
    assert torch.isin(v.abs(), torch.tensor(formats._E2M1_MIDPOINTS)).sum() > dim // 4
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
        {"staging": "shared", "groups_per_thread": 1, "threads": 128, "grid": "tiles"},
        {"staging": "registers", "groups_per_thread": 4, "threads": 64, "grid": "persistent"},
        {"staging": "shared", "groups_per_thread": 2, "threads": 512, "grid": "persistent"},
    ],
    ids=["shared-tiles", "registers-persistent", "shared-persistent"],
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group, fmt, dim", FORMATS, ids=["main", "index"])
def test_public_quantize_matches_formats(group, fmt, dim, dtype):
    x = fp4.quant_inputs(3 * 41, dim, fmt, seed=7, device="cuda", dtype=dtype)["x"].reshape(3, 41, dim)
    if dtype == torch.float32:
        x[0, 0, :group] = torch.tensor([-1e-45, 1e-45] * (group // 2))  # denormals that divide to (-)0
    packed, scales = fp4.fp4_quantize(x, group, fmt)
    ref_packed, ref_scales = formats.fp4_quantize(x, group, fmt)
    assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group, fmt, dim", FORMATS, ids=["main", "index"])
def test_public_dequantize_every_byte(group, fmt, dim, out_dtype):
    # every packed byte against every scale byte: row r carries scale byte r in all its groups
    packed = (torch.arange(256 * dim // 2, device="cuda") % 256).to(torch.uint8).reshape(256, dim // 2)
    scales = torch.arange(256, device="cuda").to(torch.uint8)[:, None].expand(256, dim // group).contiguous()
    out = fp4.fp4_dequantize(packed, scales, group, fmt, out_dtype=out_dtype)
    ref = formats.fp4_dequantize(packed, scales, group, fmt).to(out_dtype)
    assert fp4.bit_exact_nan_canonical({"y": out}, {"y": ref}).ok


@pytest.mark.gpu
def test_round_trip_and_empty_rows():
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    y = fp4.fp4_dequantize(*fp4.fp4_quantize(x), out_dtype=torch.float32)
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
