"""Sparse gather attention with an attention sink: FP4 main KV + FP8 window KV (and a bf16-KV variant).

Every query token attends, in one online softmax, to its SWA window entries (FP8 E4M3 codes
with one E8M0 scale per 32, indices into the window KV) and its top-k compressed entries
(packed FP4 E2M1 with one E4M3 scale per 16, indices into the group's global KV); the sink
adds ``exp(sink_h)`` to the denominator. K = V = the 512-dim latent (shared-KV MQA), so one
block serves ``heads_per_block`` heads of one token and gathers each KV row once for all of
them. Hopper has no FP4 MMA: the gathered rows are dequantised to bf16 in shared memory
(exactly: e2m1 x e4m3 and e4m3 x 2^k fit in bf16's 8-bit significand) and fed to wgmma.

Schedules (a tile parameter):

* ``ws`` (the Hopper default): warp specialisation after FlashMLA / TileLang's
  ``sparse_mla_fwd_pipelined``: one producer warpgroup gathers and dequantises into two KV buffers
  while consumer warpgroup 0 computes S, the online softmax and the left half of O, warpgroup 1 the
  right half (Hopper only: mbarriers, wgmma, setmaxnreg). ``produce`` picks how the producer fills a
  buffer: ``batched`` (the default: every load of a block in flight at once, packed-integer dequant,
  cp.async for bf16; 1.5-2x faster than ``serial`` on the H200, notes/sparse_attn.md run 4) or
  ``serial`` (16 rows per waited pass).
* ``pipelined``: all threads gather + dequantise, then both GEMMs; ``T.Pipelined`` prefetches the
  next block's indices (and, with ``dequant="staged"``, its raw bytes). The sm80/86/89 schedule
  (the GEMMs lower to mma.sync there).

``dequant`` (FP4 tiles, pipelined schedule) picks how the quantised bytes reach shared memory:
``direct`` (global -> registers -> bf16 smem, synchronous) or ``staged`` (the raw FP4 words and scales
are cp.async'ed into smem one block ahead, then dequantised smem -> smem). FP4 codes are read as int32
words, 8 codes per load, all inside one 16-wide scale group.

Split-KV (``n_split`` > 1, decode): each split takes a share of the window blocks and of the top-k
blocks, writes its partial output (normalised by its own sum; bf16 on Hopper, ``partials``) and its log2-sum-exp, and a small
combine kernel merges the splits together with the sink (``combine="fused"``, ws only: the last split CTA of
each token merges them itself, after an arrival counter). ``n_split="auto"`` picks the fewest
power-of-two splits that give at least two blocks per SM.

``kv_staging`` (the prefill tile): ``gather`` decodes each FP4/FP8 row in the producer every time a token reads it;
``expand`` first expands both caches to bf16 in one launch (:mod:`tiles.kv_expand`, the producer's own decode
helpers, so the same bits) and runs the bf16 kernel on them: at prefill every row is read by hundreds of tokens, and
the decode work is what paced the producer (1.24x at 4K-64K on the H200). ``auto`` (the Hopper prefill default) expands
from EXPAND_MIN_TOKENS tokens reading each row EXPAND_MIN_READS times or more. The decode tile always gathers.

Index policy: -1 is skipped (masked: its KV row is written as zeros, so no garbage reaches the GEMM);
a repeated index counts each time; an index past the cache length is rejected by the wrapper only when
``check_indices=True`` (one host sync, off by default: in the model the indexer produces in-range
indices by construction). Unchecked, the ``ws``/``batched`` producer masks such an index exactly like
-1; the other schedules' guarded loads read zeros for its row (a zero key: score 0, not -inf).
"""

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import tilelang
import tilelang.language as T
import torch

from model.formats import fp4_dequantize, fp8_dequantize
from model.ops.sparse_attn import sparse_attention as _ref_sparse_attention
from tiles.arch import Arch, get_arch
from tiles.compare import relative_l2
from tiles.contract import Comparison, Config, Constraint, Inputs, Param, SearchSpace, Shape, Tile, TileError, canonical_key, poisoned
from tiles.fp4 import PRMT_ASM_CUDA
from tiles.kv_expand import expand_caches, expand_kernel
from tiles.shapes import attention_shapes

LOG2E = 1.4426950408889634
# Relative L2 vs the fp32 reference on the same dequantised inputs: P is rounded to bf16 before
# the PV GEMM and the output is bf16, each ~2^-9 relative; measured errors sit near 4e-3.
TOLERANCE = 1e-2
_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


# ----------------------------------------------------------------------------------------------
# Kernel builders
# ----------------------------------------------------------------------------------------------
def _e2m1(nib):
    """E2M1 code (int32, 0..15) -> float32 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), branch-free.

    Codes 2..7 are normal numbers whose exponent and mantissa bits are the code's ``e m`` bits moved into
    place with the exponent rebased (126 = 127 - 1); codes 0 and 1 (0 and 0.5) are picked directly.
    """
    m = nib & 7
    normal = T.shift_left(m, 22) + (126 << 23)
    small = T.if_then_else(m == 1, 0x3F000000, 0)
    mag = T.reinterpret(T.if_then_else(m >= 2, normal, small), "float32")
    return T.if_then_else(nib >= 8, -mag, mag)


def _e8m0(byte):
    """E8M0 byte -> float32 2^(byte - 127), built from the exponent bits (exact, no exp2 rounding)."""
    return T.reinterpret(T.shift_left(T.cast(byte, "int32"), 23), "float32")


# Packed-integer dequantisation for the batched producer (CUDA, included into the kernel source). Each helper
# turns a 32-bit word of codes into bf16x2 words with shifts and masks plus two exact bf16x2 multiplies,
# ~3.5 instructions per value against ~15 for the per-value float path.
#
# The trick: a code's magnitude bits are placed straight into the bf16 exponent/mantissa field, which
# encodes value * 2^-126 (E2M1) or value * 2^-120 (E4M3): the smallest nonzero codes (E2M1 0.5, E4M3
# subnormals) land on bf16 subnormals, which fma.rn.bf16x2 keeps (there is no flush-to-zero for bf16).
# One multiply by 2^126 (2^120) restores the value exactly, a second by the scale gives value * scale,
# exact because e2m1 x e4m3 needs 6 significant bits and e4m3 x 2^k needs 4 (bf16 has 8). E4M3 NaN
# codes (0x7F/0xFF) decode as +-480 here: the quantiser writes them only for NaN inputs.
_DEQUANT_CUDA = r"""
__device__ __forceinline__ unsigned csa2_bf16x2_mul(unsigned a, unsigned b) {
  unsigned d;  // a * b + (-0): the exact product, signed zeros kept
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// E2M1 codes in bits 0-3 and 16-19 -> bf16x2 of value * 2^-126.
__device__ __forceinline__ unsigned csa2_e2m1x2(unsigned y) {
  return ((y << 6) & 0x01C001C0u) | ((y << 12) & 0x80008000u);
}
// E4M3 codes in bytes 0 and 2 -> bf16x2 of value * 2^-120.
__device__ __forceinline__ unsigned csa2_e4m3x2(unsigned y) {
  return ((y << 4) & 0x07F007F0u) | ((y << 8) & 0x80008000u);
}
// E4M3 scale byte -> its value as a bf16x2 pair (exact).
__device__ __forceinline__ unsigned csa2_e4m3_scale2(unsigned b) {
  unsigned x = csa2_bf16x2_mul(csa2_e4m3x2(b & 0xFFu), 0x7B807B80u) & 0xFFFFu;  // * 2^120
  return x | (x << 16);
}
// E8M0 scale byte -> 2^(b - 127) as a bf16x2 pair (0: the subnormal 2^-127, 255: NaN).
__device__ __forceinline__ unsigned csa2_e8m0_scale2(unsigned b) {
  unsigned x = b == 0u ? 0x0040u : (b == 255u ? 0x7FC0u : (b << 7));
  return x | (x << 16);
}
// 8 FP4 codes (code k in bits 4k..4k+3 of w) times a bf16x2 scale pair -> 8 bf16 in order at dst.
__device__ __forceinline__ void csa2_fp4x8_bf16(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  unsigned t[4];  // t[k] holds codes k and k + 4
#pragma unroll
  for (int k = 0; k < 4; ++k) t[k] = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e2m1x2(u >> (4 * k)), 0x7E807E80u), scale2);
  uint4 o;
  o.x = __byte_perm(t[0], t[1], 0x5410);
  o.y = __byte_perm(t[2], t[3], 0x5410);
  o.z = __byte_perm(t[0], t[1], 0x7632);
  o.w = __byte_perm(t[2], t[3], 0x7632);
  *reinterpret_cast<uint4*>(dst) = o;
}
// 4 E4M3 codes (byte k of w) times a bf16x2 scale pair -> 4 bf16 in order at dst.
__device__ __forceinline__ void csa2_e4m3x4_bf16(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  const unsigned t02 = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e4m3x2(u), 0x7B807B80u), scale2);
  const unsigned t13 = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e4m3x2(u >> 8), 0x7B807B80u), scale2);
  uint2 o;
  o.x = __byte_perm(t02, t13, 0x5410);
  o.y = __byte_perm(t02, t13, 0x7632);
  *reinterpret_cast<uint2*>(dst) = o;
}
"""

# ablate="no_stores" (timing only): the 16 decoded bytes at v folded into one word, so the decode stays live unstored.
_NO_STORES_CUDA = r"""
__device__ __forceinline__ int csa2_fold16(const void* v) {
  const uint4 o = *reinterpret_cast<const uint4*>(v);
  return (int)(o.x ^ o.y ^ o.z ^ o.w);
}
"""

# fp4_decode="prmt": csa2_fp4x8_bf16's 8 bf16 by byte-permute table lookups (the indexer's prmt dequant, tiles/indexer.py,
# with constant tables: the scale here is E4M3, not a power of two, so it is applied afterwards by the same exact
# multiply). The 8 E2M1 magnitudes' bf16 patterns (0, 0.5, 1, 1.5, 2, 3, 4, 6: 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000,
# 0x4040, 0x4080, 0x40C0) split into a low-byte table (00 00 80 C0 00 40 80 C0) and a high-byte table (00 3F 3F 3F
# 40 40 40 40), two registers each; a word's masked codes (bit 3, prmt's sign-replicate flag, cleared) select from them,
# 4 nibbles per prmt. Per word: mask, shift, shift, 4 lookups, 2 sign merges (prmt of w and w << 4, masked, or'ed into
# the high bytes), 4 interleaves, 4 multiplies by the scale pair: ~19 instructions against ~28. The looked-up bf16 is
# bit for bit csa2_fp4x8_bf16's intermediate (the pattern times 2^126, exact, signed zeros kept), and the scale
# multiply is the same fma, so the output is identical for every code and every scale pair
# (tests/test_sparse_attn.py emulates both exhaustively).
_FP4_PRMT_CUDA = (
    PRMT_ASM_CUDA
    + r"""
// 8 FP4 codes (code k in bits 4k..4k+3 of w) times a bf16x2 scale pair -> 8 bf16 in order at dst (= csa2_fp4x8_bf16).
__device__ __forceinline__ void csa2_fp4x8_bf16_prmt(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  const unsigned m = u & 0x77777777u;                    // magnitude codes: the lookup selectors
  unsigned mh;
  asm("shr.b32 %0, %1, 16;" : "=r"(mh) : "r"(m));       // codes 4..7 (opaque: else nvcc re-masks u for it)
  const unsigned u4 = u << 4;
  const unsigned l0 = csa2_prmt(0xC0800000u, 0xC0804000u, m);   // low bytes of codes 0..3
  const unsigned l1 = csa2_prmt(0xC0800000u, 0xC0804000u, mh);  // ... of codes 4..7
  // high bytes, with the sign of nibble j (bit 4j + 3) moved to bit 7 of byte j: from u << 4 (even j) or u (odd j)
  const unsigned h0 = csa2_prmt(0x3F3F3F00u, 0x40404040u, m) | (__byte_perm(u, u4, 0x1504) & 0x80808080u);
  const unsigned h1 = csa2_prmt(0x3F3F3F00u, 0x40404040u, mh) | (__byte_perm(u, u4, 0x3726) & 0x80808080u);
  uint4 o;
  o.x = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x5140), scale2);  // codes 0 (low half) and 1
  o.y = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x7362), scale2);  // 2, 3
  o.z = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x5140), scale2);  // 4, 5
  o.w = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x7362), scale2);  // 6, 7
  *reinterpret_cast<uint4*>(dst) = o;
}
"""
)
# The FP4 main-word dequant the ws batched/prefetch producer calls, per ``fp4_decode``.
_FP4X8_FUNCTIONS = {"fma": "csa2_fp4x8_bf16", "prmt": "csa2_fp4x8_bf16_prmt"}


def _decode_helpers_cuda(fp4_decode: str) -> str:
    """The producer's decode helpers for ``fp4_decode`` (the FP8 window's and the FP4 main word's)."""
    return _DEQUANT_CUDA + (_FP4_PRMT_CUDA if fp4_decode == "prmt" else "")


# The fused combine's release fence (see _ws_fused_combine). TileLang 0.1.15 has atomics with a memory order
# (T.atomic_add(..., memory_order=, return_prev=)) but no standalone fence.
_FUSE_CUDA = r"""
// Orders this thread's earlier global stores before its later operations at GPU scope (a release fence, cheaper
// than __threadfence's fence.sc.gpu).
__device__ __forceinline__ void csa2_fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Keeps the compiler from moving loads across it (no instruction): bounds the loads in flight, hence the registers.
__device__ __forceinline__ void csa2_compiler_fence() { asm volatile("" ::: "memory"); }
"""


def sparse_attn_kernel(
    heads: int,
    dim: int,
    window: int,
    topk: int,
    sm_scale: float,
    kv_format: str = "fp4",
    n_split: int = 1,
    block_I: int = 64,
    num_stages: int = 2,
    threads: int = 256,
    heads_per_block: int = 64,
    dequant: str = "direct",
    schedule: str = "pipelined",
    produce: str = "serial",
    io: str = "direct",
    consumers: str = "wg0_scores",
    wg1_rows: int = 0,
    tokens_per_cta: int = 1,
    combine: str = "separate",
    handoff: str = "after_pv",
    lanes: str = "row",
    fp4_decode: str = "fma",
    partials: str = "fp32",
    ablate: str = "",
    unused_rows: str = "row0",
):
    """Build the attention prim_func (B, S, Nw, Nc are dynamic; everything else is specialised).

    Inputs (``kv_format="fp4"``): Q bf16 [B, S, H, D]; WinCodes float8_e4m3fn [B, Nw, D];
    WinScales uint8 [B, Nw, D/32] (E8M0); WinIdx int32 [B, S, W]; MainPacked int32 [B, Nc, D/8] (the packed bytes viewed as words);
    MainScales float8_e4m3fn [B, Nc, D/16]; TopkIdx int32 [B, S, K]; Sink fp32 [H].
    ``kv_format="bf16"``: WinKV bf16 [B, Nw, D] and MainKV bf16 [B, Nc, D] instead of codes/scales.
    Outputs: ``n_split == 1``: Out bf16 [B, S, H, D]; else OPart fp32 [B, S, n_split, H, D] (each
    split normalised by its own sum) and LsePart fp32 [B, S, n_split, H] (log2 domain, -inf = empty).
    ``schedule="ws", produce="batched"`` takes the FP8 window codes as int32 words [B, Nw, D/4] and the
    E4M3 main scales as uint8 [B, Nc, D/16] (see :func:`ws_argument_views`).
    ``combine="fused"`` (ws, ``n_split > 1``): Out is bf16 [B, S, H, D], then LsePart fp32 [B, S, NS, H],
    OPart fp32 [B, S, NS, H, D] (scratch) and Counter int32 [B, S, H / heads_per_block] (zero before the launch,
    left zero after it).
    ``partials="bf16"`` (ws, ``consumers="wg0_scores"``, separate combine): OPart is bf16, staged out like O.
    ``ablate`` (timing only, wrong results by design; never in the search space): see :data:`ABLATIONS`.
    """
    if consumers == "auto":
        raise ValueError("consumers='auto' is resolved per call first: resolve_consumers")
    if combine == "fused" and (schedule != "ws" or n_split == 1 or tokens_per_cta != 1):
        raise ValueError("combine='fused' merges split partials in the ws kernel: schedule='ws', n_split > 1, tokens_per_cta=1")
    if partials not in PARTIALS:
        raise ValueError(f"unknown partials {partials!r}: use one of {', '.join(PARTIALS)}")
    if unused_rows not in UNUSED_ROWS or (unused_rows != "row0" and (kv_format != "bf16" or schedule != "ws" or produce != "batched")):
        raise ValueError(f"unused_rows {unused_rows!r}: one of {', '.join(UNUSED_ROWS)}; 'zeros' is the ws batched producer's bf16 KV copy")
    if partials == "bf16" and (schedule != "ws" or consumers != "wg0_scores" or combine != "separate"):
        raise ValueError("partials='bf16' is built into the ws kernel's wg0_scores consumers with the separate combine")
    if io not in IOS:
        raise ValueError(f"unknown io {io!r}: use one of {', '.join(IOS)} ('auto' is resolved per call first: resolve_io)")
    blocks = blocks_per_token(window, topk, block_I)
    if io == "overlapped" and (
        why := _overlapped_refusal(schedule, produce, consumers, wg1_rows, tokens_per_cta, n_split, block_I, kv_format, ablate, blocks)
    ):
        raise ValueError(why)
    if consumers == "paired_halves" and (why := _halves_refusal(schedule, produce, tokens_per_cta, kv_format, ablate, io)):
        raise ValueError(why)
    # the ablations that change the consumers are built into the wg0_scores consumers; the producer's leave any as they are;
    # the Q-load and O-store cuts also into paired_halves with io=overlapped (the prefill default's path)
    if (
        ablate
        and not _halves_edge_cut(ablate, consumers, io)
        and (
            ablate not in ABLATIONS
            or schedule != "ws"
            or (consumers != "wg0_scores" and ablate in _CONSUMER_ABLATIONS)
            or tokens_per_cta != 1
            or produce != "batched"
            or wg1_rows
            or (ablate in _EDGE_ABLATIONS and (io != "staged" or n_split != 1))
        )
    ):
        raise ValueError(
            f"ablate={ablate!r}: one of {', '.join(ABLATIONS)}, for the ws kernel's batched producer (and, for "
            f"{', '.join(_CONSUMER_ABLATIONS)}, its wg0_scores consumers; for {', '.join(_EDGE_ABLATIONS)}, "
            "io='staged' with one split, or paired_halves with io='overlapped'), one token per CTA"
        )
    if schedule == "ws":
        return _sparse_attn_ws(
            heads,
            dim,
            window,
            topk,
            sm_scale,
            kv_format,
            n_split,
            block_I,
            heads_per_block,
            produce,
            io,
            consumers,
            wg1_rows,
            tokens_per_cta,
            combine,
            handoff,
            lanes,
            fp4_decode,
            partials,
            ablate,
            unused_rows,
        )
    B, S, Nw, Nc = T.dynamic("B"), T.dynamic("S"), T.dynamic("Nw"), T.dynamic("Nc")
    H, D, W, K, BI, HB, NS = heads, dim, window, topk, block_I, heads_per_block, n_split
    REP = H // HB
    NBW, NBK = -(-W // BI), -(-K // BI)
    EW, EK = -(-NBW // NS), -(-NBK // NS)
    scale2 = sm_scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    fp4 = kv_format == "fp4"
    staged = dequant == "staged" and fp4
    out_shape = [B, S, H, D] if NS == 1 else [B, S, NS, H, D]
    # Staged schedule, spelled out (the inferred one cannot order the raw buffers' write/read pair); 16 statements =
    # index load, 2 raw copies, dequant, the 12 of _attend. num_stages=2 prefetches the next block's raw bytes.
    k_order = list(range(16)) if staged else None
    k_stage = [0, 0, 0] + [num_stages - 1] * 13 if staged else None

    win_args = ([B, Nw, D], "float8_e4m3fn", [B, Nw, D // 32], "uint8") if fp4 else ([B, Nw, D], bf16, [1], "uint8")
    # Packed FP4 is read as int32 words (8 codes each, inside one 16-wide scale group): one load per 8 values.
    main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "float8_e4m3fn") if fp4 else ([B, Nc, D], bf16, [1], "uint8")

    @T.prim_func
    def main(
        Q: T.Tensor([B, S, H, D], bf16),
        WinA: T.Tensor(win_args[0], win_args[1]),
        WinB: T.Tensor(win_args[2], win_args[3]),
        WinIdx: T.Tensor([B, S, W], "int32"),
        MainA: T.Tensor(main_args[0], main_args[1]),
        MainB: T.Tensor(main_args[2], main_args[3]),
        TopkIdx: T.Tensor([B, S, K], "int32"),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor(out_shape, bf16 if NS == 1 else f32),
        LsePart: T.Tensor([B, S, NS, H], f32),
    ):
        with T.Kernel(S * REP, B, NS, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([HB, D], bf16)
            KV_shared = T.alloc_shared([BI, D], bf16)
            S_shared = T.alloc_shared([HB, BI], bf16)
            idx_shared = T.alloc_shared([BI], "int32")
            # The staged top-k loop's indices in their own buffer: its explicit pipeline double-buffers them, and with
            # one window block per split (n_split > 1: the window loop has one iteration and is not pipelined) TileLang
            # kept the shared [BI] buffer at one version while the top-k loop addressed two: the second block's indices
            # landed in the first 256 bytes of KV_shared (wrong outputs, H200, tune session 8; generated CUDA read in
            # session 9: idx_shared at +32768, KV_shared at +33024).
            # (Only the staged path allocates it; the others name idx_shared at each use: binding an alias renames the
            # buffer in the generated source.)
            idx_k_shared = T.alloc_shared([BI], "int32") if staged else None
            if staged:
                raw_shared = T.alloc_shared([BI, D // 8], "int32")
                rawsc_shared = T.alloc_shared([BI, D // 16], "float8_e4m3fn")
            acc_o = T.alloc_fragment([HB, D], f32)
            acc_s = T.alloc_fragment([HB, BI], f32)
            sumexp = T.alloc_fragment([HB], f32)
            sumexp_i = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_i_prev = T.alloc_fragment([HB], f32)

            b_i, s_i = by, bx // REP
            h0 = (bx % REP) * HB
            # This split's share of each list: EW window blocks from bz * EW and EK top-k blocks from bz * EK.
            # Static trip counts: dynamic ones made T.Pipelined emit wrong code at 8 splits and fail to compile
            # at 2 or 4 (GPU runs 1-2). A block past the end of its list is masked by ``pos < W`` / ``pos < K``.
            w_lo, k_lo = bz * EW, bz * EK

            T.fill(acc_o, 0)
            T.fill(sumexp, 0)
            T.fill(m_i, -(2**30))  # finite so that an all-masked block gives exp2(-inf) = 0, not NaN
            T.copy(Q[b_i, s_i, h0 : h0 + HB, :], Q_shared)

            for i in T.Pipelined(EW, num_stages=num_stages):
                blk = w_lo + i
                for bi in T.Parallel(BI):
                    pos = blk * BI + bi
                    idx_shared[bi] = T.if_then_else(pos < W, WinIdx[b_i, s_i, T.min(pos, W - 1)], -1)
                if fp4:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        val = T.cast(WinA[b_i, row, d], f32) * _e8m0(WinB[b_i, row, d // 32])
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                else:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, WinA[b_i, row, d], T.cast(0, bf16))
                _attend(Q_shared, KV_shared, S_shared, idx_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2)

            for i in T.Pipelined(EK, num_stages=0 if staged else num_stages, order=k_order, stage=k_stage):
                blk = k_lo + i
                for bi in T.Parallel(BI):
                    pos = blk * BI + bi
                    (idx_k_shared if staged else idx_shared)[bi] = T.if_then_else(pos < K, TopkIdx[b_i, s_i, T.min(pos, K - 1)], -1)
                if staged:
                    # the raw copies take their rows from global, not idx_shared: both are cp.async in one stage
                    for bi, j in T.Parallel(BI, D // 8):
                        raw_shared[bi, j] = MainA[b_i, T.max(TopkIdx[b_i, s_i, T.min(blk * BI + bi, K - 1)], 0), j]
                    for bi, j in T.Parallel(BI, D // 16):
                        rawsc_shared[bi, j] = MainB[b_i, T.max(TopkIdx[b_i, s_i, T.min(blk * BI + bi, K - 1)], 0), j]
                    for bi, d in T.Parallel(BI, D):
                        nib = T.shift_right(raw_shared[bi, d // 8], (d % 8) * 4) & 15
                        val = _e2m1(nib) * T.cast(rawsc_shared[bi, d // 16], f32)
                        KV_shared[bi, d] = T.if_then_else(idx_k_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                elif fp4:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        nib = T.shift_right(MainA[b_i, row, d // 8], (d % 8) * 4) & 15
                        val = _e2m1(nib) * T.cast(MainB[b_i, row, d // 16], f32)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                else:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, MainA[b_i, row, d], T.cast(0, bf16))
                _attend(
                    Q_shared,
                    KV_shared,
                    S_shared,
                    idx_k_shared if staged else idx_shared,
                    acc_s,
                    acc_o,
                    sumexp,
                    sumexp_i,
                    alpha,
                    m_i,
                    m_i_prev,
                    HB,
                    BI,
                    D,
                    scale2,
                )

            if NS == 1:
                # Final normalisation with the sink: max over (scores, sink) keeps exp2 in range.
                for h in T.Parallel(HB):
                    alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
                    sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
                    # zero denominator only without a sink (sink = -inf) and no valid index: the row is zeros
                    sumexp_i[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
                for h, d in T.Parallel(HB, D):
                    acc_o[h, d] = acc_o[h, d] * sumexp_i[h]
                T.copy(acc_o, Out[b_i, s_i, h0 : h0 + HB, :])
            else:
                for h in T.Parallel(HB):
                    alpha[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
                    LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                        sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity(f32)
                    )
                for h, d in T.Parallel(HB, D):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_o, Out[b_i, s_i, bz, h0 : h0 + HB, :])

    return main


@T.macro
def _online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, DO, scale2):
    """The online-softmax update of one block: S [HB, BI] (scores in, P out, unnormalised), the running max m_i and
    sum, alpha = the old max's rescale, and the [HB, DO] accumulator O rescaled by it (log2 domain, ``scale2`` =
    softmax scale x log2 e)."""
    T.copy(m_i, m_i_prev)
    T.reduce_max(acc_s, m_i, dim=1, clear=False)
    for h in T.Parallel(HB):
        alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
    T.reduce_sum(acc_s, sumexp_i, dim=1)
    for h in T.Parallel(HB):
        sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
    for h, d in T.Parallel(HB, DO):
        acc_o[h, d] = acc_o[h, d] * alpha[h]


@T.macro
def _attend(Q_shared, KV_shared, S_shared, idx_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2):
    """One block of BI gathered rows: scores, online-softmax update, PV accumulate."""
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.if_then_else(idx_shared[bi] >= 0, 0, -T.infinity("float32"))
    T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    _online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2)
    # When a row of S spans warps (e.g. 32 heads over 4 warps), the softmax's row max and sum go through a shared
    # workspace that TileLang's planner places on S_shared's bytes, and no barrier separates the last read of it
    # (inside tl::AllReduce, after its own bar.sync) from a faster warp's store of P below: a race that changed
    # outputs run to run (session 15, H200: 19 of 19 runs of the sm89-style decode config differed). One barrier
    # orders them.
    T.sync_threads()
    T.copy(acc_s, S_shared)
    T.gemm(S_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)


def combine_kernel(heads: int, dim: int, n_split: int, threads: int = 128, partials: str = "fp32"):
    """Merge split partials with the sink: OPart fp32 (``partials="bf16"``: bf16) [B, S, NS, H, D], LsePart fp32
    [B, S, NS, H], Sink fp32 [H] -> Out bf16 [B, S, H, D]. One block per (token, head); the sum in fp32."""
    B, S = T.dynamic("B"), T.dynamic("S")
    H, D, NS = heads, dim, n_split
    f32 = "float32"

    # named apart from the attention kernel ("main_kernel") so profilers report the two separately
    @T.prim_func
    def combine(
        OPart: T.Tensor([B, S, NS, H, D], "bfloat16" if partials == "bf16" else f32),
        LsePart: T.Tensor([B, S, NS, H], f32),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor([B, S, H, D], "bfloat16"),
    ):
        with T.Kernel(H, S, B, threads=threads) as (h, s, b):
            w = T.alloc_local([NS], f32)
            m = T.alloc_local([1], f32)
            den = T.alloc_local([1], f32)
            acc = T.alloc_fragment([D], f32)
            m[0] = T.max(Sink[h] * LOG2E, -1e30)  # finite even without a sink (-inf), so exp2 never sees -inf - -inf
            for k in T.serial(NS):
                m[0] = T.max(m[0], LsePart[b, s, k, h])
            den[0] = T.exp2(Sink[h] * LOG2E - m[0])
            for k in T.serial(NS):
                w[k] = T.exp2(LsePart[b, s, k, h] - m[0])
                den[0] = den[0] + w[k]
            T.fill(acc, 0)
            for k in T.serial(NS):
                for d in T.Parallel(D):
                    acc[d] = acc[d] + OPart[b, s, k, h, d] * w[k]
            for d in T.Parallel(D):
                Out[b, s, h, d] = T.cast(T.if_then_else(den[0] > 0, acc[d] / den[0], 0.0), "bfloat16")

    return combine


def _sparse_attn_ws(
    heads,
    dim,
    window,
    topk,
    sm_scale,
    kv_format,
    n_split,
    block_I,
    heads_per_block,
    produce,
    io="direct",
    consumers="wg0_scores",
    wg1_rows=0,
    tokens_per_cta=1,
    combine="separate",
    handoff="after_pv",
    lanes="row",
    fp4_decode="fma",
    partials="fp32",
    ablate="",
    unused_rows="row0",
):
    """Warp-specialised schedule (384 threads): warpgroup 0 computes S = Q K^T, the online softmax and
    the left half of O; warpgroup 1 the right half of O; warpgroup 2 (the producer) gathers and
    dequantises the next block into the other of two KV buffers. Same tensors as sparse_attn_kernel.

    ``produce`` is how the producer fills a buffer:

    * ``serial``: 16 rows at a time, each load waited for before the next pass (four global-memory
      latencies per block, one more for the indices).
    * ``batched``: every index of the block, then every load of the block (or of half of it, FP8 rows
      being twice as wide) is issued before the first is used, so one latency covers the block; the next
      block's indices are fetched while this one is dequantised, with the packed-integer helpers of
      ``_DEQUANT_CUDA``. bf16 rows go by cp.async straight into the buffer, signalled through the
      mbarrier (``cp.async.mbarrier.arrive.noinc``) as in TileLang's sparse_mla_fwd_pipelined.
    * ``prefetch`` (FP4): ``batched``, but a main block's loads are issued at the end of the previous
      step, before its buffer frees, so the load latency leaves the critical path (see
      :func:`_ws_produce_prefetch`). Not yet run on a GPU (session 3 wrote it after the device time was spent).

    ``io`` is how the CTA reads Q and writes O:

    * ``direct``: all 384 threads copy the [64, 512] Q tile; 64 x 256 values per half do not split
      into 16-byte vectors over 384 threads, so TileLang lowers it to 2-byte loads and stores (86 per
      thread, each store waiting on its load: a third of the prefill kernel's stall samples in Nsight
      Compute, results/sm90/ncu_source notes). O goes from the accumulator fragments straight to global.
    * ``staged``: each consumer warpgroup copies its own half of Q (128 threads, 16-byte vectors) and
      arrives on the Q barrier after a proxy fence; with one split, each writes its O half into the Q
      half it no longer needs and copies that out in 16-byte vectors (as the TileLang example does).
    * ``overlapped`` (``tokens_per_cta`` > 1, one split, bf16 rows, ``wg0_scores`` with the batched producer): the
      CTA's first Q as ``staged``; every later one by 16-byte cp.async copies that consumer warpgroup 1 issues once
      warpgroup 0's last QK^T of the token before has completed (warpgroup 1 waits for P most of a block; the copies
      arrive on the Q barrier as they land). Each consumer warpgroup writes its O half into its half of the token's
      last KV buffer (both P V of that block are done) and hands the buffer back; the producer stores O from it before
      it refills that buffer one block into the next token (each thread storing the chunks it is about to overwrite),
      and after its last block for the CTA's last tokens. Neither the Q load nor the O store is on the consumers'
      path: the timing ablations put them at ~1.7 and ~2.5 us of the 5.75 us fixed per CTA (session 20).
    * ``auto`` (the prefill and bf16 tiles' Hopper default): resolved per call by :func:`resolve_io`.

    ``consumers`` is how the two consumer warpgroups share a block's work:

    * ``wg0_scores``: warpgroup 0 computes all of S = Q K^T (half the block's FLOPs) and the softmax, then both
      compute their half of O += P V. Warpgroup 1 idles through QK^T and the softmax: in Nsight Compute (prefill 4K,
      io=staged) 24% of all stall samples sat on its wait for P, and warpgroup 0 is the critical path.
    * ``balanced``: each warpgroup computes S for half of the block's rows (N = block_I / 2), the two exchange their
      row maxima through shared memory (one mbarrier phase), each writes its P columns into the shared P tile
      (a second phase), and both compute their half of O from the whole P. Both carry the same running max, so
      each keeps its own partial row sum; the two sums meet once at the end. Each warpgroup does half the FLOPs.
    * ``balanced_overlap``: ``balanced`` with P V left in flight; it completes under the next block's QK^T.
    * ``seesaw`` (FlashMLA's decode schedule): the warpgroups take whole blocks in turn, warpgroup w the blocks
      g = w, w + 2, ... (always in buffer w): each computes all of S for its block (N = block_I) and the softmax with
      the running max the other left after block g - 1, hands P, its rescale and the new max to the other through
      shared memory, and both add their half of O += P V for every block. The softmaxes still run one after the
      other, but each warpgroup's QK^T of its next block runs on the tensor cores under the other's softmax, and
      both do the same work (warpgroup 1 no longer idles through QK^T and the softmax). Each keeps the row sum of
      its own blocks; the two meet once at the end. See :func:`_ws_seesaw_consumer`.
    * ``paired`` (FlashMLA's sparse prefill schedule): the warpgroups take the two blocks of a pair at once (block
      2 k + w in buffer w), so both QK^T run together; warpgroup 0's softmax hands its new max to warpgroup 1, whose
      max is the pair's and goes back; each adds its own block by an RS wgmma from its P registers and the other's
      from shared memory. See :func:`_ws_paired_consumer`.

    ``wg1_rows`` (0 or 16, FP4 with the batched producer and ``wg0_scores``): rows of each main block that consumer
    warpgroup 1 gathers and dequantises itself. In Nsight Compute (prefill 4K, io=staged; results/sm90/ncu_roles_*)
    the producer warp issued ~1150 instructions per block at ~0.2 IPC while warpgroup 0 waited 26% of its time for
    a filled buffer, and warpgroup 1 waited 67% of its time for P. With 16: warpgroup 1 fills the last 16 rows of
    block i + 1 while warpgroup 0 computes block i's scores (its loads issued a block ahead), the producer the first
    48, both arriving on the buffer's ready barrier.

    ``tokens_per_cta`` (1, 2, 4, 8; batched producer, ``wg0_scores``, io=staged or overlapped): each CTA runs that many consecutive
    (token, head block) items in turn. At ~205 KiB of shared memory one CTA holds an SM, so a CTA's prologue (Q
    load, the producer's first gather and dequant) and epilogue (sink, O store) overlap nothing; with several tokens
    per CTA the producer runs on into the next token's blocks (its index prefetch crosses the boundary) while the
    consumers finish this one, and buffer and barrier phases run on across tokens. Measured on the H200 (session 5,
    results/sm90/sparse_attn_run9_tpc_fused.json): 2 and 4 are 1-4% slower than 1 at every shape. The block-scaling
    fit (results/sm90/attn_block_scaling.json: 2.76 us per 64-row block per SM + 5.29 us per CTA) says the fixed
    cost is real; this overlap does not recover it.

    ``combine`` (``n_split > 1``): ``separate`` writes the splits' fp32 partials for :func:`combine_kernel`;
    ``fused`` also counts each split CTA in on a per-(token, head block) counter, and the last to arrive merges
    the splits with the sink and writes bf16 Out itself (:func:`_ws_fused_combine`): no second launch. Measured
    slower than ``separate`` on the H200 (decode B=64/S=1 0.0369 vs 0.0316 ms; results/sm90/
    sparse_attn_run10_fused_deterministic.json): the merge lengthens the last CTA more than the launch it saves.

    ``handoff`` (``wg0_scores``): ``after_pv`` hands P to warpgroup 1 once warpgroup 0's own half of P V has
    completed; ``before_pv`` before it (see :func:`_ws_softmax_step`). Measured on the H200 (results/sm90/
    sparse_attn_run11_early_handoff.json): no gain with FP4 KV, 6% at bf16 decode B=128/S=2.

    ``lanes`` is which of a block's (row, 32-column slice) pairs each producer lane owns (:func:`_lane_row`):

    * ``row``: the 8 lanes of a quarter-warp share a row, lane c its columns 32 c .. 32 c + 31 of each half. The KV
      buffers are 128-byte swizzled for wgmma (64-column atoms, 16-byte chunk k of row r at k ^ (r % 8)), so at one
      store the 8 lanes hit only two chunk positions of their row: a 4-way bank conflict on every 16-byte store of
      dequantised values. Nsight Compute (prefill 4K, io=staged; results/sm90/ncu_source_*io_staged.csv.gz) counted 4x
      the ideal wavefronts on each such STS.128: 63M excess of the kernel's 164M shared-memory wavefronts, with
      L1/TEX throughput at 79% of peak (results/sm90/ncu_sparse_attn_prefill_s4k_session6.txt).
    * ``column``: the 8 lanes of a quarter-warp take 8 consecutive rows (row r % 8 all different) at the same columns,
      so the swizzle spreads their stores over all 32 banks. Each lane still loads 16 contiguous bytes per row half;
      a warp's load touches 8 rows x 64 B instead of 4 rows x 128 B (the same sectors).

    ``fp4_decode`` (FP4, batched/prefetch producer, and warpgroup 1's ``wg1_rows``) is how a packed main-KV word becomes 8
    bf16: ``fma`` (``csa2_fp4x8_bf16``: shifts and masks into the bf16 field, two exact bf16x2 multiplies per pair) or
    ``prmt`` (``csa2_fp4x8_bf16_prmt``: byte-permute lookups into constant tables of the 8 magnitudes' bf16 bytes, the
    signs merged, one exact multiply by the scale pair). The same output bits; fewer producer instructions per block.
    Not yet run on a GPU (session 7).

    ``partials`` (``n_split > 1``, ``wg0_scores``, separate combine): the dtype of the splits' partial O. ``fp32``, or
    ``bf16``: half the bytes each split CTA writes at its end (at decode B=64/S=1 every CTA of the one wave stores its
    128 KiB of fp32 partials at about the same moment, 16 MiB in all) and half what the combine reads; each partial is
    staged through the freed Q half and stored in 16-byte vectors like O. One more bf16 rounding of each partial
    before the fp32 merge.
    """
    B, S, Nw, Nc = T.dynamic("B"), T.dynamic("S"), T.dynamic("Nw"), T.dynamic("Nc")
    H, D, W, K, BI, HB, NS = heads, dim, window, topk, block_I, heads_per_block, n_split
    REP = H // HB
    NBW, NBK = -(-W // BI), -(-K // BI)
    NB = NBW + NBK
    D2 = D // 2
    ROWS = 16  # producer rows per pass: 128 threads, 8 per row, each 32 columns of each half
    # batched producer registers: a batch is all BI / ROWS rows of FP4 (4 words + 2 scales per half) or
    # half of them for FP8 (8 words + 1 scale per half)
    RAW_WORDS, RAW_SCALES = (BI // ROWS) * 8, (BI // ROWS) * 4
    scale2 = sm_scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    fp4 = kv_format == "fp4"
    out_shape = [B, S, H, D] if NS == 1 else [B, S, NS, H, D]
    out_dtype = bf16 if NS == 1 or partials == "bf16" else f32
    bf16_parts = NS > 1 and partials == "bf16"  # split partials staged out as bf16 like O
    prefetch = produce == "prefetch"  # the batched producer with the next main block's loads issued early
    helped = wg1_rows > 0  # consumer warpgroup 1 fills the last pass of rows of each main block
    TPC = tokens_per_cta
    main_passes = tuple(range(BI // ROWS - 1)) if helped else None  # the producer's passes over a main block
    if ablate == "half_main":
        main_passes = tuple(range(BI // ROWS // 2))
    balanced = consumers in ("balanced", "balanced_overlap")  # both consumer warpgroups compute S (half the rows each)
    overlap = consumers == "balanced_overlap"  # ... with P V completing under the next block's QK^T
    seesaw = consumers == "seesaw"  # the consumer warpgroups take whole blocks in turn (both compute S)
    paired = consumers in ("paired", "paired_halves")  # ... the two blocks of a pair at once (both compute S)
    halves = consumers == "paired_halves"  # ... each KV buffer handed over in halves (bf16 rows)
    batched = produce in ("batched", "prefetch")
    fused = combine == "fused"  # the last split CTA of each (token, head block) merges the partials itself
    # the producer's packed-integer helpers (bound here, outside the kernel macro, so the macro sees one name)
    dequant_cuda = _decode_helpers_cuda(fp4_decode) if batched and fp4 else ""
    if "stores" in _PRODUCER_CUTS.get(ablate, ()):
        dequant_cuda += _NO_STORES_CUDA
    win_args = ([B, Nw, D], "float8_e4m3fn", [B, Nw, D // 32], "uint8") if fp4 else ([B, Nw, D], bf16, [1], "uint8")
    # Packed FP4 is read as int32 words (8 codes each, inside one 16-wide scale group): one load per 8 values.
    main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "float8_e4m3fn") if fp4 else ([B, Nc, D], bf16, [1], "uint8")
    if batched and fp4:  # the packed-integer helpers read FP8 codes as words and scales as bytes
        win_args = ([B, Nw, D // 4], "int32", [B, Nw, D // 32], "uint8")
        main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "uint8")

    # The kernel body is a macro so that the two signatures below (with and without the fused combine's
    # scratch and counter) share it; it inlines, the default's generated source is what it was.
    @T.macro
    def body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, OPart, Counter):
        """The whole CTA; OPart and Counter are None unless ``combine="fused"``."""
        with T.Kernel(T.ceildiv(S * REP, TPC) if TPC > 1 else S * REP, B, NS, threads=384) as (bx, by, bz):
            stagger = ablate == "stagger"
            if (batched and fp4) or fused or stagger:  # one import: the producer's, the fused combine's, the ablation's helpers
                T.import_source(dequant_cuda + (_FUSE_CUDA if fused else "") + (_STAGGER_CUDA if stagger else ""))
            Q_l = T.alloc_shared([HB, D2], bf16)
            Q_r = T.alloc_shared([HB, D2], bf16)
            KV0_l = T.alloc_shared([BI, D2], bf16)
            KV0_r = T.alloc_shared([BI, D2], bf16)
            KV1_l = T.alloc_shared([BI, D2], bf16)
            KV1_r = T.alloc_shared([BI, D2], bf16)
            valid0 = T.alloc_shared([BI], "bool", scope="shared")
            valid1 = T.alloc_shared([BI], "bool", scope="shared")
            S_shared = T.alloc_shared([HB, BI], bf16)
            alpha_shared = T.alloc_shared([HB], f32, scope="shared")
            final_shared = T.alloc_shared([HB], f32, scope="shared")
            # one accumulator per consumer warpgroup: a fragment's layout belongs to one thread range
            acc_o_l = T.alloc_fragment([HB, D2], f32)
            acc_o_r = T.alloc_fragment([HB, D2], f32)
            acc_s = T.alloc_fragment([HB, BI // 2 if balanced else BI], f32)
            sumexp = T.alloc_fragment([HB], f32)
            sumexp_i = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_i_prev = T.alloc_fragment([HB], f32)
            row_local = T.alloc_local([1], "int32")
            if balanced or seesaw or paired:
                # warpgroup 1's scores and softmax state (warpgroup 0 uses acc_s, m_i, ...): a fragment's layout
                # belongs to one thread range
                acc_s1 = T.alloc_fragment([HB, BI // 2 if balanced else BI], f32)
                sumexp1 = T.alloc_fragment([HB], f32)
                sumexp_i1 = T.alloc_fragment([HB], f32)
                alpha1 = T.alloc_fragment([HB], f32)
                m_i1 = T.alloc_fragment([HB], f32)
                m_i_prev1 = T.alloc_fragment([HB], f32)
                rowmax_shared = T.alloc_shared([2, HB], f32, scope="shared")  # each warpgroup's row max of the block
                rowsum_shared = T.alloc_shared([2, HB], f32, scope="shared")  # each warpgroup's partial row sums
            if seesaw or paired:
                P1_shared = T.alloc_shared([HB, BI], bf16)  # warpgroup 1's P (warpgroup 0's goes to S_shared)
                handed_shared = T.alloc_shared([2, 2, HB], f32, scope="shared")  # per warpgroup: its block's rescale, new max
            if paired:  # each warpgroup's P in registers, the A operand of its own P V
                P0_frag = T.alloc_fragment([HB, BI], bf16)
                P1_frag = T.alloc_fragment([HB, BI], bf16)
            if batched:
                rows_cur = T.alloc_local([BI // ROWS], "int32")  # this thread's rows of the block being filled
                rows_next = T.alloc_local([BI // ROWS], "int32")  # ... and of the next one, fetched early
                raw = T.alloc_local([RAW_WORDS], "int32")  # packed codes of one batch of rows
                rawsc = T.alloc_local([RAW_SCALES], "uint8")  # their scale bytes
                vals = T.alloc_local([8], bf16)
            if helped:  # warpgroup 1's registers for its pass of rows (see _ws_wg1_fill)
                h_rows_cur = T.alloc_local([1], "int32")
                h_rows_next = T.alloc_local([1], "int32")
                h_raw = T.alloc_local([8], "int32")
                h_rawsc = T.alloc_local([4], "uint8")
                h_vals = T.alloc_local([8], bf16)

            bar_q = T.alloc_barrier(arrive_count=384 if io == "direct" else 256)
            bar_k0_ready = T.alloc_barrier(arrive_count=256 if helped else 128)  # the producer (and warpgroup 1)
            bar_k1_ready = T.alloc_barrier(arrive_count=256 if helped else 128)
            # paired_halves: the left halves' barriers (the right halves' below); one consumer warpgroup frees a half
            bar_k0_free = T.alloc_barrier(arrive_count=128 if halves else 256)
            bar_k1_free = T.alloc_barrier(arrive_count=128 if halves else 256)
            if halves:
                bar_k0r_ready = T.alloc_barrier(arrive_count=128)
                bar_k1r_ready = T.alloc_barrier(arrive_count=128)
                bar_k0r_free = T.alloc_barrier(arrive_count=128)
                bar_k1r_free = T.alloc_barrier(arrive_count=128)
                rows_pair = T.alloc_local([BI // ROWS], "int32")  # the producer's rows of the next pair's first block
                rows_pair_next = T.alloc_local([BI // ROWS], "int32")  # ... and of its second
            bar_o0 = bar_o1 = None
            if halves and TPC > 1:  # io=overlapped: each warpgroup's own barrier for storing its O half through its P tile
                bar_o0 = T.alloc_barrier(arrive_count=128)
                bar_o1 = T.alloc_barrier(arrive_count=128)
            bar_s_ready = T.alloc_barrier(arrive_count=256)
            bar_s_free = T.alloc_barrier(arrive_count=256)
            bar_final = T.alloc_barrier(arrive_count=256)
            if balanced:
                bar_max = T.alloc_barrier(arrive_count=256)  # both warpgroups' block row maxima are in rowmax_shared
                bar_p = T.alloc_barrier(arrive_count=256)  # both halves of P are in S_shared
            if seesaw or paired:
                bar_p0 = T.alloc_barrier(arrive_count=128)  # warpgroup 0's P, rescale and max are in shared memory
                bar_p1 = T.alloc_barrier(arrive_count=128)  # warpgroup 1's
                bar_p0_free = T.alloc_barrier(arrive_count=128)  # warpgroup 1 is done with warpgroup 0's P (its P V completed)
                bar_p1_free = T.alloc_barrier(arrive_count=128)  # warpgroup 0 is done with warpgroup 1's
            if paired:
                bar_m0 = T.alloc_barrier(arrive_count=128)  # warpgroup 0's new running max is in handed_shared
                bar_m1 = T.alloc_barrier(arrive_count=128)  # warpgroup 1's (the pair's)
            if fused:  # see _ws_fused_combine
                comb_shared = T.alloc_shared([2, NS + 2, HB], f32, scope="shared")  # per warpgroup: weights, max, denominator
                last_shared = T.alloc_shared([1], "int32", scope="shared")  # the counter's old value: NS - 1 in the last CTA
                bar_arrived = T.alloc_barrier(arrive_count=256)  # every consumer thread's partial is stored and fenced
                bar_last = T.alloc_barrier(arrive_count=1)  # thread 0 has counted the CTA's arrival
            # the two KV buffers, used in turn: block it goes to buffer it % 2
            bufs = (
                _WsBuffer(KV0_l, KV0_r, valid0, bar_k0_ready, bar_k0_free, *((bar_k0r_ready, bar_k0r_free) if halves else ())),
                _WsBuffer(KV1_l, KV1_r, valid1, bar_k1_ready, bar_k1_free, *((bar_k1r_ready, bar_k1r_free) if halves else ())),
            )

            b_i, s_i = by, bx // REP
            h0 = (bx % REP) * HB
            lo = bz * NB // NS
            n_blk = (bz + 1) * NB // NS - lo
            tx = T.get_thread_binding()
            nxt = None
            if io == "overlapped":
                nxt = _WsTokens(bx * TPC, T.min(TPC, S * REP - bx * TPC), REP, tx % 128, ablate)
            if stagger:  # noqa: SIM102  (TileLang conditions)
                if bx % 2 == 1 and bx < STAGGER_CTAS:  # the first wave's odd CTAs start half a token late (timing only)
                    T.call_extern("handle", "csa2_spin", STAGGER_CYCLES)
            fuse = None
            if fused:
                fuse = _WsFuse(OPart, LsePart, Counter, Sink, Out, comb_shared, last_shared, bar_arrived, bar_last, tx)

            if io == "direct":
                T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
                T.copy(Q[b_i, s_i, h0 : h0 + HB, D2:D], Q_r)
                T.barrier_arrive(bar_q)

            cta = _WsCta(
                Q,
                Q_l,
                Q_r,
                Out,
                LsePart,
                Sink,
                S_shared,
                alpha_shared,
                final_shared,
                bufs,
                bar_q,
                bar_final,
                bar_s_ready,
                bar_s_free,
                b_i,
                bz,
                lo,
                n_blk,
                HB,
                BI,
                D2,
                NS,
                scale2,
                io,
                fuse,
                handoff == "before_pv",
                bf16_parts,
                ablate,
                nxt,
            )
            if balanced:  # what both balanced consumer warpgroups are given besides their own fragments
                pair = _WsPair(Q, Q_l, Q_r, Out, LsePart, Sink, S_shared, rowmax_shared, rowsum_shared, bar_q, bar_max, bar_p, bar_final)
                balanced_args = (pair, bufs, b_i, s_i, h0, bz, n_blk, HB, BI, D2, NS, scale2, io, overlap, fuse)
            if seesaw or paired:  # what both seesaw (paired) consumer warpgroups share
                see = _WsSeesaw(
                    Q,
                    Q_l,
                    Q_r,
                    Out,
                    LsePart,
                    Sink,
                    (S_shared, P1_shared),
                    handed_shared,
                    rowsum_shared,
                    bar_q,
                    (bar_p0, bar_p1),
                    (bar_p0_free, bar_p1_free),
                    bar_final,
                    (bar_m0, bar_m1) if paired else None,
                )
                seesaw_args = (see, bufs, b_i, s_i, h0, bz, n_blk, -(-NB // NS), HB, BI, D2, NS, scale2, io)

            if balanced or seesaw or paired:  # each consumer warpgroup's own fragments (warpgroup 1's exist only here)
                wg_half = (
                    _WsHalf(0, Q_l, acc_s, acc_o_l, sumexp, sumexp_i, alpha, m_i, m_i_prev),
                    _WsHalf(1, Q_r, acc_s1, acc_o_r, sumexp1, sumexp_i1, alpha1, m_i1, m_i_prev1),
                )

            if tx < 128:
                if paired:
                    T.set_max_nreg(PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG, 1)
                    _ws_paired_warpgroup(wg_half[0], P0_frag, bar_o0, seesaw_args, halves, TPC, bx, S, REP, nxt)
                elif seesaw:
                    T.set_max_nreg(SEESAW_NREG, 1)
                    _ws_seesaw_consumer(wg_half[0], *seesaw_args)
                elif balanced:
                    T.set_max_nreg(BALANCED_NREG, 1)
                    _ws_balanced_consumer(wg_half[0], *balanced_args)
                else:
                    T.set_max_nreg(240, 1)
                    sm = _WsSoftmax(
                        Q_l, Q_r, S_shared, alpha_shared, acc_s, acc_o_l, sumexp, sumexp_i, alpha, m_i, m_i_prev, bar_s_ready, bar_s_free
                    )
                    if TPC == 1:
                        _ws_wg0_token(cta, sm, s_i, h0, 0)
                    else:
                        for j in T.serial(TPC):
                            if bx * TPC + j < S * REP:
                                _ws_wg0_token(cta, sm, (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB, j)
            elif tx < 256:
                if paired:
                    T.set_max_nreg(PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG, 1)
                    _ws_paired_warpgroup(wg_half[1], P1_frag, bar_o1, seesaw_args, halves, TPC, bx, S, REP, nxt)
                elif seesaw:
                    T.set_max_nreg(SEESAW_NREG, 1)
                    _ws_seesaw_consumer(wg_half[1], *seesaw_args)
                elif balanced:
                    T.set_max_nreg(BALANCED_NREG, 1)
                    _ws_balanced_consumer(wg_half[1], *balanced_args)
                else:
                    T.set_max_nreg(168, 1)
                    if helped:
                        q = tx - 128
                        hsrc = _WsSources(WinA, WinB, WinIdx, MainA, MainB, TopkIdx)
                        hregs = _WsRegisters(h_rows_cur, h_rows_next, h_raw, h_rawsc, h_vals)
                        hdims = _WsDims(W, K, BI, NBW, ROWS, D2, Nw, Nc, lanes, fp4_decode)
                        helper = _WsHelper(hsrc, hregs, hdims, q)
                    else:
                        helper = None
                    if TPC == 1:
                        _ws_wg1_token(cta, acc_o_r, helper, s_i, h0, 0)
                    else:
                        for j in T.serial(TPC):
                            if bx * TPC + j < S * REP:
                                _ws_wg1_token(cta, acc_o_r, helper, (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB, j)
            elif batched:
                # 240 + 168 + 96 (balanced: 200 + 200 + 104; seesaw: 2 x SEESAW_NREG + the rest) = 504 registers per
                # thread slot: what the 384-thread launch allocates (168 x 3)
                consumer_nreg = {"balanced": BALANCED_NREG, "balanced_overlap": BALANCED_NREG, "seesaw": SEESAW_NREG}
                consumer_nreg.update(paired=PAIRED_NREG, paired_halves=PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG)
                T.set_max_nreg(504 - 2 * consumer_nreg[consumers] if consumers in consumer_nreg else 96, 0)
                p = tx - 256
                src = _WsSources(WinA, WinB, WinIdx, MainA, MainB, TopkIdx)
                regs = _WsRegisters(rows_cur, rows_next, raw, rawsc, vals)
                dims = _WsDims(W, K, BI, NBW, ROWS, D2, Nw, Nc, lanes, fp4_decode, ablate, unused_rows)
                if TPC > 1 and halves:  # io=overlapped (the constraints)
                    pair_rows = (rows_cur, rows_next, rows_pair, rows_pair_next)
                    _ws_produce_halves_tokens(src, dims, bufs, pair_rows, b_i, lo, n_blk, TPC, p, nxt)
                elif TPC > 1:
                    # the CTA's tokens in turn, the row prefetch crossing into the next token (past the last one it
                    # reads a clamped token's rows, never used)
                    _ws_fetch_rows(src, dims, rows_cur, b_i, (bx * TPC) // REP, lo, p)
                    for j in T.serial(TPC):
                        if bx * TPC + j < S * REP:
                            for it in T.serial(n_blk):
                                s_cur = (bx * TPC + j) // REP
                                s_nxt = T.if_then_else(it + 1 < n_blk, s_cur, T.min((bx * TPC + j + 1) // REP, S - 1))
                                b_nxt = T.if_then_else(it + 1 < n_blk, lo + it + 1, lo)
                                if (j * n_blk + it) % 2 == 0:
                                    T.barrier_wait(bar_k0_free, (((j * n_blk + it) // 2) & 1) ^ 1)
                                    if io == "overlapped":
                                        _ws_ovl_store_o(Out, bufs[0], dims, b_i, nxt, j, it, n_blk, p)
                                    _ws_produce_batched(src, regs, dims, bufs[0], b_i, s_cur, lo + it, p, fp4, None, s_nxt, b_nxt)
                                else:
                                    T.barrier_wait(bar_k1_free, (((j * n_blk + it) // 2) & 1) ^ 1)
                                    if io == "overlapped":
                                        _ws_ovl_store_o(Out, bufs[1], dims, b_i, nxt, j, it, n_blk, p)
                                    _ws_produce_batched(src, regs, dims, bufs[1], b_i, s_cur, lo + it, p, fp4, None, s_nxt, b_nxt)
                    if io == "overlapped":
                        # the O staged in the last tokens' buffers, which no block refills: as if blocks
                        # count * n_blk and count * n_blk + 1 were acquired (the second-to-last token's too when n_blk == 1)
                        for e in T.serial(2):
                            g = nxt.count * n_blk + e
                            if g % 2 == 0:
                                T.barrier_wait(bar_k0_free, ((g // 2) & 1) ^ 1)
                                _ws_ovl_store_o(Out, bufs[0], dims, b_i, nxt, 0, g, n_blk, p)
                            else:
                                T.barrier_wait(bar_k1_free, ((g // 2) & 1) ^ 1)
                                _ws_ovl_store_o(Out, bufs[1], dims, b_i, nxt, 0, g, n_blk, p)
                else:
                    _ws_fetch_rows(src, dims, rows_cur, b_i, s_i, lo, p)
                if prefetch:  # noqa: SIM102  (a Python flag around a TileLang condition: they cannot be joined with `and`)
                    if lo >= NBW:  # the first block is a main one: its loads go out before the first free buffer
                        _ws_issue_main_loads(src, regs, dims, b_i, p)
                        _ws_fetch_rows(src, dims, rows_next, b_i, s_i, lo + 1, p)
                if TPC == 1 and ablate == "producer_idle":
                    for it in T.serial(n_blk):  # hand each buffer over as soon as it is free, unfilled
                        if it % 2 == 0:
                            T.barrier_wait(bar_k0_free, ((it // 2) & 1) ^ 1)
                            T.barrier_arrive(bar_k0_ready)
                        else:
                            T.barrier_wait(bar_k1_free, ((it // 2) & 1) ^ 1)
                            T.barrier_arrive(bar_k1_ready)
                elif TPC == 1 and ablate == "uncoupled":
                    for it in T.serial(n_blk):  # fill each buffer without waiting for it to be free
                        if it % 2 == 0:
                            _ws_produce_batched(src, regs, dims, bufs[0], b_i, s_i, lo + it, p, fp4, main_passes)
                        else:
                            _ws_produce_batched(src, regs, dims, bufs[1], b_i, s_i, lo + it, p, fp4, main_passes)
                elif TPC == 1 and halves:
                    pair_rows = (rows_cur, rows_next, rows_pair, rows_pair_next)
                    _ws_produce_halves(src, dims, bufs, pair_rows, b_i, s_i, lo, n_blk, -(-NB // NS), p)
                elif TPC == 1:
                    for it in T.serial(n_blk):
                        blk = lo + it
                        if it % 2 == 0:
                            _ws_produce_into(src, regs, dims, bufs[0], bar_k0_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch, n_blk)
                        else:
                            _ws_produce_into(src, regs, dims, bufs[1], bar_k1_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch, n_blk)
            else:
                T.set_max_nreg(80, 0)
                p = tx - 256
                c = _lane_col(p, lanes)
                for it in T.serial(n_blk):
                    blk = lo + it
                    if it % 2 == 0:
                        T.barrier_wait(bar_k0_free, ((it // 2) & 1) ^ 1)
                    else:
                        T.barrier_wait(bar_k1_free, ((it // 2) & 1) ^ 1)
                    for rr in T.serial(BI // ROWS):
                        r = rr * ROWS + _lane_row(p, lanes)
                        if blk < NBW:
                            pos = blk * BI + r
                            row_local[0] = T.if_then_else(pos < W, WinIdx[b_i, s_i, T.min(pos, W - 1)], -1)
                        else:
                            pos = (blk - NBW) * BI + r
                            row_local[0] = T.if_then_else(pos < K, TopkIdx[b_i, s_i, T.min(pos, K - 1)], -1)
                        if it % 2 == 0:
                            _ws_produce_row(WinA, WinB, MainA, MainB, KV0_l, KV0_r, valid0, row_local, b_i, r, c, blk < NBW, fp4, D2)
                        else:
                            _ws_produce_row(WinA, WinB, MainA, MainB, KV1_l, KV1_r, valid1, row_local, b_i, r, c, blk < NBW, fp4, D2)
                    # generic-proxy stores must be visible to wgmma's async-proxy reads
                    T.fence_proxy_async()
                    if it % 2 == 0:
                        T.barrier_arrive(bar_k0_ready)
                    else:
                        T.barrier_arrive(bar_k1_ready)

    if fused:

        @T.prim_func
        def main(
            Q: T.Tensor([B, S, H, D], bf16),
            WinA: T.Tensor(win_args[0], win_args[1]),
            WinB: T.Tensor(win_args[2], win_args[3]),
            WinIdx: T.Tensor([B, S, W], "int32"),
            MainA: T.Tensor(main_args[0], main_args[1]),
            MainB: T.Tensor(main_args[2], main_args[3]),
            TopkIdx: T.Tensor([B, S, K], "int32"),
            Sink: T.Tensor([H], f32),
            Out: T.Tensor([B, S, H, D], bf16),
            LsePart: T.Tensor([B, S, NS, H], f32),
            OPart: T.Tensor([B, S, NS, H, D], f32),
            Counter: T.Tensor([B, S, REP], "int32"),
        ):
            body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, OPart, Counter)

        return main

    @T.prim_func
    def main(
        Q: T.Tensor([B, S, H, D], bf16),
        WinA: T.Tensor(win_args[0], win_args[1]),
        WinB: T.Tensor(win_args[2], win_args[3]),
        WinIdx: T.Tensor([B, S, W], "int32"),
        MainA: T.Tensor(main_args[0], main_args[1]),
        MainB: T.Tensor(main_args[2], main_args[3]),
        TopkIdx: T.Tensor([B, S, K], "int32"),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor(out_shape, out_dtype),
        LsePart: T.Tensor([B, S, NS, H], f32),
    ):
        body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, None, None)

    return main


@T.macro
def _ws_softmax_step(sm, buf, it, HB, BI, D2, scale2, early_p=False, ablate="", ovl=None):
    """Warpgroup 0's step on one KV buffer: S = Q K^T, online softmax, its half of O += P V (``ablate="no_softmax"``:
    S goes to P as it is, no max, exponentials, sums or rescale).

    ``early_p`` (``handoff="before_pv"``): P and alpha go to warpgroup 1 before this warpgroup's P V instead of
    after it, so both halves of P V run together and the buffer frees one P V earlier; the shared-memory stores
    are fenced for the async proxy first (warpgroup 1's wgmma reads them).

    ``ovl``: see :func:`_ws_hand_back`."""
    Q_l, Q_r, S_shared, alpha_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, bar_s_ready, bar_s_free = sm
    KV_l, KV_r, valid, bar_ready, bar_free = buf[:5]
    if ablate != "uncoupled":
        T.barrier_wait(bar_ready, (it // 2) & 1)
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.if_then_else(valid[bi], 0, -T.infinity("float32"))
    T.wgmma_gemm(Q_l, KV_l, acc_s, transpose_B=True)
    T.wgmma_gemm(Q_r, KV_r, acc_s, transpose_B=True)
    T.wait_wgmma(0)
    if it != 0:
        # S_shared and alpha_shared are reused: warpgroup 1 must be done with the previous step.
        T.barrier_arrive(bar_s_free)
        T.barrier_wait(bar_s_free, (it & 1) ^ 1)
    if ablate != "no_softmax":
        _online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D2, scale2)
        T.copy(alpha, alpha_shared)
    T.copy(acc_s, S_shared)
    if early_p:
        T.fence_proxy_async()
        T.barrier_arrive(bar_s_ready)
        T.gemm(S_shared, KV_l, acc_o)
    else:
        T.gemm(S_shared, KV_l, acc_o)
        T.barrier_arrive(bar_s_ready)
    _ws_hand_back(bar_free, ovl)


@T.macro
def _ws_hand_back(bar_free, ovl):
    """A consumer warpgroup is done with a KV buffer: arrive on its free barrier. ``ovl`` (``io="overlapped"``: the
    _WsCta, the token j, its block it): the token's last block's buffer is kept, O is staged into it
    (:func:`_ws_ovl_stage_o` hands it back)."""
    if ovl is None:
        T.barrier_arrive(bar_free)
    else:
        if ovl[2] != ovl[0].n_blk - 1:
            T.barrier_arrive(bar_free)


@T.macro
def _ws_idle_step(bufs, it):
    """``ablate="consumers_idle"``: one consumer warpgroup's step on block ``it`` (CTA-wide index): wait until its
    buffer is filled, hand it back at once (both warpgroups arrive on ``free``, as after their P V)."""
    if it % 2 == 0:
        T.barrier_wait(bufs[0].ready, (it // 2) & 1)
        T.barrier_arrive(bufs[0].free)
    else:
        T.barrier_wait(bufs[1].ready, (it // 2) & 1)
        T.barrier_arrive(bufs[1].free)


BALANCED_NREG = 200  # per consumer thread under consumers="balanced": O half (128) + S half (16) + softmax + addresses


class _WsHalf(NamedTuple):
    """One consumer warpgroup's part under ``consumers="balanced"``: which half it is, the Q half it loads (and, with
    one split, stages its O half through), and its own fragments."""

    w: int  # 0: rows [0, BI/2) of each block and the left half of O; 1: rows [BI/2, BI) and the right half
    Q_own: Any
    acc_s: Any  # [HB, BI/2] its scores, then its P columns
    acc_o: Any  # [HB, D/2] its half of O
    sumexp: Any  # partial row sums over its columns (both warpgroups share the running max)
    sumexp_i: Any
    alpha: Any
    m_i: Any
    m_i_prev: Any


class _WsPair(NamedTuple):
    """What the two balanced consumer warpgroups share: Q, the outputs, the P tile, and the exchange buffers/barriers."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    S_shared: Any  # [HB, BI] bf16: P, warpgroup w writing columns [w BI/2, (w+1) BI/2)
    rowmax_shared: Any  # [2, HB] each warpgroup's row max of the current block
    rowsum_shared: Any  # [2, HB] each warpgroup's final partial row sum
    bar_q: Any
    bar_max: Any
    bar_p: Any
    bar_final: Any


@T.macro
def _ws_balanced_consumer(half, pair, bufs, b_i, s_i, h0, bz, n_blk, HB, BI, D2, NS, scale2, io, overlap, fuse):
    """Consumer warpgroup ``half.w`` under ``consumers="balanced"`` (or ``"balanced_overlap"``: ``overlap``): Q load,
    the block loop, the sink and the O store (``fuse``: the fused combine's :class:`_WsFuse`, else None)."""
    Sink, Out, LsePart = pair.Sink, pair.Out, pair.LsePart
    _ws_halves_prologue(half, pair.Q, pair.bar_q, b_i, s_i, h0, HB, D2, io)
    for it in T.serial(n_blk):
        if it % 2 == 0:
            _ws_balanced_step(half, pair, bufs[0], bufs[1], it, HB, BI // 2, D2, scale2, overlap)
        else:
            _ws_balanced_step(half, pair, bufs[1], bufs[0], it, HB, BI // 2, D2, scale2, overlap)
    if overlap:  # the last block's P V is still in flight
        T.wait_wgmma(0)
    _ws_halves_epilogue(half, pair.rowsum_shared, pair.bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, fuse)


@T.macro
def _ws_halves_prologue(half, Q, bar_q, b_i, s_i, h0, HB, D2, io, j=0):
    """The start of a token for the consumer schedules of :func:`_ws_halves_epilogue`: with ``io="staged"`` this
    warpgroup's Q half in 16-byte vectors (``io="direct"``: all threads loaded Q before the roles split; ``"overlapped"``
    (paired_halves): the CTA's first token's like staged, later ones' came by cp.async in the token before, their
    arrivals counting); O, the row sum and the running max cleared; then the wait until both Q halves are in (``j``:
    the CTA's token, the barrier's phase)."""
    w, Q_own, _, acc_o, sumexp, _, _, m_i, _ = half
    if io == "staged":
        T.copy(Q[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2], Q_own)
        T.fence_proxy_async()  # generic-proxy stores, read by wgmma (async proxy) after the barrier
        T.barrier_arrive(bar_q)
    elif io == "overlapped":  # noqa: SIM102  (a Python flag around a TileLang condition)
        if j == 0:
            T.copy(Q[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2], Q_own)
            T.fence_proxy_async()
            T.barrier_arrive(bar_q)
    T.fill(sumexp, 0)
    T.fill(m_i, -(2**30))
    T.fill(acc_o, 0)
    T.barrier_wait(bar_q, j & 1)


@T.macro
def _ws_halves_epilogue(
    half, rowsum_shared, bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, fuse=None, j=0, ptile=None
):
    """The end of a token for the consumer schedules whose warpgroups each keep a partial row sum under one shared
    running max (``balanced``, ``seesaw``, ``paired``): the two sums meet (past this barrier both warpgroups' last
    QK^T is done, so Q is free), then the sink, the final scale and this warpgroup's half of O (or the split's
    partial), staged through its Q half with ``io="staged"``; ``fuse``: the fused combine's (balanced only). ``j``: the
    CTA's token (the final barrier's phase). ``ptile`` (paired_halves with io="overlapped", where Q already holds the
    next token's and both KV buffers the next pair's rows): (this warpgroup's [HB, BI] P tile, the barrier the other's
    P V of it completes on, that wait's phase, a 128-arrival barrier of this warpgroup, False under the timing ablation
    no_o_store): O goes out through the P tile in chunks of BI columns, in 16-byte vectors."""
    w, Q_own, _, acc_o, sumexp, sumexp_i, alpha, m_i, _ = half
    for h in T.Parallel(HB):
        rowsum_shared[w, h] = sumexp[h]
    T.barrier_arrive(bar_final)
    T.barrier_wait(bar_final, j & 1)
    for h in T.Parallel(HB):
        sumexp[h] = rowsum_shared[0, h] + rowsum_shared[1, h]  # the same order in both warpgroups
    if NS == 1:
        for h in T.Parallel(HB):  # alpha: first M = max(m, sink) (no overflow for a large sink), then the final scale
            alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
            sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
            alpha[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
    else:
        for h in T.Parallel(HB):
            alpha[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
        if w == 0:
            for h in T.Parallel(HB):
                LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                    sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity("float32")
                )
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    if ptile is not None:
        tile, bar_tile_free, phase, bar_own, store = ptile
        T.barrier_wait(bar_tile_free, phase)  # the other warpgroup's P V of the token's last pair has read the tile
        BI = tile.shape[1]
        for c in T.unroll(D2 // BI):
            for h, d in T.Parallel(HB, BI):
                tile[h, d] = acc_o[h, c * BI + d]
            T.barrier_arrive(bar_own)
            T.barrier_wait(bar_own, 0)  # every chunk's writes are in (phases 2c)
            if store:  # ablate="no_o_store" (timing only): the chunks go through the tile, not out
                T.copy(tile, Out[b_i, s_i, h0 : h0 + HB, w * D2 + c * BI : w * D2 + (c + 1) * BI])
            T.barrier_arrive(bar_own)
            T.barrier_wait(bar_own, 1)  # ... and read before the next chunk overwrites them (phases 2c + 1)
    elif NS == 1 and io == "staged":
        T.copy(acc_o, Q_own)
        T.copy(Q_own, Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    elif NS == 1:
        T.copy(acc_o, Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    elif fuse is None:
        T.copy(acc_o, Out[b_i, s_i, bz, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    else:
        T.copy(acc_o, fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, w * D2 : (w + 1) * D2])
        _ws_fused_combine(fuse, w, acc_o, Q_own, b_i, s_i, h0, bz, HB, D2, NS, io)


@T.macro
def _ws_balanced_step(half, pair, buf, prev_buf, it, HB, BI2, D2, scale2, overlap):
    """Warpgroup ``half.w``'s step on one KV buffer: S for its BI2 rows, the block row max shared with the other
    warpgroup, its P columns into S_shared, then its half of O += P V over all 2 BI2 rows.

    ``overlap``: P V is issued without waiting; it completes together with the next step's QK^T (one wgmma wait per
    block instead of two, the tensor cores fed back to back), and the previous buffer is released there.
    """
    w, _, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    KV_l, KV_r, valid, bar_ready, bar_free = buf[:5]
    r0 = w * BI2
    T.barrier_wait(bar_ready, (it // 2) & 1)
    for h, j in T.Parallel(HB, BI2):
        acc_s[h, j] = T.if_then_else(valid[r0 + j], 0, -T.infinity("float32"))
    T.wgmma_gemm(pair.Q_l, KV_l[r0 : r0 + BI2, :], acc_s, transpose_B=True)
    T.wgmma_gemm(pair.Q_r, KV_r[r0 : r0 + BI2, :], acc_s, transpose_B=True)
    T.wait_wgmma(0)  # overlap: the previous step's P V too (wgmma groups complete in order)
    if overlap:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if it != 0:
            T.barrier_arrive(prev_buf.free)
    T.copy(m_i, m_i_prev)
    T.reduce_max(acc_s, sumexp_i, dim=1)  # sumexp_i holds this half's block row max for a moment
    for h in T.Parallel(HB):
        pair.rowmax_shared[w, h] = sumexp_i[h]
    # Safe to overwrite rowmax_shared[w] here: the other warpgroup read it last step before arriving on bar_p.
    T.barrier_arrive(pair.bar_max)
    T.barrier_wait(pair.bar_max, it & 1)
    for h in T.Parallel(HB):
        m_i[h] = T.max(m_i[h], T.max(pair.rowmax_shared[0, h], pair.rowmax_shared[1, h]))  # the same in both
        alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
    for h, j in T.Parallel(HB, BI2):
        acc_s[h, j] = T.exp2(acc_s[h, j] * scale2 - m_i[h] * scale2)
    T.reduce_sum(acc_s, sumexp_i, dim=1)
    for h in T.Parallel(HB):
        sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    # Safe to overwrite S_shared here: the other warpgroup's P V of the last step (a synchronous gemm) finished
    # before it arrived on bar_max.
    T.copy(acc_s, pair.S_shared[:, r0 : r0 + BI2])
    T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
    T.barrier_arrive(pair.bar_p)
    T.barrier_wait(pair.bar_p, it & 1)
    if overlap:
        # In flight past this step: the other warpgroup overwrites S_shared only after bar_max of the next step,
        # which this one reaches after waiting for this P V.
        T.wgmma_gemm(pair.S_shared, KV_l if w == 0 else KV_r, acc_o)
    else:
        T.gemm(pair.S_shared, KV_l if w == 0 else KV_r, acc_o)
        T.barrier_arrive(bar_free)


SEESAW_NREG = 208  # per consumer thread under consumers="seesaw": O half (128) + all of S (32) + softmax + addresses


class _WsSeesaw(NamedTuple):
    """What the two seesaw consumer warpgroups share: Q, the outputs, each one's P tile and hand-over values, barriers."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    P: Any  # (warpgroup 0's, warpgroup 1's) [HB, BI] bf16 P of its latest block
    handed: Any  # [2, 2, HB] f32: [w, 0] warpgroup w's latest block's rescale of O and the sums, [w, 1] the max after it
    rowsum_shared: Any  # [2, HB] each warpgroup's final partial row sum
    bar_q: Any
    bar_p: Any  # (warpgroup 0's, warpgroup 1's) P, rescale and max handed over: 128 arrivals
    bar_p_free: Any  # (for warpgroup 0's P, for warpgroup 1's) the other's P V with it completed: 128 arrivals
    bar_final: Any
    bar_m: Any = None  # consumers="paired": (warpgroup 0's, warpgroup 1's) new running max handed over: 128 arrivals


@T.macro
def _ws_seesaw_take(half, see, other_buf, kp, HB, D2):
    """Warpgroup ``half.w`` takes the other's block (its ``kp``-th): wait for its P, rescale O and the row sum by the
    block's rescale, adopt the running max after it, and issue this half of O += P V (left in flight)."""
    w, _, _, acc_o, sumexp, _, alpha, m_i, _ = half
    T.barrier_wait(see.bar_p[1 - w], kp & 1)
    for h in T.Parallel(HB):
        alpha[h] = see.handed[1 - w, 0, h]
        m_i[h] = see.handed[1 - w, 1, h]
        sumexp[h] = sumexp[h] * alpha[h]
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    T.wgmma_gemm(see.P[1 - w], other_buf.KV_l if w == 0 else other_buf.KV_r, acc_o)


@T.macro
def _ws_seesaw_consumer(half, see, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io):
    """Consumer warpgroup ``half.w`` under ``consumers="seesaw"``: Q load, its blocks g = w, w + 2, ... (in buffer w),
    the other's blocks in between, the sink and the O store. ``n_blk``: the split's blocks, at most ``max_blk`` (a
    Python int).

    Per own block g (the ``k``-th, g = 2 k + w): issue S = Q K^T; take the other's block g - 1 (its P V in flight,
    :func:`_ws_seesaw_take`), which also brings the running max m after g - 1; wait for S only (wgmma groups complete
    in order); the online softmax from that max; wait until the other has finished with this warpgroup's previous
    P; hand over P, the rescale and the new max; wait for the taken P V, release that buffer and P; rescale O; its
    half of O += P V for g. Both warpgroups see every block's rescale in the same order, so both carry the same
    running max and scale their own row sums alike; the sums meet at the end as under ``balanced``."""
    w, _, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    Sink, Out, LsePart = see.Sink, see.Out, see.LsePart
    own, other = bufs[w], bufs[1 - w]
    _ws_halves_prologue(half, see.Q, see.bar_q, b_i, s_i, h0, HB, D2, io)
    # A static trip count (the most blocks a split has) and a guard: with the trip count (n_blk + 1 - w) // 2, where it
    # can only be 0 or 1 (splits of 1-2 blocks) TileLang 0.1.15 replaced the loop by one unguarded pass, and a guard
    # inside it was proven true from the loop's own bound (the H200 hung on a buffer never filled, session 11).
    for k in T.serial((max_blk + 1 - w) // 2):
        if 2 * k + w < n_blk:
            T.barrier_wait(own.ready, k & 1)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
            T.wgmma_gemm(see.Q_l, own.KV_l, acc_s, transpose_B=True)
            T.wgmma_gemm(see.Q_r, own.KV_r, acc_s, transpose_B=True)
            if w == 1 or k > 0:  # the other's block g - 1 (its (k + w - 1)-th) comes first in the running max
                _ws_seesaw_take(half, see, other, k + w - 1, HB, D2)
                T.wait_wgmma(1)  # S only: the taken P V stays in flight
            else:
                T.wait_wgmma(0)
            T.copy(m_i, m_i_prev)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for h in T.Parallel(HB):
                alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
            T.reduce_sum(acc_s, sumexp_i, dim=1)
            for h in T.Parallel(HB):
                sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
            if k > 0:  # the other's P V with this warpgroup's previous P (and its read of the hand-over values) is done
                T.barrier_wait(see.bar_p_free[w], (k - 1) & 1)
            T.copy(acc_s, see.P[w])
            for h in T.Parallel(HB):
                see.handed[w, 0, h] = alpha[h]
                see.handed[w, 1, h] = m_i[h]
            T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
            T.barrier_arrive(see.bar_p[w])
            T.wait_wgmma(0)
            if w == 1 or k > 0:
                T.barrier_arrive(other.free)
                T.barrier_arrive(see.bar_p_free[1 - w])
            for h, d in T.Parallel(HB, D2):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.gemm(see.P[w], own.KV_l if w == 0 else own.KV_r, acc_o)
            T.barrier_arrive(own.free)
    if n_blk > 0:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if (n_blk - 1) % 2 == 1 - w:  # the last block is the other's: take it after the loop
            _ws_seesaw_take(half, see, other, (n_blk - 2 + w) // 2, HB, D2)
            T.wait_wgmma(0)
            T.barrier_arrive(other.free)
            T.barrier_arrive(see.bar_p_free[1 - w])
    _ws_halves_epilogue(half, see.rowsum_shared, see.bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io)


PAIRED_NREG = 208  # per consumer thread under consumers="paired": O half (128) + S (32) + P in bf16 (16) + softmax + addresses
# ... with io="overlapped" (several tokens per CTA: the Q prefetch and the chunked O store besides): ptxas spilled 104
# bytes at 208 and 48 at 216, none at 224 (the producer, 504 - 2 x 224 = 56 registers, copies bf16 rows only)
PAIRED_OVL_NREG = 224


@T.macro
def _ws_paired_consumer(
    half, see, P_own, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, halves=False, j=0, nxt=None, bar_own=None
):
    """Consumer warpgroup ``half.w`` under ``consumers="paired"`` (FlashMLA's sparse prefill schedule): the two
    warpgroups take the two blocks of a pair at once, warpgroup w block g = 2 k + w (in buffer w). ``P_own``: its
    [HB, BI] bf16 register fragment of P, the A operand of its own P V.

    Per pair k: both compute S = Q K^T of their block at the same time. Warpgroup 0's softmax runs from its own running
    max and hands the new max m0 to warpgroup 1, whose softmax runs from m0: m1 = max(m0, its block's) is the pair's
    max. Each rescales its half of O by its own step (old max -> its new max) and issues its own P V from registers.
    Warpgroup 0 then takes m1, brings its P, O and row sum to it (one factor per row), and stores P for warpgroup 1;
    warpgroup 1 stores its P (already at m1). Each adds the other's block to its half of O from shared memory, then
    releases it. A buffer is free once its owner's own P V and the other's P V of it completed (256 arrivals, as
    for the other schedules). In the last pair of an odd block count warpgroup 1 has no block: it takes m0 as m1,
    scores nothing and stores a zero P that nobody reads. Each keeps the row sum of its own blocks (at the same max);
    they meet at the end (:func:`_ws_halves_epilogue`).

    ``halves`` (consumers="paired_halves"): each half of a KV buffer is handed over on its own barriers
    (:func:`_ws_produce_halves`). Warpgroup w's own half (the one its P V reads: left for 0, right for 1) has two
    readers, its QK^T and its own P V, and warpgroup w frees it right after that P V; the other half is read last by
    the other warpgroup's P V, which frees it. Each warpgroup's QK^T starts on its own half, which the producer
    refills first.

    ``nxt`` (io="overlapped", paired_halves, an even block count; the prefill default since session 22): token ``j`` of the CTA's run
    (the _WsTokens), its pairs numbered on from the tokens before (barrier phases). In a token's last pair each
    warpgroup, once both QK^T are done (past its wait for the other's max), copies its half of the next token's Q by
    cp.async, arriving on the Q barrier as it lands. Its O half goes out through its own P tile (``bar_own``: its
    128-arrival barrier), so that no KV half waits for O: the producer refills them for the next token's first pair
    as they are freed. (Staging O in two KV halves for the producer to store measured no faster: a token's first pair
    needs all four halves; session 21. Each chunk out of the P tile by one TMA store, O straight from the accumulator
    fragments, and the chunks without the warpgroup's mbarrier (TileLang's bar.sync alone) all ran right and measured
    slower or level: session 24. So did O left in the accumulator and stored in the next token's first pair, under its
    QK^T: 4K 0.672 -> 0.726 ms, session 25; the store at a token's end overlaps the producer's refill of the next
    token's first pair, and deferred it held that pair's buffers longer. notes/sparse_attn.md.)"""
    w, Q_own, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    own, other = bufs[w], bufs[1 - w]
    ovl = nxt is not None
    npairs = (max_blk + 1) // 2  # with io=overlapped: n_blk == max_blk, even
    _ws_halves_prologue(half, see.Q, see.bar_q, b_i, s_i, h0, HB, D2, io, j)
    # A static trip count and a guard, as in _ws_seesaw_consumer (TileLang 0.1.15 unrolls a trip count of 0 or 1).
    for kk in T.serial(npairs):
        k = j * npairs + kk  # the CTA's pair index: barrier phases run on across its tokens
        if 2 * kk < n_blk:
            mine = 2 * kk + w < n_blk  # warpgroup 1 has no block in the last pair of an odd count
            if mine:
                if halves:
                    first, second = ((own.ready, see.Q_l, own.KV_l), (own.ready_r, see.Q_r, own.KV_r))[:: 1 - 2 * w]
                    T.barrier_wait(first[0], k & 1)  # the row-valid flags come with the first half
                    for h, bi in T.Parallel(HB, BI):
                        acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
                    T.wgmma_gemm(first[1], first[2], acc_s, transpose_B=True)
                    T.barrier_wait(second[0], k & 1)
                    T.wgmma_gemm(second[1], second[2], acc_s, transpose_B=True)
                else:
                    T.barrier_wait(own.ready, k & 1)
                    for h, bi in T.Parallel(HB, BI):
                        acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
                    T.wgmma_gemm(see.Q_l, own.KV_l, acc_s, transpose_B=True)
                    T.wgmma_gemm(see.Q_r, own.KV_r, acc_s, transpose_B=True)
                T.wait_wgmma(0)
            else:
                T.fill(acc_s, -T.infinity("float32"))
            T.copy(m_i, m_i_prev)
            if w == 1:  # start from warpgroup 0's new max (>= this warpgroup's old one: both end each pair at m1)
                T.barrier_wait(see.bar_m[0], k & 1)
                for h in T.Parallel(HB):
                    m_i[h] = see.handed[0, 1, h]
                if ovl:
                    _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, kk == npairs - 1, HB, D2)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for h in T.Parallel(HB):
                alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
            T.reduce_sum(acc_s, sumexp_i, dim=1)
            for h in T.Parallel(HB):
                sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
                see.handed[w, 1, h] = m_i[h]
            T.barrier_arrive(see.bar_m[w])
            for h, d in T.Parallel(HB, D2):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.copy(acc_s, P_own)
            if mine:
                T.wgmma_gemm(P_own, own.KV_l if w == 0 else own.KV_r, acc_o)  # its own block, P from registers
            if w == 0:
                # its own P V completes under warpgroup 1's softmax; then its half (the whole buffer: its share) is freed
                T.wait_wgmma(0)
                T.barrier_arrive(own.free)
                T.barrier_wait(see.bar_m[1], k & 1)
                if ovl:
                    _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, kk == npairs - 1, HB, D2)
                for h in T.Parallel(HB):
                    alpha[h] = T.exp2((m_i[h] - see.handed[1, 1, h]) * scale2)  # m0 -> m1
                    m_i[h] = see.handed[1, 1, h]
                    sumexp[h] = sumexp[h] * alpha[h]
                for h, bi in T.Parallel(HB, BI):
                    acc_s[h, bi] = acc_s[h, bi] * alpha[h]
            if k > 0:  # the other's P V with this warpgroup's previous P is done
                T.barrier_wait(see.bar_p_free[w], (k - 1) & 1)
            T.copy(acc_s, see.P[w])
            T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
            T.barrier_arrive(see.bar_p[w])
            if w == 1 and mine:
                T.wait_wgmma(0)
                T.barrier_arrive(own.free_r if halves else own.free)  # halves: its own half only
            if w == 0:
                for h, d in T.Parallel(HB, D2):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
            if 2 * kk + 1 - w < n_blk:  # the other's block of this pair
                T.barrier_wait(see.bar_p[1 - w], k & 1)
                T.wgmma_gemm(see.P[1 - w], other.KV_l if w == 0 else other.KV_r, acc_o)
                T.wait_wgmma(0)
                T.barrier_arrive(other.free_r if halves and w == 1 else other.free)  # halves: the half it just read
                T.barrier_arrive(see.bar_p_free[1 - w])
    args = (see.rowsum_shared, see.bar_final, see.Sink, see.Out, see.LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, None, j)
    if ovl:  # O out through this warpgroup's P tile, once the other's P V of the token's last pair has read it
        store = nxt.ablate != "no_o_store"
        _ws_halves_epilogue(half, *args, (see.P[w], see.bar_p_free[w], (j * npairs + npairs - 1) & 1, bar_own, store))
    else:
        _ws_halves_epilogue(half, *args)


@T.macro
def _ws_paired_warpgroup(half, P_own, bar_own, seesaw_args, halves, TPC, bx, S, REP, nxt):
    """Consumer warpgroup ``half.w`` under the paired consumers: its one token (:func:`_ws_paired_consumer`), or, with
    paired_halves and io="overlapped", the CTA's run of tokens one after another (``bar_own``: its barrier for the O
    store through its P tile)."""
    see, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io = seesaw_args
    if TPC == 1:
        _ws_paired_consumer(half, see, P_own, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, halves)
    else:
        for j in T.serial(TPC):
            if bx * TPC + j < S * REP:
                s_j, h_j = (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB
                tail = (bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, True, j, nxt, bar_own)
                _ws_paired_consumer(half, see, P_own, bufs, b_i, s_j, h_j, *tail)


@T.macro
def _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, last, HB, D2):
    """paired_halves with io="overlapped": in the token's last pair (``last``), once both warpgroups' QK^T are done,
    warpgroup ``w``'s half of the next token's Q by 16-byte cp.async copies that arrive on the Q barrier as they land
    (cp.async.mbarrier.arrive.noinc: one arrival per thread). Each warp copies whole 512-byte rows. The timing
    ablation no_q_load issues no copies (the arrivals stay)."""
    copies = 0 if nxt.ablate == "no_q_load" else HB * D2 // 8 // 128
    if last:  # noqa: SIM102  (TileLang conditions)
        if j + 1 < nxt.count:
            item = nxt.first + j + 1
            s_n, h_n = item // nxt.REP, (item % nxt.REP) * HB
            for i in T.unroll(copies):
                r = i * (128 // (D2 // 8)) + nxt.t // (D2 // 8)
                col = (nxt.t % (D2 // 8)) * 8
                T.ptx_cp_async(T.access_ptr(Q_own[r, col], "w", 8), T.access_ptr(see.Q[b_i, s_n, h_n + r, w * D2 + col], "r", 8), 8)
            T.cp_async_barrier_noinc(see.bar_q)


class _WsCta(NamedTuple):
    """What the ws consumer warpgroups share for the whole CTA: tensors, shared tiles, barriers, the split's block range."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    S_shared: Any
    alpha_shared: Any
    final_shared: Any
    bufs: Any  # the two _WsBuffer
    bar_q: Any
    bar_final: Any
    bar_s_ready: Any
    bar_s_free: Any
    b_i: Any
    bz: Any  # the split
    lo: Any  # its first block
    n_blk: Any  # its blocks per token
    HB: int
    BI: int
    D2: int
    NS: int
    scale2: float
    io: str
    fuse: Any = None  # combine="fused": the _WsFuse of the fused combine
    early_p: bool = False  # handoff="before_pv": warpgroup 1 gets P before warpgroup 0's own P V (see _ws_softmax_step)
    bf16_parts: bool = False  # partials="bf16": the split's partial O staged out as bf16 through the freed Q half
    ablate: str = ""  # a timing ablation (see ABLATIONS); "" in every real kernel
    nxt: Any = None  # io="overlapped": the _WsTokens of the CTA's run of tokens


class _WsTokens(NamedTuple):
    """``io="overlapped"``: the CTA's run of (token, head block) items, for the next token's Q and the previous O."""

    first: Any  # the CTA's first item, bx * tokens_per_cta (token item // REP, head block item % REP)
    count: Any  # how many it runs: tokens_per_cta, fewer in the last CTA
    REP: int  # head blocks per token
    t: Any  # the thread's index in its consumer warpgroup, 0..127
    ablate: str = ""  # paired_halves: "no_q_load" / "no_o_store" cut the next token's Q copy / O's global store (timing)


@T.macro
def _ws_ovl_prefetch_q(cta, j, it):
    """``io="overlapped"``, consumer warpgroup 1 once warpgroup 0's last QK^T of the CTA's token ``j`` (block ``it``
    of it) has completed: 16-byte cp.async copies of both Q halves for the next token, which arrive on ``bar_q`` as
    they land (cp.async.mbarrier.arrive.noinc, one arrival per thread; warpgroup 0 arrives itself). Warpgroup 1 waits
    for P most of a block, so warpgroup 0's loop gains no instructions. Each warp copies whole 512-byte rows."""
    HB, D2, nxt = cta.HB, cta.D2, cta.nxt
    if it == cta.n_blk - 1:  # noqa: SIM102  (TileLang conditions)
        if j + 1 < nxt.count:
            item = nxt.first + j + 1
            s_n, h_n = item // nxt.REP, (item % nxt.REP) * HB
            for i in T.unroll(HB * D2 // 8 // 128):
                r = i * (128 // (D2 // 8)) + nxt.t // (D2 // 8)
                col = (nxt.t % (D2 // 8)) * 8
                T.ptx_cp_async(T.access_ptr(cta.Q_l[r, col], "w", 8), T.access_ptr(cta.Q[cta.b_i, s_n, h_n + r, col], "r", 8), 8)
                T.ptx_cp_async(T.access_ptr(cta.Q_r[r, col], "w", 8), T.access_ptr(cta.Q[cta.b_i, s_n, h_n + r, D2 + col], "r", 8), 8)
            T.cp_async_barrier_noinc(cta.bar_q)


@T.macro
def _ws_ovl_stage_o(cta, acc, w, j):
    """``io="overlapped"``, after token ``j``'s final scale: warpgroup ``w``'s O half into its half of the token's
    last KV buffer (both P V of that block are done), which is then handed back. The producer stores it to Out before
    it refills that buffer (:func:`_ws_ovl_store_o`, one block into the next token; after its last block for the
    CTA's last tokens). Storing here instead costs warpgroup 1 spills (ptxas), and the time on the consumers' path."""
    if (j * cta.n_blk + cta.n_blk - 1) % 2 == 0:
        _ws_ovl_stage_into(cta, cta.bufs[0], acc, w, j)
    else:
        _ws_ovl_stage_into(cta, cta.bufs[1], acc, w, j)


@T.macro
def _ws_ovl_stage_into(cta, buf, acc, w, j):
    """Warpgroup ``w``'s O half (the [HB, D/2] fragment ``acc``) into its half of ``buf``; then hand ``buf`` back."""
    T.copy(acc, buf.KV_l if w == 0 else buf.KV_r)
    T.barrier_arrive(buf.free)


@T.macro
def _ws_ovl_store_o(Out, buf, dims, b_i, nxt, j, it, n_blk, p):
    """``io="overlapped"``, producer thread ``p`` after the wait for a free buffer, before filling it with block
    ``it`` of the CTA's token ``j``: when the buffer's last user was the last block of an earlier token (global block
    index g - 2 for g = j * n_blk + it), it holds that token's O staged by the consumers; store it to Out first. Each
    thread stores the rows and 16-byte chunks it is about to overwrite by cp.async (those of
    :func:`_ws_produce_batched` for bf16 rows), so no other thread's copy can land on a chunk before it is read."""
    ROWS, D2, lanes, BI = dims.ROWS, dims.D2, dims.lanes, dims.BI
    g = j * n_blk + it
    if g >= n_blk + 1:  # noqa: SIM102  (TileLang conditions)
        if (g - 1) % n_blk == 0:
            item = nxt.first + (g - 1) // n_blk - 1
            s_o, h_o = item // nxt.REP, (item % nxt.REP) * BI  # heads_per_block == block_I: O fills the buffer
            c = _lane_col(p, lanes)
            for rr in T.serial(BI // ROWS):
                r = rr * ROWS + _lane_row(p, lanes)
                for u in T.unroll(4):
                    col = 64 * u + c * 8
                    for v in T.vectorized(8):
                        Out[b_i, s_o, h_o + r, col + v] = buf.KV_l[r, col + v]
                    for v in T.vectorized(8):
                        Out[b_i, s_o, h_o + r, D2 + col + v] = buf.KV_r[r, col + v]


class _WsHelper(NamedTuple):
    """Consumer warpgroup 1's producer registers and sources under ``wg1_rows`` (see :func:`_ws_wg1_fill`)."""

    src: Any
    regs: Any
    dims: Any
    q: Any  # its thread index 0..127


@T.macro
def _ws_wg0_token(cta, sm, s_i, h0, j):
    """Consumer warpgroup 0 on token ``s_i`` (head block ``h0``), the CTA's ``j``-th: Q_l, the block loop (S, online
    softmax, left half of O), the sink and the O_l store. Block ``it`` of the token is the CTA's ``j * n_blk + it``-th:
    buffer and barrier phases run on across the CTA's tokens."""
    Q, Out, LsePart, Sink, HB, D2, NS, scale2 = cta.Q, cta.Out, cta.LsePart, cta.Sink, cta.HB, cta.D2, cta.NS, cta.scale2
    b_i, bz, n_blk, final_shared = cta.b_i, cta.bz, cta.n_blk, cta.final_shared
    Q_l, acc_o_l, sumexp, sumexp_i, alpha, m_i = sm.Q_l, sm.acc_o, sm.sumexp, sm.sumexp_i, sm.alpha, sm.m_i
    BI = cta.BI
    ovl = cta.io == "overlapped"
    if cta.io == "staged":
        if cta.ablate != "no_q_load":
            T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
        T.fence_proxy_async()  # generic-proxy stores, read by wgmma (async proxy) after the barrier
        T.barrier_arrive(cta.bar_q)
    elif cta.io == "overlapped":
        if j == 0:
            T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
            T.fence_proxy_async()
        # a later token's Q came by warpgroup 1's cp.async under the last block of the one before (_ws_ovl_prefetch_q)
        T.barrier_arrive(cta.bar_q)
    T.fill(sumexp, 0)
    T.fill(m_i, -(2**30))
    T.fill(acc_o_l, 0)
    T.barrier_wait(cta.bar_q, j & 1)
    for it in T.serial(n_blk):
        if cta.ablate == "consumers_idle":  # take each filled buffer and hand it straight back
            _ws_idle_step(cta.bufs, j * n_blk + it)
        elif (j * n_blk + it) % 2 == 0:
            _ws_softmax_step(sm, cta.bufs[0], j * n_blk + it, HB, BI, D2, scale2, cta.early_p, cta.ablate, (cta, j, it) if ovl else None)
        else:
            _ws_softmax_step(sm, cta.bufs[1], j * n_blk + it, HB, BI, D2, scale2, cta.early_p, cta.ablate, (cta, j, it) if ovl else None)
    if NS == 1:
        for h in T.Parallel(HB):
            alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
            sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
            final_shared[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
    else:
        for h in T.Parallel(HB):
            final_shared[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
            LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity("float32")
            )
    T.barrier_arrive(cta.bar_final)
    for h, d in T.Parallel(HB, D2):
        acc_o_l[h, d] = acc_o_l[h, d] * final_shared[h]
    if ovl:
        _ws_ovl_stage_o(cta, acc_o_l, 0, j)
    elif NS == 1 and cta.io == "staged":
        T.copy(acc_o_l, Q_l)  # this warpgroup's last QK^T has completed: Q_l is free
        if cta.ablate != "no_o_store":
            T.copy(Q_l, Out[b_i, s_i, h0 : h0 + HB, 0:D2])
    elif cta.bf16_parts and cta.io == "staged":
        T.copy(acc_o_l, Q_l)
        T.copy(Q_l, Out[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
    elif NS == 1:
        T.copy(acc_o_l, Out[b_i, s_i, h0 : h0 + HB, 0:D2])
    elif cta.fuse is None:
        T.copy(acc_o_l, Out[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
    else:
        T.copy(acc_o_l, cta.fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
        _ws_fused_combine(cta.fuse, 0, acc_o_l, Q_l, b_i, s_i, h0, bz, HB, D2, NS, cta.io)


@T.macro
def _ws_wg1_token(cta, acc_o_r, helper, s_i, h0, j):
    """Consumer warpgroup 1 on token ``s_i``, the CTA's ``j``-th: Q_r, the right half of O += P V per block (P and
    its rescale from warpgroup 0 through S_shared/alpha_shared), the final scale and the O_r store. ``helper``
    (``wg1_rows``, one token per CTA only): also fill the last 16 rows of each main block, one block ahead."""
    Q, Out, HB, D2, NS, b_i, bz, lo, n_blk = cta.Q, cta.Out, cta.HB, cta.D2, cta.NS, cta.b_i, cta.bz, cta.lo, cta.n_blk
    Q_r, S_shared, alpha_shared, final_shared, bufs = cta.Q_r, cta.S_shared, cta.alpha_shared, cta.final_shared, cta.bufs
    ovl = cta.io == "overlapped"
    if cta.io == "staged":
        if cta.ablate != "no_q_load":
            T.copy(Q[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2], Q_r)
        T.fence_proxy_async()
        T.barrier_arrive(cta.bar_q)
    elif ovl:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if j == 0:  # a later token's Q is issued under the last block of the one before (cp.async onto bar_q)
            T.copy(Q[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2], Q_r)
            T.fence_proxy_async()
            T.barrier_arrive(cta.bar_q)
    T.fill(acc_o_r, 0)
    if helper is not None:
        hsrc, hregs, hdims, q = helper
        last = (hdims.BI // hdims.ROWS - 1,)
        _ws_fetch_rows(hsrc, hdims, hregs.rows_cur, b_i, s_i, lo, q, last)
        _ws_fetch_rows(hsrc, hdims, hregs.rows_next, b_i, s_i, lo + 1, q, last)
        if lo >= hdims.NBW:
            _ws_issue_main_loads(hsrc, hregs, hdims, b_i, q, last)
        # the CTA's first block: both buffers start free
        _ws_wg1_fill(hsrc, hregs, hdims, bufs[0], b_i, s_i, lo, q, n_blk > 1)
    for it in T.serial(n_blk):
        if helper is not None:  # noqa: SIM102  (a Python flag around a TileLang condition)
            # block it + 1 goes to the buffer block it - 1 used: free once both P V of it - 1 are done
            if it + 1 < n_blk:
                if it % 2 == 0:
                    T.barrier_wait(bufs[1].free, (((it + 1) // 2) & 1) ^ 1)
                    _ws_wg1_fill(hsrc, hregs, hdims, bufs[1], b_i, s_i, lo + it + 1, q, it + 2 < n_blk)
                else:
                    T.barrier_wait(bufs[0].free, (((it + 1) // 2) & 1) ^ 1)
                    _ws_wg1_fill(hsrc, hregs, hdims, bufs[0], b_i, s_i, lo + it + 1, q, it + 2 < n_blk)
        if cta.ablate == "consumers_idle":
            _ws_idle_step(bufs, j * n_blk + it)
        else:
            T.barrier_arrive(cta.bar_s_ready)
            T.barrier_wait(cta.bar_s_ready, (j * n_blk + it) & 1)
            if ovl:  # warpgroup 0's last QK^T of the token has completed: Q is free for the next token's
                _ws_ovl_prefetch_q(cta, j, it)
            for h, d in T.Parallel(HB, D2):
                acc_o_r[h, d] = acc_o_r[h, d] * alpha_shared[h]
            if (j * n_blk + it) % 2 == 0:
                T.gemm(S_shared, bufs[0].KV_r, acc_o_r)
                _ws_hand_back(bufs[0].free, (cta, j, it) if ovl else None)
            else:
                T.gemm(S_shared, bufs[1].KV_r, acc_o_r)
                _ws_hand_back(bufs[1].free, (cta, j, it) if ovl else None)
            T.barrier_arrive(cta.bar_s_free)
    T.barrier_arrive(cta.bar_final)
    T.barrier_wait(cta.bar_final, j & 1)
    for h, d in T.Parallel(HB, D2):
        acc_o_r[h, d] = acc_o_r[h, d] * final_shared[h]
    if ovl:
        _ws_ovl_stage_o(cta, acc_o_r, 1, j)
    elif NS == 1 and cta.io == "staged":
        T.copy(acc_o_r, Q_r)  # warpgroup 0 arrived on bar_final after its last QK^T: Q_r is free
        if cta.ablate != "no_o_store":
            T.copy(Q_r, Out[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2])
    elif cta.bf16_parts and cta.io == "staged":
        T.copy(acc_o_r, Q_r)
        T.copy(Q_r, Out[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
    elif NS == 1:
        T.copy(acc_o_r, Out[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2])
    elif cta.fuse is None:
        T.copy(acc_o_r, Out[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
    else:
        T.copy(acc_o_r, cta.fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
        _ws_fused_combine(cta.fuse, 1, acc_o_r, Q_r, b_i, s_i, h0, bz, HB, D2, NS, cta.io)


class _WsFuse(NamedTuple):
    """What the fused combine (``combine="fused"``) needs besides a warpgroup's own accumulator."""

    OPart: Any  # fp32 [B, S, NS, H, D]: every split's partial O, normalised by its own sum (global scratch, in L2)
    LsePart: Any  # fp32 [B, S, NS, H]: every split's log2-sum-exp (-inf: nothing valid)
    Counter: Any  # int32 [B, S, REP]: split CTAs arrived per (token, head block); 0 between launches
    Sink: Any  # fp32 [H]
    Out: Any  # bf16 [B, S, H, D]: the merged output
    comb_shared: Any  # fp32 [2, NS + 2, HB]: per consumer warpgroup, each split's weight, the max, 1 / denominator
    last_shared: Any  # int32 [1]: the counter's value before this CTA's arrival
    bar_arrived: Any  # 256 arrivals: each consumer thread's partial stores are done and fenced
    bar_last: Any  # 1 arrival: thread 0 has counted the CTA in and left the old value in last_shared
    tx: Any  # the thread index


def _split_max(LsePart, b_i, s_i, h, NS, sink2):
    """max(sink2, -1e30, lse_0 .. lse_{NS-1}) for head h (a PrimExpr, the splits unrolled): combine_kernel's m."""
    m = T.max(sink2, -1e30)  # finite even without a sink (-inf), so exp2 never sees -inf - -inf
    for k in range(NS):
        m = T.max(m, LsePart[b_i, s_i, k, h])
    return m


def _split_den(comb, w, NS, h, sink2):
    """exp2(sink2 - m) + w_0 + .. + w_{NS-1} for row h of warpgroup w's weights, in combine_kernel's order."""
    den = T.exp2(sink2 - comb[w, NS, h])
    for k in range(NS):
        den = den + comb[w, k, h]
    return den


@T.macro
def _ws_fused_combine(fz, w, acc_o, Q_own, b_i, s_i, h0, bz, HB, D2, NS, io):
    """``combine="fused"``: after consumer warpgroup ``w`` stored its half of this split's partial O (acc_o [HB, D2],
    still in registers, normalised by the split's own sum; warpgroup 0 also its lse), count the CTA in on the
    (token, head block)'s arrival counter; the CTA that arrives last merges every split with the sink as
    :func:`combine_kernel` does, every split read from OPart in ascending order (its own too: the result must not
    depend on which CTA arrives last), and writes bf16 Out [b_i, s_i, h0 : h0 + HB, w D2 : (w + 1) D2]. It resets the counter, so
    the next launch (a CUDA-graph replay) starts from 0.

    Ordering: each thread's release fence orders its partial stores before its mbarrier arrival; thread 0 waits for
    all 256, then its acq_rel atomic publishes the CTA's partial at GPU scope (the fence, the CTA barrier and the
    release form the usual cumulative chain) and, in the last CTA, acquires the others'. The producer warpgroup
    takes no part (it has finished), so CTA-wide __syncthreads would hang: mbarriers only."""
    T.call_extern("handle", "csa2_fence_gpu")
    T.barrier_arrive(fz.bar_arrived)
    if w == 0:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if fz.tx == 0:
            T.barrier_wait(fz.bar_arrived, 0)
            fz.last_shared[0] = T.atomic_add(fz.Counter[b_i, s_i, h0 // HB], 1, memory_order="acq_rel", return_prev=True)
            if fz.last_shared[0] == NS - 1:
                fz.Counter[b_i, s_i, h0 // HB] = 0  # every split has arrived: nothing else touches it this launch
            T.barrier_arrive(fz.bar_last)
    T.barrier_wait(fz.bar_last, 0)
    if fz.last_shared[0] == NS - 1:
        comb = fz.comb_shared  # warpgroup w's rows: [w, k] split k's weight, [w, NS] the max, [w, NS + 1] 1 / denominator
        for h in T.Parallel(HB):
            comb[w, NS, h] = _split_max(fz.LsePart, b_i, s_i, h0 + h, NS, fz.Sink[h0 + h] * LOG2E)
        for k, h in T.Parallel(NS, HB):
            comb[w, k, h] = T.exp2(fz.LsePart[b_i, s_i, k, h0 + h] - comb[w, NS, h])
        # One reciprocal per row, not combine_kernel's acc / den per element: a precise fp32 division has a
        # slow-path call, and with the 128-register accumulator live it spills (ptxas, 24 bytes). The results are
        # at most one fp32 rounding apart, far below the bf16 output's.
        for h in T.Parallel(HB):
            den = _split_den(comb, w, NS, h, fz.Sink[h0 + h] * LOG2E)
            comb[w, NS + 1, h] = T.if_then_else(den > 0, 1.0 / den, 0.0)  # no sink, no valid index: zeros
        # acc = sum_k w_k O_k over every split in ascending k, this CTA's own split read back from OPart too: the
        # same sequence of roundings whichever split arrives last (taking its own split from registers first made
        # the result depend on the arrival order: two runs differed in the last bit on the H200, session 5).
        # A quarter of the columns at a time with a compiler fence between quarters, so at most 32 loaded registers
        # are live beside the 128 of the accumulator (warpgroup 1 has 168; loaded all at once, ptxas spilled 8-1200
        # bytes). Rolled over k (ptxas, decode B=64: no spills at 2 and 8 splits, 8 bytes at 4; unrolled at 4: 612).
        T.clear(acc_o)
        for k in T.serial(NS):
            for c in T.unroll(4, explicit=True):
                for h, d in T.Parallel(HB, D2 // 4):
                    acc_o[h, c * (D2 // 4) + d] = (
                        acc_o[h, c * (D2 // 4) + d] + fz.OPart[b_i, s_i, k, h0 + h, w * D2 + c * (D2 // 4) + d] * comb[w, k, h]
                    )
                T.call_extern("handle", "csa2_compiler_fence")
        for h, d in T.Parallel(HB, D2):
            acc_o[h, d] = acc_o[h, d] * comb[w, NS + 1, h]
        if io == "staged":  # Q_own is free: both warpgroups' last QK^T completed before bar_arrived
            T.copy(acc_o, Q_own)
            T.copy(Q_own, fz.Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
        else:
            T.copy(acc_o, fz.Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])


class _WsBuffer(NamedTuple):
    """One of the ws kernel's two KV buffers: its halves, row-valid flags, and the barriers that hand it over."""

    KV_l: Any
    KV_r: Any
    valid: Any
    ready: Any  # producer -> consumers: the rows have landed (consumers="paired_halves": the left half's)
    free: Any  # consumers -> producer: both GEMMs are done with it (paired_halves: with the left half)
    ready_r: Any = None  # consumers="paired_halves": the right half's rows have landed (128 arrivals: the producer)
    free_r: Any = None  # ... its last reader is done with the right half (128 arrivals: one consumer warpgroup)


class _WsSoftmax(NamedTuple):
    """Warpgroup 0's operands and online-softmax state (and the S/alpha hand-over barriers to warpgroup 1)."""

    Q_l: Any
    Q_r: Any
    S_shared: Any
    alpha_shared: Any
    acc_s: Any
    acc_o: Any
    sumexp: Any
    sumexp_i: Any
    alpha: Any
    m_i: Any
    m_i_prev: Any
    bar_s_ready: Any
    bar_s_free: Any


class _WsSources(NamedTuple):
    """The kernel's KV and index tensors, as the batched producer macros take them."""

    WinA: Any
    WinB: Any
    WinIdx: Any
    MainA: Any
    MainB: Any
    TopkIdx: Any


class _WsRegisters(NamedTuple):
    """The batched producer's per-thread registers: this and the next block's rows, one batch of raw codes and
    scale bytes, eight dequantised values."""

    rows_cur: Any
    rows_next: Any
    raw: Any
    rawsc: Any
    vals: Any


class _WsDims(NamedTuple):
    """List lengths, block geometry and cache sizes (Nw, Nc dynamic) of the ws kernel."""

    W: int
    K: int
    BI: int
    NBW: int
    ROWS: int
    D2: int
    Nw: Any
    Nc: Any
    lanes: str  # producer lane -> (row, column slice) map: _lane_row, _lane_col
    fp4_decode: str = "fma"  # the FP4 main-word dequant: a key of _FP4X8_FUNCTIONS
    ablate: str = ""  # a producer-side timing ablation (no_dequant, no_loads, no_stores, ...; see ABLATIONS); "" in every real kernel
    unused_rows: str = "row0"  # bf16 KV: what the batched producer's cp.async puts in an unused slot's row (UNUSED_ROWS)


def _lane_row(p, lanes):
    """Row (within a pass of 16) of producer lane p (0..127): see ``lanes`` in :func:`_sparse_attn_ws`."""
    return p // 8 if lanes == "row" else p % 8 + 8 * (p // 64)


def _lane_col(p, lanes):
    """32-column slice (0..7, of each half of a row) of producer lane p: see ``lanes`` in :func:`_sparse_attn_ws`."""
    return p % 8 if lanes == "row" else (p // 8) % 8


@T.macro
def _ws_fetch_rows(src, dims, rows, b_i, s_i, blk, p, passes=None):
    """Producer thread p's cache rows of block ``blk`` (rows rr * ROWS + _lane_row(p)): -1 where the slot is unused,
    past the end of its list, or holds an index outside the cache (masked, never read: the batched
    kernel is built without TileLang's bounds guards). ``passes``: the rr to fetch (default all), ``rows[j]``
    holding the j-th of them."""
    W, K, BI, NBW, ROWS, _, Nw, Nc, lanes = dims[:9]
    WinIdx, TopkIdx = src.WinIdx, src.TopkIdx
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j, rr in enumerate(passes):
        r = rr * ROWS + _lane_row(p, lanes)
        if blk < NBW:
            rows[j] = T.if_then_else(blk * BI + r < W, WinIdx[b_i, s_i, T.min(blk * BI + r, W - 1)], -1)
            rows[j] = T.if_then_else(rows[j] < Nw, rows[j], -1)
        else:
            rows[j] = T.if_then_else((blk - NBW) * BI + r < K, TopkIdx[b_i, s_i, T.min((blk - NBW) * BI + r, K - 1)], -1)
            rows[j] = T.if_then_else(rows[j] < Nc, rows[j], -1)


@T.macro
def _ws_produce_into(src, regs, dims, kv_buf, bar_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch: bool, n_blk):
    """One block of the producer's loop (one token per CTA): wait until ``kv_buf`` (block ``it`` of ``n_blk``, the
    buffer of parity ``it % 2``) is free, then fill it with block ``blk``, by the prefetching or the batched producer."""
    T.barrier_wait(bar_free, ((it // 2) & 1) ^ 1)
    if prefetch:
        _ws_produce_prefetch(src, regs, dims, kv_buf, b_i, s_i, blk, p, it + 1 < n_blk)
    else:
        _ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, fp4, main_passes)


@T.macro
def _ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, fp4, main_passes=None, s_next=None, blk_next=None):
    """Fill one KV buffer with block ``blk`` (batched producer), fetching block ``blk + 1``'s rows meanwhile.

    Thread p owns rows rr * ROWS + _lane_row(p) and, of each half of a row, the 32 columns from c * 32
    (FP4/FP8) or the four 8-column chunks at 64 u + c * 8 (bf16), c = _lane_col(p). An unused row (-1) gets zeros (FP4/FP8: its scale is zeroed;
    bf16 with ``unused_rows="zeros"``: the cp.async predicate zero-fills it) or a copy of row 0 (bf16, ``"row0"``);
    either way its score is -inf, so it adds nothing. ``s_next``/``blk_next``: the token and
    block whose rows to fetch next (default: block ``blk + 1`` of the same token; ``tokens_per_cta`` crosses into
    the next token).
    """
    WinA, WinB, _, MainA, _, _ = src
    if s_next is None:
        s_next, blk_next = s_i, blk + 1
    rows_cur, rows_next, raw, rawsc, vals = regs
    KV_l, KV_r, valid, bar_ready = kv_buf.KV_l, kv_buf.KV_r, kv_buf.valid, kv_buf.ready
    _, _, BI, NBW, ROWS, D2, _, _, lanes = dims[:9]
    R = BI // ROWS
    c = _lane_col(p, lanes)
    for rr in T.unroll(R):
        valid[rr * ROWS + _lane_row(p, lanes)] = rows_cur[rr] >= 0
    if not fp4:
        for rr in T.unroll(R):
            r = rr * ROWS + _lane_row(p, lanes)
            row = T.max(rows_cur[rr], 0)
            # unused_rows="zeros": an unused slot's cp.async reads nothing and zero-fills (its predicate); "row0": it
            # copies row 0, as every unused slot of every CTA does (its score is -inf either way)
            used = (rows_cur[rr] >= 0,) if dims.unused_rows == "zeros" else ()
            for u in T.unroll(4):
                col = 64 * u + c * 8
                if blk < NBW:
                    _ws_copy16(KV_l[r, col], WinA[b_i, row, col], used)
                    _ws_copy16(KV_r[r, col], WinA[b_i, row, D2 + col], used)
                else:
                    _ws_copy16(KV_l[r, col], MainA[b_i, row, col], used)
                    _ws_copy16(KV_r[r, col], MainA[b_i, row, D2 + col], used)
        _ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
        T.cp_async_barrier_noinc(bar_ready)
    else:
        if blk < NBW:
            if _cuts(dims, "window"):  # the window block's rows left unfilled
                _ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
            else:
                # FP8 window rows are 512 B: two batches of R / 2 rows keep the loads in registers
                for bt in T.unroll(2):
                    for q in T.unroll(R // 2):
                        row = T.max(rows_cur[bt * (R // 2) + q], 0)
                        for h in T.unroll(2):
                            for v in T.vectorized(8):
                                raw[(q * 2 + h) * 8 + v] = WinA[b_i, row, (h * D2 + c * 32) // 4 + v]
                            rawsc[q * 2 + h] = WinB[b_i, row, (h * D2 + c * 32) // 32]
                    if bt == 0:
                        _ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
                    for q in T.unroll(R // 2):
                        rr = bt * (R // 2) + q
                        for h, buf in ((0, KV_l), (1, KV_r)):
                            s2 = T.call_extern("uint32", "csa2_e8m0_scale2", T.cast(rawsc[q * 2 + h], "uint32"))
                            s2 = T.if_then_else(rows_cur[rr] >= 0, s2, T.uint32(0))
                            for w in T.unroll(4):
                                T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(vals[0]), raw[(q * 2 + h) * 8 + 2 * w], s2)
                                T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(vals[4]), raw[(q * 2 + h) * 8 + 2 * w + 1], s2)
                                for v in T.vectorized(8):
                                    buf[rr * ROWS + _lane_row(p, lanes), c * 32 + w * 8 + v] = vals[v]
        else:
            # FP4 rows are 288 B: the whole block's loads (R rows x 2 halves x 16 B + scales) in flight at once
            # (main_passes: the passes this warpgroup fills, when consumer warpgroup 1 fills the last one)
            if _cuts(dims, "main"):  # the main block's rows left unfilled: no loads, decode or stores
                _ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
            else:
                _ws_issue_main_loads(src, regs, dims, b_i, p, main_passes)
                _ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
                _ws_store_main(regs, dims, kv_buf, p, main_passes)
        # generic-proxy stores must be visible to wgmma's async-proxy reads (ablate="no_fence": timing only)
        if not _cuts(dims, "fence"):
            T.fence_proxy_async()
        T.barrier_arrive(bar_ready)
    for rr in T.unroll(R):
        rows_cur[rr] = rows_next[rr]


@T.macro
def _ws_copy16(dst, src, used):
    """One 16-byte cp.async of a bf16 row piece ``src`` (global) to ``dst`` (shared); ``used``: () or (predicate,),
    which zero-fills when false."""
    T.ptx_cp_async(T.access_ptr(dst, "w", 8), T.access_ptr(src, "r", 8), 8, *used)


@T.macro
def _ws_fill_half(src, dims, kv_buf, h, rows, b_i, blk, p, flags: bool):
    """consumers="paired_halves" (bf16 rows): producer thread p's cp.async copies of block ``blk``'s half ``h`` (0:
    KV_l, dims 0..D/2; 1: KV_r) for the rows in ``rows``, arriving on that half's ready barrier as they land;
    ``flags``: also write the block's row-valid flags (with the half its owner reads first)."""
    WinA, MainA = src.WinA, src.MainA
    _, _, BI, NBW, ROWS, D2, _, _, lanes = dims[:9]
    c = _lane_col(p, lanes)
    buf = kv_buf.KV_r if h else kv_buf.KV_l
    for rr in T.unroll(BI // ROWS):
        r = rr * ROWS + _lane_row(p, lanes)
        if flags:
            kv_buf.valid[r] = rows[rr] >= 0
        row = T.max(rows[rr], 0)
        used = (rows[rr] >= 0,) if dims.unused_rows == "zeros" else ()
        for u in T.unroll(4):
            col = 64 * u + c * 8
            if blk < NBW:
                _ws_copy16(buf[r, col], WinA[b_i, row, h * D2 + col], used)
            else:
                _ws_copy16(buf[r, col], MainA[b_i, row, h * D2 + col], used)
    T.cp_async_barrier_noinc(kv_buf.ready_r if h else kv_buf.ready)


@T.macro
def _ws_produce_halves(src, dims, bufs, pair_rows, b_i, s_i, lo, n_blk, max_blk, p):
    """The producer under consumers="paired_halves" (bf16 rows, one token per CTA): per pair k (blocks 2 k in buffer 0,
    2 k + 1 in buffer 1) the four halves in the order their last readers free them (FlashMLA's): buffer 0's left
    (warpgroup 0's own half: its QK^T and own P V), buffer 1's right (warpgroup 1's own half), buffer 0's right
    (read last by warpgroup 1's P V of block 2 k), buffer 1's left. The next pair's rows are fetched after the first
    two halves went out, into the second pair of row registers."""
    rows_a, rows_b, rows_a2, rows_b2 = pair_rows
    b0, b1 = bufs
    _ws_fetch_rows(src, dims, rows_a, b_i, s_i, lo, p)
    _ws_fetch_rows(src, dims, rows_b, b_i, s_i, lo + 1, p)
    # A static trip count and a guard (as the consumers': TileLang 0.1.15 unrolls a trip count of 0 or 1).
    for k in T.serial((max_blk + 1) // 2):
        if 2 * k < n_blk:
            second = 2 * k + 1 < n_blk
            T.barrier_wait(b0.free, (k & 1) ^ 1)
            _ws_fill_half(src, dims, b0, 0, rows_a, b_i, lo + 2 * k, p, True)
            if second:
                T.barrier_wait(b1.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 1, rows_b, b_i, lo + 2 * k + 1, p, True)
            _ws_fetch_rows(src, dims, rows_a2, b_i, s_i, lo + 2 * k + 2, p)
            _ws_fetch_rows(src, dims, rows_b2, b_i, s_i, lo + 2 * k + 3, p)
            T.barrier_wait(b0.free_r, (k & 1) ^ 1)
            _ws_fill_half(src, dims, b0, 1, rows_a, b_i, lo + 2 * k, p, False)
            if second:
                T.barrier_wait(b1.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 0, rows_b, b_i, lo + 2 * k + 1, p, False)
            for rr in T.unroll(dims.BI // dims.ROWS):
                rows_a[rr] = rows_a2[rr]
                rows_b[rr] = rows_b2[rr]


@T.macro
def _ws_produce_halves_tokens(src, dims, bufs, pair_rows, b_i, lo, n_blk, TPC, p, nxt):
    """The producer under paired_halves with io="overlapped": :func:`_ws_produce_halves` over the CTA's run of tokens
    (n_blk even, one split), the pair index and the barrier phases running on across them and the row fetch crossing
    into the next token (the prefill default since session 22: consumers="auto")."""
    rows_a, rows_b, rows_a2, rows_b2 = pair_rows
    b0, b1 = bufs
    npairs = n_blk // 2
    _ws_fetch_rows(src, dims, rows_a, b_i, nxt.first // nxt.REP, lo, p)
    _ws_fetch_rows(src, dims, rows_b, b_i, nxt.first // nxt.REP, lo + 1, p)
    for j in T.serial(TPC):
        if j < nxt.count:
            s_j = (nxt.first + j) // nxt.REP
            s_n = T.if_then_else(j + 1 < nxt.count, (nxt.first + j + 1) // nxt.REP, s_j)  # past the last: unused
            for kk in T.serial(npairs):
                k = j * npairs + kk
                T.barrier_wait(b0.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b0, 0, rows_a, b_i, lo + 2 * kk, p, True)
                T.barrier_wait(b1.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 1, rows_b, b_i, lo + 2 * kk + 1, p, True)
                last = kk + 1 == npairs
                s_f = T.if_then_else(last, s_n, s_j)
                _ws_fetch_rows(src, dims, rows_a2, b_i, s_f, T.if_then_else(last, lo, lo + 2 * kk + 2), p)
                _ws_fetch_rows(src, dims, rows_b2, b_i, s_f, T.if_then_else(last, lo + 1, lo + 2 * kk + 3), p)
                T.barrier_wait(b0.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b0, 1, rows_a, b_i, lo + 2 * kk, p, False)
                T.barrier_wait(b1.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 0, rows_b, b_i, lo + 2 * kk + 1, p, False)
                for rr in T.unroll(dims.BI // dims.ROWS):
                    rows_a[rr] = rows_a2[rr]
                    rows_b[rr] = rows_b2[rr]


@T.macro
def _ws_issue_main_loads(src, regs, dims, b_i, p, passes=None):
    """Load thread p's packed FP4 words and scale bytes of the rows in ``rows_cur`` into ``raw``/``rawsc`` (issue only:
    nothing reads them here, so all R x 2 x (16 B + 2 B) loads are in flight together). ``passes``: as in
    :func:`_ws_fetch_rows` (the registers hold only those passes, in order)."""
    MainA, MainB = src.MainA, src.MainB
    rows_cur, raw, rawsc = regs.rows_cur, regs.raw, regs.rawsc
    _, _, BI, _, ROWS, D2, _, _, lanes = dims[:9]
    c = _lane_col(p, lanes)
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j in range(len(passes)):
        row = T.max(rows_cur[j], 0)
        for h in T.unroll(2):
            if _cuts(dims, "loads"):  # words and scale bytes made from the row index: no global load
                for v in T.unroll(4):
                    raw[(j * 2 + h) * 4 + v] = row * 4 + v
                for v in T.unroll(2):
                    rawsc[(j * 2 + h) * 2 + v] = T.Cast("uint8", row + v)
            else:
                for v in T.vectorized(4):
                    raw[(j * 2 + h) * 4 + v] = MainA[b_i, row, (h * D2 + c * 32) // 8 + v]
                for v in T.unroll(2):
                    rawsc[(j * 2 + h) * 2 + v] = MainB[b_i, row, (h * D2 + c * 32) // 16 + v]


@T.macro
def _ws_store_main(regs, dims, kv_buf, p, passes=None):
    """Dequantise ``raw``/``rawsc`` (the rows in ``rows_cur``; an unused row's scale is zeroed) into the KV buffer.
    ``passes``: as in :func:`_ws_fetch_rows`."""
    rows_cur, raw, rawsc, vals = regs.rows_cur, regs.raw, regs.rawsc, regs.vals
    _, _, BI, _, ROWS, _, _, _, lanes = dims[:9]
    c = _lane_col(p, lanes)
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j, rr in enumerate(passes):
        for h, buf in ((0, kv_buf.KV_l), (1, kv_buf.KV_r)):
            for q in T.unroll(4):  # word q: columns c * 32 + 8 q .. + 8, scale group q // 2
                s2 = T.call_extern("uint32", "csa2_e4m3_scale2", T.cast(rawsc[(j * 2 + h) * 2 + q // 2], "uint32"))
                s2 = T.if_then_else(rows_cur[j] >= 0, s2, T.uint32(0))
                if _cuts(dims, "decode"):  # one value from the word and scale, 7 stale
                    vals[0] = T.reinterpret("bfloat16", T.Cast("uint16", raw[(j * 2 + h) * 4 + q] ^ T.Cast("int32", s2)))
                else:
                    T.call_extern("handle", _FP4X8_FUNCTIONS[dims.fp4_decode], T.address_of(vals[0]), raw[(j * 2 + h) * 4 + q], s2)
                if _cuts(dims, "stores"):  # the 8 values folded into the word they came from: kept live, not stored
                    raw[(j * 2 + h) * 4 + q] = T.call_extern("int32", "csa2_fold16", T.address_of(vals[0]))
                else:
                    for v in T.vectorized(8):
                        buf[rr * ROWS + _lane_row(p, lanes), c * 32 + q * 8 + v] = vals[v]
    if _cuts(dims, "stores"):  # one 2-byte store per block keeps every decoded value live
        for k in range(1, len(passes) * 8):
            raw[0] = raw[0] ^ raw[k]
        kv_buf.KV_l[_lane_row(p, lanes), c * 32] = T.reinterpret("bfloat16", T.Cast("uint16", raw[0]))


@T.macro
def _ws_wg1_fill(src, hregs, dims, kv_buf, b_i, s_i, blk, q, more):
    """Consumer warpgroup 1's share of block ``blk`` (``wg1_rows``): for a main block, dequantise the last pass of
    rows (rows 48..63; their loads were issued a block earlier) into ``kv_buf``; arrive on its ready barrier in any
    case (the producer fills window blocks whole); then issue the next block's loads and fetch the rows of the one
    after. Invariant at entry: ``hregs.rows_cur`` holds this block's rows (and ``raw`` their data for a main block),
    ``rows_next`` the next block's. ``more``: true when this CTA has a block after ``blk``."""
    _, _, BI, NBW, ROWS, _, _, _, _ = dims[:9]
    last = (BI // ROWS - 1,)
    if blk >= NBW:
        _ws_store_main(hregs, dims, kv_buf, q, last)
        T.fence_proxy_async()  # generic-proxy stores must be visible to wgmma's async-proxy reads
    T.barrier_arrive(kv_buf.ready)
    hregs.rows_cur[0] = hregs.rows_next[0]
    if more:
        if blk + 1 >= NBW:
            _ws_issue_main_loads(src, hregs, dims, b_i, q, last)
        _ws_fetch_rows(src, dims, hregs.rows_next, b_i, s_i, blk + 2, q, last)


@T.macro
def _ws_produce_prefetch(src, regs, dims, kv_buf, b_i, s_i, blk, p, more):
    """Fill one KV buffer with block ``blk`` (FP4, ``produce='prefetch'``), then issue block ``blk + 1``'s loads.

    The batched producer issues a main block's loads only after its buffer is free, so every block pays one
    global-memory latency on the critical path. Here a main block's packed words are already in ``raw`` when
    its buffer frees (issued at the end of the previous step), and the loads of the next block fly while this
    thread waits for the next free buffer. Same registers: ``raw`` is read by the dequantisation before the next
    loads overwrite it. Window (FP8) blocks are filled as by the batched producer. Invariant at entry: ``rows_cur``
    holds this block's rows; for a main block also ``raw``/``rawsc`` its data and ``rows_next`` the next block's rows.
    ``more``: a boolean expression, true when this CTA has a block after ``blk`` (something to prefetch).
    """
    rows_cur, rows_next = regs.rows_cur, regs.rows_next
    _, _, BI, NBW, ROWS, _, _, _, lanes = dims[:9]
    R = BI // ROWS
    if blk < NBW:
        _ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, True)  # ends with rows_cur = rows of blk + 1
        if (blk + 1 >= NBW) & more:
            _ws_issue_main_loads(src, regs, dims, b_i, p)
            _ws_fetch_rows(src, dims, rows_next, b_i, s_i, blk + 2, p)
    else:
        for rr in T.unroll(R):
            kv_buf.valid[rr * ROWS + _lane_row(p, lanes)] = rows_cur[rr] >= 0
        _ws_store_main(regs, dims, kv_buf, p)
        T.fence_proxy_async()  # generic-proxy stores must be visible to wgmma's async-proxy reads
        T.barrier_arrive(kv_buf.ready)
        for rr in T.unroll(R):
            rows_cur[rr] = rows_next[rr]
        if more:
            _ws_issue_main_loads(src, regs, dims, b_i, p)
            _ws_fetch_rows(src, dims, rows_next, b_i, s_i, blk + 2, p)


@T.macro
def _ws_produce_row(WinA, WinB, MainA, MainB, KV_l, KV_r, valid, row_local, b_i, r, c, is_window, fp4, D2):
    """Producer thread c (0..7) of row r: 32 columns of each half of the gathered row, dequantised to bf16."""
    ok = row_local[0] >= 0
    row = T.max(row_local[0], 0)
    valid[r] = ok
    zero = T.cast(0, "bfloat16")
    for half, buf in ((0, KV_l), (1, KV_r)):
        d0 = half * D2 + c * 32
        if is_window:
            for v in T.vectorized(32):
                if fp4:
                    val = T.cast(WinA[b_i, row, d0 + v], "float32") * _e8m0(WinB[b_i, row, (d0 + v) // 32])
                    buf[r, c * 32 + v] = T.if_then_else(ok, T.cast(val, "bfloat16"), zero)
                else:
                    buf[r, c * 32 + v] = T.if_then_else(ok, WinA[b_i, row, d0 + v], zero)
        else:
            for v in T.vectorized(32):
                if fp4:
                    nib = T.shift_right(MainA[b_i, row, (d0 + v) // 8], ((d0 + v) % 8) * 4) & 15
                    val = _e2m1(nib) * T.cast(MainB[b_i, row, (d0 + v) // 16], "float32")
                    buf[r, c * 32 + v] = T.if_then_else(ok, T.cast(val, "bfloat16"), zero)
                else:
                    buf[r, c * 32 + v] = T.if_then_else(ok, MainA[b_i, row, d0 + v], zero)


# ----------------------------------------------------------------------------------------------
# Compiled-kernel cache and launch
# ----------------------------------------------------------------------------------------------
_KERNELS: dict[tuple, Any] = {}
_DEFAULT_SCALE = 512**-0.5


class CompiledAttention:
    """The attention kernel (and the combine kernel when split) for one (H, D, W, K, scale, format, config, arch).

    ``combine="fused"``: no combine kernel; the attention kernel takes an arrival counter per (token, head block),
    int32, allocated zeroed once per device and grown when a call has more tokens (the kernel leaves it zero). A
    counter is shared by every call of this object on that device: calls must not run concurrently on two streams,
    and a CUDA graph must be captured after one eager call at its largest B * S (the growth allocates)."""

    def __init__(
        self, heads: int, dim: int, window: int, topk: int, scale: float, kv_format: str, config: Config, arch: Arch, ablate: str = ""
    ):
        """``ablate``: a timing ablation (see :data:`ABLATIONS`; gpu/attn_ablation.py builds these directly, never
        through :func:`compiled` or a tile's ``build``)."""
        if config.get("kv_staging", "gather") != "gather":
            raise ValueError(f"kv_staging={config['kv_staging']!r}: this class is the gathering kernel; compiled() builds the expansion")
        self.heads, self.dim, self.window, self.topk, self.kv_format = heads, dim, window, topk, kv_format
        self.n_split = int(config.get("n_split", 1))
        self.fused = config.get("combine", "separate") == "fused"
        self.partials_dtype = torch.bfloat16 if config.get("partials", "fp32") == "bf16" else torch.float32
        self.rep = heads // int(config.get("heads_per_block", 64))  # head blocks per token: counters per token
        self.counters: dict[torch.device, torch.Tensor] = {}
        target = tilelang.tvm.target.Target(arch.tilelang_target())
        params = {
            k: config[k]
            for k in (
                "block_I",
                "num_stages",
                "threads",
                "heads_per_block",
                "dequant",
                "schedule",
                "produce",
                "io",
                "consumers",
                "wg1_rows",
                "tokens_per_cta",
                "combine",
                "handoff",
                "lanes",
                "fp4_decode",
                "partials",
                "unused_rows",
            )
            if k in config
        }
        if kv_format != "bf16":
            # FP4/FP8 rows: the producer's own unused-row path and loads (these keys are for bf16 rows: BF16_ROW_KEYS)
            for key in BF16_ROW_KEYS:
                params.pop(key, None)
        # the batched producer reads FP8 window codes as int32 words and E4M3 scales as bytes
        self.word_views = kv_format == "fp4" and config.get("schedule") == "ws" and config.get("produce") in ("batched", "prefetch")
        if ablate:
            params["ablate"] = ablate
        prim = sparse_attn_kernel(heads, dim, window, topk, scale, kv_format=kv_format, n_split=self.n_split, **params)
        # The batched producer masks out-of-range indices itself (_ws_fetch_rows); TileLang's bounds guards
        # would turn its cp.async copies back into synchronous loads.
        batched = config.get("schedule") == "ws" and config.get("produce") in ("batched", "prefetch")
        passes = {**_PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True} if batched else dict(_PASS_CONFIGS)
        if config.get("ptxas_level"):  # 0: ptxas's own default (5)
            passes[tilelang.PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL] = int(config["ptxas_level"])
        self.main = tilelang.compile(prim, target=target, pass_configs=passes)
        self.combine = None
        if self.n_split > 1 and not self.fused:
            kernel = combine_kernel(heads, dim, self.n_split, partials=config.get("partials", "fp32"))
            self.combine = tilelang.compile(kernel, target=target, pass_configs=_PASS_CONFIGS)

    def __call__(self, q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out: torch.Tensor | None = None) -> torch.Tensor:
        B, S, H, D = q.shape
        if self.word_views:
            win_a, main_b = win_a.view(torch.int32), main_b.view(torch.uint8)  # [B, Nw, D/4], [B, Nc, D/16]
        if out is None:
            out = torch.empty(B, S, H, D, dtype=torch.bfloat16, device=q.device)  # [B, S, H, D]
        if self.n_split == 1:
            lse = torch.empty(B, S, 1, H, dtype=torch.float32, device=q.device)  # [B, S, 1, H], unused
            self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out, lse)
            return out
        opart = torch.empty(B, S, self.n_split, H, D, dtype=self.partials_dtype, device=q.device)  # [B, S, NS, H, D]
        lse = torch.empty(B, S, self.n_split, H, dtype=torch.float32, device=q.device)  # [B, S, NS, H]
        if self.fused:
            counter = self.counter(B, S, q.device)  # [B, S, REP], all zero
            self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out, lse, opart, counter)
            return out
        self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, opart, lse)
        self.combine(opart, lse, sink, out)
        return out

    def counter(self, B: int, S: int, device: torch.device) -> torch.Tensor:
        """The fused combine's arrival counters for B x S tokens: a zero int32 [B, S, REP] view of this device's
        buffer, allocated (zeroed) on first use and replaced by a larger one when B * S outgrows it. Every launch
        leaves its counters at zero (the last CTA of each token resets its own), so the buffer is never cleared again."""
        need = B * S * self.rep
        buf = self.counters.get(device)
        if buf is None or buf.numel() < need:
            buf = torch.zeros(max(need, 2 * buf.numel() if buf is not None else need), dtype=torch.int32, device=device)
            self.counters[device] = buf
        return buf[:need].view(B, S, self.rep)  # [B, S, REP]


# The keys of an FP4 config that the bf16 kernel behind kv_staging="expand" does not take (fp4_decode picks the
# expansion's FP4 word decode instead).
FP4_ONLY_KEYS = ("dequant", "wg1_rows", "fp4_decode", "kv_staging")


class ExpandedAttention:
    """``kv_staging="expand"``: both quantised caches expanded to bf16 (:mod:`tiles.kv_expand`, one launch), then the
    bf16 kernel of the same config gathers them. Called like :class:`CompiledAttention` with FP4/FP8 arguments."""

    def __init__(self, heads: int, dim: int, window: int, topk: int, scale: float, config: Config, arch: Arch):
        fp4_decode = config.get("fp4_decode", "fma")
        self.expand = expand_kernel(dim, _decode_helpers_cuda(fp4_decode), _FP4X8_FUNCTIONS[fp4_decode], arch)
        bf16_config = {k: v for k, v in config.items() if k not in FP4_ONLY_KEYS}
        self.attend = compiled(heads, dim, window, topk, scale, "bf16", bf16_config, arch)

    # the attention behind the expansion, by CompiledAttention's names (source dumps, profilers, tests)
    main = property(lambda self: self.attend.main)
    combine = property(lambda self: self.attend.combine)
    n_split = property(lambda self: self.attend.n_split)

    def __call__(self, q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out: torch.Tensor | None = None) -> torch.Tensor:
        window_kv, main_kv = expand_caches(self.expand, win_a, win_b, main_a, main_b)  # [B, Nw, D], [B, Nc, D] bf16
        dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
        return self.attend(q, window_kv, dummy, window_idx, main_kv, dummy, topk_idx, sink, out=out)


def compiled(
    heads: int, dim: int, window: int, topk: int, scale: float, kv_format: str, config: Config, arch: Arch
) -> "CompiledAttention | ExpandedAttention":
    """The cached kernel for (shape key, config, arch); compiles on first use. ``kv_staging`` must be resolved
    (:func:`resolve_kv_staging`): "expand" gives the expansion and the bf16 kernel behind one call."""
    key = (heads, dim, window, topk, float(scale), kv_format, tuple(sorted(config.items())), arch.name)
    if key not in _KERNELS:
        staging = config.get("kv_staging", "gather")
        if staging not in ("gather", "expand"):
            raise ValueError(f"kv_staging {staging!r} must be resolved to 'gather' or 'expand' first (resolve_kv_staging)")
        if staging == "expand":
            _KERNELS[key] = ExpandedAttention(heads, dim, window, topk, scale, config, arch)
        else:
            _KERNELS[key] = CompiledAttention(heads, dim, window, topk, scale, kv_format, config, arch)
    return _KERNELS[key]


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------
DECODE_MAX_TOKENS = 256  # B * S at or below this runs the decode tile (split-KV), above it the prefill tile


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise TileError(msg)


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _require(tuple(t.shape) == tuple(shape), f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _require(t.device == device, f"{name} is on {t.device} but q is on {device}: put every input on one GPU")
    _require(t.is_contiguous(), f"{name} must be contiguous (call .contiguous())")


def _require_cuda(q: torch.Tensor) -> None:
    # Checked after shapes and dtypes so that those errors read the same on any device.
    _require(q.is_cuda, "q must be on a CUDA device: the kernels run on the GPU (use model.ops.sparse_attention on the CPU)")


_NO_SINK: dict[tuple, torch.Tensor] = {}


def _sink_or_none(sink: torch.Tensor | None, heads: int, device: torch.device) -> torch.Tensor:
    """No sink is a sink of -inf: exp(-inf) adds nothing to the denominator."""
    if sink is not None:
        return sink
    key = (heads, str(device))
    if key not in _NO_SINK:
        _NO_SINK[key] = torch.full((heads,), float("-inf"), dtype=torch.float32, device=device)  # [H]
    return _NO_SINK[key]


def _check_common(q, window_idx, topk_idx, sink, nw: int, nc: int, check_indices: bool) -> tuple[int, int, int, int, int, int]:
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    B, S, H, D = q.shape
    _require(q.dtype == torch.bfloat16, f"q must be torch.bfloat16, got {q.dtype}")
    _require(q.is_contiguous(), "q must be contiguous (call .contiguous())")
    _require(D == 512, f"head dim must be 512 (the CSA2 latent), got {D}")
    _require(H % 64 == 0, f"heads must be a multiple of 64 (64 or 128 in the model), got {H}")
    _require(window_idx.dim() == 3 and topk_idx.dim() == 3, "window_idx and topk_idx must be [B, S, W] and [B, S, K]")
    W, K = window_idx.shape[-1], topk_idx.shape[-1]
    _require(nw >= 1, "the window KV is empty: it holds at least the current token")
    _require(1 <= W <= 128, f"window_idx holds {W} slots per token; the SWA window is 1..128")
    _require(0 <= K <= 2048, f"topk_idx holds {K} slots per token; 0..2048 are supported")
    _check_tensor(window_idx, "window_idx", torch.int32, (B, S, W), q.device)
    _check_tensor(topk_idx, "topk_idx", torch.int32, (B, S, K), q.device)
    if sink is not None:
        _check_tensor(sink, "sink", torch.float32, (H,), q.device)
    if check_indices:
        for idx, n, name in ((window_idx, nw, "window_idx"), (topk_idx, nc, "topk_idx")):
            lo_hi = torch.stack([idx.min(), idx.max()]).tolist() if idx.numel() else [-1, -1]
            _require(lo_hi[0] >= -1 and lo_hi[1] < n, f"{name} holds values outside [-1, {n}): the cache has {n} entries")
    return B, S, H, D, W, K


_PICKED: dict[tuple, Config] = {}


def _pick_config(tile: "SparseAttnTile", arch: Arch, dims: dict[str, int], config: Config | None) -> Config:
    """An explicit config over the default, else the tuned winner nearest this shape (tiles.results), else the default.

    The winner lookup reads files, so its answer is kept per (tile, arch, dims)."""
    shape = Shape("call", tile.phase, dims)
    if config is not None:
        cfg = tile.with_defaults(arch, config)
    else:
        key = (tile.name, arch.name, tuple(sorted(dims.items())))
        if key not in _PICKED:
            try:
                from tiles.results import load_winner
            except ImportError:  # the results module is optional: without it the default runs
                _PICKED[key] = tile.default_config(arch)
            else:
                _PICKED[key] = dict(load_winner(tile.name, arch, shape, default=tile.default_config(arch))[0])
        cfg = dict(_PICKED[key])
    reasons = tile.search_space(arch).violations(cfg, shape, arch)
    _require(not reasons, f"config {cfg} is not valid for {tile.name} at {dims}: {'; '.join(reasons)}")
    return tile.resolve_call(cfg, dims, arch)


def _arch_of(device: torch.device) -> Arch:
    major, minor = torch.cuda.get_device_capability(device)
    return get_arch(f"sm{major}{minor}")


def tile_for_tokens(B: int, S: int, bf16: bool) -> "SparseAttnTile":
    """The attention tile a call runs on: the bf16-KV tile, else decode up to DECODE_MAX_TOKENS query tokens, else prefill."""
    if bf16:
        return BF16_TILE
    return DECODE_TILE if B * S <= DECODE_MAX_TOKENS else PREFILL_TILE


def sparse_attention(
    q: torch.Tensor,
    window_codes: torch.Tensor,
    window_scales: torch.Tensor,
    window_idx: torch.Tensor,
    main_packed: torch.Tensor,
    main_scales: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float = _DEFAULT_SCALE,
    config: Config | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """Sparse gather attention over the FP8 window KV and the FP4 main KV, with a per-head sink.

    Args:
        q: bf16 [B, S, H, D] queries (H a multiple of 64, D = 512).
        window_codes: uint8 (or float8_e4m3fn) [B, Nw, D] FP8 E4M3 window KV codes.
        window_scales: uint8 [B, Nw, D/32] E8M0 scale bytes.
        window_idx: int32 [B, S, W] indices into the window KV (W <= 128), -1 = unused.
        main_packed: uint8 [B, Nc, D/2] packed FP4 E2M1 main KV (even element in the low nibble).
        main_scales: uint8 (or float8_e4m3fn) [B, Nc, D/16] E4M3 scale bytes.
        topk_idx: int32 [B, S, K] indices into the main KV, -1 = unused. K = 0 (or Nc = 0): an SWA-only layer.
        sink: float32 [H] per-head sink logits, or None for no sink.
        scale: softmax scale (512^-0.5 in the model).
        config: tile config overriding the tuned winner / default (keys of the tile's search space).
        check_indices: reject indices outside [-1, N) with a TileError (costs one host sync).
    Returns:
        bf16 [B, S, H, D]. A row whose indices are all -1 is zero.
    """
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    B, S, _, D = q.shape
    _require(window_codes.dim() == 3 and main_packed.dim() == 3, "window_codes and main_packed must be [B, Nw, D] and [B, Nc, D/2]")
    nw, nc = window_codes.shape[1], main_packed.shape[1]
    B, S, H, D, W, K = _check_common(q, window_idx, topk_idx, sink, nw, nc, check_indices)
    codes = window_codes.view(torch.uint8) if window_codes.dtype == torch.float8_e4m3fn else window_codes
    mscales = main_scales.view(torch.uint8) if main_scales.dtype == torch.float8_e4m3fn else main_scales
    _check_tensor(codes, "window_codes", torch.uint8, (B, nw, D), q.device)
    _check_tensor(window_scales, "window_scales", torch.uint8, (B, nw, D // 32), q.device)
    _check_tensor(main_packed, "main_packed", torch.uint8, (B, nc, D // 2), q.device)
    _check_tensor(mscales, "main_scales", torch.uint8, (B, nc, D // 16), q.device)
    _require_cuda(q)
    if K == 0 or nc == 0:  # SWA-only layer: one masked top-k slot over a one-row dummy cache
        topk_idx = torch.full((B, S, 1), -1, dtype=torch.int32, device=q.device)  # [B, S, 1]
        main_packed = torch.zeros(B, 1, D // 2, dtype=torch.uint8, device=q.device)  # [B, 1, D/2]
        mscales = torch.zeros(B, 1, D // 16, dtype=torch.uint8, device=q.device)  # [B, 1, D/16]
        nc, K = 1, 1
    tile = tile_for_tokens(B, S, bf16=False)
    arch = _arch_of(q.device)
    dims = {"B": B, "S": S, "Nc": nc, "Nw": nw, "H": H, "D": D, "W": W, "K": K}
    cfg = _pick_config(tile, arch, dims, config)
    kernel = compiled(H, D, W, K, scale, "fp4", cfg, arch)
    return kernel(
        q,
        codes.view(torch.float8_e4m3fn),
        window_scales,
        window_idx,
        main_packed.view(torch.int32),
        mscales.view(torch.float8_e4m3fn),
        topk_idx,
        _sink_or_none(sink, H, q.device),
    )


def sparse_attention_bf16(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_idx: torch.Tensor,
    main_kv: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float = _DEFAULT_SCALE,
    config: Config | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """:func:`sparse_attention` with bf16 KV.

    Args:
        window_kv: bf16 [B, Nw, D]; main_kv: bf16 [B, Nc, D]. Others as in :func:`sparse_attention`.
    Returns:
        bf16 [B, S, H, D].
    """
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    _require(window_kv.dim() == 3 and main_kv.dim() == 3, "window_kv and main_kv must be [B, Nw, D] and [B, Nc, D]")
    nw, nc = window_kv.shape[1], main_kv.shape[1]
    B, S, H, D, W, K = _check_common(q, window_idx, topk_idx, sink, nw, nc, check_indices)
    _check_tensor(window_kv, "window_kv", torch.bfloat16, (B, nw, D), q.device)
    _check_tensor(main_kv, "main_kv", torch.bfloat16, (B, nc, D), q.device)
    _require_cuda(q)
    if K == 0 or nc == 0:  # SWA-only layer: one masked top-k slot over a one-row dummy cache
        topk_idx = torch.full((B, S, 1), -1, dtype=torch.int32, device=q.device)  # [B, S, 1]
        main_kv = torch.zeros(B, 1, D, dtype=torch.bfloat16, device=q.device)  # [B, 1, D]
        nc, K = 1, 1
    tile = tile_for_tokens(B, S, bf16=True)
    arch = _arch_of(q.device)
    dims = {"B": B, "S": S, "Nc": nc, "Nw": nw, "H": H, "D": D, "W": W, "K": K}
    cfg = _pick_config(tile, arch, dims, config)
    dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
    kernel = compiled(H, D, W, K, scale, "bf16", cfg, arch)
    return kernel(q, window_kv, dummy, window_idx, main_kv, dummy, topk_idx, _sink_or_none(sink, H, q.device))


# ----------------------------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------------------------
SPLIT_CHOICES = ("auto", 1, 2, 4, 8)
IOS = ("direct", "staged", "overlapped")  # how the ws kernel reads Q and writes O (see _sparse_attn_ws)
PARTIALS = ("fp32", "bf16")  # the dtype of the split partials of O (see _sparse_attn_ws)
BF16_ROW_KEYS = ("unused_rows",)  # keys of the ws batched producer's bf16 row copies: no effect on FP4/FP8 rows
UNUSED_ROWS = ("row0", "zeros")  # bf16 KV, ws batched producer: an unused slot's row copied from row 0, or zero-filled
# Hopper (ws): zero-filled, H200, one run against row0 (results/sm90/sparse_attn_unused_rows_zeros_session18.json):
# prefill 4K with the expansion 0.8263 -> 0.7672 ms, 512-token prompt 0.1831 -> 0.1093; the bf16 tile by lab bench,
# prefill 4K 0.8272 ms with row0 (bench_bf16_row0_session18.json) and 0.7653 with zeros in the next call
# (bench/bench_sparse_attn_bf16.json), decode unchanged (its lists have no unused slots). Every CTA copying the same
# row 0 for its unused slots was the expansion's loss at short prompts (most of their slots are unused).
_UNUSED_ROWS_DEFAULT = "zeros"
# Timing ablations of the ws kernel (gpu/attn_ablation.py; wrong results by design, never in the search space): what a
# block costs when one role's work is removed. producer_idle: the producer hands each buffer over unfilled (the
# consumers' chain alone); consumers_idle: the consumers hand each filled buffer back at once (the producer's cycle
# alone); no_softmax: warpgroup 0 skips the online softmax (S goes to P as it is); no_dequant: the producer gathers and
# stores FP4 main rows as before but skips the E2M1 decode (one value per packed word taken from its bits); uncoupled:
# both roles do all their work but never wait for each other (the producer ignores free, warpgroup 0 ignores ready),
# so each runs at its own pace while sharing the SM: against the roles alone, what contention costs; against the
# default, what the hand-offs cost; no_loads: the producer decodes and stores FP4 main rows made from the row index
# instead of loading them (the index loads and the FP8 window rows stay); no_fence: the producer arrives on a filled
# buffer without its proxy fence (fence.proxy.async.shared::cta) after the FP4/FP8 stores; no_stores: the producer
# loads and decodes FP4 main rows as before but stores none of them (each 16 decoded bytes folded into a register, one
# 2-byte store per block keeping the decode live); stores_only: the producer stores FP4 main rows (one value per
# packed word, from the row index) with neither loads nor decode, so its shared-memory stores are what is left of it;
# skeleton: FP4 main blocks get none of the three (only their row indices, flags, fence and arrival), FP8 window
# blocks are filled as in the default; no_window: the reverse (window blocks unfilled, main blocks as in the default);
# half_main: the producer fills only the first half of each FP4 main block's rows (what it would do per CTA if two CTAs
# of a token's two head blocks shared the decode, as FlashMLA's FP8 sparse decode does across a cluster).
# no_q_load: the consumer warpgroups skip their Q copy from global memory (Q_l/Q_r keep whatever they held; the fence
# and the Q barrier stay); no_o_store: they stage O through Q as before but store none of it to global memory. Both
# take one piece out of a CTA's fixed cost (gpu/attn_block_scaling.py --variants); they cut io="staged" with one
# split (wg0_scores), and paired_halves with io="overlapped" (the prefill default's path: the next token's Q copies, and
# O's global store from the P tile).
ABLATIONS = (
    "producer_idle",
    "consumers_idle",
    "no_softmax",
    "no_dequant",
    "uncoupled",
    "no_loads",
    "no_fence",
    "no_stores",
    "stores_only",
    "skeleton",
    "no_window",
    "half_main",
    "no_q_load",
    "no_o_store",
    "stagger",
)
# the ones that change warpgroups 0 and 1, and of those the ones that cut the staged Q load or O store (one split only)
# or, stagger, shift the token boundaries of every other CTA
_CONSUMER_ABLATIONS = ("consumers_idle", "no_softmax", "uncoupled", "no_q_load", "no_o_store", "stagger")
_EDGE_ABLATIONS = ("no_q_load", "no_o_store", "stagger")
# stagger: the first wave's odd CTAs (one per SM of the H200's 132) spin this many cycles before they start, about half
# a prefill token (~11 us at ~1.75 GHz), so that their token boundaries (each token's Q load and O store, 64 KiB each,
# from every SM at once) fall between the even CTAs'. Each SM runs one CTA at a time, so the CTAs that follow on an SM
# inherit the offset. Measured slower (session 24): the fixed cost per token is not the SMs' coinciding bursts.
STAGGER_CYCLES = 20000
STAGGER_CTAS = 132
_STAGGER_CUDA = r"""
__device__ __forceinline__ void csa2_spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
"""
# The parts of the FP4 producer's work each of its ablations leaves out (half_main and producer_idle change which
# passes or blocks it fills instead): "loads" (the packed words and scale bytes are made from the row index), "decode"
# (one value per word from its bits), "stores" (no decoded row written), "main" / "window" (those blocks not filled at
# all), "fence" (no proxy fence before the arrival).
_PRODUCER_CUTS = {
    "no_loads": frozenset({"loads"}),
    "no_dequant": frozenset({"decode"}),
    "stores_only": frozenset({"loads", "decode"}),
    "no_stores": frozenset({"stores"}),
    "skeleton": frozenset({"main"}),
    "no_window": frozenset({"window"}),
    "no_fence": frozenset({"fence"}),
}


def timing_ablation(tile: "SparseAttnTile", shape: Shape, arch: Arch, ablate: str, override: Config | None = None) -> "CompiledAttention":
    """The tile's default for ``shape`` (``override`` over it) as the kernel the ablations cut into (the gathering
    producer, one token per CTA with staged Q/O: io="auto" and kv_staging pinned so; an io named in ``override``
    stays, e.g. paired_halves with io="overlapped" for no_q_load and no_o_store) with the timing ablation
    ``ablate`` (see ABLATIONS; "" for that kernel as it is). Built directly, never cached or proposed by the tuner;
    what gpu/attn_ablation.py and gpu/attn_block_scaling.py time."""
    cfg = tile.with_defaults(arch, override or {})
    if cfg.get("io") == "auto":
        cfg["io"] = "staged"
    if "kv_staging" in cfg:
        cfg["kv_staging"] = "gather"
    cfg = tile.resolve_call(cfg, shape, arch)
    return CompiledAttention(shape["H"], shape["D"], shape["W"], shape["K"], _DEFAULT_SCALE, tile.kv_format, cfg, arch, ablate=ablate)


def _cuts(dims, part: str) -> bool:
    """True when the producer's ablation (``dims.ablate``) leaves ``part`` of its work out (see _PRODUCER_CUTS)."""
    return part in _PRODUCER_CUTS.get(dims.ablate, ())


_BLACKWELL = "not built for Blackwell: it wants native block-scaled FP4 MMA (tcgen05), not dequant-to-bf16 for wgmma"


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


KV_STAGINGS = ("gather", "expand", "auto")  # prefill: decode in the producer per read, or expand both caches once
# "auto" expands when the call has at least EXPAND_MIN_TOKENS query tokens and reads every cache row at least
# EXPAND_MIN_READS times on average (rows gathered over rows expanded). From the H200 runs of B=1 prompts with
# unused_rows="zeros" (results/sm90/sparse_attn_unused_rows_zeros_session18.json): expand faster at 512, 1024, 2048 and
# 4096 tokens (0.109 vs 0.136, 0.210 vs 0.264, 0.406 vs 0.520, 0.767 vs 1.008 ms); with every slot used (the same
# copies as zeros) at 512 tokens over 32K entries, 9.8 reads per row, 0.115 vs 0.137 ms
# (sparse_attn_kv_staging_full_lists_session18.json). Fewer reads per row, or fewer tokens, are not measured.
EXPAND_MIN_TOKENS = 512
EXPAND_MIN_READS = 8


def resolve_kv_staging(kv_staging: str, dims: Mapping[str, int]) -> str:
    """``kv_staging`` for one call of ``dims`` (a Shape or its dims: B, S, W, K, Nw, Nc): "auto" -> "expand" when the
    call has B * S >= EXPAND_MIN_TOKENS tokens whose W + K gathered rows read every row of the two caches
    (B * (Nw + Nc)) at least EXPAND_MIN_READS times on average, else "gather"."""
    if kv_staging != "auto":
        return kv_staging
    return "expand" if dims["B"] * dims["S"] >= EXPAND_MIN_TOKENS and _rereads_rows(dims) else "gather"


def _rereads_rows(dims: Mapping[str, int]) -> bool:
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
# against 1.895 + 3.27 (24.3 / 22.2; 0.12 x 22.2) (results/sm90/attn_block_scaling_bf16_*_session2{0,1,2}*.json).
# What the rule reproduces, H200 (results/sm90/attn_prefill_lengths_*_session2{1,2}*.json, every config checked first):
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
#   winner of sessions 20-21; sparse_attn_run_default_ovl2_halves_ovl2_session22.json).


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
    rows = _kernel_rows(kv_format, config.get("kv_staging", "gather"))
    args = (config["schedule"], config.get("produce", "serial"), config.get("consumers", "wg0_scores"), config.get("wg1_rows", 0))

    blocks = blocks_per_token(dims["W"], dims["K"], config["block_I"])

    def overlaps(tokens: int) -> bool:
        return _overlapped_refusal(*args, tokens, config.get("n_split", 1), config["block_I"], rows, blocks=blocks) is None

    if tpc > 1:
        return ("overlapped" if overlaps(tpc) else "staged"), tpc
    items = dims["B"] * dims["S"] * (dims["H"] // config["heads_per_block"])
    staged = (_io_cost(items, "staged", 1, arch.sm_count), -1, "staged", 1)
    overlapped = [(_io_cost(items, "overlapped", t, arch.sm_count), -t, "overlapped", t) for t in IO_AUTO_TOKENS if overlaps(t)]
    _, _, io, tpc = min([staged, *overlapped])
    return io, tpc


# consumers="auto" (the Hopper default of the prefill and bf16 tiles): paired_halves where io="auto" takes it to
# io=overlapped and the call rereads its KV rows (EXPAND_MIN_READS: a prefill), else wg0_scores. H200, one run per tile,
# every config checked first (results/sm90/attn_prefill_lengths_*_session22.json; ms, prefill tile / bf16 tile, the
# default of then: wg0_scores with io="auto"): 512 tokens 0.0923 / 0.0904 against 0.1004 / 0.0991, 1024 0.1749 / 0.1723
# against 0.1885 / 0.1898, 2048 0.3377 / 0.3377 against 0.3645 / 0.3618, 4096 0.6656-0.6908 / 0.7190 against 0.7099 /
# 0.7178 (the bf16 tile level; another run 0.6806 / 0.6997 against 0.7105 / 0.7176), 16384 2.8064 / 2.8909 against
# 2.9084 / 3.0002. At bf16 decode B=128/S=2 (rows read about once) paired_halves with io=overlapped lost: 0.0632
# against wg0_scores' 0.0585 ms at 2 tokens per CTA in the same run.


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
        and _rereads_rows(dims)
        and resolve_io(resolved, dims, arch, kv_format)[0] == "overlapped"
        and not any(con.check(probe, dims, arch) for con in _constraints(kv_format))
    )
    return probe if halves else {**config, "consumers": "wg0_scores"}


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


def blocks_per_token(window: int, topk: int, block_I: int) -> int:
    """KV blocks a token's index lists make: the window's and the top-k's, each rounded up to whole blocks."""
    return -(-window // block_I) + -(-topk // block_I)


def _kernel_rows(kv_format: str, kv_staging: str) -> str:
    """The KV rows the attention kernel reads ("bf16" or "fp4"), ``kv_staging`` resolved: the expansion's are bf16."""
    return "bf16" if kv_format == "bf16" or kv_staging == "expand" else "fp4"


def _halves_edge_cut(ablate: str, consumers: str, io: str) -> bool:
    """True for the timing ablations built into paired_halves with io="overlapped" (the prefill default's path):
    no_q_load and no_o_store cut its next token's Q copies and O's global store."""
    return ablate in _EDGE_ABLATIONS and consumers == "paired_halves" and io == "overlapped"


def _halves_refusal(schedule, produce, tokens_per_cta, rows, ablate="", io="staged") -> str | None:
    """Why ``consumers="paired_halves"`` cannot run (its producer copies bf16 rows half by half, several tokens per CTA
    only with io="overlapped", and no timing ablation hands its half barriers over), or None. ``rows``: the kernel's
    row format (_kernel_rows)."""
    cut = ablate and not _halves_edge_cut(ablate, "paired_halves", io)
    if schedule != "ws" or produce != "batched" or rows != "bf16" or cut or (int(tokens_per_cta) != 1 and io != "overlapped"):
        return (
            "consumers=paired_halves hands bf16 KV rows over in halves: schedule=ws, produce=batched, bf16 KV or "
            "kv_staging=expand, no timing ablation but no_q_load/no_o_store with io=overlapped, tokens_per_cta=1 "
            "unless io=overlapped"
        )
    return None


def _overlapped_refusal(
    schedule, produce, consumers, wg1_rows, tokens_per_cta, n_split, block_I, rows, ablate="", blocks=None
) -> str | None:
    """Why ``io="overlapped"`` cannot be built with these choices (``n_split`` resolved or "auto"; ``rows``: the
    kernel's KV rows, "bf16" or "fp4"; ``blocks``: the blocks per token, None when not known here), or None."""
    cut = ablate and not _halves_edge_cut(ablate, consumers, "overlapped")
    if schedule != "ws" or produce != "batched" or consumers not in ("wg0_scores", "paired_halves") or int(wg1_rows) or cut:
        return (
            "io=overlapped is built into the ws kernel's wg0_scores and paired_halves consumers: schedule=ws, "
            "produce=batched, consumers=wg0_scores or paired_halves, wg1_rows=0, no timing ablation (paired_halves: "
            "but no_q_load or no_o_store)"
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


def _bf16_partials_refusal(c: Config, kv_format: str) -> str | None:
    """Why partials="bf16" cannot run with config ``c``, or None (either KV format)."""
    # consumers="auto" is wg0_scores wherever there are splits (its paired_halves runs io=overlapped: one split)
    consumers = c.get("consumers", "wg0_scores")
    if c["schedule"] != "ws" or consumers not in ("wg0_scores", "auto") or c.get("combine", "separate") != "separate":
        return "partials=bf16 is built into the ws kernel's wg0_scores consumers with the separate combine"
    return None


def _bf16_copy_refusal(c: Config, kv_format: str) -> str | None:
    """Why unused_rows="zeros" cannot run with config ``c``, or None. It concerns bf16 rows: bf16 KV, or FP4 KV under
    kv_staging "expand" or "auto" (which may expand); the FP4/FP8 rows the producer decodes have their own path, where
    the key does not apply."""
    bf16_rows = kv_format == "bf16" or c.get("kv_staging", "gather") != "gather"
    if bf16_rows and (c["schedule"] != "ws" or c.get("produce", "serial") != "batched"):
        return "unused_rows=zeros is the ws batched producer's cp.async of bf16 rows: schedule=ws, produce=batched"
    return None


def _prmt_decode_refusal(c: Config, kv_format: str) -> str | None:
    """Why fp4_decode="prmt" cannot run with config ``c``, or None."""
    if kv_format != "fp4" or c["schedule"] != "ws" or c.get("produce", "serial") not in ("batched", "prefetch"):
        return (
            "fp4_decode=prmt is the ws batched producer's packed FP4 main-KV dequant: FP4 main KV, schedule=ws, "
            "produce=batched or prefetch (bf16 KV has nothing to decode; the other paths decode per value)"
        )
    return None


# (key, its Hopper default built for one path only, the choice every path has, why the default cannot run with a config)
_NARROW_DEFAULTS = (
    ("fp4_decode", "prmt", "fma", _prmt_decode_refusal),  # the ws batched producer's packed word decode
    ("partials", "bf16", "fp32", _bf16_partials_refusal),  # the ws wg0_scores consumers' split epilogue
    ("unused_rows", "zeros", "row0", _bf16_copy_refusal),  # the ws batched producer's bf16 cp.async
)


def _constraints(kv_format: str) -> tuple[Constraint, ...]:
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
            rows = _kernel_rows(kv_format, resolve_kv_staging(c.get("kv_staging", "gather"), s))
            args = (c["schedule"], c.get("produce", "serial"), c.get("consumers", "wg0_scores"), c.get("wg1_rows", 0))
            blocks = blocks_per_token(s["W"], s["K"], c["block_I"])
            if why := _overlapped_refusal(*args, c.get("tokens_per_cta", 1), n_split, c["block_I"], rows, blocks=blocks):
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
        if c.get("fp4_decode", "fma") != "fma" and (why := _prmt_decode_refusal(c, kv_format)):
            return why
        expands = resolve_kv_staging(c.get("kv_staging", "gather"), s) == "expand"
        if c.get("consumers", "wg0_scores") == "paired_halves":
            rows = _kernel_rows(kv_format, "expand" if expands else "gather")
            io = c.get("io", "direct")
            if io == "auto":  # resolved as per call: kv_staging first (the rows), then io
                io = resolve_io({**c, "kv_staging": "expand" if expands else "gather"}, s, a, kv_format)[0]
            if why := _halves_refusal(c["schedule"], c.get("produce", "serial"), c.get("tokens_per_cta", 1), rows, io=io):
                return why
        fp4_rows = c.get("produce", "serial") == "prefetch" or int(c.get("wg1_rows", 0)) or c.get("dequant", "direct") != "direct"
        if c.get("unused_rows", "row0") != "row0" and (why := _bf16_copy_refusal(c, kv_format)):
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
        if c.get("partials", "fp32") == "bf16" and (why := _bf16_partials_refusal(c, kv_format)):
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


class SparseAttnTile(Tile):
    """Shared machinery of the three sparse attention tiles (they differ in shapes, KV format and split)."""

    kv_format = "fp4"
    phase = "decode"
    splits = True
    unsupported: ClassVar[dict[str, str]] = {"sm100": _BLACKWELL, "sm120": _BLACKWELL}

    def shapes(self) -> list[Shape]:
        return [s for s in attention_shapes() if self.phase == "any" or s.phase == self.phase]

    def search_space(self, arch: Arch) -> SearchSpace:
        params = [
            Param(
                "schedule", ("pipelined", "ws"), "all threads gather+dequant then compute, or a producer warpgroup feeding two consumers"
            ),
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
        if self.kv_format == "fp4":
            params.append(
                Param(
                    "dequant", ("direct", "staged"), "global bytes -> registers -> bf16 smem, or raw bytes -> smem (cp.async) -> bf16 smem"
                )
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
        if self.kv_format == "fp4" and not self.splits:
            params.append(
                Param(
                    "kv_staging",
                    KV_STAGINGS,
                    "prefill: the producer decodes each FP4/FP8 row every time a token reads it, or one launch first "
                    "expands both caches to bf16 (each row once; fp4_decode picks its FP4 decode) and the bf16 kernel "
                    "gathers them; auto expands from EXPAND_MIN_TOKENS tokens reading each row EXPAND_MIN_READS times or more",
                )
            )
        if self.kv_format == "bf16" or not self.splits:
            params.append(
                Param(
                    "unused_rows",
                    UNUSED_ROWS,
                    "bf16 rows (the bf16 tile, the prefill tile's expand), ws batched producer: an unused slot (-1) "
                    "copies row 0 by cp.async, or its cp.async reads nothing and zero-fills",
                )
            )
        if self.splits:
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
        return SearchSpace(tuple(params), _constraints(self.kv_format))

    def default_config(self, arch: Arch) -> Config:
        if arch.family == "hopper":
            # FlashMLA's decode design, TileLang's sparse_mla_fwd_pipelined: a producer warpgroup gathers and
            # dequantises into two KV buffers while two consumer warpgroups run the GEMMs and the softmax.
            cfg: Config = {"schedule": "ws", "produce": "batched", "block_I": 64, "num_stages": 2, "threads": 256, "heads_per_block": 64}
        elif arch.smem_per_block >= 160 * 1024:  # A100: the Hopper tiles, single-buffered to fit 163 KiB
            cfg = {"schedule": "pipelined", "block_I": 64, "num_stages": 1, "threads": 256, "heads_per_block": 64}
        else:  # sm86/sm89: 99 KiB per block
            cfg = {"schedule": "pipelined", "block_I": 32, "num_stages": 1, "threads": 128, "heads_per_block": 32}
        cfg.setdefault("produce", "serial")
        cfg["consumers"] = "wg0_scores"
        cfg["tokens_per_cta"] = 1
        cfg["handoff"] = "after_pv"
        cfg["lanes"] = "row"
        # staged Q/O on Hopper: prefill 2.58 -> 1.03 ms, decode B=128/S=2 0.203 -> 0.075 ms (sparse_attn_run5_io_staged.json);
        # the prefill and bf16 tiles: overlapped per call where it applies (io="auto", see IO_AUTO_TOKENS)
        cfg["io"] = "staged" if cfg["schedule"] == "ws" else "direct"
        if cfg["schedule"] == "ws" and (not self.splits or self.kv_format == "bf16"):
            cfg["io"] = "auto"
            # ... and there FlashMLA's paired consumers with the buffers handed over in halves where io=auto overlaps a
            # prefill's tokens (consumers="auto", see resolve_consumers): prefill 4K 0.6806 against 0.7105 ms, 1K
            # 0.1749 against 0.1885 (sparse_attn_run_default_halves*_session22.json, attn_prefill_lengths_*_session22.json)
            cfg["consumers"] = "auto"
        # register-usage level 10, as TileLang's sparse_mla_fwd_pipelined: on the H200 decode 4% faster, prefill level
        # (results/sm90/sparse_attn_run4_regs10.json)
        cfg["ptxas_level"] = 10 if arch.family == "hopper" else 0
        if self.kv_format == "fp4":
            cfg["dequant"] = "direct"
            cfg["wg1_rows"] = 0
            # Hopper: the producer decodes packed FP4 words by byte-permute lookups of the E2M1 bf16 patterns (the same
            # bits), H200, one run against fma (results/sm90/sparse_attn_run14_fp4_prmt.json): prefill 4K 1.0247 ->
            # 1.0081 ms, decode B=128/S=2 0.0775 -> 0.0765 ms, B=64/S=1 0.0326 -> 0.0315 ms.
            cfg["fp4_decode"] = "prmt" if cfg["schedule"] == "ws" else "fma"
            if not self.splits:
                cfg["unused_rows"] = _UNUSED_ROWS_DEFAULT if cfg["schedule"] == "ws" else "row0"
                # Hopper prefill: both caches expanded to bf16 once for long prompts that reread their rows (auto; short
                # ones gather, see EXPAND_MIN_TOKENS), H200, one run against gather
                # (results/sm90/sparse_attn_kv_staging_session18.json): 4K 1.0195 -> 0.8290 ms, 16K 3.954 -> 3.093,
                # 64K 15.83 -> 12.74 (the expansion 4 / 13 / 54 us of it). Elsewhere not yet run on a GPU.
                cfg["kv_staging"] = "auto" if arch.family == "hopper" else "gather"
        if self.kv_format == "bf16":
            cfg["unused_rows"] = _UNUSED_ROWS_DEFAULT if cfg["schedule"] == "ws" else "row0"
        if self.splits:
            cfg["n_split"] = "auto" if self.phase != "prefill" else 1
            cfg["combine"] = "separate"  # "fused" measured slower on the H200 (notes/sparse_attn.md, session 5)
            # Hopper: bf16 split partials, H200, one run against fp32 (results/sm90/sparse_attn_run16_bf16_partials.json):
            # decode B=64/S=1 0.0313 -> 0.0273 ms (bf16 KV 0.0291 -> 0.0254), rel L2 2.0e-3 -> 2.5e-3 (bound 1e-2).
            cfg["partials"] = "bf16" if cfg["schedule"] == "ws" else "fp32"
        return cfg

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. The ws-only choices (``produce``, ``io``, ``consumers``, ...) fall back to the plain ones when
        ``config`` picks another schedule without naming them: {"schedule": "pipelined"} alone is a valid config."""
        cfg = {**self.default_config(arch), **config}
        if cfg["schedule"] != "ws":
            plain_choices = (
                ("produce", "serial"),
                ("io", "direct"),
                ("consumers", "wg0_scores"),
                ("tokens_per_cta", 1),
                ("handoff", "after_pv"),
                ("lanes", "row"),
            )
            for key, plain in plain_choices:
                cfg[key] = config.get(key, plain)
        # Hopper-default choices built for one path only give way, when not named, to the choice every path has:
        # {"produce": "serial"} or {"consumers": "seesaw"} alone is valid.
        for key, narrow, broad, refusal in _NARROW_DEFAULTS:
            if key not in config and cfg.get(key) == narrow and refusal(cfg, self.kv_format):
                cfg[key] = broad
        return cfg

    def build(self, shape: Shape, config: Config, arch: Arch) -> "CompiledAttention | ExpandedAttention":
        reason = self.support_reason(arch)
        if reason:
            raise TileError(f"{self.name} does not support {arch.name}: {reason}")
        cfg = self.resolve_call(self.with_defaults(arch, config), shape, arch)
        return compiled(shape["H"], shape["D"], shape["W"], shape["K"], _DEFAULT_SCALE, self.kv_format, cfg, arch)

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        """The resolved config's key: a config naming "auto" (consumers, io, n_split, kv_staging) and one naming what it
        resolves to at ``shape`` build the same kernels (e.g. the prefill default and paired_halves, io=overlapped,
        8 tokens per CTA at 4K)."""
        cfg = self.resolve_call(self.with_defaults(arch, config), shape, arch)
        if _kernel_rows(self.kv_format, cfg.get("kv_staging", "gather")) != "bf16":
            for key in BF16_ROW_KEYS:  # as CompiledAttention: FP4/FP8 rows decoded by the producer ignore them
                cfg.pop(key, None)
        return canonical_key(cfg)

    def resolve_call(self, config: Config, dims: Mapping[str, int], arch: Arch) -> Config:
        """``config`` (full) with its per-call choices resolved for one call of ``dims`` (a Shape or its dims), in the
        order they depend on each other: ``n_split``, then ``kv_staging``, then ``consumers``, then ``io`` and
        ``tokens_per_cta``."""
        cfg = dict(config)
        if self.splits:
            cfg["n_split"] = resolve_split(cfg["n_split"], dims["B"], dims["S"], dims["H"], cfg["heads_per_block"], arch, cfg["schedule"])
        if "kv_staging" in cfg:
            cfg["kv_staging"] = resolve_kv_staging(cfg["kv_staging"], dims)
        cfg = resolve_consumers(cfg, dims, arch, self.kv_format)
        cfg["io"], cfg["tokens_per_cta"] = resolve_io(cfg, dims, arch, self.kv_format)
        return cfg

    def make_inputs(self, shape: Shape, seed: int, device: str | torch.device = "cuda") -> Inputs:
        return make_attention_inputs(shape, seed, device, self.kv_format)

    def alloc_outputs(self, kernel: CompiledAttention, inputs: Inputs) -> dict[str, torch.Tensor]:
        return {"out": poisoned(inputs["q"].shape, torch.bfloat16, inputs["q"].device)}  # [B, S, H, D]

    def launch(self, kernel: CompiledAttention, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        q, out = inputs["q"], outputs["out"]
        if self.kv_format == "fp4":
            f8 = torch.float8_e4m3fn
            kernel(
                q,
                inputs["window_codes"].view(f8),
                inputs["window_scales"],
                inputs["window_idx"],
                inputs["main_packed"].view(torch.int32),
                inputs["main_scales"].view(f8),
                inputs["topk_idx"],
                inputs["sink"],
                out=out,
            )
        else:
            dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
            kernel(
                q, inputs["window_kv"], dummy, inputs["window_idx"], inputs["main_kv"], dummy, inputs["topk_idx"], inputs["sink"], out=out
            )

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        if self.kv_format == "fp4":
            window_kv = fp8_dequantize(inputs["window_codes"], inputs["window_scales"])
            main_kv = fp4_dequantize(inputs["main_packed"], inputs["main_scales"], 16, "e4m3")
        else:
            window_kv, main_kv = inputs["window_kv"], inputs["main_kv"]
        out = _ref_sparse_attention(
            inputs["q"], window_kv, inputs["window_idx"], main_kv, inputs["topk_idx"], inputs["sink"], _DEFAULT_SCALE
        )
        return {"out": out}

    def compare(self, outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
        return relative_l2(outputs, expected, TOLERANCE)

    def flops(self, shape: Shape) -> float:
        return 4.0 * shape["B"] * shape["S"] * shape["H"] * (shape["W"] + shape["K"]) * shape["D"]

    def bytes_moved(self, shape: Shape) -> float:
        B, S, H, D, W, K = (shape[k] for k in ("B", "S", "H", "D", "W", "K"))
        if self.kv_format == "fp4":
            kv = W * (D + D // 32) + K * (D // 2 + D // 16)
        else:
            kv = (W + K) * D * 2
        return B * S * (2 * H * D * 2 + kv + (W + K) * 4)


class SparseAttnDecode(SparseAttnTile):
    name = "sparse_attn_decode"
    description = "sparse gather attention, FP4 main + FP8 window KV + sink, decode (B <= 128, S = 1 or 2), split-KV"
    phase = "decode"


class SparseAttnPrefill(SparseAttnTile):
    name = "sparse_attn_prefill"
    description = "sparse gather attention, FP4 main + FP8 window KV + sink, prefill (B = 1, S up to 64K)"
    phase = "prefill"
    splits = False

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: the default's paired_halves at 4 tokens per CTA (io=auto takes 8 at 4K), its wg0_scores consumers
        (the default before session 22), several tokens per CTA on the expanded caches (the producer runs into the next
        token), with the next token's Q load and this one's O store off the consumers' path (io=overlapped), the seesaw
        consumers on them (the fastest chain measured alone), the gathering path beside the expanding default (so a
        study times both), and the gathering path's best options (within ~1% of it at prefill 4K before the
        expansion)."""
        if arch.family != "hopper":
            return []
        gather = {"kv_staging": "gather"}
        return [
            (
                {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4},
                "prefill 4K 0.6656 against 8 per CTA's 0.6908 ms in one run (attn_prefill_lengths_prefill_session22.json)",
            ),
            (
                {"consumers": "wg0_scores"},
                "the default before session 22: prefill 4K 0.7099 against paired_halves' 0.6656-0.6908 ms in one run",
            ),
            (
                {"io": "overlapped", "tokens_per_cta": 4},
                (
                    "prefill 4K (expanded) 0.7201 against 0.7211 ms with 8 tokens per CTA (what io=auto picks there) in one "
                    "run (sparse_attn_overlapped_session20.json)"
                ),
            ),
            (
                {"io": "staged", "tokens_per_cta": 4},
                (
                    "the expanded prefill 4K 0.7605 against the default's 0.7768 ms (sparse_attn_io_prefetched_session19.json), "
                    "763.7 against 766.7 us in session 19's tuning run"
                ),
            ),
            (
                {"kv_staging": "expand", "consumers": "seesaw"},
                (
                    "on bf16 KV at prefill 4K with zero-filled unused rows 0.8350 ms against the default's 0.7840 with the "
                    "producer, 0.6859 against 0.7405 with the consumers alone (attn_ablation_session19_bf16*.json)"
                ),
            ),
            (gather, "prefill 4K 1.0195 ms against expand's 0.8290 (sparse_attn_kv_staging_session18.json)"),
            ({**gather, "produce": "prefetch"}, "gathering: prefill 4K 1.01x in the session-5 tuning run (H200)"),
            (
                {**gather, "lanes": "column", "handoff": "before_pv"},
                "gathering: prefill 4K 1.010 vs 1.021 ms (sparse_attn_run12_lanes_column.json)",
            ),
        ]


class SparseAttnBf16(SparseAttnTile):
    name = "sparse_attn_bf16"
    description = "sparse gather attention with bf16 KV (window + main) and sink, decode and prefill"
    kv_format = "bf16"
    phase = "any"

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: handing P over before warpgroup 0's own P V won at bf16 decode B=128/S=2 on the H200; one CTA per
        sequence (tokens_per_cta) won there in one run and came even or lost in others; with the Q load and O store
        off the consumers' path (io=overlapped) it won at decode and prefill in one run; the paired consumers with each
        buffer handed over in halves won at decode B=128/S=2 in two runs."""
        if arch.family != "hopper":
            return []
        overlapped = "{} {} against io=staged's {} ms in one run (sparse_attn_overlapped_session20.json)"
        halves = (
            {"consumers": "paired_halves", "io": "staged"},  # io=auto would overlap 2 tokens per CTA: 0.0632 ms
            "bf16 decode B=128/S=2 0.0606 vs the default's 0.0633 and 0.0634 ms in two runs (sparse_attn_paired_halves*_session21.json)",
        )
        if shape.phase != "decode":  # io=auto picks 8 tokens per CTA at prefill 4K: 0.7406 ms in that run
            return [
                ({"io": "overlapped", "tokens_per_cta": 4, "n_split": 1}, overlapped.format("bf16 prefill 4K", "0.7517", "0.7739")),
                (
                    {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4, "n_split": 1},
                    (
                        "bf16 prefill 4K 0.7239 against 8 per CTA's 0.7190 ms, 0.7013 against 0.6997 in another run; 4 per CTA "
                        "was 3.8% faster in the FP4 tile (attn_prefill_lengths_*_session22.json)"
                    ),
                ),
                (
                    {"consumers": "wg0_scores"},
                    (
                        "the default before session 22: bf16 prefill 4K 0.7178 against paired_halves' 0.7190 ms in one run, "
                        "0.7176 against 0.6997 in another"
                    ),
                ),
            ]
        return [
            (
                {"io": "staged"},
                (
                    "the default before session 22 (one token per CTA at decode B=128/S=2): 0.0636 against 2 per CTA's 0.0585 ms "
                    "in one run (sparse_attn_run_default_ovl2_halves_ovl2_session22.json)"
                ),
            ),
            # one wave of 2-token CTAs: what io=auto takes at B=128/S=2 (resolve_io), named for the other decode shapes
            ({"io": "overlapped", "tokens_per_cta": 2, "n_split": 1}, overlapped.format("bf16 decode B=128/S=2", "0.0583", "0.0636")),
            (
                {"io": "staged", "tokens_per_cta": 4},
                (
                    "bf16 decode B=128/S=2 0.0603 vs 0.0637 ms (sparse_attn_io_prefetched_session19.json); tuning runs: "
                    "tokens_per_cta=2 0.0645 against 0.0638 (session 15); the study's best 63.0 us against the default's "
                    "63.3, not this candidate (session 19)"
                ),
            ),
            ({"handoff": "before_pv"}, "bf16 decode B=128/S=2 0.0599 vs 0.0636 ms (sparse_attn_run11_early_handoff.json)"),
            halves,
            (
                {"handoff": "before_pv", "lanes": "column"},
                "bf16 decode B=128/S=2 0.0623 vs 0.0644 ms (sparse_attn_run12_lanes_column.json)",
            ),
        ]


DECODE_TILE, PREFILL_TILE, BF16_TILE = SparseAttnDecode(), SparseAttnPrefill(), SparseAttnBf16()
TILES = [DECODE_TILE, PREFILL_TILE, BF16_TILE]


def make_attention_inputs(shape: Shape, seed: int, device: str | torch.device, kv_format: str = "fp4") -> Inputs:
    """Random inputs shaped like the model's: unit-scale latents, decode windows over the latest ring
    entries and distinct top-k over the context, prefill windows/top-k causal (-1 early on, top-k
    drawn with repeats among the visible entries)."""
    B, S, H, D, W, K, Nw, Nc = (shape[k] for k in ("B", "S", "H", "D", "W", "K", "Nw", "Nc"))
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, device=device).to(torch.bfloat16)  # [B, S, H, D]
    window_kv = torch.randn(B, Nw, D, generator=g, device=device)  # [B, Nw, D]
    main_kv = torch.randn(B, Nc, D, generator=g, device=device)  # [B, Nc, D]
    sink = torch.randn(H, generator=g, device=device)  # [H]
    if shape.phase == "decode":
        # token s sees ring slots s+1 .. s+W in a random order; top-k distinct over the whole context
        order = torch.rand(B, S, W, generator=g, device=device).argsort(dim=-1)
        window_idx = (order + torch.arange(S, device=device).view(1, S, 1) + Nw - W - S + 1).int()  # [B, S, W]
        topk_idx = torch.rand(B * S, Nc, generator=g, device=device).topk(K, dim=-1).indices.sort(dim=-1).values
        topk_idx = topk_idx.view(B, S, K).int()  # [B, S, K]
    else:
        t = torch.arange(S, device=device).view(1, S, 1)
        j = torch.arange(W, device=device).view(1, 1, W)
        window_idx = torch.where(j <= t, t - j, -1).expand(B, S, W).contiguous().int()  # [B, S, W]
        draw = (torch.rand(B, S, K, generator=g, device=device) * (t + 1)).long().clamp(max=Nc - 1)
        draw = torch.where(torch.arange(K, device=device).view(1, 1, K) <= t, draw, -1)
        topk_idx = torch.where(draw >= 0, draw, Nc).sort(dim=-1).values  # -1 slots last, rows sorted
        topk_idx = torch.where(topk_idx >= Nc, -1, topk_idx).int().contiguous()  # [B, S, K]
    inputs: Inputs = {"q": q, "window_idx": window_idx.contiguous(), "topk_idx": topk_idx, "sink": sink}
    if kv_format == "fp4":
        from model.formats import fp4_quantize, fp8_quantize

        inputs["window_codes"], inputs["window_scales"] = fp8_quantize(window_kv)  # [B, Nw, D], [B, Nw, D/32]
        inputs["main_packed"], inputs["main_scales"] = fp4_quantize(main_kv, 16, "e4m3")  # [B, Nc, D/2], [B, Nc, D/16]
    else:
        inputs["window_kv"] = window_kv.to(torch.bfloat16)
        inputs["main_kv"] = main_kv.to(torch.bfloat16)
    return inputs
