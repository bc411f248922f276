"""The index-K projection 512 -> 128 in tf32x3 (TF32 high parts plus fp32 remainders, three tensor-core products):
the operand split, and the CUDA of the register and wgmma variants."""

import tilelang.language as T
import torch

from tiles.compressor.common import DI, D


@T.macro
def split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g: int, k_chunk: int):
    """Columns ``kc * k_chunk ..`` of ``rot_s`` [block_g, *] -> TF32 high part + fp32 remainder (exact split).

    Used for the latent and (``wk="fp32"``) for the staged Wk chunk [128, k_chunk]: the same bits as :func:`split_tf32`.
    """
    for i, kk in T.Parallel(block_g, k_chunk):
        x = rot_s[i, kc * k_chunk + kk]
        xh = T.reinterpret(T.reinterpret(x, "uint32") & T.uint32(0xFFFFE000), "float32")
        a_hi[i, kk] = xh
        a_lo[i, kk] = x - xh


ROT_PAD = 4  # proj_operands=registers: rot_s row stride 516 words, so a warp's fragment reads hit 32 distinct banks
PROJ_WARPS = 8  # proj_operands=registers: each warp owns 16 of the 128 output columns, all block_g rows

# proj_operands="registers": the index-K projection with every operand in registers. Warp w computes columns
# [16w, 16w + 16) for all block_g rows (MT = block_g / 16 m-tiles): per 16-wide k chunk it reads its latent words from
# rot_s (row stride RS = 516: the 8 rows x 4 columns of a fragment read sit in 32 distinct banks) and its Wk words from
# global memory (L2) as two float4s per thread, in the order of wk_fragment_order (host), two chunks ahead; each word is
# split into its TF32 high part and fp32 remainder once per warp (the split of split_tf32_tile, bit for bit), and the
# three products run in T.gemm's order per output tile (lo*hi, hi*lo, hi*hi, each k step 0 then 1), with the PTX
# fragment layout T.gemm's ldmatrix loads give: the same accumulator bits. No shared staging, no barrier, no cp.async.
PROJ_REGS_CUDA = r"""
__device__ __forceinline__ void csa2_split_tf32(float x, unsigned& hi, unsigned& lo) {
  const unsigned h = __float_as_uint(x) & 0xFFFFE000u;
  hi = h;
  lo = __float_as_uint(x - __uint_as_float(h));
}
__device__ __forceinline__ void csa2_mma_tf32(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// rot: fp32 [MT * 16, RS] shared; wkf: Wk [128, 512] fp32 in fragment order (global); out: fp32 [MT * 16, 128] shared.
template <int MT, int RS>
__device__ __forceinline__ void csa2_proj_tf32x3_regs(const float* rot, const float* __restrict__ wkf, float* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float acc[MT][2][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
  // Chunk c of this warp: 32 lanes x 8 words at float4 (warp * 32 + c) * 64 + lane * 2; word j = n * 4 + ks * 2 + h
  // is Wk[16 warp + 8 n + g, 16 c + 8 ks + 4 h + t].
  const float4* wp = reinterpret_cast<const float4*>(wkf) + warp * 32 * 64 + lane * 2;
  float4 raw[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    raw[s][0] = __ldg(wp + s * 64);
    raw[s][1] = __ldg(wp + s * 64 + 1);
  }
  const float* arow = rot + g * RS + t;
#pragma unroll 1
  for (int kc = 0; kc < 32; kc += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = kc + s;
      unsigned bh[2][2][2], bl[2][2][2];  // [n][ks][h]
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float w[4] = {raw[s][n].x, raw[s][n].y, raw[s][n].z, raw[s][n].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) csa2_split_tf32(w[j], bh[n][j >> 1][j & 1], bl[n][j >> 1][j & 1]);
      }
      // Two chunks ahead (the last two wrap to chunks 0 and 1: valid addresses, values unused).
      const int nc = (c + 2) & 31;
      raw[s][0] = __ldg(wp + nc * 64);
      raw[s][1] = __ldg(wp + nc * 64 + 1);
      unsigned ah[MT][2][4], al[MT][2][4];  // [m][ks][a0..a3]: (g, k), (g + 8, k), (g, k + 4), (g + 8, k + 4)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            csa2_split_tf32(arow[(m * 16 + (e & 1) * 8) * RS + c * 16 + ks * 8 + (e >> 1) * 4], ah[m][ks][e], al[m][ks][e]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], al[m][ks], bh[n][ks][0], bh[n][ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], ah[m][ks], bl[n][ks][0], bl[n][ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], ah[m][ks], bh[n][ks][0], bh[n][ks][1]);
    }
  }
  // Accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16 x 8 tile.
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float* o = out + (m * 16 + g) * 128 + warp * 16 + n * 8 + t * 2;
      *reinterpret_cast<float2*>(o) = make_float2(acc[m][n][0], acc[m][n][1]);
      *reinterpret_cast<float2*>(o + 8 * 128) = make_float2(acc[m][n][2], acc[m][n][3]);
    }
}
"""


def split_accumulator_cuda() -> str:
    """``proj_accumulators="split"``: :data:`PROJ_REGS_CUDA` as ``csa2_proj_tf32x3_regs_split``, with the two small
    products (lo*hi, hi*lo) accumulated apart from hi*hi and added at the end. Each output tile then has two independent
    MMA chains instead of one (at block_g 16 a warp has only two tiles: six dependent MMAs per tile and chunk); the sum
    is in another order than T.gemm's, so the index keys may differ from the shared accumulator's in the last bits."""
    # the helpers (csa2_split_tf32, csa2_mma_tf32) come once, from PROJ_REGS_CUDA: only the function is derived
    src = PROJ_REGS_CUDA[PROJ_REGS_CUDA.index("// rot: fp32") :]
    src = src.replace("void csa2_proj_tf32x3_regs(", "void csa2_proj_tf32x3_regs_split(")
    replacements = (
        ("  float acc[MT][2][4];\n", "  float acc[MT][2][4], acc_s[MT][2][4];\n"),
        (
            "      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;",
            "      for (int e = 0; e < 4; ++e) acc[m][n][e] = acc_s[m][n][e] = 0.0f;",
        ),
        ("csa2_mma_tf32(acc[m][n], al[m][ks]", "csa2_mma_tf32(acc_s[m][n], al[m][ks]"),
        ("csa2_mma_tf32(acc[m][n], ah[m][ks], bl[n]", "csa2_mma_tf32(acc_s[m][n], ah[m][ks], bl[n]"),
        ("make_float2(acc[m][n][0], acc[m][n][1])", "make_float2(acc[m][n][0] + acc_s[m][n][0], acc[m][n][1] + acc_s[m][n][1])"),
        ("make_float2(acc[m][n][2], acc[m][n][3])", "make_float2(acc[m][n][2] + acc_s[m][n][2], acc[m][n][3] + acc_s[m][n][3])"),
    )
    for old, new in replacements:
        if src.count(old) != 1:  # the shared template changed under this derivation
            raise RuntimeError(f"PROJ_REGS_CUDA no longer has exactly one {old.strip()!r}: update split_accumulator_cuda")
        src = src.replace(old, new)
    return src


# proj_k_split=2: the register projection with the 512-long K split between two halves of the CTA. Warp w covers the K
# half kh = w / 4 (chunks [16 kh, 16 kh + 16)) and the output columns [32 cg, 32 cg + 32), cg = w % 4 (four n tiles), so
# it reads and splits only its half of the latent: 128 instead of 256 latent LDS and splits per warp (Nsight on the
# H200, 6a0ff60: the projection is 58% of the default's stall samples and 52% of its shared-memory wavefronts, every
# warp reading the whole latent). Its Wk words are wk_fragment_order(Wk, 32): per chunk a lane reads four float4s (n
# tiles 0-3), issued one chunk ahead, each n tile's float4 reloaded as soon as it is split. The halves meet in `out`:
# half 1 stores its sums, a barrier, half 0 adds its own to them (a fixed order: two runs give the same bits). The same
# three products per tile in the shared template's order; the K halves are summed apart, so the index keys may differ in
# the last bits.
# Measured (H200, 45064e7): slower at three CTAs of 16 (ratio 2 at 64K 0.1443 -> 0.1664 ms; Nsight: its warps wait on
# the Wk loads, one chunk ahead is not enough, and L1 throughput rose 68 -> 83%), faster at two CTAs of 32 (ratio 2
# 0.1418 ms, ratio 1 0.2147 ms, against the default's 0.1443 / 0.2292): a tuning candidate there, not a default.
PROJ_REGS_K2_CUDA = r"""
template <int MT, int RS>
__device__ __forceinline__ void csa2_proj_tf32x3_regs_k2(const float* rot, const float* __restrict__ wkf, float* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, kh = warp >> 2, cg = warp & 3;
  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
  // Chunk c of column group cg: 32 lanes x 16 words at float4 (cg * 32 + c) * 128 + lane * 4 + n; word ks * 2 + h of
  // float4 n is Wk[32 cg + 8 n + g, 16 c + 8 ks + 4 h + t].
  const float4* wp = reinterpret_cast<const float4*>(wkf) + cg * 32 * 128 + lane * 4;
  const int c0 = kh * 16;
  float4 raw[4];
#pragma unroll
  for (int n = 0; n < 4; ++n) raw[n] = __ldg(wp + c0 * 128 + n);
  const float* arow = rot + g * RS + t;
#pragma unroll 1
  for (int c = c0; c < c0 + 16; ++c) {
    unsigned ah[MT][2][4], al[MT][2][4];  // [m][ks][a0..a3]: (g, k), (g + 8, k), (g, k + 4), (g + 8, k + 4)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          csa2_split_tf32(arow[(m * 16 + (e & 1) * 8) * RS + c * 16 + ks * 8 + (e >> 1) * 4], ah[m][ks][e], al[m][ks][e]);
    const int nc = c + 1 < c0 + 16 ? c + 1 : c0;  // the next chunk (the last wraps: a valid address, its value unused)
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      unsigned bh[2][2], bl[2][2];  // [ks][h]
      const float w[4] = {raw[n].x, raw[n].y, raw[n].z, raw[n].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) csa2_split_tf32(w[j], bh[j >> 1][j & 1], bl[j >> 1][j & 1]);
      raw[n] = __ldg(wp + nc * 128 + n);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], al[m][ks], bh[ks][0], bh[ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], ah[m][ks], bl[ks][0], bl[ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], ah[m][ks], bh[ks][0], bh[ks][1]);
    }
  }
  // Accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16 x 8 tile; K half 1 first, then half 0 adds.
#pragma unroll
  for (int half = 1; half >= 0; --half) {
    if (kh == half) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          float2* o = reinterpret_cast<float2*>(out + (m * 16 + g) * 128 + cg * 32 + n * 8 + t * 2);
          float2* o8 = reinterpret_cast<float2*>(out + (m * 16 + g + 8) * 128 + cg * 32 + n * 8 + t * 2);
          float2 v = make_float2(acc[m][n][0], acc[m][n][1]), v8 = make_float2(acc[m][n][2], acc[m][n][3]);
          if (half == 0) {
            const float2 p = *o, p8 = *o8;
            v = make_float2(p.x + v.x, p.y + v.y);
            v8 = make_float2(p8.x + v8.x, p8.y + v8.y);
          }
          *o = v;
          *o8 = v8;
        }
    }
    if (half == 1) __syncthreads();
  }
}
"""


# proj_operands="wgmma" (sm_90a, block_g 16): the projection transposed, k^T [128, N] = Wk [128, 512] x latent^T, on
# wgmma m64nNk8 TF32 (N = block_g groups). Warpgroup q computes output columns [64q, 64q + 64); warp w's A fragment is
# Wk rows [16w, 16w + 16), the very words the register projection's warp w reads (wk_fragment_order: a0..a3 of k step
# ks are its words (n 0, h 0), (n 1, h 0), (n 0, h 1), (n 1, h 1), i.e. rows g, g + 8 at columns t, t + 4), split per
# warp as there. The latent is split ONCE per CTA instead of once per warp (8x fewer splits and LDS): its TF32 high part
# overwrites rot_s (read into registers first, a barrier between) and its remainder goes to `lo`, both in wgmma's
# no-swizzle K-major layout (8 x 16-byte core matrices: rows n % 8 16 B apart, the N / 8 row blocks 128 B apart, k
# quads 16 N bytes apart), which the tensor cores read through descriptors. Three wgmmas per k step (Wk lo x hi,
# Wk hi x lo, Wk hi x hi), one commit group per 16-wide chunk, A registers double-buffered so that a chunk's splits and
# loads run under the previous chunk's wgmmas. The result is written to `out` [N, OS] after every warpgroup's wgmmas
# have completed (out may alias lo: a barrier first).
# Measured (H200, 20b10f3): right (index keys equal to the register projection's at 4K), but slower at every shape:
# ratio 2 at 64K 0.1488 -> 0.1650 ms, ratio 1 0.2490 -> 0.2512, decode 0.0124 -> 0.0132. Its loop is 45 instructions a
# chunk instead of ~70, but the kernel is not bound by them: the wgmmas read the latent once per warpgroup and k step
# (1.5K shared wavefronts a CTA, plus the split's 0.5K, against the register projection's 2.3K), and in Nsight the other
# phases' samples grew by more than the projection's shrank.
PROJ_WGMMA_CUDA = r"""
__device__ __forceinline__ unsigned long long csa2_wgmma_desc(const float* smem, int lbo_bytes) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // start address >> 4 | leading (K-direction) byte offset >> 4 << 16 | stride (8-row block) byte offset 128 >> 4 << 32
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo_bytes >> 4) << 16) | ((unsigned long long)(128 >> 4) << 32);
}
template <int N>
__device__ __forceinline__ void csa2_wgmma_tf32(float* d, const unsigned* a, unsigned long long desc);
template <>
__device__ __forceinline__ void csa2_wgmma_tf32<16>(float* d, const unsigned* a, unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));  // p true: D += A B
}
// rot: fp32 [N, RS] shared (in: the latent before RoPE; out: its TF32 high part, wgmma layout); lo: fp32 [N * 512] shared;
// wkf: Wk [128, 512] fp32 in fragment order (global); out: fp32 [N, OS] shared.
template <int N, int RS, int OS>
__device__ __forceinline__ void csa2_proj_tf32x3_wgmma(float* rot, float* lo, const float* __restrict__ wkf, float* out) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // 1. The latent's split, once per CTA. Thread tid's p-th float4 is row n = i % N, k quad i / N (i = p * 256 + tid):
  // eight neighbouring threads read rows n..n+7 of one quad (banks 4n apart at RS = 516) and write one 128-byte core
  // matrix row block: no bank conflicts either way.
  constexpr int PER = N * (512 / 4) / 256;
  float4 v[PER];
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = p * 256 + tid;
    v[p] = *reinterpret_cast<const float4*>(rot + (i % N) * RS + 4 * (i / N));
  }
  __syncthreads();  // every latent word is in registers before its high part overwrites rot
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = p * 256 + tid, n = i % N, off = (((i / N) * (N / 8) + n / 8) * 8 + n % 8) * 4;
    const float x[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
    unsigned h[4], l[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) csa2_split_tf32(x[e], h[e], l[e]);
    *reinterpret_cast<uint4*>(rot + off) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(lo + off) = make_uint4(l[0], l[1], l[2], l[3]);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy stores -> the wgmma (async proxy) reads
  __syncthreads();
  // 2. The wgmmas. Descriptors advance 32 N bytes (two k quads) per k step of 8.
  const unsigned long long d_hi = csa2_wgmma_desc(rot, 16 * N), d_lo = csa2_wgmma_desc(lo, 16 * N);
  float acc[N / 2];
#pragma unroll
  for (int e = 0; e < N / 2; ++e) acc[e] = 0.0f;
  const float4* wp = reinterpret_cast<const float4*>(wkf) + warp * 32 * 64 + lane * 2;
  float4 raw[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    raw[s][0] = __ldg(wp + s * 64);
    raw[s][1] = __ldg(wp + s * 64 + 1);
  }
  unsigned ah[2][2][4], al[2][2][4];  // [buffer][ks][a0..a3]
#pragma unroll 1
  for (int kc = 0; kc < 32; kc += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = kc + s;
      // Buffer s was last read by chunk c - 2's wgmmas: wait until at most chunk c - 1's group is pending.
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      const float w0[4] = {raw[s][0].x, raw[s][0].y, raw[s][0].z, raw[s][0].w};
      const float w1[4] = {raw[s][1].x, raw[s][1].y, raw[s][1].z, raw[s][1].w};
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        csa2_split_tf32(w0[2 * ks], ah[s][ks][0], al[s][ks][0]);      // (g, t)
        csa2_split_tf32(w1[2 * ks], ah[s][ks][1], al[s][ks][1]);      // (g + 8, t)
        csa2_split_tf32(w0[2 * ks + 1], ah[s][ks][2], al[s][ks][2]);  // (g, t + 4)
        csa2_split_tf32(w1[2 * ks + 1], ah[s][ks][3], al[s][ks][3]);  // (g + 8, t + 4)
      }
      const int nc = (c + 2) & 31;  // two chunks ahead (the last two wrap: valid addresses, values unused)
      raw[s][0] = __ldg(wp + nc * 64);
      raw[s][1] = __ldg(wp + nc * 64 + 1);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const unsigned long long step = (unsigned long long)((2 * c + ks) * 2 * N);  // (2c + ks) * 32 N bytes, >> 4
        csa2_wgmma_tf32<N>(acc, al[s][ks], d_hi + step);
        csa2_wgmma_tf32<N>(acc, ah[s][ks], d_lo + step);
        csa2_wgmma_tf32<N>(acc, ah[s][ks], d_hi + step);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int e = 0; e < N / 2; ++e) asm volatile("" : "+f"(acc[e])::"memory");
  __syncthreads();  // both warpgroups' wgmmas have read lo before out (which may alias it) is written
  // Accumulator e = 4j + 2r + b: row (output column) 16 warp + g + 8r, column (group) 8j + 2t + b.
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(8 * j + 2 * t + (e & 1)) * OS + 16 * warp + g + 8 * (e >> 1)] = acc[4 * j + e];
}
"""


def wk_fragment_order(wk: torch.Tensor, columns: int = 16) -> torch.Tensor:
    """fp32 Wk [128, 512] -> the same words [128, 512] in the order ``proj_operands="registers"`` reads them: per column
    group w (``columns`` output columns: 16, or 32 with ``proj_k_split=2``) and k chunk c (16 wide), 32 lanes x
    ``columns / 2`` words, word n * 4 + ks * 2 + h of lane 4g + t being ``Wk[columns w + 8n + g, 16c + 8ks + 4h + t]``
    (``columns / 8`` float4 loads per lane per chunk, a warp reads 1-2 KiB contiguous)."""
    w = wk.float().contiguous().view(DI // columns, columns // 8, 8, D // 16, 2, 2, 4)  # (w, n, g, c, ks, h, t)
    return w.permute(0, 3, 2, 6, 1, 4, 5).contiguous().view(DI, D)  # (w, c, g, t, n, ks, h)


# The fp16 split of the latent, shared by the projection (proj_latent="fp32": each warp splits what it reads) and the main
# pass (proj_latent="f16_split": csa2_store_f16_split, once per value); imported before both.
F16_SPLIT_CUDA = r"""
#include <cuda_fp16.h>
// Two adjacent latent words -> their fp16 high parts and the fp16 roundings of the remainders (lower k in the low half).
__device__ __forceinline__ void csa2_split_f16x2(float2 x, unsigned& hi, unsigned& lo) {
  const __half2 h = __floats2half2_rn(x.x, x.y);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(x.x - hf.x, x.y - hf.y);
  hi = *reinterpret_cast<const unsigned*>(&h);
  lo = *reinterpret_cast<const unsigned*>(&l);
}
// proj_latent="f16_split": latent columns col .. col + 3 of a row of rot_s (fp32 [*, 516]) as fp16 high parts in halves
// [0, 512) of the row and remainders in halves [512, 1024): the row stride of 1032 halves (16 B x 129) keeps
// ldmatrix's eight row reads in distinct 16-byte bank groups.
__device__ __forceinline__ void csa2_store_f16_split(float* row, int col, float x0, float x1, float x2, float x3) {
  unsigned h0, l0, h1, l1;
  csa2_split_f16x2(make_float2(x0, x1), h0, l0);
  csa2_split_f16x2(make_float2(x2, x3), h1, l1);
  unsigned* w = reinterpret_cast<unsigned*>(row);
  *reinterpret_cast<uint2*>(w + col / 2) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(w + 256 + col / 2) = make_uint2(l0, l1);
}
"""

# proj="f16x3" (register projection): the same three-product split in fp16 on m16n8k16, half the MMAs of tf32x3 (a k
# step of 16 instead of 8 for the same issue slot, twice the tensor-core rate) and no Wk splits in the kernel. The latent
# word x becomes hi = f16(x) and lo = f16(x - hi) (round to nearest: 22 significant bits together, against TF32's
# truncated 21); Wk is split on the host once per weight, after scaling by 2^e so that max |Wk| 2^e < 2^14 (the remainders of all but the
# smallest weights then stay normal fp16, not subnormal), and the accumulator is scaled back by 2^-e, exactly, before the store.
# Limits: the latent must stay below 65504 in magnitude (a normalised row's entries are at most sqrt(512) max |norm_w|,
# so max |norm_w| < 2896); a latent entry below 2^-3 loses the relative precision of its remainder (absolute error
# <= 2^-25). An emulation at 64K groups (f16x3 vs tf32x3 vs fp64, 515fa4d) gives a relative error of 7.6e-8 against
# tf32x3's 3.5e-7 and the same index-code differences.
# Fragments: a0 = latent (g, 2t..2t+1), a1 = (g + 8, ..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..) of the 16 x 16 tile
# (two adjacent fp32 words per register: one float2 read, rot_s rows ROT_PAD_F16X3 words past 512 so that a half-warp's
# float2 reads hit distinct bank pairs); b0 = Wk[col g, k 2t..2t+1], b1 = Wk[col g, k 2t + 8..]. Per lane, n tile and
# 16-wide chunk one uint4 (hi b0, hi b1, lo b0, lo b1), in the order of wk_fragment_order_f16.
# KH = 1: warp w owns output columns [16w, 16w + 16) over all 32 chunks; KH = 2 (proj_k_split=2): warp w covers the K half
# w / 4 for columns [32 (w % 4), + 32), the halves summed in `out` (half 1 stores, a barrier, half 0 adds). SPLIT
# (proj_accumulators="split"): the two small products in their own accumulator, added at the end.
# PRESPLIT (proj_latent="f16_split"): the latent is already in rot_s as fp16 high parts and remainders
# (csa2_store_f16_split, written by the main pass); each 16 x 16 A tile is two ldmatrix.x4 instead of four float2 reads
# and their splits.
PROJ_F16X3_CUDA = r"""
__device__ __forceinline__ void csa2_ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void csa2_mma_f16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// rot: fp32 [MT * 16, RS] shared (PRESPLIT: each row its fp16 high parts, then its remainders, see csa2_store_f16_split); wkf: wk_fragment_order_f16 (global, read as uint4); unscale: 2^-e (global, first
// word); out: fp32 [MT * 16, 128] shared, or (OVER_ROT, proj_out="rot_s") rot itself: the first 128 words of each row,
// written after a barrier, once every warp has read its latent.
template <int MT, int RS, int KH, bool SPLIT, bool PRESPLIT, bool OVER_ROT = false>
__device__ __forceinline__ void csa2_proj_f16x3_regs(const float* rot, const float* __restrict__ wkf,
                                                     const float* __restrict__ unscale, float* out) {
  constexpr int NT = 2 * KH;   // n tiles of 8 output columns per warp
  constexpr int NC = 32 / KH;  // 16-wide k chunks per warp
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kh = KH == 2 ? warp >> 2 : 0, cg = KH == 2 ? warp & 3 : warp;
  float acc[MT][NT][4], acc_s[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = acc_s[m][n][e] = 0.0f;
  // Chunk c of column group cg: lane's uint4 of n tile n at ((cg * 32 + c) * NT + n) * 32 + lane, so each load
  // instruction reads 512 contiguous bytes a warp (lane-major in n, the order before 0dc5557, put the lanes 16 * NT B
  // apart: each instruction touched twice the sectors it used).
  const uint4* wp = reinterpret_cast<const uint4*>(wkf) + cg * 32 * NT * 32 + lane;
  const int c0 = kh * NC;
  uint4 raw[2][NT];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int n = 0; n < NT; ++n) raw[s][n] = __ldg(wp + ((c0 + s) * NT + n) * 32);
  const float* arow = rot + g * RS + 2 * t;
  // PRESPLIT: this lane's ldmatrix row of an m tile (rows lane % 16, k half lane / 16), bytes in the shared window
  const unsigned a_lane = static_cast<unsigned>(__cvta_generic_to_shared(rot)) + (lane & 15) * RS * 4 + (lane >> 4) * 16;
#pragma unroll 1
  for (int cc = 0; cc < NC; cc += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = c0 + cc + s;
      uint4 b[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) b[n] = raw[s][n];
      const int nc = c0 + (cc + s + 2) % NC;  // two chunks ahead (the last two wrap: valid addresses, values unused)
#pragma unroll
      for (int n = 0; n < NT; ++n) raw[s][n] = __ldg(wp + (nc * NT + n) * 32);
      unsigned ah[MT][4], al[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if constexpr (PRESPLIT) {  // the 16 x 16 tile's four 8 x 8 matrices = a0..a3, high parts then remainders
          csa2_ldmatrix_x4(ah[m], a_lane + m * 64 * RS + 32 * c);
          csa2_ldmatrix_x4(al[m], a_lane + m * 64 * RS + 32 * c + 1024);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            csa2_split_f16x2(*reinterpret_cast<const float2*>(arow + (m * 16 + (e & 1) * 8) * RS + c * 16 + (e >> 1) * 8),
                             ah[m][e], al[m][e]);
        }
      }
      // The small products first, then hi x hi (tf32x3's order).
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(SPLIT ? acc_s[m][n] : acc[m][n], al[m], b[n].x, b[n].y);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(SPLIT ? acc_s[m][n] : acc[m][n], ah[m], b[n].z, b[n].w);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(acc[m][n], ah[m], b[n].x, b[n].y);
    }
  }
  const float u = __ldg(unscale);
  constexpr int OS = OVER_ROT ? RS : 128;  // out's row stride (words)
  if constexpr (OVER_ROT) __syncthreads();
  // Accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16 x 8 tile, times 2^-e (exact).
#pragma unroll
  for (int half = KH - 1; half >= 0; --half) {
    if (kh == half) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          float r[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) r[e] = (SPLIT ? acc[m][n][e] + acc_s[m][n][e] : acc[m][n][e]) * u;
          float2* o = reinterpret_cast<float2*>(out + (m * 16 + g) * OS + cg * 8 * NT + n * 8 + t * 2);
          float2* o8 = reinterpret_cast<float2*>(out + (m * 16 + g + 8) * OS + cg * 8 * NT + n * 8 + t * 2);
          if (half == 0 && KH == 2) {
            const float2 p = *o, p8 = *o8;
            r[0] += p.x;
            r[1] += p.y;
            r[2] += p8.x;
            r[3] += p8.y;
          }
          *o = make_float2(r[0], r[1]);
          *o8 = make_float2(r[2], r[3]);
        }
    }
    if (half == 1) __syncthreads();
  }
}
"""

# proj_pipeline="deep" (proj_latent="f16_split", proj_k_split=1): csa2_proj_f16x3_regs's MMAs in the same order on the
# same operands, scheduled further ahead. Nsight of the two-CTA ratio-2 winner (H200, 887c37c): the first HMMA of each
# chunk held 11% of the kernel's stall samples, waiting on the Wk fragments (loaded two chunks ahead, then copied into
# the MMA registers: 16 moves an iteration) and on the ldmatrix of its own chunk. Here chunk c's Wk fragments are loaded
# four chunks ahead into a ring the MMAs read in place (no copies), and its latent fragments by ldmatrix one chunk ahead
# into two alternating buffers. ptxas (sm_90a): 79-102 registers against near's 78-109, no spills at three CTAs per SM
# (the pooling, not the projection, sets the kernel's peak).
PROJ_F16X3_DEEP_CUDA = r"""
template <int MT, int RS, bool SPLIT, bool OVER_ROT = false>
__device__ __forceinline__ void csa2_proj_f16x3_regs_deep(const float* rot, const float* __restrict__ wkf,
                                                          const float* __restrict__ unscale, float* out) {
  constexpr int NT = 2, NC = 32, WKD = 4;  // n tiles per warp, 16-wide k chunks, Wk chunks in flight
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float acc[MT][NT][4], acc_s[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = acc_s[m][n][e] = 0.0f;
  const uint4* wp = reinterpret_cast<const uint4*>(wkf) + warp * 32 * NT * 32 + lane;  // the n-major fragment order
  uint4 raw[WKD][NT];
#pragma unroll
  for (int s = 0; s < WKD; ++s)
#pragma unroll
    for (int n = 0; n < NT; ++n) raw[s][n] = __ldg(wp + (s * NT + n) * 32);
  const unsigned a_lane = static_cast<unsigned>(__cvta_generic_to_shared(rot)) + (lane & 15) * RS * 4 + (lane >> 4) * 16;
  unsigned ah[2][MT][4], al[2][MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    csa2_ldmatrix_x4(ah[0][m], a_lane + m * 64 * RS);
    csa2_ldmatrix_x4(al[0][m], a_lane + m * 64 * RS + 1024);
  }
#pragma unroll 1
  for (int cc = 0; cc < NC; cc += WKD) {
#pragma unroll
    for (int s = 0; s < WKD; ++s) {
      const int c = cc + s, cur = s & 1, nxt = cur ^ 1;
      const int cn = (c + 1) % NC;  // the last chunk's next wraps: a valid address, values unused
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        csa2_ldmatrix_x4(ah[nxt][m], a_lane + m * 64 * RS + 32 * cn);
        csa2_ldmatrix_x4(al[nxt][m], a_lane + m * 64 * RS + 32 * cn + 1024);
      }
      // The small products first, then hi x hi (csa2_proj_f16x3_regs's order).
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(SPLIT ? acc_s[m][n] : acc[m][n], al[cur][m], raw[s][n].x, raw[s][n].y);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(SPLIT ? acc_s[m][n] : acc[m][n], ah[cur][m], raw[s][n].z, raw[s][n].w);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) csa2_mma_f16(acc[m][n], ah[cur][m], raw[s][n].x, raw[s][n].y);
      const int cw = (c + WKD) % NC;  // the last WKD chunks wrap likewise
#pragma unroll
      for (int n = 0; n < NT; ++n) raw[s][n] = __ldg(wp + (cw * NT + n) * 32);
    }
  }
  const float u = __ldg(unscale);
  constexpr int OS = OVER_ROT ? RS : 128;
  if constexpr (OVER_ROT) __syncthreads();
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float r[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) r[e] = (SPLIT ? acc[m][n][e] + acc_s[m][n][e] : acc[m][n][e]) * u;
      *reinterpret_cast<float2*>(out + (m * 16 + g) * OS + warp * 16 + n * 8 + t * 2) = make_float2(r[0], r[1]);
      *reinterpret_cast<float2*>(out + (m * 16 + g + 8) * OS + warp * 16 + n * 8 + t * 2) = make_float2(r[2], r[3]);
    }
}
"""

ROT_PAD_F16X3 = 8  # proj="f16x3": rot_s row stride 520 words, so a half-warp's float2 fragment reads hit 16 distinct bank pairs


def rot_pad(proj: str, proj_latent: str) -> int:
    """Words past 512 in a row of rot_s for the register projections: ROT_PAD_F16X3 where f16x3 reads the fp32 latent as
    float2s, else ROT_PAD (tf32x3's word reads; f16_split's rows of 1032 fp16 halves, 16 B x 129 a row, for ldmatrix)."""
    return ROT_PAD_F16X3 if proj == "f16x3" and proj_latent == "fp32" else ROT_PAD


F16X3_WK_MAX_EXP = 14  # proj="f16x3": Wk is scaled by 2^e with max |Wk| 2^e < 2^14


def wk_fragment_order_f16(wk: torch.Tensor, columns: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 Wk [128, 512] -> (fragments, unscale) for ``proj="f16x3"``, computed on the device without a host sync.

    ``fragments``: fp32-typed [128, 512] holding fp16 pairs: per column group cg (``columns`` output columns: 16, or 32
    with ``proj_k_split=2``), 16-wide k chunk c, n tile n (``columns / 8`` of them) and lane 4g + t, one uint4 (the 32
    lanes of an n tile contiguous: a warp's load instruction reads 512 B in a row), whose words are
    (hi b0, hi b1, lo b0, lo b1): b0 = W[columns cg + 8n + g, 16c + 2t .. + 1], b1 = the same at k + 8, low half first,
    W = Wk 2^e, hi = f16(W), lo = f16(W - hi). ``unscale``: fp32 [128, 512], every word 2^-e (the kernel reads the first).
    e = F16X3_WK_MAX_EXP - the exponent of max |Wk| (frexp's, so max |W| < 2^14); e = 0 for an all-zero Wk.
    """
    w = wk.float().contiguous()
    amax = w.abs().amax()
    exp = torch.where(amax > 0, F16X3_WK_MAX_EXP - torch.frexp(amax).exponent, 0).to(torch.int32)
    scaled = torch.ldexp(w, exp.float())
    hi = scaled.half()
    lo = (scaled - hi.float()).half()
    nt = columns // 8
    parts = torch.stack([hi, lo]).view(2, DI // columns, nt, 8, D // 16, 2, 4, 2)  # (part, cg, n, g, c, j, t, p)
    frags = parts.permute(1, 4, 2, 3, 6, 0, 5, 7).contiguous()  # (cg, c, n, g, t, part, j, p)
    unscale = torch.ldexp(torch.ones(DI, D, device=w.device), -exp.float())
    return frags.view(-1).view(torch.float32).view(DI, D), unscale
