"""Conformance with the official DeepSeek-V4.1 inference code (``inference/model.py`` + ``kernel.py``).

Each rule gets a small case whose answer can be checked by hand from the official semantics, and
the model gets one end-to-end check: after a CED prefill and decode steps across group boundaries,
every KV source's caches equal what the official order of operations gives from the compressor's
own inputs (index keys from the latent *before* RoPE). The three deliberate differences
(``model/__init__.py``) are tested as such. CPU, float64 where a model runs, seconds.
"""

import math

import pytest
import torch

from model import build_model, formats, preset
from model.backend import INDEX_GROUP, INDEX_SCALE, MAIN_GROUP, MAIN_SCALE, TorchBackend
from model.config import PRESETS, LayerMode
from model.ops.compressor import index_keys
from model.ops.norm import rms_norm
from model.ops.rope import RopeConfig, rope_tables

F32 = torch.float32
ROPE2 = RopeConfig(rope_dim=2, theta=10000.0)  # one rotating pair: the angle of position p is p radians


# -- index keys ---------------------------------------------------------------------------------------


def test_index_key_projects_the_latent_before_rope():
    """Latent ``[0, 0, 1, 0]`` (RoPE rotates its last two dims), Wk row 0 reads the latent's last dim.

    Before RoPE that dim is 0, so ``k[0]`` is 0; from the rotated latent it would be ``sin(p)``. The key's own RoPE then
    rotates k's last two dims at the same position ``p = group * ratio``."""
    latent = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)  # [B=1, G=1, D=4]
    wk = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    first_group, ratio = 3, 2  # position 6: angle 6 rad
    k = index_keys(latent, wk, torch.ones(4, dtype=torch.float64), first_group, ratio, ROPE2, eps=1e-20)
    # wk @ latent = [0, 0, 1, 0]; k_norm: rms = 1/2, so [0, 0, 2, 0]; RoPE of the pair (2, 0) by 6 rad: (2 cos 6, 2 sin 6)
    want = torch.tensor([0.0, 0.0, 2 * math.cos(6.0), 2 * math.sin(6.0)], dtype=torch.float64)
    torch.testing.assert_close(k[0, 0], want, rtol=1e-6, atol=1e-6)  # the angle passes through float32 cos/sin tables


def test_backend_index_cache_is_the_pre_rope_projection():
    """TorchBackend.compressor's index cache is fp4(rope(k_norm(Wk latent))) with the latent unrotated, its main cache
    fp4(rope(latent)), for random groups at a nonzero first group (positions far from 0 rotate by a lot)."""
    gen = torch.Generator().manual_seed(5)
    B, G, D, Di, ratio, first = 2, 6, 64, 32, 2, 1000
    kv = torch.randn(B, G * ratio, D, generator=gen, dtype=torch.float64)
    gate = torch.randn(B, G * ratio, D, generator=gen, dtype=torch.float64)
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    wk = torch.randn(Di, D, generator=gen, dtype=torch.float64) / 8
    k_norm_w = 1 + 0.1 * torch.randn(Di, generator=gen, dtype=torch.float64)
    rope = RopeConfig(rope_dim=16, theta=160000.0, yarn_factor=16.0, original_seq_len=4096)
    got = TorchBackend().compressor(kv, gate, ratio, first, norm_w, wk, k_norm_w, rope, 1e-20)
    latent = _official_latents(kv, gate, ratio, norm_w, 1e-20)
    positions = (first + torch.arange(G)) * ratio
    main = _official_rope(latent, positions, rope)
    keys = _official_rope(rms_norm(latent @ wk.t(), k_norm_w, 1e-20), positions, rope)
    want = (*formats.fp4_quantize(main, MAIN_GROUP, MAIN_SCALE), *formats.fp4_quantize(keys, INDEX_GROUP, INDEX_SCALE))
    for name, a, b in zip(("main_packed", "main_scales", "index_packed", "index_scales"), got, want):
        assert torch.equal(a, b), name
    rotated_keys = _official_rope(rms_norm(main @ wk.t(), k_norm_w, 1e-20), positions, rope)
    assert not torch.equal(got[2], formats.fp4_quantize(rotated_keys, INDEX_GROUP, INDEX_SCALE)[0])  # the test can tell


# -- quantisers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amax", "byte"),
    [(448.0, 127), (0.05, 114), (1e-4, 105), (1e-6, 105), (0.0, 105)],
    ids=["amax448", "amax0.05", "at_floor", "below_floor", "zero"],
)
def test_fp8_window_scale_floors_amax_at_1e_4(amax, byte):
    """Official ``act_quant``: ``amax = max(amax, 1e-4)``, ``s = 2^ceil(log2(amax / 448))``.
    448 -> 2^0 (byte 127); 0.05/448 = 1.12e-4 -> 2^-13 (114); anything at or below 1e-4: 2.2e-7 -> 2^-22 (105)."""
    x = torch.zeros(32)
    x[7] = -amax
    _, scales = formats.fp8_quantize(x)
    assert scales.item() == byte


def test_fp8_values_divide_by_the_floored_scale():
    """Values at 1e-6 in a group of amax 1e-6: the scale is 2^-22 (the floor), so 1e-6 / 2^-22 = 4.19 -> E4M3 4.0."""
    codes, scales = formats.fp8_quantize(torch.full((32,), 1e-6))
    assert scales.item() == 105 and formats.e4m3_decode(codes).eq(4.0).all()


@pytest.mark.parametrize(
    ("maximum", "exponents"), [(6.0, (1, 2, 3, 20, 127, 200)), (448.0, (1, 2, 3, 112, 127, 200))], ids=["fp4_e8m0", "fp8"]
)
def test_e8m0_scale_division_equals_the_official_reciprocal_multiply(maximum, exponents):
    """The official kernels form ``amax * fp32(1 / max)`` and take ``2^ceil(log2(.))`` from its bits; we divide. Every
    float32 significand at each exponent (the ceiling depends on the significand alone, the exponent only shifts it,
    except near the subnormal end) gives the same scale byte both ways."""
    significands = torch.arange(1 << 23, dtype=torch.int32)
    inverse = torch.tensor(1.0 / maximum, dtype=F32)
    for e in exponents:
        amax = ((e << 23) | significands).view(F32)
        assert torch.equal(formats.e8m0_encode_ceil(amax / maximum), formats.e8m0_encode_ceil(amax * inverse)), f"exponent field {e}"


@pytest.mark.parametrize(
    ("fmt", "amax", "byte"),
    [
        ("e4m3", 0.0, 0x01),  # max(0, 6 * 2^-9) / 6 = 2^-9: the smallest E4M3 subnormal
        ("e4m3", 6.0, 0x38),  # 1.0
        ("e4m3", 9.0, 0x3C),  # 1.5
        ("e4m3", 6.0 * 448, 0x7E),  # 448, the largest finite
        ("e4m3", 1e9, 0x7E),  # saturates
        ("e8m0", 0.0, 1),  # max(0, 6 * 2^-126) / 6 = 2^-126
        ("e8m0", 6.0, 127),  # 2^0
        ("e8m0", 6.5, 128),  # 2^ceil(log2(1.08)) = 2^1
        ("e8m0", 3.0, 126),  # 2^-1
    ],
)
def test_fp4_scale_rules_are_the_official_ones(fmt, amax, byte):
    """Official ``fp4_act_quant``: E4M3 ``s = e4m3_satfinite(max(amax, 6 * 2^-9) / 6)``; E8M0 ``s = 2^ceil(log2(max(amax,
    6 * 2^-126) / 6))``; values ``e2m1_rne(clamp(x / s, -6, 6))``."""
    group = formats.SCALE_FORMATS[fmt]
    x = torch.zeros(group)
    x[1] = amax
    packed, scales = formats.fp4_quantize(x, group, fmt)
    assert scales.item() == byte
    s = formats.e4m3_decode(scales) if fmt == "e4m3" else formats.e8m0_decode(scales)
    want_code = formats.e2m1_encode(torch.clamp(torch.tensor([amax], dtype=F32) / s, -6, 6))
    assert formats.unpack_nibbles(packed)[1] == want_code[0]


# -- RMSNorm epsilon ----------------------------------------------------------------------------------


def test_norm_eps_is_the_official_value_in_every_preset_and_norm():
    """``norm_eps`` 1e-20 (the official configuration), in every RMSNorm a built model holds."""
    for name in PRESETS:
        assert preset(name).norm_eps == 1e-20, name
    model = build_model(preset("tiny"), seed=0)
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) > 10 and all(m.eps == 1e-20 for m in norms)


def test_norm_eps_keeps_tiny_rows_at_unit_rms():
    """A row of 1e-8s: with eps 1e-20 the norm gives 1.0 (1e-16 + 1e-20 ~ 1e-16); with 1e-6 it would give 1e-5."""
    x = torch.full((1, 8), 1e-8, dtype=torch.float64)
    y = rms_norm(x, torch.ones(8, dtype=torch.float64), preset("v4.1-flash").norm_eps)
    torch.testing.assert_close(y, torch.ones_like(y), rtol=1e-4, atol=0)


# -- deliberate differences ---------------------------------------------------------------------------


class _RecordingBackend(TorchBackend):
    """Records the index cache each indexer_topk call scores against."""

    def __init__(self) -> None:
        super().__init__()
        self.scored: list[tuple[int, int]] = []  # (data_ptr, entries)

    def indexer_topk(self, q_packed, q_scales, weights, index_packed, index_scales, n_visible, k):
        self.scored.append((index_packed.data_ptr(), index_packed.shape[1]))
        return super().indexer_topk(q_packed, q_scales, weights, index_packed, index_scales, n_visible, k)


def test_ratio2_decode_with_a_filling_group_scores_its_own_groups_keys():
    """tiny: layers 1, 3 are ratio-2 Full layers, 4 the decoder's ratio-1 source. At a decode step that brings the first
    token of a group, layer 1 publishes no key; it still scores against its own group's cache (the official indexer would
    read the index cache layer 4 published last)."""
    cfg = preset("tiny")
    backend = _RecordingBackend()
    model = build_model(cfg, backend=backend, dtype=torch.float64, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    _, cache = model.prefill(tokens)  # 10 tokens: 5 complete ratio-2 groups
    backend.scored.clear()
    model.decode(torch.tensor([3, 4]), cache)  # position 10: the first token of group 5, still filling
    full_layers = [p.index for p in cfg.layer_plan() if p.mode == LayerMode.FULL]
    assert len(backend.scored) == len(full_layers)
    for layer, (ptr, entries) in zip(full_layers, backend.scored):
        own = cache.globals[layer]
        assert ptr == own.index()[0].data_ptr() and entries == own.n, f"layer {layer}"
    assert cache.globals[1].n == 5 and cache.globals[4].n == 11  # the two caches differ, so the check can tell


def test_reindex_fills_with_minus_one_when_the_pool_holds_fewer_than_topk():
    """8 visible entries, a pool of one block of 2 (entries 4, 5), top-4: ``[4, 5, -1, -1]`` (the official code would fill
    the last two slots with visible entries outside the pool)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 2, 32, generator=gen)
    k = torch.randn(1, 8, 32, generator=gen)
    q_packed, q_scales = formats.fp4_quantize(q, INDEX_GROUP, INDEX_SCALE)
    k_packed, k_scales = formats.fp4_quantize(k, INDEX_GROUP, INDEX_SCALE)
    weights, n_visible = torch.ones(1, 1, 2), torch.tensor([[8]])
    pool = torch.tensor([[[2]]], dtype=torch.int32)
    got = TorchBackend().reindex_topk(q_packed, q_scales, weights, k_packed, k_scales, n_visible, pool, 2, 4)
    assert got.tolist() == [[[4, 5, -1, -1]]]


def test_rope_angles_are_float64_products():
    """cos/sin at position p are those of ``p * f`` taken in float64 (f the float32 frequency); the official float32
    product differs by about 2^-24 of the angle: 4e-3 rad at position 65,535 for the fastest pair (f = 1)."""
    cfg = preset("v4.1-flash").compress_rope()
    freq = cfg.inv_freq()  # float32 [32]
    positions = torch.tensor([0, 1, 4097, 65535, 1 << 20])
    cos, sin = rope_tables(cfg, positions)
    angle64 = positions.double().unsqueeze(-1) * freq.double()
    assert torch.equal(cos, torch.cos(angle64).float()) and torch.equal(sin, torch.sin(angle64).float())
    angle32 = torch.outer(positions.float(), freq)  # the official tables' angles
    off = (angle32.double() - angle64).abs()
    assert off[3].max() > 1e-4 and off[3].max() < 8e-3  # a real difference at 64K, of the expected size
    assert off[:2].max() == 0  # none at positions 0 and 1


# -- end to end ---------------------------------------------------------------------------------------


def _official_latents(kv: torch.Tensor, gate: torch.Tensor | None, ratio: int, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """The official Compressor's output for complete groups, written out: per-channel softmax pooling over the ``ratio``
    tokens of a group, then RMSNorm; no RoPE. [B, G * ratio, D] -> [B, G, D]."""
    B, N, D = kv.shape
    if ratio == 1:
        pooled = kv
    else:
        w = gate.view(B, N // ratio, ratio, D).softmax(dim=2)
        pooled = (kv.view(B, N // ratio, ratio, D) * w).sum(dim=2)
    return pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm_w


def _official_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """The official ``apply_rotary_emb`` on x's last ``rope_dim`` dims: adjacent pairs as complex numbers times
    ``exp(i p f)`` (angles in float64: our one deliberate RoPE difference). x [B, G, N], positions [G]."""
    r = rope.rope_dim
    angle = positions.double().unsqueeze(-1) * rope.inv_freq().double()  # [G, r/2]
    freqs = torch.polar(torch.ones_like(angle), angle).to(torch.complex128)
    tail = torch.view_as_complex(x[..., -r:].double().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(tail * freqs).flatten(-2)
    return torch.cat([x[..., :-r].double(), rotated], dim=-1)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_every_source_layers_caches_follow_the_official_order_after_prefill_and_decode(name):
    """float64 model, CED prefill of 21 tokens (odd: ratio-2 groups left filling) then 6 decode steps (groups complete
    and start again): each KV source's main cache is fp4(rope(latent)) and its index cache fp4(rope(k_norm(Wk latent)))
    with the latent *before* RoPE, rebuilt from the compressor's inputs recorded during the run."""
    cfg = preset(name)
    model = build_model(cfg, dtype=torch.float64, seed=3)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # random norm weights, so a norm applied in the wrong place shows
        for layer in model.layers:
            comp = layer.attn.compressor
            if comp is not None:
                comp.norm.weight.copy_(1 + 0.2 * torch.randn(comp.norm.weight.shape, generator=gen, dtype=torch.float64))
                comp.k_norm.weight.copy_(1 + 0.2 * torch.randn(comp.k_norm.weight.shape, generator=gen, dtype=torch.float64))
    inputs: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        comp = layer.attn.compressor
        if comp is not None:
            inputs[i] = []
            project = comp.project

            def recording(x, project=project, seen=inputs[i]):
                seen.append(x.clone())
                return project(x)

            comp.project = recording
    tokens = torch.randint(0, cfg.vocab_size, (2, 27), generator=gen)
    _, cache = model.prefill(tokens[:, :21])
    for t in range(21, 27):
        model.decode(tokens[:, t], cache)
    rope = cfg.compress_rope()
    for i, seen in inputs.items():
        comp, ratio = model.layers[i].attn.compressor, cfg.compress_ratios[i]
        x = torch.cat(seen, dim=1)  # [B, 27, dim]: every token this source compressed, in order
        assert x.shape[1] == 27, f"layer {i}"
        n = x.shape[1] // ratio * ratio
        kv = x[:, :n] @ comp.wkv.weight.t()
        gate = x[:, :n] @ comp.wgate.weight.t() if ratio > 1 else None
        latent = _official_latents(kv, gate, ratio, comp.norm.weight, cfg.norm_eps)  # [B, G, D] before RoPE
        positions = torch.arange(latent.shape[1]) * ratio
        main = _official_rope(latent, positions, rope)
        keys = _official_rope(rms_norm(latent @ comp.wk.weight.t(), comp.k_norm.weight, cfg.norm_eps), positions, rope)
        glob = cache.globals[i]
        assert glob.n == latent.shape[1], f"layer {i}"
        for got, want, what in (
            (glob.main(), formats.fp4_quantize(main, MAIN_GROUP, MAIN_SCALE), "main"),
            (glob.index(), formats.fp4_quantize(keys, INDEX_GROUP, INDEX_SCALE), "index"),
        ):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {i} {what} cache"
