"""Building and launching the kernels for one call: the score kernel, then the select (multipass or two-pass), the
candidate pool and Reindex, on tensors already checked by :mod:`tiles.indexer.api`."""

from typing import Any

import torch

from tiles.core.arch import Arch
from tiles.core.contract import Config
from tiles.indexer.policy import radix_config, resolve_select_split, resolve_tiles_per_cta
from tiles.indexer.radix_select import build_kernels, check_config, remapped_kernel, resolve_parts, select_launcher
from tiles.indexer.score_kernel import build_score_kernel
from tiles.indexer.select_kernel import block_max_kernel, build_select_kernel


def index_k_words(k_packed: torch.Tensor, k_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, N, 64] + [B, N, 4] -> int32 [B, N, 16] + int32 [B, N] (same bytes, 4 per word)."""
    B, N = k_packed.shape[:2]
    words = k_packed.contiguous().view(torch.int32)  # [B, N, 16]
    scales = k_scales.contiguous().view(torch.int32).view(B, N)  # [B, N]
    return words, scales


def _score(cfg: Config, arch: Arch, gather: bool, block: int, q, weights, words, scales, nvis, pool, scores) -> None:
    """Launch the score kernel the config names (scores [B, S, n_out] give ``tiles_per_cta="auto"`` its grid)."""
    B, S, n_out = scores.shape
    score = build_score(arch, cfg, gather, block, B * S, n_out)
    score(q.to(torch.bfloat16).contiguous(), weights.float().contiguous(), words, scales, nvis, pool, scores)


def build_score(arch: Arch, cfg: Config, gather: bool, block: int, rows: int | None = None, n_out: int | None = None):
    """The score kernel for ``cfg``; ``tiles_per_cta="auto"`` is resolved for ``rows`` token rows of ``n_out`` scores."""
    if cfg["tiles_per_cta"] == "auto" and (rows is None or n_out is None):
        raise ValueError("tiles_per_cta='auto' is resolved per grid: give the score rows and their length")
    tiles = resolve_tiles_per_cta(cfg["tiles_per_cta"], rows, n_out, cfg["block_n"], arch)
    common = (arch.nvcc_arch, cfg["block_n"], cfg["threads"], cfg["stages"], tiles)
    hidden = cfg.get("hidden_tiles", "score") if not gather else "score"  # Reindex's slots are not in position order
    # every argument named, so a config with or without an optional key at its default is one cache entry
    return build_score_kernel(*common, cfg["dequant"], gather, block, cfg.get("min_ctas", 0), cfg.get("epilogue", "per_tile"), hidden)


def launch_topk(cfg: Config, arch: Arch, q, weights, words, scales, nvis, scores, out) -> None:
    B, S, N = scores.shape
    dummy_pool = torch.empty(B, S, 1, dtype=torch.int32, device=q.device)  # the contiguous variant reads no pool
    _score(cfg, arch, False, 8, q, weights, words, scales, nvis, dummy_pool, scores)
    if cfg.get("select_algo", "multipass") == "two_pass":
        # tiles.indexer.radix_select: two passes over each row in global memory, the rest in shared memory
        select_launcher(B * S, N, out.shape[-1], q.device, arch=arch, config=radix_config(cfg))(
            scores.view(B * S, N), nvis.view(B * S), out.view(B * S, -1)
        )
        return
    select = build_select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], 0)
    parts = resolve_select_split(cfg.get("select_split", 1), B * S, N, out.shape[-1], arch)
    _select_in_parts(select, parts, scores.view(B * S, N), nvis.view(B * S), out.view(B * S, -1))


def _select_in_parts(select, parts: int, scores: torch.Tensor, nvis: torch.Tensor, out: torch.Tensor) -> None:
    """Top-k of each score row by the select kernel, the row cut into ``parts`` equal parts first.

    The kernel runs one CTA per row, so B = 64 decode rows of 128K scores kept 64 of 132 SMs busy for
    1.3 ms on the H200 (notes/indexer.md). With parts: a top-k of every part (R x parts CTAs), then a
    top-k of the parts x k candidates of each row. Exact, with the same tie rule: an entry the whole
    row keeps is among the k best of its part, ties going to lower positions in both stages, and the
    candidates stay in position order (parts in order, each sorted). Rows whose length is not a
    multiple of ``parts`` run in one piece.

    Args: scores fp32 [R, N]; nvis int32 [R] (columns >= nvis are not candidates); out int32 [R, k].
    """
    R, N = scores.shape
    k = out.shape[1]
    dummy_blocks = torch.empty(R, 1, dtype=torch.int32, device=scores.device)
    if parts <= 1 or N % parts:
        select(scores, nvis, dummy_blocks, out)
        return
    width = N // parts
    offsets = torch.arange(parts, device=scores.device, dtype=torch.int32) * width  # [parts]
    part_nvis = (nvis.view(R, 1) - offsets.view(1, parts)).clamp(0, width).to(torch.int32)  # [R, parts]
    local = torch.empty(R * parts, k, dtype=torch.int32, device=scores.device)  # [R * parts, k]
    select(scores.view(R * parts, width), part_nvis.view(-1), dummy_blocks.new_empty(R * parts, 1), local)
    local = local.view(R, parts, k)
    pos = torch.where(local >= 0, local + offsets.view(1, parts, 1), -1).view(R, parts * k)  # [R, parts * k], ascending
    cand = torch.where(pos >= 0, scores.gather(1, pos.clamp(min=0).long()), float("-inf"))  # [R, parts * k]
    n_cand = torch.full((R,), parts * k, dtype=torch.int32, device=scores.device)  # [R]
    pick = torch.empty(R, k, dtype=torch.int32, device=scores.device)  # [R, k] candidate slots, ascending
    select(cand, n_cand, dummy_blocks, pick)
    out.copy_(torch.where(pick >= 0, pos.gather(1, pick.clamp(min=0).long()), -1))


def launch_pool(cfg: Config, arch: Arch, scores2d, nvis, block: int, block_scores, out) -> None:
    R, nb = block_scores.shape
    block_max_kernel(arch.nvcc_arch, block, cfg["block_threads"])(scores2d, nvis, block_scores)
    nvis_blocks = torch.full_like(nvis, nb)  # every block id is a candidate; -inf blocks are skipped
    if cfg.get("select_algo", "multipass") == "two_pass":
        select_launcher(R, nb, out.shape[-1], out.device, arch=arch)(block_scores, nvis_blocks, out.view(R, -1))
        return
    dummy = torch.empty(R, 1, dtype=torch.int32, device=out.device)
    build_select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], 0)(
        block_scores, nvis_blocks, dummy, out.view(R, -1)
    )


def launch_reindex(cfg: Config, arch: Arch, q, weights, words, scales, nvis, pool, block: int, scores, out) -> None:
    B, S, C = scores.shape
    _score(cfg, arch, True, block, q, weights, words, scales, nvis, pool, scores)
    if cfg.get("select_algo", "multipass") == "two_pass":
        # slot c -> cache position pool[c // block] * block + c % block, in the select's output (an unused block's
        # slots map to negative positions; their scores are -inf, never chosen)
        R = B * S
        dummy = torch.empty(R, 1, dtype=torch.float32, device=q.device)
        select = remapped_kernel(arch, out.shape[-1], R, block=block)
        select(scores.view(R, C), nvis.view(R), pool.view(R, -1), out.view(R, -1), dummy)
        return
    select = build_select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], block)
    n_cand = torch.full((B * S,), C, dtype=torch.int32, device=q.device)
    select(scores.view(B * S, C), n_cand, pool.view(B * S, -1), out.view(B * S, -1))


def build_two_pass(arch: Arch, rows: int, n: int, k: int, radix: Config | None = None) -> dict[str, Any]:
    """Compile tiles.indexer.radix_select's kernels for ``rows`` rows of ``n`` scores, top ``k`` (``radix``: a
    radix_select config, its default when None): the select, and the merge of its parts when there are several."""
    cfg = check_config(radix or {}, k)
    parts = resolve_parts(cfg["parts"], rows, n, k, arch)
    first, merge = build_kernels(arch, k, parts, rows, cfg)
    return {"select": first} if merge is None else {"select": first, "merge": merge}
