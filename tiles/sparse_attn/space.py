"""The attention tiles' search space: the structural parameters the tuner offers, the constraints that refuse what a
build cannot run or hold (``consumers="auto"`` resolved per shape where a constraint reads it), and that resolution
itself (:func:`resolve_consumers`). The option vocabulary and the rules the kernel builders share are in
:mod:`tiles.sparse_attn.options`; the per-call "auto" choices in :mod:`tiles.sparse_attn.policy`."""

from collections.abc import Mapping

from tiles.core.arch import Arch
from tiles.core.contract import Config, Constraint, Param, SearchSpace
from tiles.sparse_attn.options import (
    IOS,
    KV_STAGINGS,
    PARTIALS,
    SPLIT_CHOICES,
    UNUSED_ROWS,
    bf16_copy_refusal,
    bf16_partials_refusal,
    blocks_per_token,
    halves_refusal,
    kernel_rows,
    overlapped_refusal,
    prmt_decode_refusal,
)
from tiles.sparse_attn.policy import rereads_rows, resolve_io, resolve_kv_staging, resolve_split, smem_bytes


def resolve_consumers(config: Config, dims: Mapping[str, int], arch: Arch, kv_format: str) -> Config:
    """``config`` with ``consumers="auto"`` resolved for one call of ``dims``: "paired_halves" where ``io`` is "auto"
    and takes it to "overlapped", the call rereads its KV rows (a prefill) and the constraints allow it; else
    "wg0_scores". paired_halves runs one split, so bf16 ``partials`` (nothing to store) become fp32. Any other
    ``consumers`` is returned as it is."""
    if config.get("consumers") != "auto":
        return config
    probe = {**config, "consumers": "paired_halves"}
    if "partials" in probe:
        probe["partials"] = "fp32"  # io=overlapped runs one split: no partials, the same kernel
    staging = resolve_kv_staging(config.get("kv_staging", "gather"), dims)
    n_split = resolve_split(config.get("n_split", 1), dims["B"], dims["S"], dims["H"], config["heads_per_block"], arch, config["schedule"])
    resolved = {**probe, "kv_staging": staging, "n_split": n_split}
    halves = (
        config.get("io") == "auto"
        and rereads_rows(dims)
        and resolve_io(resolved, dims, arch, kv_format)[0] == "overlapped"
        and not any(con.check(probe, dims, arch) for con in constraints(kv_format))
    )
    return probe if halves else {**config, "consumers": "wg0_scores"}


def constraints(kv_format: str) -> tuple[Constraint, ...]:
    def heads(c, s, a):
        return None if s["H"] % c["heads_per_block"] == 0 else f"{s['H']} heads do not split into blocks of {c['heads_per_block']}"

    def registers(c, s, a):
        threads = 256 if c["schedule"] == "ws" else c["threads"]
        per_thread = c["heads_per_block"] * s["D"] // threads
        return None if per_thread <= 128 else f"the [heads, D] fp32 accumulator needs {per_thread} registers per thread (> 128)"

    def warpgroups(c, s, a):
        if c["heads_per_block"] == 32 and c["threads"] != 128:
            return "32 heads per block feed one warpgroup only: use threads=128"
        return None

    def ws_shape(c, s, a):
        if c["schedule"] != "ws":
            return None
        if not a.wgmma:
            return f"warp specialisation uses wgmma, mbarriers and setmaxnreg: {a.name} lacks them"
        if c["heads_per_block"] != 64 or c["threads"] != 256 or c["num_stages"] != 2:
            return "ws is two 128-thread consumer warpgroups over 64 heads plus a producer, double-buffered: heads_per_block=64, threads=256, num_stages=2"
        if c.get("dequant", "direct") != "direct":
            return "ws dequantises in the producer warpgroup: dequant=direct"
        return None

    def producer(c, s, a):
        if int(c.get("wg1_rows", 0)) and (
            c["schedule"] != "ws" or c.get("produce", "serial") != "batched" or c.get("consumers", "wg0_scores") != "wg0_scores"
        ):
            return "wg1_rows fills rows in consumer warpgroup 1's wait for P: schedule=ws, produce=batched, consumers=wg0_scores"
        if int(c.get("tokens_per_cta", 1)) > 1 and (
            c["schedule"] != "ws"
            or c.get("produce", "serial") != "batched"
            or c.get("consumers", "wg0_scores") not in ("wg0_scores", "paired_halves")
            or int(c.get("wg1_rows", 0))
            or c.get("io", "direct") not in ("staged", "overlapped", "auto")
        ):
            return (
                "tokens_per_cta > 1 runs the ws kernel's batched producer across tokens: schedule=ws, produce=batched, "
                "consumers=wg0_scores (or paired_halves with io=overlapped), wg1_rows=0, io=staged, overlapped or auto"
            )
        if c.get("io", "direct") == "overlapped":
            n_split = resolve_split(c.get("n_split", 1), s["B"], s["S"], s["H"], c["heads_per_block"], a, c["schedule"])
            rows = kernel_rows(kv_format, resolve_kv_staging(c.get("kv_staging", "gather"), s))
            args = (c["schedule"], c.get("produce", "serial"), c.get("consumers", "wg0_scores"), c.get("wg1_rows", 0))
            blocks = blocks_per_token(s["W"], s["K"], c["block_I"])
            if why := overlapped_refusal(*args, c.get("tokens_per_cta", 1), n_split, c["block_I"], rows, blocks=blocks):
                return why
        if c.get("handoff", "after_pv") != "after_pv" and (c["schedule"] != "ws" or c.get("consumers", "wg0_scores") != "wg0_scores"):
            return "handoff=before_pv is when the ws warpgroup 0 hands P to warpgroup 1: schedule=ws, consumers=wg0_scores"
        if c.get("lanes", "row") != "row" and c["schedule"] != "ws":
            return "lanes=column maps the ws producer warpgroup's lanes: schedule=ws"
        if c.get("consumers", "wg0_scores") != "wg0_scores" and c["schedule"] != "ws":
            return "consumers=balanced splits S between the ws consumer warpgroups: schedule=ws"
        if c.get("consumers", "wg0_scores") in ("seesaw", "paired", "paired_halves") and c.get("produce", "serial") not in (
            "batched",
            "prefetch",
        ):
            # the serial producer's fixed 80 registers and the seesaw consumers' 2 x SEESAW_NREG are not balanced
            return f"consumers={c['consumers']} is built with the batched producer: produce=batched or prefetch"
        if c.get("io", "direct") in ("staged", "auto") and c["schedule"] != "ws":
            return f"io={c['io']} splits the Q load between the ws consumer warpgroups: schedule=ws"
        if c.get("produce", "serial") == "prefetch" and kv_format != "fp4":
            return "produce=prefetch keeps a block of packed FP4 words in registers: FP4 main KV only (bf16 rows go by cp.async)"
        if c.get("produce", "serial") in ("batched", "prefetch") and c["schedule"] != "ws":
            return "produce=batched is the ws producer warpgroup's fill strategy: schedule=ws"
        if c.get("fp4_decode", "fma") != "fma" and (why := prmt_decode_refusal(c, kv_format)):
            return why
        expands = resolve_kv_staging(c.get("kv_staging", "gather"), s) == "expand"
        if c.get("consumers", "wg0_scores") == "paired_halves":
            rows = kernel_rows(kv_format, "expand" if expands else "gather")
            io = c.get("io", "direct")
            if io == "auto":  # resolved as per call: kv_staging first (the rows), then io
                io = resolve_io({**c, "kv_staging": "expand" if expands else "gather"}, s, a, kv_format)[0]
            if why := halves_refusal(c["schedule"], c.get("produce", "serial"), c.get("tokens_per_cta", 1), rows, io=io):
                return why
        fp4_rows = c.get("produce", "serial") == "prefetch" or int(c.get("wg1_rows", 0)) or c.get("dequant", "direct") != "direct"
        if c.get("unused_rows", "row0") != "row0" and (why := bf16_copy_refusal(c, kv_format)):
            return why
        if expands and fp4_rows:
            return "kv_staging=expand runs the bf16 kernel, which has no FP4 rows to prefetch, split or stage: produce=serial or batched, wg1_rows=0, dequant=direct"
        if c.get("produce", "serial") in ("batched", "prefetch") and c["block_I"] % 32:
            return "the batched producer moves rows in passes of 16, FP8 in two halves: block_I a multiple of 32"
        return None

    def shared(c, s, a):
        n = smem_bytes(c, s, kv_format)
        return None if n <= a.smem_per_block else f"shared memory {n // 1024} KiB > {a.smem_per_block // 1024} KiB"

    def split(c, s, a):
        if c.get("n_split", 1) == "auto":
            return None
        blocks = blocks_per_token(s["W"], s["K"], c["block_I"])
        return None if int(c.get("n_split", 1)) <= blocks else f"{c['n_split']} splits > {blocks} index blocks"

    def combine(c, s, a):
        if c.get("partials", "fp32") == "bf16" and (why := bf16_partials_refusal(c, kv_format)):
            return why
        if c.get("combine", "separate") != "fused":
            return None
        if c["schedule"] != "ws" or int(c.get("tokens_per_cta", 1)) != 1:
            return "combine=fused merges the splits in the ws kernel's last split CTA: schedule=ws, tokens_per_cta=1"
        if int(c.get("wg1_rows", 0)):
            # warpgroup 1 then holds producer registers besides its accumulator: ptxas spills ~500 bytes
            return "combine=fused with wg1_rows spills in consumer warpgroup 1 (ptxas): wg1_rows=0"
        if c.get("consumers", "wg0_scores") in ("seesaw", "paired", "paired_halves"):
            return f"combine=fused is not built into the {c['consumers']} consumers: combine=separate"
        n_split = resolve_split(c.get("n_split", 1), s["B"], s["S"], s["H"], c["heads_per_block"], a, c["schedule"])
        return None if n_split > 1 else "combine=fused merges split partials: n_split resolves to 1 here, nothing to combine"

    # the last "auto" config resolved, (key, config), replaced whole: the tuner enumerates a space in a thread
    last: list = [None]

    def resolved(c, s, a):
        if c.get("consumers") != "auto":
            return c
        key = (tuple(sorted(c.items())), tuple(sorted(getattr(s, "dims", s).items())), a.name)
        entry = last[0]
        if entry is None or entry[0] != key:
            entry = last[0] = (key, resolve_consumers(c, s, a, kv_format))
        return entry[1]

    def on_resolved_consumers(check):
        """``check`` of the config with consumers="auto" resolved for the shape (resolve_consumers)."""
        return lambda c, s, a: check(resolved(c, s, a), s, a)

    # the ones that read ``consumers`` see "auto" resolved (the tuner's enumeration of a space checks millions)
    reads_consumers = (producer, shared, combine)
    constraints = (heads, registers, warpgroups, ws_shape, producer, shared, split, combine)
    return tuple(Constraint(f.__name__, on_resolved_consumers(f) if f in reads_consumers else f) for f in constraints)


def attention_search_space(kv_format: str, splits: bool) -> SearchSpace:
    """The attention tiles' structural choices (``splits``: the split-KV parameters, decode and bf16 tiles) and their
    constraints, with ``consumers="auto"`` resolved per shape where a constraint reads it."""
    params = [
        Param("schedule", ("pipelined", "ws"), "all threads gather+dequant then compute, or a producer warpgroup feeding two consumers"),
        Param(
            "produce",
            ("serial", "batched", "prefetch"),
            "ws producer: 16 rows per waited pass; the whole block's loads in flight with packed-integer dequant; or that "
            "with the next FP4 block's loads issued before its buffer frees",
        ),
        Param("block_I", (32, 64), "gathered KV rows per step"),
        Param("num_stages", (1, 2), "software pipeline depth over index blocks"),
        Param("threads", (128, 256), "consumer threads (ws adds a 128-thread producer)"),
        Param("heads_per_block", (32, 64), "heads sharing one gathered block (H=128 runs as two blocks of 64)"),
        Param(
            "io",
            (*IOS, "auto"),
            "ws Q load / O store: all threads element-wise and O from the fragments, or per consumer warpgroup in "
            "16-byte vectors with O staged through the freed Q tile, or (overlapped, several tokens per CTA) the "
            "next token's Q by cp.async under the last block and O staged through the last KV buffer, stored by the "
            "producer; auto: overlapped per call where its rows are bf16 and it has the tokens (resolve_io), else staged",
        ),
        Param(
            "consumers",
            ("wg0_scores", "balanced", "balanced_overlap", "seesaw", "paired", "paired_halves", "auto"),
            "ws consumer split: warpgroup 0 computes all of S and the softmax (both then compute half of O), or each "
            "warpgroup half of S's rows and its softmax with the row max exchanged through shared memory (overlap: "
            "P V left in flight under the next block's QK^T), or whole blocks in turn with P, the rescale and the "
            "running max handed over (seesaw: one warpgroup's QK^T under the other's softmax), or the two blocks "
            "of a pair at once, the max handed from warpgroup 0 to 1 and back, each warpgroup's own P V from "
            "registers (paired: FlashMLA's sparse prefill schedule; paired_halves: with each KV buffer handed "
            "over in halves, bf16 rows); auto: paired_halves where io=auto overlaps a prefill's tokens "
            "(resolve_consumers), else wg0_scores",
        ),
        Param(
            "tokens_per_cta",
            (1, 2, 4, 8),
            "ws (token, head block) items each CTA runs in turn: the producer runs on into the next token while the "
            "consumers finish this one (one CTA holds an SM, so its prologue and epilogue overlap nothing otherwise)",
        ),
        Param(
            "handoff",
            ("after_pv", "before_pv"),
            "ws, wg0_scores: when warpgroup 0 hands P to warpgroup 1, after its own half of P V (the two halves run "
            "one after the other) or before it (both at once; the KV buffer frees a P V earlier)",
        ),
        Param(
            "lanes",
            ("row", "column"),
            "ws producer lanes: a quarter-warp's 8 lanes store one row (4-way bank conflicts on the 128-byte-swizzled "
            "KV buffer) or the same columns of 8 rows (conflict-free)",
        ),
        Param(
            "ptxas_level",
            (0, 10),
            "ptxas --register-usage-level (0: its default, 5); TileLang's sparse_mla_fwd_pipelined example compiles with 10",
        ),
    ]
    if kv_format == "fp4":
        params.append(
            Param("dequant", ("direct", "staged"), "global bytes -> registers -> bf16 smem, or raw bytes -> smem (cp.async) -> bf16 smem")
        )
        params.append(
            Param(
                "wg1_rows",
                (0, 16),
                "rows of each FP4 main block that consumer warpgroup 1 gathers and dequantises in its wait for P "
                "(0: the producer warpgroup fills every row)",
            )
        )
        params.append(
            Param(
                "fp4_decode",
                ("fma", "prmt"),
                "ws batched producer, packed FP4 word -> 8 bf16: shifts and masks into the bf16 field with two exact "
                "bf16x2 multiplies per pair, or byte-permute lookups into constant bf16 byte tables and one exact "
                "multiply by the scale pair (the same bits, fewer producer instructions)",
            )
        )
    if kv_format == "fp4" and not splits:
        params.append(
            Param(
                "kv_staging",
                KV_STAGINGS,
                "prefill: the producer decodes each FP4/FP8 row every time a token reads it, or one launch first "
                "expands both caches to bf16 (each row once; fp4_decode picks its FP4 decode) and the bf16 kernel "
                "gathers them; auto expands from EXPAND_MIN_TOKENS tokens reading each row EXPAND_MIN_READS times or more",
            )
        )
    if kv_format == "bf16" or not splits:
        params.append(
            Param(
                "unused_rows",
                UNUSED_ROWS,
                "bf16 rows (the bf16 tile, the prefill tile's expand), ws batched producer: an unused slot (-1) "
                "copies row 0 by cp.async, or its cp.async reads nothing and zero-fills",
            )
        )
    if splits:
        params.append(Param("n_split", SPLIT_CHOICES, "split over the index list with a combine step; auto fills the SMs"))
        params.append(
            Param(
                "partials",
                PARTIALS,
                "dtype of the splits' partial O: fp32, or bf16 (ws, wg0_scores, separate combine: half the bytes the "
                "split CTAs store at their end and the combine reads, one more bf16 rounding)",
            )
        )
        params.append(
            Param(
                "combine",
                ("separate", "fused"),
                "merge the splits in a second kernel, or in the ws kernel's last split CTA per token (an arrival "
                "counter; no second launch, the partials read back from L2)",
            )
        )
    return SearchSpace(tuple(params), constraints(kv_format))
