"""Random inputs for the indexer tiles and the comparison with the torch reference (scores by tolerance, top-k as
sets with the tie rule)."""

import torch

from model.formats import fp4_dequantize
from model.ops.indexer import indexer_scores
from tiles.core.contract import Comparison, Inputs
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS, TIE_RTOL


def _random_fp4(shape: tuple[int, ...], gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed FP4 rows with E8M0 scales: uint8 [..., 64] and uint8 [..., 4].

    Every code appears; scale bytes 121..127 (2^-6..1) give the magnitudes of a normalised key.
    Drawn directly in packed form so a 1M-entry cache costs no fp32 staging.
    """
    packed = torch.randint(0, 256, (*shape, HEAD_DIM // 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 128, (*shape, HEAD_DIM // GROUP), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    return packed, scales


def indexer_inputs(B: int, S: int, N: int, seed: int, device, causal: bool) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    k_packed, k_scales = _random_fp4((B, N), gen, device)  # [B, N, 64], [B, N, 4]
    q_packed, q_scales = _random_fp4((B, S, HEADS), gen, device)
    q = fp4_dequantize(q_packed, q_scales, GROUP, "e8m0").to(torch.bfloat16)  # [B, S, Hi, Di], exact
    weights = torch.randn(B, S, HEADS, generator=gen, device=device) * (HEAD_DIM**-0.5 * HEADS**-0.5)  # [B, S, Hi]
    if causal:
        n_visible = (torch.arange(S, device=device) + 1).clamp(max=N).expand(B, S).contiguous()  # ratio-1 prefill
    else:
        # Most rows see (nearly) the whole cache; with three rows or more, one sees less than top-k and one nothing
        # (a single row, as at decode B=1, sees the cache: its timing must be the full score and select).
        n_visible = N - torch.randint(0, max(1, N // 16), (B, S), generator=gen, device=device)
        if B * S > 2:
            n_visible[0, 0] = min(N, 300)
            n_visible.view(-1)[-1] = 0
    return {"q": q, "weights": weights, "k_packed": k_packed, "k_scales": k_scales, "n_visible": n_visible.to(torch.int32)}


def into_page_pool(inputs: Inputs, page: int, gen: torch.Generator) -> None:
    """Move the index K into a paged cache's pool: each row's entries in pages of ``page``, the pages in a random order
    among spare pages of random bytes, and ``block_table`` int32 [B, N / page] naming them; a page wholly past a row's
    n_visible (at any of its tokens) is -1 in its table. The contiguous cache stays for the reference
    (``k_packed_logical``, ``k_scales_logical``)."""
    k_packed, k_scales = inputs["k_packed"], inputs["k_scales"]
    B, N = k_packed.shape[:2]
    if N % page:
        raise ValueError(f"a paged index cache of {N} entries is not a whole number of {page}-entry pages")
    per_row, spare = N // page, max(1, B // 4)
    order = torch.randperm(B * per_row + spare, generator=gen, device=k_packed.device)
    table = order[: B * per_row].view(B, per_row)  # [B, N / page]
    packed, scales = _random_fp4(((B * per_row + spare) * page,), gen, k_packed.device)  # [R, 64], [R, 4]
    rows = (table.unsqueeze(-1) * page + torch.arange(page, device=k_packed.device)).view(B * N)
    packed[rows], scales[rows] = k_packed.reshape(B * N, -1), k_scales.reshape(B * N, -1)
    owned = torch.arange(per_row, device=k_packed.device) * page < inputs["n_visible"].amax(dim=1, keepdim=True)  # [B, N / page]
    inputs["block_table"] = torch.where(owned, table, -1).to(torch.int32).contiguous()
    inputs["k_packed_logical"], inputs["k_scales_logical"] = k_packed, k_scales
    inputs["k_packed"], inputs["k_scales"] = packed.unsqueeze(0), scales.unsqueeze(0)  # [1, R, 64], [1, R, 4]


# Working memory of one chunk of the reference (the dequantised keys and the per-head logits of its batch rows): the
# 1M-entry decode shape at B = 64 asked for 64 GiB in one piece, more than an 80 GB H100 has beside its inputs.
REFERENCE_CHUNK_BYTES = 2 << 30


def reference_rows_per_chunk(B: int, S: int, N: int) -> int:
    """Batch rows the reference scores at once: as many as fit :data:`REFERENCE_CHUNK_BYTES` (at least one)."""
    per_row = N * HEAD_DIM * 4 + 2 * S * HEADS * N * 4  # fp32 keys, then logits and their ReLU
    return max(1, min(B, REFERENCE_CHUNK_BYTES // per_row))


def reference_scores(inputs: Inputs) -> torch.Tensor:
    """:func:`model.ops.indexer.indexer_scores` on the dequantised keys, [B, S, N], computed a few batch rows at a
    time (:func:`reference_rows_per_chunk`; rows are independent, so the chunks are the whole computation)."""
    q, weights, n_visible = inputs["q"], inputs["weights"], inputs["n_visible"]
    k_packed = inputs.get("k_packed_logical", inputs["k_packed"])  # a paged cache: its contiguous copy
    k_scales = inputs.get("k_scales_logical", inputs["k_scales"])
    B, S = q.shape[:2]
    N = k_packed.shape[1]
    step = reference_rows_per_chunk(B, S, N)
    chunks = []
    for b in range(0, B, step):
        rows = slice(b, b + step)
        index_k = fp4_dequantize(k_packed[rows], k_scales[rows], GROUP, "e8m0")  # [b, N, Di]
        chunks.append(indexer_scores(q[rows], weights[rows], index_k, n_visible[rows]))  # [b, S, N]
        del index_k
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def compare_topk_sets(out: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor, rtol: float = TIE_RTOL) -> Comparison:
    """Top-k lists as index sets, with ties allowed to differ.

    ``out``/``ref`` int32 [B, S, K] (ascending, -1 fill), ``ref_scores`` fp32 [B, S, N] the
    reference scores the lists were chosen from. Both lists must be ascending with the same
    number of entries; a position in one set but not the other must have a reference score
    equal to the k-th largest chosen reference score within ``rtol`` (relative).
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Comparison(False, "topk-set", 1.0, f"got {tuple(out.shape)} {out.dtype}, want {tuple(ref.shape)} {ref.dtype}")
    R, K = out.shape[0] * out.shape[1], out.shape[-1]
    N = ref_scores.shape[-1]
    o, r, sc = out.reshape(R, K).long(), ref.reshape(R, K).long(), ref_scores.reshape(R, N)
    n_o, n_r = (o >= 0).sum(-1), (r >= 0).sum(-1)
    if not torch.equal(n_o, n_r):
        bad = int((n_o != n_r).sum())
        return Comparison(False, "topk-set", bad / R, f"{bad} rows choose a different number of entries")
    valid = o >= 0
    if bool(((o < -1) | (o >= N)).any()):
        return Comparison(False, "topk-set", 1.0, "positions out of range")
    srt = torch.where(valid, o, torch.full_like(o, N))
    if bool((srt[:, 1:] <= srt[:, :-1])[valid[:, 1:]].any()) or bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        return Comparison(False, "topk-set", 1.0, "positions are not strictly ascending followed by -1 fill")
    mask_o = torch.zeros(R, N + 1, dtype=torch.bool, device=out.device).scatter_(1, srt, True)[:, :N]
    mask_r = torch.zeros(R, N + 1, dtype=torch.bool, device=out.device).scatter_(1, torch.where(r >= 0, r, N), True)[:, :N]
    diff = mask_o ^ mask_r
    kth = torch.where(mask_r, sc, torch.full_like(sc, float("inf"))).amin(-1, keepdim=True)  # [R, 1]
    close = (sc - kth).abs() <= rtol * kth.abs().clamp(min=1e-30)
    bad = diff & ~close
    n_diff, n_bad = int(diff.sum()), int(bad.sum())
    total = max(1, int(n_r.sum()))
    ok = n_bad == 0
    return Comparison(ok, "topk-set", n_diff / total, f"{n_diff} tie swaps, {n_bad} non-tie differences")


def merge(*comparisons: Comparison) -> Comparison:
    ok = all(c.ok for c in comparisons)
    return Comparison(
        ok, " + ".join(c.metric for c in comparisons), max(c.error for c in comparisons), "; ".join(str(c) for c in comparisons)
    )


def random_pool(n_visible: torch.Tensor, N: int, P: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Random candidate pools: the newest visible block plus random others, ascending, -1 fill."""
    B, S = n_visible.shape
    nb = -(-N // block)
    keys = torch.rand(B, S, nb, generator=gen, device=n_visible.device)  # [B, S, nb]
    ids = torch.arange(nb, device=n_visible.device)
    vis_blocks = (n_visible.long() + block - 1) // block
    keys = torch.where(ids < vis_blocks.unsqueeze(-1), keys, torch.full_like(keys, -1.0))
    keys = torch.where(ids == (vis_blocks - 1).unsqueeze(-1), torch.full_like(keys, 2.0), keys)
    take = min(P, nb)
    top = keys.topk(take, dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, nb))
    chosen = chosen.sort(-1).values
    chosen = torch.where(chosen == nb, torch.full_like(chosen, -1), chosen).to(torch.int32)
    if take < P:
        chosen = torch.cat([chosen, chosen.new_full((B, S, P - take), -1)], dim=-1)
    return chosen
