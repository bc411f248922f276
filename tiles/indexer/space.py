"""The indexer tiles' search space: the score and select parameters, the constraints that refuse configs a GPU
cannot build or hold, and the defaults per arch."""

from tiles.core.arch import Arch
from tiles.core.contract import Config, Param, Shape
from tiles.indexer.common import HEAD_DIM, HEADS
from tiles.indexer.dequant import FP8_MAX_BLOCK_N, HOPPER_ONLY_DEQUANTS, REGISTER_A_DEQUANTS, RS_DEQUANTS, rs_register_split
from tiles.indexer.policy import RADIX_DEFAULT, TILES_PER_CTA, radix_config
from tiles.indexer.radix_select import PARAMS, STAGES, smem_bytes
from tiles.indexer.score_kernel import EPILOGUES


def smem_score(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {**SCORE_DEFAULT, **config}  # a partial config is judged with the defaults filled in
    bn = config["block_n"]
    # TileLang's pipeline multi-buffers every shared tile written inside the loop: the packed
    # words, scales and positions, and the dequantised bf16 tile too (an estimate without that
    # factor let a 253 KiB lut config through to a launch failure on the H200).
    per_stage = bn * (HEAD_DIM // 2 + 4 + 4) + (bn * HEAD_DIM * 2 if config["dequant"] in ("shared", "lut", "bits", "prmt") else 0)
    tables = {"lut": 1024, "prmt_rs": 4096, "prmt_rs2": 4096}.get(config["dequant"], 0)  # lut: byte -> bf16x2; prmt_rs(2): tables
    need = HEADS * HEAD_DIM * 2 + HEADS * 4 + max(1, config["stages"]) * per_stage + tables
    if need > arch.smem_per_block:
        return f"shared memory {need // 1024} KiB > {arch.smem_per_block // 1024} KiB"
    ctas = config.get("min_ctas", 0)
    if ctas > 1:
        if config["dequant"] in ("bits", "prmt"):
            # Compiled sizes: the warp-specialised lowering multi-buffers only what the producer writes; the
            # consumer-written bf16 tile is single (bits, block_n 128: 59392 B at 2 stages; prmt: 76800 B at 4).
            need = HEADS * HEAD_DIM * 2 + 128 + max(1, config["stages"]) * bn * (HEAD_DIM // 2 + 8) + bn * HEAD_DIM * 2
        if ctas * (need + 1024) > arch.smem_per_sm:  # + the 1 KiB the runtime reserves per CTA
            return f"min_ctas={ctas} x shared memory {need // 1024} KiB > {arch.smem_per_sm // 1024} KiB per SM"
    return None


def register_cap(config: Config, shape: Shape, arch: Arch) -> str | None:
    """min_ctas CTAs of (consumers + TileLang's producer: 2 x threads) threads must leave ptxas enough registers.

    ptxas caps a thread at 64K / (min_ctas x threads), rounded down to a multiple of 8; the score kernel's wgmma
    and its dequant need about 48 (min_ctas 3 at 256 consumer threads, a cap of 40, fails to assemble:
    "Insufficient registers (40) to compile instruction").
    """
    config = {**SCORE_DEFAULT, **config}
    ctas = config.get("min_ctas", 0)
    if ctas <= 1:
        return None
    cap = (arch.registers_per_sm // (ctas * 2 * config["threads"])) // 8 * 8
    return None if cap >= 48 else f"min_ctas={ctas} x {2 * config['threads']} threads leaves {cap} registers per thread (< 48)"


def fragment_rows(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The register-fragment paths (wgmma RS) need exactly one 64-row wgmma tile per warpgroup when there are two.

    With block_n 256 and two warpgroups TileLang gives the A fragment (k_deq) to each warpgroup as rows
    {wg*64 + i*128} (its m-tiles interleaved across warpgroups: the generated dequant reads kw_s rows
    ``((i_1 & 7) >> 2) * 128 + warp * 16``) while the accumulator and the output store use rows
    {wg*128 + i*64} (``(threadIdx.x >> 7) * 128 + (i_5 >> 1) * 64``): a warpgroup multiplies K rows of the other
    warpgroup into its own score rows. That is the 0.92 relative error the H200 showed for
    {"dequant": "fragment_bits", "block_n": 256, "stages": 4, "tiles_per_cta": 4}. One warpgroup, or one m-tile each, has
    no such mismatch.
    """
    config = {**SCORE_DEFAULT, **config}
    wgs = config["threads"] // 128
    if config["dequant"] in ("registers", "fragment_bits", *RS_DEQUANTS) and wgs > 1 and config["block_n"] // wgs > 64:
        return f"dequant={config['dequant']} with {wgs} warpgroups needs block_n = {64 * wgs} (one 64-row wgmma tile each), got {config['block_n']}"
    return None


def rs_registers(config: Config, shape: Shape, arch: Arch) -> str | None:
    """dequant="prmt_rs" / "fma_rs" under min_ctas: the consumers' setmaxnreg share must hold the A fragment and accumulator.

    A consumer thread holds 32 A + 16 accumulator registers per 64-row m-tile of its warpgroup, plus ~32 of
    addresses and tables (ptxas, sm_90a: 74 registers for one m-tile, 122 for two, with no cap). Below that ptxas
    spills and serialises the wgmmas (C7512), e.g. 128 threads, block_n 128, min_ctas 4 (104 registers).
    """
    config = {**SCORE_DEFAULT, **config}
    if config["dequant"] not in REGISTER_A_DEQUANTS or config.get("min_ctas", 0) <= 1:
        return None
    mtiles = max(1, config["block_n"] // (config["threads"] // 128) // 64)
    # fp8_rs: 16 A + 64 accumulator registers an m-tile (four groups), all live while the four wgmmas are in flight;
    # at one m-tile and min_ctas 4 (104 registers) ptxas serialised them (C7512)
    need = 32 + (80 if config["dequant"] == "fp8_rs" else 48) * mtiles
    have = rs_register_split(config["threads"], config["min_ctas"])[1]
    if have >= need:
        return None
    return f"{config['dequant']}: {mtiles} m-tiles per warpgroup need ~{need} registers, min_ctas={config['min_ctas']} leaves {have}"


def epilogue_fits(config: Config, shape: Shape | None, arch: Arch) -> str | None:
    """epilogue="hoisted" / "fused" are built for the RS dequants only (their weights and store live in the consumer
    registers); "fused" also for one consumer warpgroup only (its hand-written epilogue reads the wgmma accumulator
    layout of one warpgroup: threads 128)."""
    config = {**SCORE_DEFAULT, **config}
    epilogue = config.get("epilogue", "per_tile")
    if epilogue != "per_tile" and config["dequant"] not in REGISTER_A_DEQUANTS:
        return f"epilogue={epilogue} needs dequant in {list(REGISTER_A_DEQUANTS)}, got {config['dequant']}"
    if epilogue == "fused" and config["threads"] != 128:
        return f"epilogue=fused needs one consumer warpgroup (threads 128), got threads={config['threads']}"
    if config["dequant"] == "fp8_rs" and (epilogue != "fused" or config["block_n"] > FP8_MAX_BLOCK_N):
        return f"dequant=fp8_rs is built with epilogue=fused and block_n <= {FP8_MAX_BLOCK_N} (four accumulators a thread)"
    return None


def dequant_arch(config: Config, shape: Shape, arch: Arch) -> str | None:
    """dequant="prmt_rs2" and "fp8_rs" are built for sm_90a only; the kernel builder refuses other targets."""
    config = {**SCORE_DEFAULT, **config}
    if config["dequant"] in HOPPER_ONLY_DEQUANTS and arch.family != "hopper":
        return f"dequant={config['dequant']} is built for Hopper (sm_90a) only, got {arch.family}"
    return None


def warps_fit(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {**SCORE_DEFAULT, **config}
    # FullRow splits the entry tile across warpgroups: each needs at least 64 rows for wgmma.
    rows = config["block_n"] // (config["threads"] // 128)
    return None if rows >= 64 else f"block_n={config['block_n']} gives {rows} rows per warpgroup (< 64)"


def score_params() -> tuple[Param, ...]:
    return (
        Param("block_n", (64, 128, 256), "entries per MMA tile (the wgmma M side)"),
        Param("threads", (128, 256), "consumer threads (one or two warpgroups; the TMA producer is added by TileLang)"),
        Param("stages", (1, 2, 3, 4), "software-pipeline depth of the packed-K loads"),
        Param(
            "tiles_per_cta",
            ("auto", *TILES_PER_CTA),
            "entry tiles per CTA: how finely N is split across CTAs (auto: the most that still fill the SMs, see resolve_tiles_per_cta)",
        ),
        Param(
            "min_ctas",
            (0, 2, 3, 4),
            "CTAs per SM the compiler must fit (__launch_bounds__ second argument: registers capped at 64K / (ctas x "
            "threads incl. the producer)); 0 = TileLang's own bound (1)",
        ),
        Param(
            "dequant",
            ("shared", "registers", "lut", "bits", "fragment_bits", "prmt", "prmt_rs", "fma_rs", "prmt_rs2", "fp8_rs"),
            "FP4 -> bf16 by arithmetic into a shared tile (wgmma SS) or into the A fragment (wgmma RS), "
            "by a 256-entry byte -> bf16x2 table into a shared tile, (bits) one thread per packed word "
            "building the scaled bf16 bit patterns by integer arithmetic into a shared tile, or (fragment_bits) "
            "those bit patterns per value into the A fragment (no bf16 tile: deeper pipelines fit), or (prmt) the bits "
            "path's patterns by byte-permute table lookups, one thread per 32-value scale group (~2 integer "
            "instructions per value instead of ~12: the integer pipe is the bits kernel's limit), or (prmt_rs) the prmt "
            "lookups straight into the A fragment (wgmma RS: no bf16 tile, no per-tile barrier; K and q in a permuted dim "
            "order so each thread dequantises whole scale groups; setmaxnreg moves the producer's registers to the "
            "consumers under min_ctas), or (fma_rs) prmt_rs's A fragment with half the integer work on the FMA pipe: "
            "nibble bits placed at bf16 positions by an integer multiply (code x 2^-126) and the E8M0 scale applied by "
            "two packed bf16 multiplies (~1 integer instruction per value instead of ~1.9, no table), or (prmt_rs2, "
            "sm_90a only) prmt_rs's A registers bit for bit with the high-half selectors on the FMA pipe (IMAD.HI) and the "
            "scale byte by one byte permute (13 instead of 14 ALU-pipe instructions per packed word), or (fp8_rs, sm_90a "
            "only, fused epilogue, block_n <= 128) no bf16 at all: the E2M1 codes shifted into E4M3 bytes (7 integer "
            "instructions per packed word) for one FP8 wgmma per scale group, q in E4M3 with a power-of-two factor per "
            "head, the four group sums scaled by their E8M0 scales on the FMA pipe (right on the H200, and slower than "
            "prmt_rs there)",
        ),
        Param(
            "epilogue",
            EPILOGUES,
            "RS dequants only: (per_tile) every tile reloads the weights from shared memory, halves them and rebuilds "
            "the int64 output index of each store; (hoisted) w / 2 in registers and the CTA's output-row pointer built "
            "once per CTA (the same products and sums, bitwise: code motion only); (fused, one consumer warpgroup) hoisted plus "
            "the ReLU-weighted head sum as one FFMA chain per row, the quad sum as a reduce-scatter and each quad lane "
            "storing its own rows (hand-written on the wgmma accumulator registers)",
        ),
    )


SELECT_ALGO = Param(
    "select_algo",
    ("multipass", "two_pass"),
    "top-k select: radix passes over the row in global memory (select_threads, radix_bits, select_split), or "
    "tiles.indexer.radix_select (one histogram and one compaction pass over the row, the rest in shared memory)",
)


# The two-pass select's knobs in the indexer's space: the structural ones that matter when few rows are long (B=1
# decode: 8 CTAs on the whole GPU at radix_select's default; its row staged in shared memory at 512 threads ran one
# 128K row 25.4 -> 21.0 us on the H200, 0f2e979). Defaults are DEFAULT_CONFIG's.
RADIX_PARAMS = (
    Param("radix_threads", PARAMS["threads"], "two_pass select: threads per CTA (tiles.indexer.radix_select)"),
    Param(
        "radix_stage",
        STAGES,
        "two_pass select: its passes read each row part from global memory (L2) or from a copy in shared memory",
    ),
    Param("radix_parts", ("auto", 8, 16, 32), "two_pass select: row parts selected apart before their merge"),
)


def page_fits(config: Config, shape: Shape, arch: Arch) -> str | None:
    """A paged shape's score tiles are whole pages, or its pages whole tiles, at most 8 page copies a tile
    (:func:`tiles.indexer.score_kernel.build_score_kernel`)."""
    page = shape.dims.get("page", 0)
    bn = {**SCORE_DEFAULT, **config}["block_n"]
    if page and ((page % bn and bn % page) or bn // page > 8):
        return f"block_n={bn} with {page}-entry pages: a tile must be whole pages (at most 8) or a part of one"
    return None


def radix_two_pass_only(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The radix_* knobs configure select_algo="two_pass" only: other values under multipass would repeat a config."""
    if config.get("select_algo", "multipass") == "two_pass":
        return None
    moved = sorted(name for name, default in RADIX_DEFAULT.items() if config.get(name, default) != default)
    return f"{', '.join(moved)} apply to select_algo=two_pass only" if moved else None


def radix_smem(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The two-pass select's shared memory must fit the arch (a staged part needs 104 KiB: not on sm86/89/120)."""
    if config.get("select_algo", "multipass") != "two_pass":
        return None
    need = smem_bytes(radix_config(config))
    return (
        f"the select needs {need // 1024} KiB of shared memory > {arch.smem_per_block // 1024} KiB" if need > arch.smem_per_block else None
    )


def select_params() -> tuple[Param, ...]:
    return (
        Param("select_threads", (512, 1024), "threads of the one-CTA-per-row radix select"),
        Param("radix_bits", (8, 11), "bits per radix pass: 4 passes of 8 or 3 of 11 (2048 bins)"),
    )


SCORE_DEFAULT = {
    "block_n": 128,
    "threads": 256,
    "stages": 2,
    "tiles_per_cta": 4,
    "dequant": "shared",
    "min_ctas": 0,
    "epilogue": "per_tile",
}
SELECT_DEFAULT = {"select_threads": 1024, "radix_bits": 8}
# Hopper: word-wise integer dequant (no per-value float chain, one barrier per tile), two
# consumer warpgroups so 8 warps share the dequant of a 128-entry tile, and 16 tiles (2048
# entries) per CTA so the 8 KiB query load and the pipeline prologue are paid once per 2048
# entries, not per 512. On the H200 its score kernel ran 0.84 ms at decode B=64 x 128K against 2.52 ms
# for the first default (`shared`), level with `lut` (260003f).
SCORE_DEFAULT_SM90 = {
    "block_n": 128,
    "threads": 256,
    "stages": 2,
    "tiles_per_cta": 16,
    "dequant": "bits",
    "min_ctas": 0,
    "epilogue": "per_tile",
}
