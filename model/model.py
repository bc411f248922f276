"""The CSA2/CED reference model: embedding, pre-norm residual blocks, final norm, LM head.

Three entry points, all without autograd:

* :meth:`Model.forward` tokens [B, N] -> logits [B, N, vocab]: every layer over every token
  (the non-CED architectural baseline).
* :meth:`Model.prefill` tokens [B, N] -> (logits [B, vocab] of the last position, cache):
  CED prefill (spec section 4). All N tokens pass through the encoder layers; the decoder
  KV source (the first decoder layer) compresses all N encoder outputs into the decoder
  global KV; only the last ``window`` encoder outputs pass through the decoder layers,
  seeding their SWA rings. Exact (equal to ``forward``) when N <= window; for longer
  prompts the replayed tail misses earlier decoder SWA states (bounded replay).
* :meth:`Model.decode` tokens [B] -> logits [B, vocab]: one step through every layer
  (tokens [B, S] -> [B, S, vocab] steps S tokens at once).

A batch holds sequences of equal length (equal-length prompts): one position counter
serves every sequence. Continuous batching runs on a :class:`PagedKVCache` instead
(:meth:`Model.new_paged_cache`): :meth:`Model.prefill_paged` fills one sequence from its own
prompt (CED or not), :meth:`Model.decode_paged` steps any subset of live sequences, each at its
own position; a sequence can join between any two steps and leave with ``cache.free(seq)``. Logits are float32. A float64 model computes everything in float64
(the stored formats stay FP8/FP4): decode then reproduces forward to ~1e-12, which float32
cannot promise, since batch-shape-dependent last-bit noise can flip an FP8/FP4 code or a
near-tied top-k choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.attention import Attention, Step
from model.backend import Backend, load_backend
from model.cache import KVCache
from model.config import ConfigError, LayerMode, LayerPlan, ModelConfig
from model.inputs import InputError, check_length, check_tokens
from model.layers import MoE, RMSNorm, SwiGLU
from model.ops.precision import compute_dtype
from model.paged import DEFAULT_PAGE_SIZE, PagedKVCache, SequenceError
from model.prefix import PrefixHit


@dataclass(frozen=True)
class PrefixPrefill:
    """What :meth:`Model.prefill_with_prefix` did: the new sequence, its last logits and how much came from the cache."""

    seq: int
    logits: torch.Tensor  # float32 [vocab] (float64 for a float64 model)
    hit: PrefixHit
    replayed: int  # prefix tokens run again through the encoder to rebuild its SWA rings: min(window, hit.n_tokens)
    published: int  # prefix blocks newly indexed

    @property
    def hit_tokens(self) -> int:
        return self.hit.n_tokens


class Block(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, plan)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.n_routed_experts > 0:
            self.ffn: nn.Module = MoE(cfg.dim, cfg.n_routed_experts, cfg.n_active_experts, cfg.moe_inter)
        else:
            self.ffn = SwiGLU(cfg.dim, cfg.ffn_inter)

    def forward(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """h [B, S, dim] -> [B, S, dim]."""
        dtype = h.dtype
        h = h + self.attn(self.attn_norm(h).to(dtype), step).to(dtype)
        return h + self.ffn(self.ffn_norm(h).to(dtype)).to(dtype)


class Model(nn.Module):
    """CSA2/CED language model. Build it with :func:`build_model`."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, plan) for plan in cfg.layer_plan())
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, batch: int, capacity_tokens: int = 256) -> KVCache:
        """An empty cache for ``batch`` sequences; global buffers start at ``capacity_tokens`` and grow."""
        return KVCache(self.cfg, batch, self.device, capacity_tokens, state_dtype=compute_dtype(self.embed.weight))

    def new_paged_cache(self, n_pages: int | dict[int, int], n_slots: int, page_size: int = DEFAULT_PAGE_SIZE) -> PagedKVCache:
        """An empty :class:`PagedKVCache`: ``n_pages`` pages of ``page_size`` entries per KV group (or source layer ->
        pages) and ``n_slots`` state slots (the most live sequences), on this model's device, tails in its compute dtype."""
        return PagedKVCache(self.cfg, n_pages, n_slots, page_size, self.device, state_dtype=compute_dtype(self.embed.weight))

    # -- entry points -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, return_cache: bool = False) -> torch.Tensor | tuple[torch.Tensor, KVCache]:
        """Every layer over every token (no CED).

        Args:
            tokens: int [B, N] ids, N <= max_seq_len.
            return_cache: also return the cache this pass filled (decode can continue from it).
        Returns:
            float32 logits [B, N, vocab] (and the :class:`KVCache`).
        """
        tokens = check_tokens(tokens, self.cfg, (2,), "forward")
        B, N = tokens.shape
        check_length(N, self.cfg, "forward")
        cache = self.new_cache(B, N)
        h = self._run(self.embed(tokens), cache, range(self.cfg.n_layers), 0)  # [B, N, dim]
        cache.n_tokens = N
        logits = self._logits(h)
        return (logits, cache) if return_cache else logits

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, capacity_tokens: int | None = None, ced: bool = True) -> tuple[torch.Tensor, KVCache]:
        """CED prefill of equal-length prompts.

        Args:
            tokens: int [B, N] ids, N <= max_seq_len.
            capacity_tokens: initial global-buffer capacity (default N + 256; it grows on demand).
            ced: False runs every layer over every token instead (the non-CED baseline; only the
                last position's logits are computed).
        Returns:
            float32 logits [B, vocab] for position N - 1, and the :class:`KVCache` to decode from.
        """
        cfg = self.cfg
        tokens = check_tokens(tokens, cfg, (2,), "prefill")
        B, N = tokens.shape
        check_length(N, cfg, "prefill")
        E, L = cfg.n_encoder_layers, cfg.n_layers
        cache = self.new_cache(B, capacity_tokens or N + 256)
        if not ced:
            h = self._run(self.embed(tokens), cache, range(L), 0)  # [B, N, dim]
            cache.n_tokens = N
            return self._logits(h[:, -1]), cache
        src = self._decoder_kv_source()
        h = self._run(self.embed(tokens), cache, range(E), 0)  # H_E [B, N, dim]
        block = self.layers[src]
        block.attn.append_global(block.attn_norm(h).to(h.dtype), cache, self.backend)
        T = min(cfg.window, N)
        for i in range(E, L):
            cache.rings[i].reset(N - T)
        h = self._run(h[:, N - T :], cache, range(E, L), N - T, prebuilt=frozenset({src}))  # [B, T, dim]
        cache.n_tokens = N
        return self._logits(h[:, -1]), cache

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step through every layer.

        Args:
            tokens: int [B] (one token per sequence) or [B, S] (S tokens per sequence).
            cache: from :meth:`prefill`, :meth:`forward` (``return_cache=True``) or :meth:`new_cache`; updated in place.
        Returns:
            float32 logits [B, vocab] (or [B, S, vocab] for [B, S] tokens).
        """
        tokens = check_tokens(tokens, self.cfg, (1, 2), "decode")
        one = tokens.dim() == 1
        if one:
            tokens = tokens.unsqueeze(1)
        if not isinstance(cache, KVCache) or cache.cfg != self.cfg:
            raise InputError(f"decode: cache must be a KVCache of preset {self.cfg.name!r} from this model's prefill() or new_cache()")
        B, S = tokens.shape
        if B != cache.batch:
            raise InputError(f"decode: tokens hold {B} sequences but the cache holds {cache.batch}; pass one token per cached sequence")
        check_length(cache.n_tokens + S, self.cfg, "decode")
        h = self._run(self.embed(tokens), cache, range(self.cfg.n_layers), cache.n_tokens)
        cache.n_tokens += S
        logits = self._logits(h)
        return logits[:, 0] if one else logits

    @torch.no_grad()
    def prefill_paged(self, tokens: torch.Tensor, cache: PagedKVCache, seq: int, ced: bool = True) -> torch.Tensor:
        """Prefill one empty sequence of a paged cache from its own prompt (what :meth:`prefill` does for one row).

        Args:
            tokens: int [N] or [1, N] prompt ids, N <= max_seq_len.
            cache: a :class:`PagedKVCache` of this model (:meth:`new_paged_cache`).
            seq: a live sequence with no tokens yet (``cache.add()``).
            ced: False runs every layer over every prompt token (exact; the non-CED baseline).
        Returns:
            float32 logits [vocab] for position N - 1 (float64 for a float64 model).
        Raises:
            OutOfPages when the prompt's pages do not fit; the cache is then unchanged.
        """
        cfg = self.cfg
        tokens = self._one_prompt(tokens, cache, "prefill_paged")  # [1, N]
        N = tokens.shape[1]
        held = cache.sequence(seq, "prefill_paged").n_tokens
        if held:
            raise SequenceError(f"prefill_paged: sequence {seq} already holds {held} tokens; extend it with decode_paged")
        src = self._decoder_kv_source() if ced else None
        cache.extend([seq], N)
        E, L = cfg.n_encoder_layers, cfg.n_layers
        h = self.embed(tokens)  # [1, N, dim]
        if not ced:
            h = self._run_paged(h, cache, (seq,), (0,), range(L))
        else:
            h = self._run_paged(h, cache, (seq,), (0,), range(E))  # H_E [1, N, dim]
            block = self.layers[src]
            block.attn.append_paged(block.attn_norm(h).to(h.dtype), cache, (seq,), self.backend)
            T = min(cfg.window, N)
            for i in range(E, L):
                cache.reset_ring(seq, i, N - T)
            h = self._run_paged(h[:, N - T :], cache, (seq,), (N - T,), range(E, L), prebuilt=frozenset({src}))  # [1, T, dim]
        cache.advance([seq], N)
        return self._logits(h[0, -1])

    @torch.no_grad()
    def decode_paged(self, tokens: torch.Tensor, cache: PagedKVCache, seqs: list[int] | tuple[int, ...]) -> torch.Tensor:
        """One decode step of any live sequences of a paged cache, each at its own position.

        Args:
            tokens: int [B] (one token per sequence) or [B, S] (S tokens each); row b extends ``seqs[b]``.
            cache: a :class:`PagedKVCache` of this model; updated in place.
            seqs: B distinct live sequence ids (any subset of the live ones, in any order).
        Returns:
            float32 logits [B, vocab] (or [B, S, vocab] for [B, S] tokens).
        Raises:
            SequenceError for an unknown, freed or repeated id, OutOfPages when the new entries do not fit; both
            before anything is written.
        """
        tokens = check_tokens(tokens, self.cfg, (1, 2), "decode_paged")
        one = tokens.dim() == 1
        if one:
            tokens = tokens.unsqueeze(1)
        self._check_paged_cache(cache, "decode_paged")
        seqs = tuple(seqs)
        B, S = tokens.shape
        if B != len(seqs):
            raise InputError(f"decode_paged: tokens hold {B} rows for {len(seqs)} sequences {list(seqs)}; pass one row per sequence")
        first = tuple(s.n_tokens for s in cache.sequences(seqs, "decode_paged"))
        check_length(max(first) + S, self.cfg, "decode_paged")
        cache.extend(seqs, S)
        h = self._run_paged(self.embed(tokens), cache, seqs, first, range(self.cfg.n_layers))
        cache.advance(seqs, S)
        logits = self._logits(h)
        return logits[:, 0] if one else logits

    @torch.no_grad()
    def prefill_with_prefix(
        self,
        tokens: torch.Tensor,
        cache: PagedKVCache,
        ced: bool = True,
        publish: bool = True,
        max_hit_tokens: int | None = None,
        replay_tokens: int | None = None,
    ) -> PrefixPrefill:
        """Prefill a new sequence whose prompt may start with a published prefix: its global KV pages are shared, and
        the lost SWA state is rebuilt by encoder bounded replay (V4.1's bounded replay, encoder side).

        The hit (``h`` tokens, whole prefix blocks: see :mod:`model.prefix`) ends on a page and compression-group
        boundary in every group, so every ratio-2 tail is empty there and the suffix starts a new group. The last
        ``T = min(window, h)`` prefix tokens and the N - h suffix tokens pass through the encoder together from empty
        rings at position h - T: the replayed tokens rebuild the SWA rings and attend to the cached global KV, but
        append nothing (their entries exist); the suffix appends its entries. With CED, the decoder KV source then
        compresses the suffix's encoder outputs and the last ``min(window, N)`` encoder outputs pass through the
        decoder layers (the decoder replay of :meth:`prefill_paged`). Exact (equal to :meth:`prefill_paged` of the
        whole prompt) when ``h <= window``; past that the replay misses the SWA history before h - T (measured by
        :mod:`model.replay_error`).

        Args:
            tokens: int [N] or [1, N] prompt ids.
            cache: a :class:`PagedKVCache` of this model.
            ced: False runs every layer over the replay and suffix instead (decoder rings replayed the same way).
            publish: index the prompt's whole blocks afterwards (:meth:`PagedKVCache.publish_prefix`).
            max_hit_tokens: use at most this many cached tokens.
            replay_tokens: prefix tokens to replay instead of ``window`` (at most the hit; with CED at least
                ``min(window, N)`` minus the suffix, the encoder outputs the decoder replay reads). A longer replay
                narrows the gap: the encoder's outputs at the suffix are exact once it covers
                ``(E - 1) * (window - 1) + window`` tokens (each encoder layer's window reaches ``window - 1`` further
                back), E the encoder layers.
        Returns:
            :class:`PrefixPrefill`: the new sequence id, float32 logits [vocab] of position N - 1 (float64 for a float64
            model), the hit, the replayed token count and the blocks published.
        Raises:
            OutOfSlots / OutOfPages (from :meth:`PagedKVCache.add_with_prefix`) with the cache unchanged.
        """
        tokens = self._one_prompt(tokens, cache, "prefill_with_prefix")  # [1, N]
        src = self._decoder_kv_source() if ced else None
        seq, hit = cache.add_with_prefix(tokens[0], max_hit_tokens)
        try:
            logits, replayed = self._prefill_after_hit(tokens, cache, seq, hit.n_tokens, src, replay_tokens)
        except BaseException:
            cache.free(seq)
            raise
        published = cache.publish_prefix(seq, tokens[0]) if publish else 0
        return PrefixPrefill(seq, logits, hit, replayed, published)

    def _prefill_after_hit(
        self, tokens: torch.Tensor, cache: PagedKVCache, seq: int, n_hit: int, src: int | None, replay_tokens: int | None
    ) -> tuple[torch.Tensor, int]:
        """Bounded replay of tokens [1, N] after ``n_hit`` cached tokens; ``src`` the decoder KV source (None: no CED)."""
        cfg = self.cfg
        N, E, L, W = tokens.shape[1], cfg.n_encoder_layers, cfg.n_layers, cfg.window
        assert all(c == 0 for c in cache.sequence(seq).tail.values()), "a prefix hit ends on a compression-group boundary"
        T = min(W if replay_tokens is None else max(0, replay_tokens), n_hit)
        if src is not None:  # the decoder replays the last min(W, N) encoder outputs: the encoder pass must hold them
            T = max(T, min(min(W, N) - (N - n_hit), n_hit))
        start = n_hit - T
        layers = range(E) if src is not None else range(L)
        for i in layers:
            cache.reset_ring(seq, i, start)
        h = self._run_paged(self.embed(tokens[:, start:]), cache, (seq,), (start,), layers, replay=T)  # [1, T + N - n_hit, dim]
        if src is not None:
            block = self.layers[src]
            if N > n_hit:  # the prefix's decoder entries exist: compress the suffix's encoder outputs only
                block.attn.append_paged(block.attn_norm(h[:, T:]).to(h.dtype), cache, (seq,), self.backend)
            Td = min(W, N)
            for i in range(E, L):
                cache.reset_ring(seq, i, N - Td)
            h = self._run_paged(h[:, N - Td - start :], cache, (seq,), (N - Td,), range(E, L), prebuilt=frozenset({src}))  # [1, Td, dim]
        cache.advance([seq], N - n_hit)
        return self._logits(h[0, -1]), T

    # -- internals ----------------------------------------------------------------------------

    def _one_prompt(self, tokens: object, cache: object, what: str) -> torch.Tensor:
        """One sequence's prompt ids as int64 [1, N], checked (ids, length, the cache's preset)."""
        tokens = check_tokens(tokens, self.cfg, (1, 2), what)
        tokens = tokens.view(1, -1) if tokens.dim() == 1 or tokens.shape[0] == 1 else tokens
        if tokens.shape[0] != 1:
            raise InputError(f"{what}: fills one sequence, got tokens of shape {tuple(tokens.shape)}; pass [N] or [1, N]")
        self._check_paged_cache(cache, what)
        check_length(tokens.shape[1], self.cfg, what)
        return tokens

    def _check_paged_cache(self, cache: object, what: str) -> None:
        if not isinstance(cache, PagedKVCache) or cache.cfg != self.cfg:
            raise InputError(f"{what}: cache must be a PagedKVCache of preset {self.cfg.name!r} from this model's new_paged_cache()")

    def _run_paged(
        self,
        h: torch.Tensor,
        cache: PagedKVCache,
        seqs: tuple[int, ...],
        first: tuple[int, ...],
        layers: range,
        prebuilt: frozenset[int] = frozenset(),
        replay: int = 0,
    ) -> torch.Tensor:
        """Pass h [B, S, dim] through ``layers``: row b holds tokens of ``seqs[b]`` at positions first[b]..first[b]+S-1
        (the first ``replay`` of them already in the global KV: they rebuild SWA rings only)."""
        step = Step(cache, self.backend, 0, h.shape[1], prebuilt, seqs=seqs, row_first=first, replay=replay)
        for i in layers:
            h = self.layers[i](h, step)
        return h

    def _run(self, h: torch.Tensor, cache: KVCache, layers: range, first: int, prebuilt: frozenset[int] = frozenset()) -> torch.Tensor:
        """Pass h [B, S, dim] (tokens at positions first..first+S-1) through ``layers``."""
        step = Step(cache, self.backend, first, h.shape[1], prebuilt)
        for i in layers:
            h = self.layers[i](h, step)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> float32 [..., vocab] (float64 for a float64 model)."""
        return self.head(self.norm(h).to(self.dtype)).to(compute_dtype(self.embed.weight))

    def _decoder_kv_source(self) -> int:
        cfg = self.cfg
        dec = [s for s in cfg.kv_source_layers if s >= cfg.n_encoder_layers]
        if dec != [cfg.n_encoder_layers]:
            raise ConfigError(
                f"{cfg.name}: CED prefill needs exactly one decoder KV source at layer {cfg.n_encoder_layers} (the first decoder layer),"
                f" got {dec}; use forward() for this config"
            )
        return dec[0]


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of :class:`Model` for ``cfg``, from the config alone (no allocation)."""
    dim, H, D = cfg.dim, cfg.n_heads, cfg.head_dim
    total = 2 * cfg.vocab_size * dim + dim  # embedding, LM head, final norm
    if cfg.n_routed_experts > 0:
        ffn = dim * cfg.n_routed_experts + (cfg.n_routed_experts + 1) * 3 * dim * cfg.moe_inter
    else:
        ffn = 3 * dim * cfg.ffn_inter
    attn = dim * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * D  # query path
    attn += dim * D + D + H  # SWA KV, its norm, sinks
    attn += cfg.o_lora_rank * H * D + cfg.o_groups * cfg.o_lora_rank * dim  # grouped output projection
    indexer = cfg.q_lora_rank * cfg.index_heads * cfg.index_head_dim + dim * cfg.index_heads
    for plan in cfg.layer_plan():
        total += 2 * dim + attn + ffn
        if plan.mode == LayerMode.FULL:
            total += dim * D * (2 if plan.ratio > 1 else 1) + D + D * cfg.index_head_dim + cfg.index_head_dim
        if plan.mode in (LayerMode.FULL, LayerMode.REINDEX):
            total += indexer
    return total


def init_weights(model: Model, seed: int) -> None:
    """Deterministic random init from ``seed`` (per device type): weights ~ N(0, 1/fan_in), norms 1, sinks ~ N(0, 0.1^2).

    The embedding is N(0, 1) (its rows are normalised before use).
    """
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            std = None
        elif name == "embed.weight":
            std = 1.0
        elif name.endswith("sink"):
            std = 0.1
        else:
            std = p.shape[-1] ** -0.5  # fan_in: weights are stored [..., out, in]
        with torch.no_grad():
            if std is None:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def build_model(
    cfg: ModelConfig,
    backend: str | Backend = "torch",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Model:
    """A randomly initialised :class:`Model` in eval mode.

    Args:
        cfg: a :class:`ModelConfig` (e.g. ``preset("tiny")``).
        backend: ``"torch"`` (reference ops), ``"tiles"`` (TileLang kernels, imported lazily
            from ``tiles.backend.TilesBackend``) or a backend object with the same methods.
        device, dtype: where the weights live and their dtype (sinks stay float32); float32,
            bfloat16, or float64 (the whole reference in double precision, for exactness tests).
        seed: weights are a deterministic function of (cfg, seed, device type).
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model: cfg must be a ModelConfig (use model.preset(name)), got {type(cfg).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"build_model: dtype must be a float dtype (torch.float32 or torch.bfloat16), got {dtype}")
    device = torch.device(device)
    impl = load_backend(backend, device)
    with torch.device("meta"):
        model = Model(cfg, impl)
    model.to(dtype)
    for layer in model.layers:
        layer.attn.sink.data = layer.attn.sink.data.float()
    model.to_empty(device=device)
    init_weights(model, seed)
    return model.eval()
