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


def build_score(arch: Arch, cfg: Config, gather: bool, block: int, rows: int | None = None, n_out: int | None = None, page: int = 0):
    """The score kernel for ``cfg``; ``tiles_per_cta="auto"`` is resolved for ``rows`` token rows of ``n_out`` scores.
    ``page`` > 0: the index K is a paged cache's pool of ``page``-entry pages read through a block table."""
    if cfg["tiles_per_cta"] == "auto" and (rows is None or n_out is None):
        raise ValueError("tiles_per_cta='auto' is resolved per grid: give the score rows and their length")
    tiles = resolve_tiles_per_cta(cfg["tiles_per_cta"], rows, n_out, cfg["block_n"], arch)
    common = (arch.nvcc_arch, cfg["block_n"], cfg["threads"], cfg["stages"], tiles)
    hidden = cfg.get("hidden_tiles", "score") if not gather else "score"  # Reindex's slots are not in position order
    # every argument named, so a config with or without an optional key at its default is one cache entry
    return build_score_kernel(*common, cfg["dequant"], gather, block, cfg.get("min_ctas", 0), cfg.get("epilogue", "per_tile"), hidden, page)


def no_block_table(device: torch.device) -> torch.Tensor:
    """The score kernel's block-table argument of a contiguous cache (not read): int32 [1, 1]."""
    return torch.zeros(1, 1, dtype=torch.int32, device=device)


class TopkLaunch:
    """The launches of one ``indexer_topk`` call shape (R = B * S score rows of N, top k) and config, built once: the
    score kernel, then the select (two-pass launcher with its merge buffers, or the multipass kernel in parts).
    Calls of one object share those buffers: run them on one stream (as a captured CUDA graph does). ``page`` > 0: the
    index K is a pool read through the block table each call passes (N is then the logical width, MP * page)."""

    def __init__(self, cfg: Config, arch: Arch, B: int, S: int, N: int, k: int, device: torch.device, page: int = 0):
        self.R, self.N = B * S, N
        self.score = build_score(arch, cfg, False, 8, self.R, N, page)
        self.dummy_pool = torch.empty(B, S, 1, dtype=torch.int32, device=device)  # [B, S, 1]: the contiguous variant reads no pool
        self.no_table = no_block_table(device)
        self.two_pass = cfg.get("select_algo", "multipass") == "two_pass"
        if self.two_pass:  # tiles.indexer.radix_select: two passes over each row in global memory, the rest in shared memory
            self.select = select_launcher(self.R, N, k, device, arch=arch, config=radix_config(cfg))
        else:
            self.select = build_select_kernel(arch.nvcc_arch, k, cfg["select_threads"], cfg["radix_bits"], 0)
            self.parts = resolve_select_split(cfg.get("select_split", 1), self.R, N, k, arch)

    def __call__(self, q, weights, words, scales, nvis, scores, out, block_table: torch.Tensor | None = None) -> None:
        table = self.no_table if block_table is None else block_table
        self.score(q.to(torch.bfloat16).contiguous(), weights.float().contiguous(), words, scales, nvis, self.dummy_pool, table, scores)
        rows, nv, picked = scores.view(self.R, self.N), nvis.view(self.R), out.view(self.R, -1)
        if self.two_pass:
            self.select(rows, nv, picked)
        else:
            _select_in_parts(self.select, self.parts, rows, nv, picked)


def launch_topk(cfg: Config, arch: Arch, q, weights, words, scales, nvis, scores, out, block_table=None, page: int = 0) -> None:
    """Build and run :class:`TopkLaunch` for one call (the tile's harness; the public function keeps its launch)."""
    B, S, N = scores.shape
    TopkLaunch(cfg, arch, B, S, N, out.shape[-1], q.device, page)(q, weights, words, scales, nvis, scores, out, block_table)


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


class PoolLaunch:
    """The launches of one ``candidate_pool`` call shape (R rows of nb blocks, pool of P) and config, built once: the
    block max, then the select of the best blocks (every block id a candidate; -inf blocks are skipped)."""

    def __init__(self, cfg: Config, arch: Arch, R: int, nb: int, P: int, block: int, device: torch.device):
        self.R = R
        self.block_max = block_max_kernel(arch.nvcc_arch, block, cfg["block_threads"])
        self.all_blocks = torch.full((R,), nb, dtype=torch.int32, device=device)  # [R]
        self.two_pass = cfg.get("select_algo", "multipass") == "two_pass"
        if self.two_pass:
            self.select = select_launcher(R, nb, P, device, arch=arch)
        else:
            self.select = build_select_kernel(arch.nvcc_arch, P, cfg["select_threads"], cfg["radix_bits"], 0)
            self.dummy = torch.empty(R, 1, dtype=torch.int32, device=device)  # [R, 1]: not read

    def __call__(self, scores2d, nvis, block_scores, out) -> None:
        self.block_max(scores2d, nvis, block_scores)
        if self.two_pass:
            self.select(block_scores, self.all_blocks, out.view(self.R, -1))
        else:
            self.select(block_scores, self.all_blocks, self.dummy, out.view(self.R, -1))


def launch_pool(cfg: Config, arch: Arch, scores2d, nvis, block: int, block_scores, out) -> None:
    R, nb = block_scores.shape
    PoolLaunch(cfg, arch, R, nb, out.shape[-1], block, out.device)(scores2d, nvis, block_scores, out)


class ReindexLaunch:
    """The launches of one ``reindex_topk`` call shape (R = B * S rows of C = P * block candidate slots, top k) and
    config, built once: the gathering score kernel, then the select mapped back to cache positions. ``page`` > 0: the
    index K is a pool read through the block table each call passes."""

    def __init__(self, cfg: Config, arch: Arch, B: int, S: int, C: int, k: int, block: int, device: torch.device, page: int = 0):
        self.R, self.C = B * S, C
        self.score = build_score(arch, cfg, True, block, self.R, C, page)
        self.no_table = no_block_table(device)
        self.two_pass = cfg.get("select_algo", "multipass") == "two_pass"
        if self.two_pass:
            # slot c -> cache position pool[c // block] * block + c % block, in the select's output (an unused block's
            # slots map to negative positions; their scores are -inf, never chosen)
            self.select = remapped_kernel(arch, k, self.R, block=block)
            self.dummy = torch.empty(self.R, 1, dtype=torch.float32, device=device)  # [R, 1]: not read
        else:
            self.select = build_select_kernel(arch.nvcc_arch, k, cfg["select_threads"], cfg["radix_bits"], block)
            self.n_cand = torch.full((self.R,), C, dtype=torch.int32, device=device)  # [R]

    def __call__(self, q, weights, words, scales, nvis, pool, scores, out, block_table: torch.Tensor | None = None) -> None:
        table = self.no_table if block_table is None else block_table
        self.score(q.to(torch.bfloat16).contiguous(), weights.float().contiguous(), words, scales, nvis, pool, table, scores)
        rows, pool2d, picked = scores.view(self.R, self.C), pool.view(self.R, -1), out.view(self.R, -1)
        if self.two_pass:
            self.select(rows, nvis.view(self.R), pool2d, picked, self.dummy)
        else:
            self.select(rows, self.n_cand, pool2d, picked)


def launch_reindex(
    cfg: Config, arch: Arch, q, weights, words, scales, nvis, pool, block: int, scores, out, block_table=None, page: int = 0
) -> None:
    B, S, C = scores.shape
    ReindexLaunch(cfg, arch, B, S, C, out.shape[-1], block, q.device, page)(q, weights, words, scales, nvis, pool, scores, out, block_table)


def build_two_pass(arch: Arch, rows: int, n: int, k: int, radix: Config | None = None) -> dict[str, Any]:
    """Compile tiles.indexer.radix_select's kernels for ``rows`` rows of ``n`` scores, top ``k`` (``radix``: a
    radix_select config, its default when None): the select, and the merge of its parts when there are several."""
    cfg = check_config(radix or {}, k)
    parts = resolve_parts(cfg["parts"], rows, n, k, arch)
    first, merge = build_kernels(arch, k, parts, rows, cfg)
    return {"select": first} if merge is None else {"select": first, "merge": merge}
