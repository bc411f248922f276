"""The reference CSA2/CED model (model.model) on preset tiny in fp32.

tiny: window 8, ratio-2 encoder sources at layers 1 and 3, decoder source 4 (ratio 1) with
the candidate pool (blocks of 2, at most 4), Reindex layer 6, top-k 6. Lengths past 16 cross
the window, the encoder and decoder top-k, and the pool limit.

Equivalence tests (decode vs forward vs CED prefill) run the model in float64, where the
reference computes in double precision and the stored formats stay FP8/FP4: float32 GEMMs of
different batch shapes differ in the last bit, which now and then flips an FP8/FP4 code or a
near-tied top-k choice and moves later logits by 1e-3..1e-1; in float64 that does not happen
and decode reproduces forward to ~1e-14. The float32 model is checked too, with that caveat.
"""

from __future__ import annotations

import sys

import pytest
import torch

from model import BackendError, InputError, InputTypeError, LayerMode, Model, TorchBackend, build_model, count_parameters, preset
from model.config import PRESETS

TOL = {"rtol": 1e-9, "atol": 1e-9}


@pytest.fixture(scope="module")
def tiny() -> Model:
    """float64, for exact equivalence."""
    return build_model(preset("tiny"), backend="torch", device="cpu", dtype=torch.float64, seed=0)


@pytest.fixture(scope="module")
def tiny32() -> Model:
    return build_model(preset("tiny"), backend="torch", device="cpu", dtype=torch.float32, seed=0)


def _tokens(cfg, B: int, N: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, N), generator=torch.Generator().manual_seed(seed))


# -- build -----------------------------------------------------------------------------------------


def test_build_is_deterministic_from_seed(tiny32):
    again = build_model(preset("tiny"), seed=0)
    other = build_model(preset("tiny"), seed=1)
    for (name, a), b, c in zip(tiny32.named_parameters(), again.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.numel() == 1 or not torch.equal(a, c) or "norm" in name, name


def test_init_magnitudes(tiny32):
    attn = tiny32.layers[1].attn
    assert torch.equal(attn.kv_norm.weight, torch.ones_like(attn.kv_norm.weight))
    assert attn.sink.dtype == torch.float32 and 0 < attn.sink.abs().max() < 1
    w = attn.wq_b.weight  # [H*D, q_lora]: std ~ q_lora^-0.5
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.1


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_parameters_matches_the_module(name):
    cfg = preset(name)
    with torch.device("meta"):
        m = Model(cfg, TorchBackend())
    assert count_parameters(cfg) == sum(p.numel() for p in m.parameters())


def test_owned_modules_follow_the_layer_mode(tiny):
    for block in tiny.layers:
        mode = block.attn.plan.mode
        assert (block.attn.compressor is not None) == (mode == LayerMode.FULL)
        assert (block.attn.indexer is not None) == (mode in (LayerMode.FULL, LayerMode.REINDEX))
    reuse = [b for b in tiny.layers if b.attn.plan.mode == LayerMode.REUSE]
    assert reuse and all(not any("compressor" in n or "indexer" in n for n, _ in b.named_parameters()) for b in reuse)


# -- forward vs decode vs CED prefill ---------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 7, 16, 33], ids=lambda n: f"N{n}")
def test_decode_token_by_token_matches_forward(tiny, N):
    tokens = _tokens(tiny.cfg, 2, N, seed=N)
    full = tiny.forward(tokens)
    assert full.shape == (2, N, tiny.cfg.vocab_size) and full.dtype == torch.float64
    cache = tiny.new_cache(2)
    steps = torch.stack([tiny.decode(tokens[:, i], cache) for i in range(N)], dim=1)
    torch.testing.assert_close(steps, full, **TOL)
    assert cache.n_tokens == N


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_decode_matches_forward_in_float32_up_to_rare_code_flips(tiny32, seed):
    """float32: the forward's batched matmuls round unlike the decode's one-token ones, so an FP8/FP4 code that sits on a
    rounding boundary can flip by one step. The window KV is FP8 from the first token, so a flip can start at any
    position, and in a model this small (32-dim heads, top-6) it compounds through the later layers and tokens: seed 0
    row 0 parts at position 7 (a one-step FP8 flip in layer 1's window) and its logits then move by up to ~1. What
    must hold is that most positions agree to 1e-5: a wrong decode moves every position. The float64 tests above
    require exact agreement everywhere."""
    tokens = _tokens(tiny32.cfg, 2, 33, seed=200 + seed)
    full = tiny32.forward(tokens)
    assert full.dtype == torch.float32
    cache = tiny32.new_cache(2)
    steps = torch.stack([tiny32.decode(tokens[:, i], cache) for i in range(33)], dim=1)
    err = (steps - full).abs().amax(-1)  # [B, N]
    assert (err < 1e-5).float().mean() > 0.5, err


@pytest.mark.parametrize("S", [2, 3], ids=lambda s: f"S{s}")
def test_multi_token_decode_steps_match_forward(tiny, S):
    tokens = _tokens(tiny.cfg, 1, 7 * S, seed=40 + S)
    full = tiny.forward(tokens)
    cache = tiny.new_cache(1)
    steps = torch.cat([tiny.decode(tokens[:, i : i + S], cache) for i in range(0, tokens.shape[1], S)], dim=1)
    torch.testing.assert_close(steps, full, **TOL)


@pytest.mark.parametrize("N", [1, 5, 8], ids=lambda n: f"N{n}")
def test_ced_prefill_is_exact_within_the_window(tiny, N):
    assert N <= tiny.cfg.window
    tokens = _tokens(tiny.cfg, 2, N + 12, seed=100 + N)
    full = tiny.forward(tokens)
    logits, cache = tiny.prefill(tokens[:, :N])
    assert logits.shape == (2, tiny.cfg.vocab_size)
    torch.testing.assert_close(logits, full[:, N - 1], **TOL)
    steps = torch.stack([tiny.decode(tokens[:, i], cache) for i in range(N, N + 12)], dim=1)
    torch.testing.assert_close(steps, full[:, N:], **TOL)


def test_non_ced_prefill_equals_forward(tiny):
    tokens = _tokens(tiny.cfg, 2, 21, seed=9)
    full = tiny.forward(tokens)
    logits, cache = tiny.prefill(tokens, ced=False)
    torch.testing.assert_close(logits, full[:, -1], **TOL)
    torch.testing.assert_close(tiny.decode(tokens[:, 0], cache), tiny.forward(torch.cat([tokens, tokens[:, :1]], 1))[:, -1], **TOL)


def test_ced_prefill_past_the_window_is_bounded_replay(tiny):
    cfg = tiny.cfg
    N = 21
    tokens = _tokens(cfg, 2, N, seed=7)
    full, ref = tiny.forward(tokens, return_cache=True)
    logits, cache = tiny.prefill(tokens)
    # Global KV (encoder groups and the decoder group built from H_E) is exact.
    for src in ref.globals:
        assert torch.equal(ref.globals[src].main()[0], cache.globals[src].main()[0]), src
        assert torch.equal(ref.globals[src].index()[0], cache.globals[src].index()[0]), src
    for i in range(cfg.n_encoder_layers):
        assert torch.equal(ref.rings[i].codes, cache.rings[i].codes), i
    # Decoder rings hold only the replayed tail; the tail misses earlier decoder states.
    for i in range(cfg.n_encoder_layers, cfg.n_layers):
        assert (cache.rings[i].start, cache.rings[i].end) == (N - cfg.window, N)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits, full[:, -1], rtol=1e-4, atol=1e-4)
    nxt = tiny.decode(tokens[:, -1], cache)
    assert nxt.shape == (2, cfg.vocab_size) and torch.isfinite(nxt).all()


def test_causality(tiny):
    tokens = _tokens(tiny.cfg, 1, 24, seed=11)
    base = tiny.forward(tokens)
    for t in (5, 16, 23):
        changed = tokens.clone()
        changed[0, t] = (changed[0, t] + 1) % tiny.cfg.vocab_size
        out = tiny.forward(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t], base[:, t])


def test_batch_rows_are_independent(tiny):
    tokens = _tokens(tiny.cfg, 3, 18, seed=12)
    both = tiny.forward(tokens)
    torch.testing.assert_close(tiny.forward(tokens[1:2]), both[1:2], **TOL)


# -- sharing is real ------------------------------------------------------------------------------


def _attn_out_with_pinned_input(model: Model, tokens: torch.Tensor, layer: int, pinned: torch.Tensor | None):
    """Run forward; return (input of block ``layer``, its attention output). With ``pinned``, that block's input is replaced."""
    seen = {}

    def pre(module, args):
        seen["input"] = args[0]
        return (pinned, *args[1:]) if pinned is not None else None

    def post(module, args, out):
        seen["attn"] = out

    block = model.layers[layer]
    handles = [block.register_forward_pre_hook(pre), block.attn.register_forward_hook(post)]
    try:
        model.forward(tokens)
    finally:
        for h in handles:
            h.remove()
    return seen["input"], seen["attn"]


def _perturbed(model: Model, param: torch.nn.Parameter):
    class Ctx:
        def __enter__(self):
            self.saved = param.detach().clone()
            with torch.no_grad():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(99)) * param.abs().mean())

        def __exit__(self, *exc):
            with torch.no_grad():
                param.copy_(self.saved)

    return Ctx()


@pytest.mark.parametrize(
    ("source", "reader", "param"),
    [
        pytest.param(1, 2, "compressor.wkv.weight", id="encoder-KV-source1-to-reuse2"),
        pytest.param(1, 2, "indexer.wq.weight", id="encoder-topk-source1-to-reuse2"),
        pytest.param(4, 5, "compressor.wkv.weight", id="decoder-KV-source4-to-reuse5"),
        pytest.param(4, 6, "indexer.wq.weight", id="pool-source4-to-reindex6"),
        pytest.param(6, 7, "indexer.wq.weight", id="reindex6-topk-to-reuse7"),
    ],
)
def test_reader_sees_its_source(tiny, source, reader, param):
    """With the reader's input pinned, only state shared from ``source`` can change its attention output."""
    tokens = _tokens(tiny.cfg, 2, 33, seed=21)
    x_in, base = _attn_out_with_pinned_input(tiny, tokens, reader, None)
    with _perturbed(tiny, tiny.layers[source].attn.get_parameter(param)):
        _, out = _attn_out_with_pinned_input(tiny, tokens, reader, x_in)
    assert not torch.allclose(out, base, rtol=1e-4, atol=1e-4)
    _, again = _attn_out_with_pinned_input(tiny, tokens, reader, x_in)
    assert torch.equal(again, base)


def test_reuse_layer_before_a_reindex_layer_ignores_it(tiny):
    """Reuse layer 5 reads layer 4's top-k: perturbing Reindex layer 6's indexer changes nothing up to layer 5."""
    tokens = _tokens(tiny.cfg, 2, 33, seed=22)
    _, base = _attn_out_with_pinned_input(tiny, tokens, 5, None)
    with _perturbed(tiny, tiny.layers[6].attn.indexer.wq.weight):
        _, out = _attn_out_with_pinned_input(tiny, tokens, 5, None)
    assert torch.equal(out, base)


# -- backend seam -----------------------------------------------------------------------------------


class RecordingBackend(TorchBackend):
    """The torch backend, counting calls per method."""

    def __init__(self):
        super().__init__("cpu")
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("fp4_quantize", "fp8_quantize", "compressor", "indexer_topk", "candidate_pool", "reindex_topk", "sparse_attention"):
            calls = super().__getattribute__("calls")
            calls[name] = calls.get(name, 0) + 1
        return attr


def test_every_accelerated_op_goes_through_the_backend(tiny32):
    rec = RecordingBackend()
    m = build_model(preset("tiny"), backend=rec, seed=0)
    rec.calls.clear()  # build_model looked each method up once to check the seam
    tokens = _tokens(m.cfg, 1, 20, seed=3)
    torch.testing.assert_close(m.forward(tokens), tiny32.forward(tokens), rtol=0, atol=0)
    L = m.cfg.n_layers
    assert rec.calls["sparse_attention"] == L and rec.calls["fp8_quantize"] == L
    assert rec.calls["compressor"] == 3 and rec.calls["candidate_pool"] == 1 and rec.calls["reindex_topk"] == 1
    assert rec.calls["indexer_topk"] == 3
    assert rec.calls["fp4_quantize"] == 4 + 2 * 3  # 4 indexer queries; main KV + index K inside each compressor call


def _rope_by_concatenation(x, cos, sin, inverse=False):
    """apply_rope as written before session 13: the whole tensor widened, the rotated dims concatenated back."""
    from model.ops.precision import compute_dtype

    r = 2 * cos.shape[-1]
    xf = x.to(compute_dtype(x))
    nope, rot = xf[..., :-r], xf[..., -r:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    s = -sin if inverse else sin
    rotated = torch.stack([even * cos - odd * s, even * s + odd * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rotated], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_rotates_only_the_rope_dims_bitwise(dtype, inverse):
    """apply_rope widens only the rope dims: bitwise what widening everything and concatenating gave, and with
    ``out_dtype`` bitwise that result rounded once; x itself is never written."""
    from model.ops.rope import apply_rope

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 5, 3, 64, generator=g) * 3).to(dtype)  # [B, S, H, D], rope on the last 16 dims
    cos, sin = torch.randn(5, 1, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    before = x.clone()
    want = _rope_by_concatenation(x, cos, sin, inverse)
    got = apply_rope(x, cos, sin, inverse=inverse)
    assert got.dtype == want.dtype and torch.equal(got, want)
    narrow = apply_rope(x, cos, sin, inverse=inverse, out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, want.to(torch.bfloat16))
    assert torch.equal(x, before)


class _NarrowingBackend(TorchBackend):
    """The attention reads bf16 queries it narrows itself (what the tiles backend did before query_dtype)."""

    def sparse_attention(self, q, *args):
        return super().sparse_attention(q.to(torch.bfloat16), *args)


class _Bf16QueryBackend(TorchBackend):
    """The same attention, asking the model for bf16 queries (query_dtype)."""

    def query_dtype(self, n_heads, head_dim):
        return torch.bfloat16

    def sparse_attention(self, q, *args):
        assert q.dtype == torch.bfloat16
        return super().sparse_attention(q, *args)


def test_query_dtype_rounds_the_queries_once_in_the_model():
    """A backend that asks for bf16 queries gets bitwise the logits of one that narrowed float32 queries itself."""
    tokens = _tokens(preset("tiny").replace(), 2, 20, seed=8)
    narrowing = build_model(preset("tiny"), backend=_NarrowingBackend(), dtype=torch.float32, seed=0)
    asking = build_model(preset("tiny"), backend=_Bf16QueryBackend(), dtype=torch.float32, seed=0)
    assert torch.equal(asking.forward(tokens), narrowing.forward(tokens))
    cache_a, cache_n = asking.new_cache(2), narrowing.new_cache(2)
    for i in range(3):
        assert torch.equal(asking.decode(tokens[:, i], cache_a), narrowing.decode(tokens[:, i], cache_n))


def test_backend_errors():
    with pytest.raises(BackendError, match="unknown backend 'cuda'"):
        build_model(preset("tiny"), backend="cuda")
    with pytest.raises(BackendError, match="lacks .*sparse_attention"):
        build_model(preset("tiny"), backend=object())


def test_tiles_backend_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiles.backend", None)  # makes `import tiles.backend` fail
    with pytest.raises(BackendError, match="backend 'tiles' is unavailable .*use backend='torch'"):
        build_model(preset("tiny"), backend="tiles")


# -- options -------------------------------------------------------------------------------------------


def test_moe_option_matches_between_forward_and_decode():
    cfg = preset("tiny").replace(n_routed_experts=4, n_active_experts=2, moe_inter=24)
    m = build_model(cfg, seed=2, dtype=torch.float64)
    assert count_parameters(cfg) == sum(p.numel() for p in m.parameters())
    tokens = _tokens(cfg, 2, 11, seed=4)
    full = m.forward(tokens)
    cache = m.new_cache(2)
    steps = torch.stack([m.decode(tokens[:, i], cache) for i in range(11)], dim=1)
    torch.testing.assert_close(steps, full, **TOL)


def test_bfloat16_model_runs():
    m = build_model(preset("tiny"), dtype=torch.bfloat16, seed=0)
    tokens = _tokens(m.cfg, 1, 12, seed=5)
    logits, cache = m.prefill(tokens)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert torch.isfinite(m.decode(tokens[:, 0], cache)).all()


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        pytest.param(lambda cfg: torch.tensor([[1, cfg.vocab_size]]), InputError, "outside the vocabulary", id="id-too-large"),
        pytest.param(lambda cfg: torch.tensor([[-1, 2]]), InputError, "outside the vocabulary", id="negative-id"),
        pytest.param(lambda cfg: torch.ones(1, 4), InputTypeError, "integer tensor", id="float-tokens"),
        pytest.param(lambda cfg: [[1, 2]], InputTypeError, "torch.Tensor", id="list-tokens"),
        pytest.param(lambda cfg: torch.ones(1, 2, 3, dtype=torch.long), InputError, r"shape \[B, N\]", id="rank-3"),
        pytest.param(lambda cfg: torch.ones(4, dtype=torch.long), InputError, r"shape \[B, N\]", id="rank-1"),
        pytest.param(lambda cfg: torch.ones(1, 0, dtype=torch.long), InputError, "empty", id="empty"),
        pytest.param(lambda cfg: torch.ones(1, cfg.max_seq_len + 1, dtype=torch.long), InputError, "max_seq_len", id="too-long"),
    ],
)
@pytest.mark.parametrize("entry", ["forward", "prefill"])
def test_bad_prompts_are_rejected(tiny, entry, make, error, message):
    with pytest.raises(error, match=message):
        getattr(tiny, entry)(make(tiny.cfg))


def test_bad_decode_input_is_rejected():
    m = build_model(preset("tiny").replace(max_seq_len=6), seed=0)
    _, cache = m.prefill(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(InputError, match="the cache holds 2"):
        m.decode(torch.ones(3, dtype=torch.long), cache)
    with pytest.raises(InputError, match="KVCache"):
        m.decode(torch.ones(2, dtype=torch.long), None)
    with pytest.raises(InputTypeError, match="integer"):
        m.decode(torch.ones(2), cache)
    m.decode(torch.ones(2, dtype=torch.long), cache)
    with pytest.raises(InputError, match="max_seq_len=6"):
        m.decode(torch.ones(2, dtype=torch.long), cache)


def test_bad_build_arguments():
    with pytest.raises(TypeError, match="ModelConfig"):
        build_model("tiny")
    with pytest.raises(TypeError, match="float dtype"):
        build_model(preset("tiny"), dtype=torch.int32)
