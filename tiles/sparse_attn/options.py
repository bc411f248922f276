"""The attention tiles' option vocabulary and the rules that both the kernel builders and the search space apply
(which combinations a kernel is built for), so that a refused config and a kernel build error say the same thing."""

from tiles.core.contract import Config

SPLIT_CHOICES = ("auto", 1, 2, 4, 8)
IOS = ("direct", "staged", "overlapped")  # how the ws kernel reads Q and writes O (see sparse_attn_ws)
PARTIALS = ("fp32", "bf16")  # the dtype of the split partials of O (see sparse_attn_ws)
BF16_ROW_KEYS = ("unused_rows",)  # keys of the ws batched producer's bf16 row copies: no effect on FP4/FP8 rows
UNUSED_ROWS = ("row0", "zeros")  # bf16 KV, ws batched producer: an unused slot's row copied from row 0, or zero-filled
# Hopper (ws): zero-filled, H200, one run against row0 (945825d): prefill 4K with the expansion 0.8263 -> 0.7672 ms,
# 512-token prompt 0.1831 -> 0.1093; the bf16 tile by lab bench, prefill 4K 0.8272 ms with row0 and 0.7653 with zeros
# in the next call (98a05fe), decode unchanged (its lists have no unused slots). Every CTA copying the same
# row 0 for its unused slots was the expansion's loss at short prompts (most of their slots are unused).
UNUSED_ROWS_DEFAULT = "zeros"


KV_STAGINGS = ("gather", "expand", "auto")  # prefill: decode in the producer per read, or expand both caches once


def blocks_per_token(window: int, topk: int, block_I: int) -> int:
    """KV blocks a token's index lists make: the window's and the top-k's, each rounded up to whole blocks."""
    return -(-window // block_I) + -(-topk // block_I)


def kernel_rows(kv_format: str, kv_staging: str) -> str:
    """The KV rows the attention kernel reads ("bf16" or "fp4"), ``kv_staging`` resolved: the expansion's are bf16."""
    return "bf16" if kv_format == "bf16" or kv_staging == "expand" else "fp4"


def halves_refusal(schedule, produce, tokens_per_cta, rows, io="staged") -> str | None:
    """Why ``consumers="paired_halves"`` cannot run (its producer copies bf16 rows half by half, several tokens per CTA
    only with io="overlapped"), or None. ``rows``: the kernel's row format (kernel_rows)."""
    if schedule != "ws" or produce != "batched" or rows != "bf16" or (int(tokens_per_cta) != 1 and io != "overlapped"):
        return (
            "consumers=paired_halves hands bf16 KV rows over in halves: schedule=ws, produce=batched, bf16 KV or "
            "kv_staging=expand, tokens_per_cta=1 unless io=overlapped"
        )
    return None


def overlapped_refusal(schedule, produce, consumers, wg1_rows, tokens_per_cta, n_split, block_I, rows, blocks=None) -> str | None:
    """Why ``io="overlapped"`` cannot be built with these choices (``n_split`` resolved or "auto"; ``rows``: the
    kernel's KV rows, "bf16" or "fp4"; ``blocks``: the blocks per token, None when not known here), or None."""
    if schedule != "ws" or produce != "batched" or consumers not in ("wg0_scores", "paired_halves") or int(wg1_rows):
        return (
            "io=overlapped is built into the ws kernel's wg0_scores and paired_halves consumers: schedule=ws, "
            "produce=batched, consumers=wg0_scores or paired_halves, wg1_rows=0"
        )
    if consumers == "paired_halves" and blocks is not None and blocks % 2:
        # the pairs' barrier phases run on across the CTA's tokens: a token ends on a whole pair
        return "io=overlapped with consumers=paired_halves needs whole pairs: an even number of blocks per token"
    if int(tokens_per_cta) < 2 or n_split not in (1, "auto"):
        return "io=overlapped overlaps one token's O store and the next one's Q load: tokens_per_cta > 1, n_split=1"
    if rows != "bf16" or int(block_I) != 64:
        # the producer stores each staged O chunk it is about to overwrite by cp.async: the bf16 rows' mapping (the
        # FP4 producer, storing on its own lanes' mapping, spilled 40 bytes in ptxas at decode B=128/S=2)
        return "io=overlapped stages O (64 heads) through a 64-row bf16 KV buffer: bf16 KV (or kv_staging=expand), block_I=64"
    return None


def bf16_partials_refusal(c: Config, kv_format: str) -> str | None:
    """Why partials="bf16" cannot run with config ``c``, or None (either KV format)."""
    # consumers="auto" is wg0_scores wherever there are splits (its paired_halves runs io=overlapped: one split)
    consumers = c.get("consumers", "wg0_scores")
    if c["schedule"] != "ws" or consumers not in ("wg0_scores", "auto") or c.get("combine", "separate") != "separate":
        return "partials=bf16 is built into the ws kernel's wg0_scores consumers with the separate combine"
    return None


def bf16_copy_refusal(c: Config, kv_format: str) -> str | None:
    """Why unused_rows="zeros" cannot run with config ``c``, or None. It concerns bf16 rows: bf16 KV, or FP4 KV under
    kv_staging "expand" or "auto" (which may expand); the FP4/FP8 rows the producer decodes have their own path, where
    the key does not apply."""
    bf16_rows = kv_format == "bf16" or c.get("kv_staging", "gather") != "gather"
    if bf16_rows and (c["schedule"] != "ws" or c.get("produce", "serial") != "batched"):
        return "unused_rows=zeros is the ws batched producer's cp.async of bf16 rows: schedule=ws, produce=batched"
    return None


def prmt_decode_refusal(c: Config, kv_format: str) -> str | None:
    """Why fp4_decode="prmt" cannot run with config ``c``, or None."""
    if kv_format != "fp4" or c["schedule"] != "ws" or c.get("produce", "serial") not in ("batched", "prefetch"):
        return (
            "fp4_decode=prmt is the ws batched producer's packed FP4 main-KV dequant: FP4 main KV, schedule=ws, "
            "produce=batched or prefetch (bf16 KV has nothing to decode; the other paths decode per value)"
        )
    return None


# (key, its Hopper default built for one path only, the choice every path has, why the default cannot run with a config)
NARROW_DEFAULTS = (
    ("fp4_decode", "prmt", "fma", prmt_decode_refusal),  # the ws batched producer's packed word decode
    ("partials", "bf16", "fp32", bf16_partials_refusal),  # the ws wg0_scores consumers' split epilogue
    ("unused_rows", "zeros", "row0", bf16_copy_refusal),  # the ws batched producer's bf16 cp.async
)
