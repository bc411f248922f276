"""Per-call resolution of the "auto" choices (splits, KV staging, Q/O handling) and the shared-memory count: what a
config means at one call's dims, given the arch."""

from collections.abc import Mapping

from tiles.core.arch import Arch
from tiles.core.contract import Config, Shape
from tiles.sparse_attn.options import blocks_per_token, kernel_rows, overlapped_refusal


def resolve_split(n_split, B: int, S: int, heads: int, heads_per_block: int, arch: Arch, schedule: str = "pipelined") -> int:
    """``auto``, ``pipelined``: the fewest splits (a power of two, at most 8) that give at least two blocks per SM.
    ``auto``, ``ws``: its ~200 KiB of shared memory holds one block per SM, and each split pays a Q load, a
    partial-output write and its share of the combine, so the most splits that still fit one wave."""
    if n_split != "auto":
        return int(n_split)
    blocks = B * S * (heads // heads_per_block)
    split = 1
    if schedule == "ws":
        while split < 8 and blocks * split * 2 <= arch.sm_count:
            split *= 2
        return split
    while split < 8 and blocks * split < 2 * arch.sm_count:
        split *= 2
    return split


# "auto" expands when the call has at least EXPAND_MIN_TOKENS query tokens and reads every cache row at least
# EXPAND_MIN_READS times on average (rows gathered over rows expanded). From the H200 runs of B=1 prompts with
# unused_rows="zeros" (945825d): expand faster at 512, 1024, 2048 and 4096 tokens (0.109 vs 0.136, 0.210 vs 0.264,
# 0.406 vs 0.520, 0.767 vs 1.008 ms); with every slot used (the same copies as zeros) at 512 tokens over 32K entries,
# 9.8 reads per row, 0.115 vs 0.137 ms (bad01b1). Fewer reads per row, or fewer tokens, are not measured.
EXPAND_MIN_TOKENS = 512
EXPAND_MIN_READS = 8


def resolve_kv_staging(kv_staging: str, dims: Mapping[str, int]) -> str:
    """``kv_staging`` for one call of ``dims`` (a Shape or its dims: B, S, W, K, Nw, Nc): "auto" -> "expand" when the
    call has B * S >= EXPAND_MIN_TOKENS tokens whose W + K gathered rows read every row of the two caches
    (B * (Nw + Nc)) at least EXPAND_MIN_READS times on average, else "gather"."""
    if kv_staging != "auto":
        return kv_staging
    return "expand" if dims["B"] * dims["S"] >= EXPAND_MIN_TOKENS and rereads_rows(dims) else "gather"


def rereads_rows(dims: Mapping[str, int]) -> bool:
    """True when the call's W + K gathered rows a token read every row of its caches (B * (Nw + Nc)) at least
    EXPAND_MIN_READS times on average: a prefill, whose rows stay in L2 between their reads."""
    rows = dims["B"] * (dims["Nw"] + dims["Nc"])
    return dims["B"] * dims["S"] * (dims["W"] + dims["K"]) >= EXPAND_MIN_READS * rows


IO_AUTO_TOKENS = (8, 4, 2)  # io="auto": the tokens per CTA it chooses between with overlapped (staged runs one)
IO_STAGED_TOKEN_COST = 1.09  # ... in units of an overlapped token's time: a token with io=staged
IO_CTA_COST = 0.12  # ... and an overlapped CTA's exposed first Q load and last O store
# io="auto" (the Hopper default of the prefill and bf16 tiles): overlapped where the call's rows are bf16 and it has the
# tokens, else staged, at the tokens per CTA that leave the busiest SM the least work: ceil(CTAs / SMs) waves x (tokens
# per CTA + IO_CTA_COST), or with staged ceil(items / SMs) x IO_STAGED_TOKEN_COST (:func:`_io_cost`). Both costs come
# from the H200 block-scaling fits at top-k 512 (10 blocks a token): wg0_scores staged 1.946 us a block + 5.72 a token
# against overlapped 2.022 + 2.86 (25.2 / 23.1 us a token; 5.72 - 2.86 = 0.12 x 23.1), paired_halves 1.829 + 5.99
# against 1.895 + 3.27 (24.3 / 22.2; 0.12 x 22.2) (0ce975d, 6d13715, ec81287).
# What the rule reproduces, H200 (da868da, b14d793, ec81287; every config checked first):
# - 768 tokens: 2 per CTA (3 waves x 2.12 = 6.4) 0.1458 against 4 per CTA (2 waves x 4.12 = 8.2) 0.1830 ms, and 1536:
#   4 per CTA 0.2742 against 8 per CTA 0.3484 (a second wave half full costs as much as a full one);
# - 256 tokens (bf16): 2 per CTA (one wave, 2.12) 2.5% faster than staged (two waves, 2 x 1.09); 384: staged
#   (3 x 1.09 against 2 x 2.12) 19% faster than 2 per CTA;
# - paired_halves, 512 tokens: 4 per CTA (one wave) 0.0923 / 0.0904 ms (prefill / bf16 tile) against 2 per CTA (two
#   waves) 0.0946 / 0.0931; 16384: 8 per CTA 2.8064 / 2.8909 against 2 per CTA (fewer ceiling slots, more CTAs)
#   2.8527 / 2.9369. At 1024-16384 tokens 8 and 4 per CTA were within 1% but at 4096 in the prefill tile (0.6908
#   against 0.6656 ms, 4 per CTA faster; the bf16 tile 0.7190 against 0.7239, and in another run 0.6997 against
#   0.7013, 8 per CTA faster).
# - bf16 decode B=128/S=2 (256 items): 2 per CTA (one wave) 0.0585 against staged's 0.0636 ms (the stored tuned
#   winner before io=auto chose it; ec81287).


def _io_cost(items: int, io: str, tokens: int, sm_count: int) -> float:
    """The busiest SM's work, in overlapped token times, when ``items`` (token, head block) items go ``tokens`` to a CTA
    with ``io`` ("staged" or "overlapped"), one CTA per SM at a time: the waves of CTAs (the last one part full) times a
    CTA's work."""
    ctas = -(-items // tokens)
    waves = -(-ctas // sm_count)
    return waves * (tokens * IO_STAGED_TOKEN_COST if io == "staged" else tokens + IO_CTA_COST)


def resolve_io(config: Config, dims: Mapping[str, int], arch: Arch, kv_format: str) -> tuple[str, int]:
    """(io, tokens_per_cta) for one call of ``dims`` (B, S, H) under ``config`` (``n_split``, ``kv_staging`` and
    ``consumers`` resolved). ``io="auto"``: "overlapped" where the kernel's rows are bf16 (bf16 KV, or FP4 expanded) and
    the config is one io=overlapped is built for, else "staged". The tokens per CTA are the config's when it names more
    than one; with one (the default), the choice of overlapped with each of IO_AUTO_TOKENS and staged with one token per
    CTA that leaves the busiest SM the least work (:func:`_io_cost`; ties to more tokens per CTA). Any other io is
    returned as it is."""
    io, tpc = config.get("io", "direct"), int(config.get("tokens_per_cta", 1))
    if io != "auto":
        return io, tpc
    rows = kernel_rows(kv_format, config.get("kv_staging", "gather"))
    args = (config["schedule"], config.get("produce", "serial"), config.get("consumers", "wg0_scores"), config.get("wg1_rows", 0))

    blocks = blocks_per_token(dims["W"], dims["K"], config["block_I"])

    def overlaps(tokens: int) -> bool:
        return overlapped_refusal(*args, tokens, config.get("n_split", 1), config["block_I"], rows, blocks=blocks) is None

    if tpc > 1:
        return ("overlapped" if overlaps(tpc) else "staged"), tpc
    items = dims["B"] * dims["S"] * (dims["H"] // config["heads_per_block"])
    staged = (_io_cost(items, "staged", 1, arch.sm_count), -1, "staged", 1)
    overlapped = [(_io_cost(items, "overlapped", t, arch.sm_count), -t, "overlapped", t) for t in IO_AUTO_TOKENS if overlaps(t)]
    _, _, io, tpc = min([staged, *overlapped])
    return io, tpc


def smem_bytes(config: Config, shape: Shape, kv_format: str) -> int:
    """Shared memory one block asks for (the compiler's own figure is within a few KiB)."""
    hb, bi, d = config["heads_per_block"], config["block_I"], shape["D"]
    q = hb * d * 2
    s = hb * bi * 2
    if config["schedule"] == "ws":
        seesaw = config.get("consumers") in ("seesaw", "paired", "paired_halves")  # a second P tile, the hand-over values, row sums
        return q + 2 * bi * d * 2 + s * (2 if seesaw else 1) + 2 * bi + 8 * hb + (24 * hb if seesaw else 0)
    stages = max(1, config["num_stages"])
    kv = bi * d * 2 * stages
    raw = bi * (d // 2 + d // 16) * stages if (config.get("dequant") == "staged" and kv_format == "fp4") else 0
    return q + kv + s + raw + 4 * bi * stages
