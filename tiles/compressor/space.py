"""The compressor's search space: the values of its structural parameters (encode, loads, schedule, pooling, norm
and main passes, projection operands and accumulators), what ``compress_kernel`` builds and the tuner offers, and the
constraints (occupancy, shared memory) that refuse a config before it is compiled."""

from tiles.compressor.common import DI, DIRECT_ROWS, LOAD_CHUNK, MAIN_GROUP, MULTI_CTA_CHUNK, MULTI_CTA_STAGES, D
from tiles.compressor.projection import rot_pad
from tiles.core.arch import Arch
from tiles.core.contract import Config, Constraint, Param, SearchSpace, Shape

ENCODES = ("divide", "thresholds")
WK_LOADS = ("hi_lo", "fp32")  # how the index-K weight reaches the SM (see compress_kernel)
SCHEDULES = ("ws", "flat")  # producer warpgroup (one CTA per SM) or none (see compress_kernel)
# kv (and gate): 16-channel slabs, ratio 1's block rows in one copy, or per-thread loads into the pooling (see compress_kernel)
KV_LOADS = ("slabs", "whole", "direct")


POOL_MATHS = ("ieee", "fast")  # how the ratio-2 softmax over a group's two tokens is computed (see pool_pair)
PROJ_K_SPLITS = (1, 2)  # register projection: each warp covers all 512 k, or half of them with twice the output columns
NORM_PASSES = ("separate", "in_pool")  # RMSNorm after the pooling from rot_s, or on the pooled rows in registers (kv_load=direct)
MAIN_PASSES = ("separate", "in_pool")  # RoPE + main cache as passes over rot_s, or from the rows in registers (norm_pass=in_pool)


PROJ_OPERANDS = ("smem", "registers", "wgmma")  # where the tf32x3 projection's operands live (see compress_kernel)
PROJ_ACCUMULATORS = ("shared", "split")  # register projection: one accumulator per output tile, or the small products apart
MMA_PROJS = ("tf32x3", "f16x3")  # the tensor-core projections (the others: "simt")
PROJ_LATENTS = ("fp32", "f16_split")  # proj=f16x3: the latent in rot_s as fp32 (split per warp) or split once by the main pass
PROJ_OUTS = ("k_s", "rot_s")  # proj=f16x3: the keys into their own shared buffer, or over rot_s's first 128 columns
MAIN_STORES = ("bulk", "registers")  # main_pass=in_pool: main cache via shared memory and bulk stores, or from registers
PROJ_PIPELINES = ("near", "deep")  # proj=f16x3 with f16_split: Wk two chunks ahead, latent at use; or four / one ahead


def proj_registers_refusal(config: Config, schedule: str) -> str | None:
    """Why proj_operands="registers" (or "wgmma", which reads Wk the same way) cannot run with ``config`` (whose kernel
    is ``schedule``), or None."""
    name = f"proj_operands={config.get('proj_operands', 'registers')}"
    if schedule != "flat":
        return f"{name} exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
    if config.get("wk", "hi_lo") != "fp32":
        return f"{name} reads fp32 Wk (in fragment order) from L2: it needs wk=fp32"
    if config.get("kv_load", "slabs") == "whole":
        return f"{name} pads rot_s's rows (conflict-free fragment reads): kv_load=whole's one copy is not built"
    if config.get("wk_stages", 2) != 2:
        return f"{name} has no Wk pipeline in shared memory: wk_stages must stay 2"
    if config.get("proj_operands") == "wgmma" and config.get("block_g") != 16:
        return "proj_operands=wgmma is built for block_g 16 (the latent's high and low parts in wgmma's layout: three CTAs per SM)"
    return None


def occupancy_compress(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The flat kernel (``ctas_per_sm`` > 1, or ``schedule="flat"`` at one CTA per SM) and its values (``k_chunk`` 16,
    ``wk`` fp32, ``wk_stages`` 3-4, ``kv_load`` whole or direct) exist for the builds checked with ptxas (sm_90a).

    256 threads x 2 CTAs leave 128 registers a thread (ptxas: 88-102 at block_g 32, no spills), x 3 CTAs 85 (56-77 at
    block_g 16); one flat CTA of block_g 64 took 102-150, no spills. The staged kv/gate path and the pipelined tf32x3
    projection are the code it was cut from, and k_chunk 16 is what makes the Wk stages small enough (k_chunk 32 asked
    for 154,112 B at block_g 32, ratio 2). The shared memory itself is judged by :func:`smem_compress`.
    ``proj_operands="registers"`` (ptxas, no spills): 117 / 109 registers at block_g 32, 2 CTAs (ratio 2 / 1, direct),
    79-80 at block_g 16, 3 CTAs (slabs; direct at ratio 1), 118-146 at block_g 64, one CTA. ``proj="f16x3"`` at
    block_g 32, 3 CTAs (the shared memory of ``proj_out="rot_s"`` with ``main_store="registers"``): 80, no spills.
    """
    config = {"block_g": 32, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "direct", **config}  # partial: judged with defaults
    n = config.get("ctas_per_sm", 1)
    schedule = config.get("schedule", "flat" if n > 1 else "ws")
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}"
    if n > 1 and schedule != "flat":
        return f"ctas_per_sm {n} is the flat kernel (no producer warpgroup): schedule=ws exists only at one CTA per SM"
    kv_load = config.get("kv_load", "slabs")
    if kv_load == "whole" and shape.dims.get("ratio") != 1:
        return "kv_load=whole exists for ratio 1 only (ratio 2 pools pairs of tokens through the slabs)"
    if kv_load not in KV_LOADS:
        return f"unknown kv_load {kv_load!r}: use one of {', '.join(KV_LOADS)}"
    proj_operands = config.get("proj_operands", "smem")
    if proj_operands not in PROJ_OPERANDS:
        return f"unknown proj_operands {proj_operands!r}: use one of {', '.join(PROJ_OPERANDS)}"
    if config["proj"] == "f16x3" and (schedule != "flat" or proj_operands != "registers"):
        return "proj=f16x3 is built in the register projection only (the flat kernel, proj_operands=registers)"
    if proj_operands in ("registers", "wgmma") and (why := proj_registers_refusal(config, schedule)):
        return why
    if config.get("proj_accumulators", "shared") not in PROJ_ACCUMULATORS:
        return f"unknown proj_accumulators {config['proj_accumulators']!r}: use one of {', '.join(PROJ_ACCUMULATORS)}"
    if config.get("proj_accumulators", "shared") == "split" and proj_operands != "registers":
        return "proj_accumulators=split exists in the register projection only (proj_operands=registers)"
    k_split = config.get("proj_k_split", 1)
    if k_split not in PROJ_K_SPLITS:
        return f"unknown proj_k_split {k_split!r}: use one of {', '.join(map(str, PROJ_K_SPLITS))}"
    if k_split == 2 and (proj_operands != "registers" or config.get("proj_accumulators", "shared") != "shared"):
        return "proj_k_split=2 exists in the register projection with one accumulator (proj_operands=registers, proj_accumulators=shared)"
    norm_pass = config.get("norm_pass", "separate")
    if norm_pass not in NORM_PASSES:
        return f"unknown norm_pass {norm_pass!r}: use one of {', '.join(NORM_PASSES)}"
    if norm_pass == "in_pool" and kv_load != "direct":
        return "norm_pass=in_pool normalises the direct loads' pooled rows in registers: it needs kv_load=direct"
    main_pass = config.get("main_pass", "separate")
    if main_pass not in MAIN_PASSES:
        return f"unknown main_pass {main_pass!r}: use one of {', '.join(MAIN_PASSES)}"
    proj_latent = config.get("proj_latent", "fp32")
    if proj_latent not in PROJ_LATENTS:
        return f"unknown proj_latent {proj_latent!r}: use one of {', '.join(PROJ_LATENTS)}"
    if proj_latent == "f16_split" and (config["proj"] != "f16x3" or main_pass != "in_pool"):
        return "proj_latent=f16_split is the main pass's split of the f16x3 operands: it needs proj=f16x3 and main_pass=in_pool"
    proj_out, main_store = config.get("proj_out", "k_s"), config.get("main_store", "bulk")
    if proj_out not in PROJ_OUTS:
        return f"unknown proj_out {proj_out!r}: use one of {', '.join(PROJ_OUTS)}"
    if proj_out == "rot_s" and config["proj"] != "f16x3":
        return "proj_out=rot_s is built in the f16x3 projection only (proj=f16x3)"
    proj_pipeline = config.get("proj_pipeline", "near")
    if proj_pipeline not in PROJ_PIPELINES:
        return f"unknown proj_pipeline {proj_pipeline!r}: use one of {', '.join(PROJ_PIPELINES)}"
    if proj_pipeline == "deep" and (proj_latent != "f16_split" or k_split != 1):
        return "proj_pipeline=deep is built for the split-once latent (proj_latent=f16_split) and proj_k_split=1"
    if main_store not in MAIN_STORES:
        return f"unknown main_store {main_store!r}: use one of {', '.join(MAIN_STORES)}"
    if main_store == "registers" and main_pass != "in_pool":
        return "main_store=registers writes the main cache from main_pass=in_pool's rows: it needs main_pass=in_pool"
    if n == 3 and config.get("block_g") == 32 and (k_split != 1 or config.get("proj_accumulators", "shared") != "shared"):
        # ptxas at 80 registers (f16x3): 8-64 B of spills with split accumulators or the k-split (200-216 B without
        # f16_split); one accumulator and all 512 k per warp: none.
        return "three CTAs of 32 groups fit 80 registers with one accumulator and proj_k_split=1 only (the others spill)"
    if main_pass == "in_pool" and (norm_pass != "in_pool" or config.get("encode", "divide") != "thresholds"):
        return "main_pass=in_pool encodes the normalised rows in registers: it needs norm_pass=in_pool and encode=thresholds"
    if kv_load == "direct" and n > 2 and shape.dims.get("ratio", 2) == 2 and config.get("pool_math", "ieee") == "ieee":
        # ptxas: 80 registers (the cap of 3 x 256 threads) and 36-40 bytes of spills at block_g 16, ratio 2, with the
        # reference's pooling expression; pool_math="fast" compiles to 80 registers without spills (b6dc303).
        return "kv_load=direct at ratio 2 holds 16 float4s per thread: with pool_math=ieee it spills at 3 CTAs per SM (use ctas_per_sm 1-2 or pool_math=fast)"
    if schedule == "ws":
        # The new values came with the flat kernel and were compiled and checked only there.
        if config.get("wk", "hi_lo") == "fp32":
            return "wk=fp32 exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
        if config.get("wk_stages", 2) != 2 or kv_load != "slabs":
            return "wk_stages 3-4 and kv_load=whole/direct exist only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
        return "k_chunk 16 exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)" if config["k_chunk"] == 16 else None
    if arch.family != "hopper":
        return f"ctas_per_sm {n} (the flat kernel) is built and checked for Hopper (sm_90a) only"
    # block_g 64 only at one CTA per SM (its rot_s alone is 128 KiB); 16 only at 3 (what was compiled and checked).
    groups = (16, 32) if n > 1 else (32, 64)
    want = {"load": ("staged",), "proj": MMA_PROJS, "threads": (256,), "k_chunk": (16,), "block_g": groups}
    wrong = [f"{k}={config[k]!r}" for k, ok in want.items() if config[k] not in ok]
    if wrong:
        g = " or ".join(map(str, groups))
        return f"ctas_per_sm {n} (flat) needs load=staged, proj=tf32x3, threads=256, k_chunk=16, block_g {g} (got {', '.join(wrong)})"
    return None


def smem_flat(config: Config, ratio: int) -> int:
    """Dynamic shared memory of the flat kernel (B), fitted to the compiled kernels (sm_90a, TileLang 0.1.15, k_chunk 16,
    no static shared memory; tests/test_compressor.py checks it against the launch of every build in FLAT_BUILDS).

    rot_s, the gate slabs (the kv slabs share bytes with the Wk stages), four Wk-sized stages, a_lo and the small
    per-group arrays: exact at block_g 32 ratio 2/1 = 115,200/102,912 B and block_g 16 = 74,240/68,096 B. Each Wk
    stage past two adds one [128, k_chunk] fp32 tile (wk=fp32: the raw chunk) or two (hi_lo: both halves); block_g 64
    adds 2 KiB of the allocator's packing (174,592 B at ratio 1, 199,168 B at ratio 2). kv_load=whole changes nothing:
    the kv slabs it drops shared their bytes with the Wk stages; kv_load=direct also drops the gate slabs (its
    kv/gate rows are registers), so ratio 2 needs what ratio 1 does (102,912 B at block_g 32).
    """
    bg, kc = config["block_g"], config["k_chunk"]
    if config.get("proj_operands", "smem") in ("registers", "wgmma"):
        # rot_s with padded rows, k_s (the projection's result, written while rot_s is read; "wgmma": the latent's
        # remainder [block_g, 512], which k_s then reuses) and 2,560 B of small arrays; no Wk stages or split tiles, so
        # kv_load=slabs adds all its slabs (kv and gate, three stages each). Exact at block_g 16/32/64, ratio 1/2,
        # kv_load slabs/direct (tests/test_compressor.py).
        n_slabs = 0 if config.get("kv_load", "slabs") != "slabs" else (2 if ratio == 2 else 1)
        slab = MULTI_CTA_STAGES * ratio * bg * MULTI_CTA_CHUNK * 4
        k_s = bg * (D if config["proj_operands"] == "wgmma" else DI) * 4
        pad = rot_pad(config["proj"], config.get("proj_latent", "fp32"))
        if config.get("proj_out", "k_s") == "rot_s":
            # No k_s. main_store="bulk": bytes_m and sbyte_m (288 B a group), which bytes_i shares; "registers": bytes_i
            # (64 B a group) alone, in the bytes w_s has left at block_g 16 (fitted: exact at block_g 16/32/64).
            k_s = bg * 288 if config.get("main_store", "bulk") == "bulk" else (0 if bg == 16 else bg * 64)
        return 2560 + bg * (D + pad) * 4 + k_s + n_slabs * slab
    slabs = ratio == 2 and config.get("kv_load", "slabs") != "direct"
    gate_slabs = MULTI_CTA_STAGES * 2 * bg * MULTI_CTA_CHUNK * 4 if slabs else 0
    need = bg * D * 4 + gate_slabs + 4 * DI * kc * 4 + 8 * bg * kc + 512
    per_stage = DI * kc * 4 * (1 if config.get("wk", "hi_lo") == "fp32" else 2)
    return need + (config.get("wk_stages", 2) - 2) * per_stage + (2048 if bg == 64 else 0)


def smem_compress(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {"block_g": 32, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "direct", **config}  # partial: judged with defaults
    bg, kc = config["block_g"], config["k_chunk"]
    staged = config["load"] == "staged"
    ratio = shape.dims.get("ratio", 2)  # unknown ratio: count the larger ratio-2 staging
    n = config.get("ctas_per_sm", 1)
    if n > 1 or config.get("schedule") == "flat":
        # Every CTA also costs the 1 KiB the hardware reserves per block. Other k_chunk values are refused by
        # occupancy_compress.
        need = smem_flat(config, ratio)
        budget = min(arch.smem_per_sm // n - 1024, arch.smem_per_block)
        return None if need <= budget else f"shared memory {need} B > {budget} B per CTA at {n} CTAs per SM"
    need = (
        bg * D * 4
        + D * 4
        + bg * (D // MAIN_GROUP) * 5
        + bg * D // 2
        + bg * DI * 4
        + DI * 4
        + bg * DI // 2
        + 2 * bg * kc * 4
        + 2 * DI * kc * 4
    )
    if config["proj"] == "tf32x3":
        # Fitted to the dynamic shared memory of the compiled kernels (sm_90a, TileLang 0.1.15; exact at block_g
        # 16/32 x k_chunk 32/64): the sum above misses the split-precision copies of the Wk chunks, and the
        # staged pipeline keeps six Wk stages. On the H200 a (16, 64) staged config asked for 311 KiB and failed.
        need = -1024 + 2304 * bg + 1024 * kc + 12 * bg * kc
        if staged:
            need += 6 * DI * kc * 4 + 384 * bg + 2048
    elif staged:  # two pipeline stages of the kv (and gate) slabs
        slabs = 2 if ratio == 2 else 1
        need += 2 * slabs * bg * ratio * LOAD_CHUNK * 4
    # The fit is exact at 256 threads; at 128 it missed 1.5 KiB (block_g 32, k_chunk 32, staged: 230,400 B fitted,
    # 231,936 B asked) and on the H200 that request failed at launch, twice (5f78fe9). Below 256 threads 3 KiB stay
    # clear of the limit (the 256-thread builds of the same size launch: GPU tests, 5f78fe9).
    budget = arch.smem_per_block - (3072 if config["threads"] < 256 else 0)
    return None if need <= budget else f"shared memory {need // 1024} KiB > {budget // 1024} KiB"


def compressor_search_space(arch: Arch) -> SearchSpace:
    """The compressor's structural choices and the constraints that refuse what a build cannot hold."""
    params = (
        Param("block_g", (16, 32, 64), "groups (cache entries) per CTA"),
        Param("threads", (128, 256, 512), "threads per CTA"),
        Param(
            "proj",
            ("tf32x3", "f16x3", "simt"),
            "index-K projection: three TF32 tensor-core products (m16n8k8), or (register projection) three fp16 "
            "products on m16n8k16 with Wk split and scaled on the host (half the MMAs, no Wk splits in the kernel, "
            "22-bit operands), or fp32 FMA",
        ),
        Param("k_chunk", (16, 32, 64), "K chunk of the projection staged through shared memory"),
        Param(
            "load",
            ("direct", "staged"),
            "kv/gate (and Wk chunks) by per-thread loads into registers, or by double-buffered bulk copies through shared memory",
        ),
        Param(
            "encode",
            ENCODES,
            "E2M1 codes: IEEE x / s and 7 midpoint comparisons, or the same codes division-free "
            "(|x| against exact per-scale fp32 bounds; index cache: x times the exact inverse power of two)",
        ),
        Param(
            "ctas_per_sm",
            (1, 2, 3),
            "CTAs resident per SM: 1 = the warp-specialised kernel (one CTA fills the SM); 2-3 = no producer "
            "warpgroup, registers and shared memory cut so that several CTAs share the SM and one CTA's kv/gate "
            "stream overlaps another's norm/encode/projection (staged tf32x3, 256 threads, k_chunk 16)",
        ),
        Param(
            "wk",
            WK_LOADS,
            "index-K weight from L2: the host-split TF32 high part + remainder (512 KiB per CTA), or (ctas_per_sm > 1) "
            "fp32 Wk split in shared memory (256 KiB per CTA, the same operands)",
        ),
        Param(
            "schedule",
            SCHEDULES,
            "one CTA per SM: the warp-specialised kernel, or the flat kernel of ctas_per_sm > 1 (for block_g 64: "
            "one pass over Wk per 64 groups, half the Wk bytes and splits per group); ctas_per_sm > 1 is flat",
        ),
        Param("wk_stages", (2, 3, 4), "flat kernel: Wk chunks (L2 round trips) in flight + 1 in the projection loop"),
        Param(
            "kv_load",
            KV_LOADS,
            "flat kernel, ratio 1: kv through 16-channel slabs (32 HBM round trips per CTA), or the block's rows "
            "straight into the latent buffer in one copy; 'direct' (both ratios): no slabs and no barriers, each "
            f"thread loads {DIRECT_ROWS} groups' kv/gate float4s into registers at once, then pools them",
        ),
        Param(
            "proj_operands",
            PROJ_OPERANDS,
            "flat kernel, tf32x3 projection: latent and Wk chunks split into TF32 high/low tiles in shared memory and "
            "read by T.gemm (ldmatrix, three barriers per chunk), or every operand in registers: each warp owns 16 "
            "output columns, reads its latent words from rot_s and its Wk words from L2 (host fragment order), splits "
            "each once and issues the same MMAs (no Wk stages, no barriers; wk=fp32, wk_stages 2); or (block_g 16) the "
            "transposed product on wgmma: Wk from registers as before, the latent split once per CTA into wgmma's "
            "shared layout instead of once per warp",
        ),
        Param(
            "proj_accumulators",
            PROJ_ACCUMULATORS,
            "register projection: the three TF32 products of an output tile in one accumulator (T.gemm's order), or "
            "the two small products in a second one added at the end (two independent MMA chains per tile)",
        ),
        Param(
            "pool_math",
            POOL_MATHS,
            "ratio 2's softmax over a group's two tokens: two accurate expf and two IEEE divisions (the reference's "
            "expression), or ex2.approx and one approximate reciprocal (a few ulps: within the one-code-step rule); "
            "no effect at ratio 1",
        ),
        Param(
            "proj_k_split",
            PROJ_K_SPLITS,
            "register projection: each warp covers all 512 k for 16 output columns (every warp reads and splits the "
            "whole latent), or half of them for 32 columns (half the latent reads and splits; the halves added in k_s)",
        ),
        Param(
            "norm_pass",
            NORM_PASSES,
            "kv_load=direct: RMSNorm as its own passes over rot_s (sum of squares, barrier, scale), or on the pooled "
            "rows in registers (one warp per row, a shuffle reduction) so that rot_s is written once, normalised",
        ),
        Param(
            "main_pass",
            MAIN_PASSES,
            "norm_pass=in_pool, encode=thresholds: RoPE and the main cache's amax, scale and codes as passes over rot_s "
            "(barriers between), or from the normalised rows in registers (the group max by two shuffles; the same bits)",
        ),
        Param(
            "proj_latent",
            PROJ_LATENTS,
            "proj=f16x3: the pre-RoPE latent in shared memory as fp32, split into fp16 parts by every projection warp "
            "that reads it (8 or 4 times a word), or (main_pass=in_pool) split once by the main pass and stored as "
            "fp16 high parts and remainders, which the projection reads by ldmatrix",
        ),
        Param(
            "proj_out",
            PROJ_OUTS,
            "proj=f16x3: the index keys into their own shared buffer, or over the latent's first 128 columns once "
            "every warp has read it (a barrier; block_g x 512 B less shared memory)",
        ),
        Param(
            "main_store",
            MAIN_STORES,
            "main_pass=in_pool: the main cache through shared memory and bulk stores, or from the main pass's "
            "registers straight into the cache (block_g x 288 B less shared memory; with proj_out=rot_s three CTAs "
            "of 32 groups fit an SM)",
        ),
        Param(
            "proj_pipeline",
            PROJ_PIPELINES,
            "proj_latent=f16_split, proj_k_split=1: each chunk's Wk fragments two chunks ahead, copied into the MMA "
            "registers, and its latent fragments right before the MMAs; or Wk four chunks ahead in a ring the MMAs "
            "read in place and the latent one chunk ahead (the same MMAs in the same order)",
        ),
    )
    return SearchSpace(params, (Constraint("smem", smem_compress), Constraint("occupancy", occupancy_compress)))
