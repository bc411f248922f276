"""The tile contract: search spaces, shapes, poisoned buffers, the registry and the comparison rules."""

from __future__ import annotations

import math
from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from tiles.core import registry
from tiles.core.arch import ArchError, device_arch, get_arch, parse_arch_list
from tiles.core.compare import bit_exact, relative_l2
from tiles.core.contract import Constraint, Param, SearchSpace, Shape, Tile, TileError, poisoned

SM90 = get_arch("sm90")
SHAPE = Shape("s", "any", {"rows": 64, "dim": 512})


def _space() -> SearchSpace:
    return SearchSpace(
        params=(Param("threads", (128, 256)), Param("staging", ("registers", "shared")), Param("vec", (1, 2, 4))),
        constraints=(
            Constraint("rows", lambda c, s, a: None if s["dim"] % (c["threads"] * c["vec"]) == 0 or c["vec"] == 1 else "uneven"),
            Constraint("smem", lambda c, s, a: "too big" if c["staging"] == "shared" and a.smem_per_block < 200 * 1024 else None),
        ),
    )


def test_search_space_valid_config_has_no_violations():
    assert _space().violations({"threads": 128, "staging": "registers", "vec": 4}, SHAPE, SM90) == []


def test_search_space_reports_unknown_and_bad_choices():
    reasons = _space().violations({"threads": 96, "staging": "registers", "vec": 1, "colour": "red"}, SHAPE, SM90)
    assert any("unknown parameters ['colour']" in r for r in reasons)
    assert any("threads=96 is not one of [128, 256]" in r for r in reasons)


@pytest.mark.parametrize("arch, bad", [("sm90", False), ("sm89", True)], ids=["sm90-fits", "sm89-too-big"])
def test_search_space_constraint_uses_arch(arch, bad):
    reasons = _space().violations({"threads": 256, "staging": "shared", "vec": 2}, SHAPE, get_arch(arch))
    assert (reasons == ["smem: too big"]) == bad and (reasons == []) != bad


def test_search_space_constraint_uses_shape():
    odd = Shape("odd", "any", {"rows": 64, "dim": 500})
    assert _space().violations({"threads": 128, "staging": "registers", "vec": 2}, odd, SM90) == ["rows: uneven"]


def test_all_configs_is_the_full_grid():
    space = _space()
    configs = space.all_configs()
    assert len(configs) == space.size() == 12
    assert len({tuple(sorted(c.items())) for c in configs}) == 12
    assert all(set(c) == set(space.names()) for c in configs)


def test_shape_distance():
    a = Shape("a", "any", {"rows": 64, "dim": 512})
    assert a.distance(a) == 0
    assert a.distance(Shape("b", "any", {"rows": 256, "dim": 512})) == pytest.approx(2.0)
    assert a.distance(Shape("c", "any", {"rows": 16, "dim": 128})) == pytest.approx(4.0)
    assert math.isinf(a.distance(Shape("d", "any", {"rows": 64})))
    assert a["rows"] == 64


@pytest.mark.parametrize(
    "dtype, fill",
    [(torch.float32, None), (torch.bfloat16, None), (torch.uint8, 255), (torch.int32, -1), (torch.int64, -1)],
    ids=["fp32", "bf16", "uint8", "int32", "int64"],
)
def test_poisoned(dtype, fill):
    t = poisoned((3, 5), dtype, "cpu")
    assert t.shape == (3, 5) and t.dtype == dtype
    if fill is None:
        assert torch.isnan(t).all()
    else:
        assert (t == fill).all()


def test_unknown_tile_lists_the_known_ones():
    with pytest.raises(TileError, match="unknown tile 'no_such_tile': choose one of .*fp4_quant_main"):
        registry.get_tile("no_such_tile")


def test_select_all_and_names():
    names = list(registry.all_tiles())
    assert [t.name for t in registry.select("all")] == names
    assert [t.name for t in registry.select("fp4_quant_main, fp4_dequant_main")] == ["fp4_quant_main", "fp4_dequant_main"]


def test_duplicate_tile_names_are_refused(monkeypatch):
    tile = SimpleNamespace(name="twin")
    mods = {"tiles.first": SimpleNamespace(TILES=[tile]), "tiles.second": SimpleNamespace(TILES=[tile])}
    monkeypatch.setattr(registry.pkgutil, "iter_modules", lambda path: [SimpleNamespace(name="first"), SimpleNamespace(name="second")])
    monkeypatch.setattr(registry.importlib, "import_module", lambda name: mods[name])
    with pytest.raises(RuntimeError, match="two tiles are named 'twin'"):
        registry.all_tiles.__wrapped__()


def test_tile_shape_lookup_names_the_choices():
    tile = registry.get_tile("fp4_quant_main")
    assert tile.shape("bulk_1m")["rows"] == 1 << 20
    with pytest.raises(TileError, match="has no shape 'nope': choose one of decode_b64"):
        tile.shape("nope")


def test_base_tile_support_reason():
    class T(Tile):
        unsupported = MappingProxyType({"sm80": "needs wgmma"})

    assert T().support_reason(get_arch("sm80")) == "needs wgmma"
    assert T().support_reason(SM90) is None


def test_arch_names():
    assert get_arch("sm_90a") is get_arch("90") is SM90
    assert [a.name for a in parse_arch_list("sm80, sm100")] == ["sm80", "sm100"]
    with pytest.raises(ArchError, match="unknown arch 'sm42'"):
        get_arch("sm42")


@pytest.mark.parametrize("capability, arch", [((9, 0), "sm90"), ((8, 9), "sm89"), ((8, 6), "sm86"), ((8, 7), "sm80"), ((10, 0), "sm100")])
def test_device_arch_takes_the_exact_capability_else_its_family(monkeypatch, capability, arch):
    """The tiles' entry points pick kernels by the tensors' GPU: its own arch, else its major family's (an sm_87 GPU runs
    sm80's kernels); a GPU of no known family is refused by name."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert device_arch("cuda:0").name == arch


def test_device_arch_refuses_an_unknown_family(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ArchError, match="compute capability 7.5 is not in tiles.core.arch"):
        device_arch("cuda:0")


# --- comparison rules --------------------------------------------------------------
def test_bit_exact_equal():
    a = torch.arange(10, dtype=torch.uint8)
    cmp = bit_exact({"q": a}, {"q": a.clone()})
    assert cmp.ok and cmp.error == 0 and str(cmp).startswith("ok")


def test_bit_exact_one_byte_off():
    a = torch.arange(10, dtype=torch.uint8)
    b = a.clone()
    b[7] ^= 1
    cmp = bit_exact({"q": b}, {"q": a})
    assert not cmp.ok and cmp.error == pytest.approx(0.1) and "first at (7,)" in cmp.detail and "WRONG" in str(cmp)


def test_bit_exact_sees_negative_zero_and_dtype():
    z = torch.zeros(4)
    assert not bit_exact({"y": -z}, {"y": z}).ok
    assert not bit_exact({"y": z.to(torch.bfloat16)}, {"y": z}).ok
    assert not bit_exact({"y": z[:3]}, {"y": z}).ok


def test_relative_l2_tolerance():
    ref = torch.ones(100)
    assert relative_l2({"y": ref + 1e-4}, {"y": ref}, tol=1e-3).ok
    bad = relative_l2({"y": ref + 1e-2}, {"y": ref}, tol=1e-3)
    assert not bad.ok and bad.error == pytest.approx(1e-2, rel=1e-3)


def test_relative_l2_nan_and_inf_positions_must_match():
    ref = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert relative_l2({"y": ref.clone()}, {"y": ref}, tol=0).ok
    moved = torch.tensor([float("nan"), 1.0, float("inf"), 2.0])
    assert not relative_l2({"y": moved}, {"y": ref}, tol=1.0).ok
    assert not relative_l2({"y": torch.ones(3)}, {"y": ref}, tol=1.0).ok


def test_relative_l2_in_chunks_is_the_whole_tensors_error(monkeypatch):
    """The chunked comparison (big outputs: a 64K prefill's is 8 GiB as fp32) gives the error of the whole tensors,
    and finds a NaN or inf in any chunk."""
    import tiles.core.compare

    g = torch.Generator().manual_seed(3)
    ref = torch.randn(4, 250, generator=g).to(torch.bfloat16)
    out = ref.float() + 1e-2 * torch.randn(4, 250, generator=g)
    whole = ((out - ref.float()).norm() / ref.float().norm()).item()
    monkeypatch.setattr(tiles.core.compare, "CHUNK", 64)  # 16 chunks, the last one part full
    assert relative_l2({"y": out}, {"y": ref}, tol=1.0).error == pytest.approx(whole, rel=1e-5)
    out[3, 249] = float("nan")  # in the last chunk
    assert not relative_l2({"y": out}, {"y": ref}, tol=1.0).ok


def test_relative_l2_zero_reference_uses_absolute_error():
    zero = torch.zeros(8)
    assert relative_l2({"y": zero.clone()}, {"y": zero}, tol=0).ok
    assert not relative_l2({"y": zero + 1.0}, {"y": zero}, tol=1e-3).ok


@pytest.mark.parametrize("arch_name", ["sm80", "sm86", "sm89", "sm90", "sm100"])
def test_every_default_names_every_parameter(arch_name):
    """The tuner enqueues the default as its first trial: a parameter the default does not name would be sampled
    there, so the "default" trial would not be the default and the study would lose its baseline (default_ms)."""
    arch = get_arch(arch_name)
    for name, tile in registry.all_tiles().items():
        if tile.support_reason(arch):
            continue
        default = tile.default_config(arch)
        assert set(tile.search_space(arch).names()) <= set(default), (name, arch_name)
        assert tile.with_defaults(arch, {}) == default, (name, arch_name)


@pytest.mark.parametrize("arch_name", ["sm80", "sm86", "sm89", "sm90", "sm100"])
def test_every_candidate_is_a_valid_config_that_differs_from_the_default(arch_name):
    """A tile's tuning candidates (Tile.candidates) are seeded only if the arch's constraints accept them: one they
    reject would be dropped silently, so every candidate must be valid where it is offered, and not the default."""
    arch = get_arch(arch_name)
    for name, tile in registry.all_tiles().items():
        if tile.support_reason(arch):
            continue
        space, default = tile.search_space(arch), tile.default_config(arch)
        for shape in tile.shapes():
            for partial, why in tile.candidates(arch, shape):
                config = tile.with_defaults(arch, partial)
                assert space.violations(config, shape, arch) == [], (name, shape.name, why)
                assert config != default, (name, shape.name, why)
