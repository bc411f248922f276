"""Exact top-k of fp32 score rows, sorted by position: a radix select with two global passes.

Same contract as ``tiles.indexer.select_kernel.build_select_kernel``: per row the ``k`` largest values among columns
``< n_valid[r]`` (-inf and NaN never chosen; ties at the k-th value go to the lower positions, the
reference's rule ``model.ops.indexer.topk_positions``), written in ascending position order with -1
fill. One CTA per row (or per row part, see below) runs:

1. **histogram pass** (global): the top ``hist_bits`` bits of each valid entry's order-preserving
   uint32 key into a shared-memory histogram (plain shared atomics; ``agg`` makes lanes with the same
   bin elect one adder, as the indexer's select does, which the H200 sweep found slower: match.any
   costs more than the same-address serialisation it saves). ``loads`` independent coalesced loads
   per thread are in flight before any is used: a pass is latency-bound unless many loads overlap.
2. **one block-wide scan** finds the bin holding the k-th largest key: warp-shuffle suffix sums and a
   single round through shared memory (2 barriers, where a Hillis-Steele scan over the threads costs
   2 x log2(threads)).
3. **compaction pass** (global): every entry in that bin or above goes to shared memory (key and
   position) in position order: warps own contiguous runs of a tile, ballots order the lanes and one
   barrier per tile orders the warps. Their number is known from the histogram, so when it exceeds
   ``cap`` the row simply stays in global memory and the next radix digit is histogrammed there
   (extra L2 passes, never a wrong answer: heavy ties or a crowded bin only cost time).
4. the remaining key bits are resolved by radix passes over the shared candidates only, then one
   ordered pass writes the chosen positions: an entry above the k-th key, or equal to it among the
   first ``k - above`` such entries in position order, lands at ``above_before + min(eq_before, k -
   above)``, which is both the tie rule and the ascending output order, with no sort.

The kernel body is CUDA (``_SELECT_CUDA``, called through ``T.call_extern`` like the histogram
helper of ``tiles.indexer``): TileLang has no ballot/match/ordered-compaction primitives, and the
whole algorithm is warp-synchronous control flow. TileLang builds the launch, the shared-memory
plan and the argument checks.

**Parts**: one CTA per row leaves SMs idle for few long rows (decode: 64 rows of 128K on 132 SMs).
With ``parts`` > 1 the first launch selects ``k`` in each of ``parts`` slices of a row (grid R x
parts) and writes each part's chosen values and global positions to a [R, parts * k] candidate row
(-inf / -1 fill); a second launch selects ``k`` among those and maps the chosen slots back to
positions. Slots are in position order (parts in order, each ascending), so the merge keeps the tie
rule and the output order. No torch ops run between the launches.
"""

# no `from __future__ import annotations`: T.prim_func evaluates the closure's annotations
import functools

import tilelang
import tilelang.language as T
import torch
import tvm

from tiles.core.arch import Arch, cuda_target, device_arch, get_arch
from tiles.core.contract import Config, TileError

# CUDA body of the select. Template parameters: THREADS per CTA, HB histogram bits per radix digit,
# E loads in flight per thread, CAP shared-memory candidate slots, AGG warp-aggregated histogram atomics.
_SELECT_CUDA = r"""
namespace csa2_rs {

// Order-preserving key of an fp32 (larger float -> larger key). -0 is folded into +0 first: the reference
// compares values, and -0 == +0 there, so the tie between them must go by position as well.
__device__ __forceinline__ unsigned key_of(float x) {
  unsigned b = __float_as_uint(x);
  b = (b & 0x7fffffffu) ? b : 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float value_of(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Shared-memory histogram increment. AGG: lanes with the same bin elect a leader that adds the group's
// count (fp32 keys put most of a row in a few bins; same-address shared atomics serialise). Convergent:
// every lane of the warp calls it.
template <bool AGG>
__device__ __forceinline__ void hist_add(int* hist, int bin, bool active) {
  if (AGG) {
    const unsigned voters = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    const unsigned peers = __match_any_sync(voters, bin);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
  } else if (active) {
    atomicAdd(hist + bin, 1);
  }
}

// A row slice in global memory: entries j < n, position j; -inf and NaN are not candidates.
struct GlobalSrc {
  const float* v;
  int n;
  __device__ __forceinline__ float raw(int j) const { return j < n ? v[j] : __int_as_float(0xff800000); }
  __device__ __forceinline__ bool valid(float x) const { return x > __int_as_float(0xff800000); }
  __device__ __forceinline__ int pos(int j) const { return j; }
};

// Candidates compacted into shared memory, in position order.
struct SharedSrc {
  const unsigned* key;
  const int* p;
  int n;
  __device__ __forceinline__ unsigned raw(int j) const { return j < n ? key[j] : 0u; }
  __device__ __forceinline__ int pos(int j) const { return p[j]; }
};

// Tile layout shared by every pass: a tile is THREADS * E entries, warp w owns the contiguous run
// [w * 32 * E, (w + 1) * 32 * E) of it and load e of lane l is entry e * 32 + l of that run: each load
// instruction is one coalesced 128-byte line, and a warp's entries are in position order (e, lane).
template <int THREADS, int E>
__device__ __forceinline__ int tile_index(int base, int e) {
  return base + (threadIdx.x >> 5) * 32 * E + e * 32 + (threadIdx.x & 31);
}

template <int E>
__device__ __forceinline__ void load_keys(const GlobalSrc& s, int base, unsigned* key, bool* ok, int* j, int stride_warp) {
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {  // all E loads issued before any is used
    j[e] = base + stride_warp + e * 32 + (int)(threadIdx.x & 31);
    x[e] = s.raw(j[e]);
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    ok[e] = s.valid(x[e]);
    key[e] = key_of(x[e]);
  }
}

template <int E>
__device__ __forceinline__ void load_keys(const SharedSrc& s, int base, unsigned* key, bool* ok, int* j, int stride_warp) {
#pragma unroll
  for (int e = 0; e < E; ++e) {
    j[e] = base + stride_warp + e * 32 + (int)(threadIdx.x & 31);
    ok[e] = j[e] < s.n;
    key[e] = s.raw(j[e]);
  }
}

// Histogram of digit (key >> shift) & (nbins - 1) over valid entries whose masked key equals prefix.
template <int THREADS, int E, bool AGG, class Src>
__device__ void hist_pass(const Src& src, unsigned mask, unsigned prefix, int shift, unsigned digit_mask, int* hist) {
  const int warp_run = (int)(threadIdx.x >> 5) * 32 * E;
  for (int base = 0; base < src.n; base += THREADS * E) {
    unsigned key[E];
    bool ok[E];
    int j[E];
    load_keys<E>(src, base, key, ok, j, warp_run);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      hist_add<AGG>(hist, (int)((key[e] >> shift) & digit_mask), ok[e] && (key[e] & mask) == prefix);
    }
  }
}

// The bin holding the need-th largest active key (need >= 1): res[0] = bin (-1 when all active entries
// number <= need: take them all), res[1] = active entries in bins above it, res[2] = entries in the bin.
// Threads own consecutive bins; suffix sums by warp shuffles, one round through shared memory for the
// warp totals.
template <int THREADS, int NB>
__device__ void find_bin(const int* hist, int nbins, int need, int* wsum, int* res) {
  constexpr int WARPS = THREADS / 32;
  constexpr int PER = (NB + THREADS - 1) / THREADS;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int mine = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int b = t * PER + i;
    if (b < nbins) mine += hist[b];
  }
  int v = mine;  // inclusive suffix sum over the lanes of this warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_down_sync(0xffffffffu, v, off);
    if (lane + off < 32) v += o;
  }
  if (lane == 0) wsum[warp] = v;
  if (t == 0) res[0] = -1, res[1] = 0, res[2] = 0;
  __syncthreads();
  int w = lane < WARPS ? wsum[lane] : 0;  // suffix sums over the warp totals, in every warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_down_sync(0xffffffffu, w, off);
    if (lane + off < 32) w += o;
  }
  const int total = __shfl_sync(0xffffffffu, w, 0);
  const int after = __shfl_sync(0xffffffffu, w, (warp + 1) & 31);
  int run = (warp + 1 < WARPS ? after : 0) + v - mine;  // active entries in bins above this thread's
  if (total > need) {
#pragma unroll
    for (int i = PER - 1; i >= 0; --i) {
      const int b = t * PER + i;
      if (b < nbins) {
        const int h = hist[b];
        if (run < need && run + h >= need) res[0] = b, res[1] = run, res[2] = h;
        run += h;
      }
    }
  }
  __syncthreads();
}

// One tile's per-warp counts in tile order: lane 0 of each warp writes its warp's count to wcount[warp], one barrier,
// then a warp-shuffle scan over the warp counts gives every lane (x) the tile's total and (y) the count of the warps
// before its own. The callers alternate two wcount buffers between tiles, so one barrier per tile suffices.
template <int WARPS>
__device__ __forceinline__ int2 scan_warp_counts(int count, int* wcount) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) wcount[warp] = count;
  __syncthreads();
  const int c = lane < WARPS ? wcount[lane] : 0;
  int incl = c;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  return make_int2(__shfl_sync(0xffffffffu, incl, 31), __shfl_sync(0xffffffffu, incl - c, warp));
}

// Ordered pass: every valid entry with (key & mask) > prefix ("above") and the first take_eq entries with
// (key & mask) == prefix go to emit(ordinal, key, position), ordinal = above_before + min(eq_before, take_eq):
// the entry's rank in position order among the chosen. Returns the chosen count (every thread).
// wcount: 2 * WARPS ints (double-buffered per-tile warp counts, so one barrier per tile).
template <int THREADS, int E, class Src, class Emit>
__device__ int ordered_pass(const Src& src, unsigned mask, unsigned prefix, int take_eq, int* wcount, Emit emit) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lt = (1u << lane) - 1u;
  const int warp_run = warp * 32 * E;
  int gt_run = 0, eq_run = 0, buf = 0;
  for (int base = 0; base < src.n; base += THREADS * E, buf ^= 1) {
    unsigned key[E];
    bool ok[E];
    int j[E];
    load_keys<E>(src, base, key, ok, j, warp_run);
    // Per-lane flag bits (bit e: entry e is above / equal) instead of E ballot words kept across the barrier:
    // registers are the limit at 1024 threads (64 per thread); the ballots are redone after it (one instruction each).
    unsigned my_gt = 0u, my_eq = 0u;
    int wg = 0, we = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const unsigned mk = key[e] & mask;
      const bool g = ok[e] && mk > prefix, q = ok[e] && mk == prefix;
      my_gt |= (unsigned)g << e;
      my_eq |= (unsigned)q << e;
      wg += __popc(__ballot_sync(0xffffffffu, g));
      we += __popc(__ballot_sync(0xffffffffu, q));
    }
    // Two counts in one int (each < 65536: a tile holds THREADS * E <= 32768 entries) so one scan orders both.
    const int2 scan = scan_warp_counts<WARPS>((wg << 16) | we, wcount + buf * WARPS);
    const int tile_total = scan.x, before = scan.y;
    int g_before = gt_run + (before >> 16), e_before = eq_run + (before & 0xffff);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const bool is_gt = (my_gt >> e) & 1u, is_eq = (my_eq >> e) & 1u;
      const unsigned gm = __ballot_sync(0xffffffffu, is_gt), em = __ballot_sync(0xffffffffu, is_eq);
      const int gb = g_before + __popc(gm & lt), eb = e_before + __popc(em & lt);
      if (is_gt || (is_eq && eb < take_eq)) emit(gb + min(eb, take_eq), key[e], src.pos(j[e]));
      g_before += __popc(gm);
      e_before += __popc(em);
    }
    gt_run += tile_total >> 16;
    eq_run += tile_total & 0xffff;
  }
  __syncthreads();  // wcount and the emitted slots are reused by the caller
  return gt_run + min(eq_run, take_eq);
}

// Compaction: every valid entry with (key & mask) >= prefix goes to emit(ordinal, key, position), ordinal = its
// rank in position order. ordered_pass with take_eq unlimited computes the same ordinals from two predicates (above,
// equal), four ballots and six popcounts per load; here one predicate, one ballot per load kept across the barrier
// (E registers) and two popcounts. Returns the count (every thread).
template <int THREADS, int E, class Src, class Emit>
__device__ int compact_pass(const Src& src, unsigned mask, unsigned prefix, int* wcount, Emit emit) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lt = (1u << lane) - 1u;
  const int warp_run = warp * 32 * E;
  int run = 0, buf = 0;
  for (int base = 0; base < src.n; base += THREADS * E, buf ^= 1) {
    unsigned key[E];
    bool ok[E];
    int j[E];
    load_keys<E>(src, base, key, ok, j, warp_run);
    unsigned votes[E];
    int wc = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      votes[e] = __ballot_sync(0xffffffffu, ok[e] && (key[e] & mask) >= prefix);
      wc += __popc(votes[e]);
    }
    const int2 scan = scan_warp_counts<WARPS>(wc, wcount + buf * WARPS);
    const int tile_total = scan.x;
    int before = run + scan.y;  // entries of earlier tiles and warps
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((votes[e] >> lane) & 1u) emit(before + __popc(votes[e] & lt), key[e], src.pos(j[e]));
      before += __popc(votes[e]);
    }
    run += tile_total;
  }
  __syncthreads();  // wcount and the emitted slots are reused by the caller
  return run;
}

struct ToShared {
  unsigned* key;
  int* pos;
  __device__ __forceinline__ void operator()(int o, unsigned k, int p) const { key[o] = k; pos[o] = p; }
};

// Final output of one row (part): position p is written as pos_base + p, or as map[p] when map is given
// (merge stage: candidate slot -> cache position); the value too when val is given (parts stage).
template <int MB>  // the map's columns per entry (see select_kernel's remap_block): a constant, so p / MB is a shift
struct ToOutput {
  int* out;
  float* val;
  const int* map;  // the row's position map, or null: positions are pos_base + column
  int pos_base;
  __device__ __forceinline__ void operator()(int o, unsigned k, int p) const {
    out[o] = map ? map[p / MB] * MB + p % MB : pos_base + p;
    if (val) val[o] = value_of(k);
  }
};

// The whole select of one row (part) by one CTA; see tiles/radix_select.py for the algorithm.
template <int THREADS, int HB, int E, int CAP, bool AGG, bool COMPACT, class Dst>
__device__ void topk_cta(const float* row, int n, int k, Dst dst, int* hist, unsigned* skey, int* spos, int* scratch) {
  constexpr int NB = 1 << HB;
  constexpr int WARPS = THREADS / 32;
  int* wsum = scratch;          // WARPS
  int* res = scratch + WARPS;   // 4
  int* wcount = res + 4;        // 2 * WARPS
  const GlobalSrc g{row, n};
  SharedSrc s{skey, spos, 0};
  unsigned prefix = 0u, mask = 0u;
  int above = 0, remaining = k, shift = 32;
  bool in_smem = false;
  while (shift > 0) {
    const int width = min(HB, shift);
    shift -= width;
    const unsigned digit_mask = (1u << width) - 1u;
    for (int b = threadIdx.x; b < NB; b += THREADS) hist[b] = 0;
    __syncthreads();
    if (in_smem) hist_pass<THREADS, E, AGG>(s, mask, prefix, shift, digit_mask, hist);
    else hist_pass<THREADS, E, AGG>(g, mask, prefix, shift, digit_mask, hist);
    __syncthreads();
    find_bin<THREADS, NB>(hist, 1 << width, remaining, wsum, res);
    const int bin = res[0], n_above = res[1], n_bin = res[2];
    if (bin < 0) break;  // every active entry fits in the slots left: all are chosen
    prefix |= (unsigned)bin << shift;
    mask |= digit_mask << shift;
    above += n_above;
    remaining -= n_above;
    if (n_bin == remaining) break;  // the bin is taken whole
    if (!in_smem && above + n_bin <= CAP) {
      // Everything at or above the bin, in position order, into shared memory: later passes stay on chip.
      if (COMPACT) compact_pass<THREADS, E>(g, mask, prefix, wcount, ToShared{skey, spos});
      else ordered_pass<THREADS, E>(g, mask, prefix, 0x7fffffff, wcount, ToShared{skey, spos});
      s.n = above + n_bin;
      in_smem = true;
    }
  }
  const int chosen = in_smem ? ordered_pass<THREADS, E>(s, mask, prefix, remaining, wcount, dst)
                             : ordered_pass<THREADS, E>(g, mask, prefix, remaining, wcount, dst);
  for (int i = chosen + threadIdx.x; i < k; i += THREADS) {
    dst.out[i] = -1;
    if (dst.val) dst.val[i] = __int_as_float(0xff800000);
  }
}

// Row r, part p of parts, of values [R, L] with columns < n_valid: where the part's scores start, how many there
// are, and where its k picks go (out row r has parts * k slots: part p writes slots [p * k, (p + 1) * k)).
template <int MB>
struct RowPart {
  const float* row;
  int n;
  ToOutput<MB> dst;
};

template <int MB>
__device__ __forceinline__ RowPart<MB> row_part(const float* values, long long L, int r, int p, int parts, int n_valid, int k,
                                                int* out, float* out_val, int emit_values, const int* map, int remap_block,
                                                long long map_stride) {
  const long long n_row = max(0LL, min((long long)n_valid, L));
  const long long width = (L + parts - 1) / parts;
  const long long base = (long long)p * width;
  const long long n = max(0LL, min(n_row - base, width));
  const long long o = ((long long)r * parts + p) * k;
  ToOutput<MB> dst{out + o, emit_values ? out_val + o : nullptr, remap_block ? map + (long long)r * map_stride : nullptr, (int)base};
  return RowPart<MB>{values + (long long)r * L + base, (int)n, dst};
}

// Launch glue for one CTA: row r, part p (see row_part).
template <int THREADS, int HB, int E, int CAP, bool AGG, bool COMPACT, int MB>
__device__ void select_row(const float* values, long long L, int r, int p, int parts, int n_valid, int k, int* out,
                           float* out_val, int emit_values, const int* map, int remap_block, long long map_stride, int* hist,
                           unsigned* skey, int* spos, int* scratch) {
  const RowPart<MB> part = row_part<MB>(values, L, r, p, parts, n_valid, k, out, out_val, emit_values, map, remap_block, map_stride);
  topk_cta<THREADS, HB, E, CAP, AGG, COMPACT>(part.row, part.n, k, part.dst, hist, skey, spos, scratch);
}

}  // namespace csa2_rs
"""

# stage="shared": the part's scores are copied into shared memory once (16-byte loads, a batch of them in flight per
# thread), and the histogram and ordered passes read them there instead of from L2. Why: the global passes re-read each
# tile of a part behind a barrier with ``loads`` loads in flight per thread, and at the decode shape the parts launch
# spends most of its samples in those passes waiting on their loads (Nsight Compute on the H200, 43684b5). topk_cta is
# the same code either way: it reads through a plain pointer, which nvcc resolves to shared memory here. A part wider
# than the stage (odd shapes: 7 x 70001 in 4 parts) runs the global path. Measured on the H200 (0f2e979):
# exact, 7-17% faster for one long row (1 x 128K), slower at decode 64 x 128K (55.1 vs 48.0 us: the 64 KiB stage leaves
# 2 CTAs per SM where the default runs 4, whose loads already overlap) and at 4096 x 8K; not a default.
_STAGED_ROW_CUDA = r"""
namespace csa2_rs {

// n values from src (global) to dst (shared): B loads per thread in flight before the first store.
template <int THREADS, class V>
__device__ __forceinline__ void copy_batched(const V* src, V* dst, int n) {
  constexpr int B = 8;
  for (int i0 = threadIdx.x; i0 < n; i0 += THREADS * B) {
    V v[B];
#pragma unroll
    for (int b = 0; b < B; ++b) if (i0 + b * THREADS < n) v[b] = src[i0 + b * THREADS];
#pragma unroll
    for (int b = 0; b < B; ++b) if (i0 + b * THREADS < n) dst[i0 + b * THREADS] = v[b];
  }
}

// n scores from src (global) to stage (shared), by 16-byte vectors where src and n allow, then a barrier.
template <int THREADS>
__device__ __forceinline__ void stage_part(const float* src, int n, float* stage) {
  if ((((unsigned long long)src) & 15ull) == 0ull && (n & 3) == 0) {
    copy_batched<THREADS>(reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(stage), n >> 2);
  } else {
    copy_batched<THREADS>(src, stage, n);
  }
  __syncthreads();
}

// select_row with the part staged in shared memory first (STAGE scores at most).
template <int THREADS, int HB, int E, int CAP, bool AGG, bool COMPACT, int MB, int STAGE>
__device__ void select_row_staged(const float* values, long long L, int r, int p, int parts, int n_valid, int k, int* out,
                                  float* out_val, int emit_values, const int* map, int remap_block, long long map_stride,
                                  int* hist, unsigned* skey, int* spos, int* scratch, float* stage) {
  const RowPart<MB> part = row_part<MB>(values, L, r, p, parts, n_valid, k, out, out_val, emit_values, map, remap_block, map_stride);
  if (part.n <= STAGE) {
    stage_part<THREADS>(part.row, part.n, stage);
    topk_cta<THREADS, HB, E, CAP, AGG, COMPACT>(stage, part.n, k, part.dst, hist, skey, spos, scratch);
  } else {
    topk_cta<THREADS, HB, E, CAP, AGG, COMPACT>(part.row, part.n, k, part.dst, hist, skey, spos, scratch);
  }
}

}  // namespace csa2_rs
"""
STAGES = ("global", "shared")  # where the passes read a part's scores (see _STAGED_ROW_CUDA)
COMPACTIONS = ("ordered_pass", "compact_pass")  # how the candidates reach shared memory (see compact_pass)
STAGE_ENTRIES = 16384  # stage="shared": scores per part staged (64 KiB): the decode parts of 128K rows in 8 parts


def select_cuda(stage: str = "global") -> str:
    """The select's CUDA source (with the staged row for ``stage="shared"``)."""
    return _SELECT_CUDA + (_STAGED_ROW_CUDA if stage == "shared" else "")


# Defaults from an H200 sweep of the select alone, each config checked exactly and timed per shape (3b022ca: plain
# atomics beat match.any aggregation, 8 loads in flight keep a 256-thread CTA's registers low enough for several CTAs
# per SM, which the prefill-like row counts need; decode rows get their CTAs from parts instead). compact_pass: exact
# at every case and shape, faster at all three timed shapes in one run (H200, 74e11bb: 64 x 128K 48.4 -> 41.0 us,
# 1 x 128K 25.4 -> 21.9 us, 4096 x 8K 152.5 -> 131.4 us). threads="auto": see resolve_threads.
DEFAULT_CONFIG: Config = {
    "threads": "auto",
    "hist_bits": 11,
    "loads": 8,
    "cap": 4096,
    "agg": False,
    "parts": "auto",
    "stage": "global",
    "compaction": "compact_pass",
}
PARAMS = {
    "threads": ("auto", 256, 512, 1024),  # threads per CTA ("auto": resolve_threads)
    "hist_bits": (11, 12),  # bits per radix digit (2048 / 4096 histogram bins)
    "loads": (4, 8, 16, 32),  # loads in flight per thread per pass
    "cap": (2048, 4096, 8192),  # shared-memory candidate slots (8 bytes each); any value >= k is accepted
    "agg": (False, True),  # plain histogram atomics, or warp-aggregated ones (match.any)
    # the passes read the part from global memory (L2), or from a copy in shared memory (STAGE_ENTRIES at most;
    # H200: faster for one long row, slower at decode and prefill-like rows, 0f2e979)
    "stage": STAGES,
    "parts": ("auto", 1, 2, 4, 8, 16, 32),  # row slices selected separately before a merge launch
    # the compaction into shared memory by the general ordered pass (two predicates, four ballots per load) or by
    # compact_pass (one predicate, one ballot kept across the barrier): the compaction was 62% of the decode parts
    # launch's samples (Nsight Compute source counters on the H200, 43684b5)
    "compaction": COMPACTIONS,
}
MAX_PARTS = 32


AUTO_THREADS = (256, 512)  # threads="auto": many CTAs, or as few as one per SM at most (see resolve_threads)


def _widest(threads) -> int:
    """The most threads per CTA a setting may resolve to (for the bounds that hold before the shape is known)."""
    return max(AUTO_THREADS) if threads == "auto" else int(threads)


def resolve_threads(setting, ctas: int, arch: Arch) -> int:
    """Threads per CTA: ``setting`` itself, or for ``"auto"`` 512 when the first launch has at most one CTA per SM
    (``ctas`` = rows x parts) and 256 otherwise. Few CTAs leave most of each SM's issue slots and load bandwidth to
    one CTA, which twice the warps then use; many 256-thread CTAs already overlap one another's barriers and passes.
    H200, one run (d48086d; compact_pass, 128K rows in 8 parts): 1 to 16 rows (8 to 128 CTAs)
    512 threads 18.5-21.2 us against 22.3-25.8 with 256; 32 rows (256 CTAs) 31.6 against 30.2; 64 rows 53.8 against
    41.0 (256 threads, 74e11bb's run); 16K rows in one part (Reindex, the candidate pool) 64 rows 12.8 against
    16.1 us, one row 11.6 against 14.6."""
    if setting != "auto":
        return int(setting)
    return max(AUTO_THREADS) if ctas <= arch.sm_count else min(AUTO_THREADS)


def check_config(config: Config, k: int) -> Config:
    """The full config (defaults filled in), or a TileError naming the bad key or value."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TileError(f"unknown radix_select config keys {sorted(unknown)}: known keys are {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    for name, choices in PARAMS.items():
        if name != "cap" and cfg[name] not in choices:
            raise TileError(f"radix_select {name}={cfg[name]!r} is not one of {choices}")
    if _widest(cfg["threads"]) * cfg["loads"] > 32768:
        # ordered_pass packs two per-tile counts into one int (16 bits each)
        raise TileError(f"threads x loads = {_widest(cfg['threads']) * cfg['loads']} > 32768 entries per tile")
    if not isinstance(cfg["cap"], int) or cfg["cap"] < k:
        # the shared candidates must hold at least the k chosen, else the fast path could never run
        raise TileError(f"cap={cfg['cap']} is smaller than k={k}")
    return cfg


def smem_bytes(config: Config) -> int:
    """Shared memory one CTA needs: histogram, candidate keys and positions, scan scratch."""
    cfg = {**DEFAULT_CONFIG, **config}
    staged = STAGE_ENTRIES if cfg["stage"] == "shared" else 0
    return 4 * ((1 << cfg["hist_bits"]) + 2 * cfg["cap"] + 3 * (_widest(cfg["threads"]) // 32) + 4 + staged)


@functools.cache
def select_kernel(
    target: str,
    k: int,
    threads: int = 256,
    hist_bits: int = 11,
    loads: int = 8,
    cap: int = 4096,
    agg: bool = False,
    parts: int = 1,
    emit_values: bool = False,
    remap_block: int = 0,
    all_valid: bool = False,
    stage: str = "global",
    compaction: str = "compact_pass",
):
    """Build the select kernel for one config and ``target`` (an nvcc arch such as ``"sm_90a"``).

    Arguments of the compiled kernel:
        values fp32 [R, L]; n_valid int32 [R] (columns >= n_valid[r] are not candidates; ignored with
        ``all_valid``); pos_map int32 [R, M] (with ``remap_block`` b > 0 the chosen column c is reported as
        ``pos_map[r, c // b] * b + c % b``: b = 1 maps each column, b = 8 maps Reindex's candidate slots through the
        pool's block ids; with 0 M may be 1 and it is not read); out int32 [R, parts * k] (part p of
        row r writes its ascending positions, global within the row, to ``[p * k, (p + 1) * k)``,
        -1 fill); out_val fp32 [R, V] (with ``emit_values`` V = parts * k and the chosen values
        land beside their positions, -inf fill; else V may be 1 and it is not written).
    Dims R, L, M, V are dynamic: one kernel serves every row count and row length. ``stage``: where the passes
    read a part (``STAGES``; the same output either way); ``compaction``: which pass moves the candidates to shared
    memory (``COMPACTIONS``; the same output either way).
    """
    if stage not in STAGES:
        raise TileError(f"radix_select stage={stage!r} is not one of {STAGES}")
    if compaction not in COMPACTIONS:
        raise TileError(f"radix_select compaction={compaction!r} is not one of {COMPACTIONS}")
    R, L, M, V = T.dynamic("R, L, M, V")
    nb = 1 << hist_bits
    warps = threads // 32
    flags = ", ".join("true" if on else "false" for on in (agg, compaction == "compact_pass"))
    fn = f"csa2_rs::select_row<{threads}, {hist_bits}, {loads}, {cap}, {flags}, {max(remap_block, 1)}>"
    if stage == "shared":
        fn = fn.replace("select_row<", "select_row_staged<")[:-1] + f", {STAGE_ENTRIES}>"
    out_w = parts * k

    @T.prim_func
    def select(
        values: T.Tensor((R, L), "float32"),
        n_valid: T.Tensor((R,), "int32"),
        pos_map: T.Tensor((R, M), "int32"),
        out: T.Tensor((R, out_w), "int32"),
        out_val: T.Tensor((R, V), "float32"),
    ):
        # Rows in grid x (a 64K prefill has 65536 rows; grid y stops at 65535), parts in y.
        with T.Kernel(R, parts, threads=threads) as (r, p):
            T.import_source(select_cuda(stage))
            hist = T.alloc_shared((nb,), "int32")
            skey = T.alloc_shared((cap,), "uint32")
            spos = T.alloc_shared((cap,), "int32")
            scratch = T.alloc_shared((3 * warps + 4,), "int32")
            staged = ()
            if stage == "shared":
                stage_s = T.alloc_shared((STAGE_ENTRIES,), "float32")
                staged = (T.address_of(stage_s[0]),)
            T.call_extern(
                "handle",
                fn,
                T.address_of(values[0, 0]),
                T.Cast("int64", L),
                r,
                p,
                parts,
                T.Cast("int32", L) if all_valid else n_valid[r],
                k,
                T.address_of(out[0, 0]),
                T.address_of(out_val[0, 0]),
                int(emit_values),
                T.address_of(pos_map[0, 0]),
                remap_block,
                T.Cast("int64", M),
                T.address_of(hist[0]),
                T.address_of(skey[0]),
                T.address_of(spos[0]),
                T.address_of(scratch[0]),
                *staged,
            )

    return tilelang.compile(select, target=tvm.target.Target(cuda_target(target)))


# --------------------------------------------------------------------------------------
# wrapper
# --------------------------------------------------------------------------------------


CTAS_PER_SM = 4  # auto parts aim at this many CTAs per SM: 256-thread CTAs overlap one another's barriers and scans
MIN_PART = 32  # auto parts keep each slice >= MIN_PART * k wide: the merge then re-reads <= 1/32 of the row


def resolve_parts(setting, rows: int, n: int, k: int, arch: Arch) -> int:
    """Slices per row: ``setting`` itself, or for ``"auto"`` the fewest (a power of two) that give the GPU
    ``CTAS_PER_SM`` CTAs per SM, each slice at least ``MIN_PART * k`` wide."""
    if setting != "auto":
        return int(setting)
    parts = 1
    while parts < MAX_PARTS and rows * parts < CTAS_PER_SM * arch.sm_count and n // (2 * parts) >= MIN_PART * k:
        parts *= 2
    return parts


def _select_for(arch: Arch, k: int, cfg: Config, ctas: int, **launch):
    """select_kernel for a full config, ``threads`` resolved for a first launch of ``ctas`` CTAs; ``launch``: the
    launch-shape arguments (parts, emit_values, remap_block, all_valid)."""
    threads = resolve_threads(cfg["threads"], ctas, arch)
    knobs = (threads, cfg["hist_bits"], cfg["loads"], cfg["cap"], cfg["agg"])
    return select_kernel(arch.nvcc_arch, k, *knobs, stage=cfg["stage"], compaction=cfg["compaction"], **launch)


def _kernels(arch: Arch, k: int, cfg: Config, parts: int, rows: int):
    """(first launch, merge launch or None) for a full config, a resolved part count and the rows selected (which,
    with the parts, resolve ``threads="auto"``; both launches get the first one's width)."""
    if parts == 1:
        return _select_for(arch, k, cfg, rows), None
    first = _select_for(arch, k, cfg, rows * parts, parts=parts, emit_values=True)
    merge = _select_for(arch, k, cfg, rows * parts, parts=1, remap_block=1, all_valid=True)
    return first, merge


def remapped_kernel(arch: Arch, k: int, rows: int, config: Config | None = None, block: int = 1):
    """The one-launch select of ``rows`` rows whose chosen columns are reported through a position map (every column a
    candidate): ``fn(values [R, L] fp32, n_valid [R] (not read), pos_map [R, L / block] int32, out [R, k] int32,
    out_val [R, 1])`` writes ``pos_map[r, c // block] * block + c % block`` for each chosen column c, in column order,
    -1 fill. The merge launch of the parts path is this kernel with block 1; Reindex passes its pool's block ids with
    block 8, so candidate slots map back to cache positions without a per-call map."""
    return _select_for(arch, k, check_config(config or {}, k), rows, parts=1, remap_block=block, all_valid=True)


def build_kernels(arch: Arch, k: int, parts: int, rows: int, config: Config | None = None):
    """Compile (or fetch) the kernels one select of ``k`` over ``rows`` rows in ``parts`` parts launches, for callers
    that build ahead."""
    return _kernels(arch, k, check_config(config or {}, k), parts, rows)


def _check_inputs(scores: torch.Tensor, n_valid: torch.Tensor, k: int) -> tuple[int, int]:
    """(R, N) of valid inputs, else a TileError that names the problem."""
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 2:
        got = f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TileError(f"scores must be float32 [R, N], got {got}")
    R, N = scores.shape
    if not isinstance(n_valid, torch.Tensor) or n_valid.dtype != torch.int32 or tuple(n_valid.shape) != (R,):
        got = f"{n_valid.dtype} {tuple(n_valid.shape)}" if isinstance(n_valid, torch.Tensor) else type(n_valid).__name__
        raise TileError(f"n_valid must be int32 [{R}] (one count per score row), got {got}")
    if not isinstance(k, int) or k <= 0:
        raise TileError(f"k must be a positive int, got {k!r}")
    if R == 0 or N == 0:
        raise TileError(f"scores must have rows and columns, got shape {(R, N)}")
    if N >= 2**31:
        raise TileError(f"rows of {N} entries do not fit the kernel's int32 positions")
    if scores.device != n_valid.device:
        raise TileError(f"n_valid is on {n_valid.device} but scores are on {scores.device}")
    if scores.device.type != "cuda":
        raise TileError(f"the select kernel runs on a CUDA GPU, got tensors on {scores.device}: move them with .cuda()")
    return R, N


def select_launcher(R: int, N: int, k: int, device, *, arch: Arch | str | None = None, config: Config | None = None):
    """A launch function ``fn(scores [R, N] fp32, n_valid [R] int32, out [R, k] int32)`` with the kernels built and
    the merge buffers allocated once: nothing is allocated per call, so it can be captured in a CUDA graph."""
    arch = get_arch(arch) if isinstance(arch, str) else arch or device_arch(torch.device(device))
    cfg = check_config(config or {}, k)
    if smem_bytes(cfg) > arch.smem_per_block:
        raise TileError(f"radix_select config needs {smem_bytes(cfg)} bytes of shared memory > {arch.smem_per_block} on {arch.name}")
    parts = resolve_parts(cfg["parts"], R, N, k, arch)
    first, merge = _kernels(arch, k, cfg, parts, R)
    dummy_map = torch.empty(R, 1, dtype=torch.int32, device=device)  # [R, 1]: not read
    dummy_val = torch.empty(R, 1, dtype=torch.float32, device=device)  # [R, 1]: not written
    if merge is None:
        return lambda scores, n_valid, out: first(scores, n_valid, dummy_map, out, dummy_val)
    cand_pos = torch.empty(R, parts * k, dtype=torch.int32, device=device)  # [R, parts * k] slot -> position
    cand_val = torch.empty(R, parts * k, dtype=torch.float32, device=device)  # [R, parts * k] slot -> value

    def launch(scores, n_valid, out):
        first(scores, n_valid, dummy_map, cand_pos, cand_val)
        merge(cand_val, n_valid, cand_pos, out, dummy_val)

    return launch


def topk_positions_fast(
    scores: torch.Tensor, n_valid: torch.Tensor, k: int, *, arch: Arch | str | None = None, config: Config | None = None
) -> torch.Tensor:
    """Exact top-k positions of each score row, ascending, -1 fill (ties: lower position wins).

    Args:
        scores: fp32 [R, N] on a CUDA GPU (-inf and NaN are never chosen); made contiguous if it is not.
        n_valid: int32 [R]; columns >= n_valid[r] are not candidates.
        k: positions to keep per row.
        arch: the GPU's arch (name or :class:`Arch`); None = the device of ``scores``.
        config: knobs (see ``DEFAULT_CONFIG`` / ``PARAMS``); missing keys take the defaults.
    Returns:
        int32 [R, k], equal to ``model.ops.indexer.topk_positions`` of the masked scores.
    """
    R, N = _check_inputs(scores, n_valid, k)
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)  # [R, k]
    select_launcher(R, N, k, scores.device, arch=arch, config=config)(scores.contiguous(), n_valid.contiguous(), out)
    return out


# --------------------------------------------------------------------------------------
# reference and test data (for tests/test_radix_select.py)
# --------------------------------------------------------------------------------------

CASES = ("random", "ties10", "short", "neginf", "nan", "equal", "signed_zero", "crowded")


def reference_topk(scores: torch.Tensor, n_valid: torch.Tensor, k: int) -> torch.Tensor:
    """The contract in torch: ``model.ops.indexer.topk_positions`` of the scores with columns >= n_valid and NaN
    set to -inf (the reference would let a NaN take a slot; the kernel skips it). fp32 [R, N] -> int32 [R, k]."""
    from model.ops.indexer import topk_positions

    cols = torch.arange(scores.shape[1], device=scores.device)
    masked = scores.masked_fill((cols >= n_valid.unsqueeze(1)) | scores.isnan(), float("-inf"))  # [R, N]
    return topk_positions(masked.unsqueeze(1), k).squeeze(1)


def make_case(kind: str, R: int, N: int, k: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random scores fp32 [R, N] and n_valid int32 [R] of one kind (``CASES``).

    random: normal scores, most rows valid to (near) N; ties10: 10 distinct values (ties at the k-th score,
    bins past the shared capacity); short: n_valid < k on most rows (-1 fill), one row empty; neginf: 30%
    -inf, one row all -inf; nan: NaN sprinkled in (never chosen); equal: one value everywhere (every radix
    digit resolved in global memory); signed_zero: +0 / -0 / tiny values (-0 == +0 as the reference compares);
    crowded: all scores in [1, 1.25), one histogram bin.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(R, N, generator=gen, device=device)  # [R, N]
    n_valid = N - torch.randint(0, max(1, N // 16), (R,), generator=gen, device=device)  # [R]
    if kind == "ties10":
        scores = torch.randint(0, 10, (R, N), generator=gen, device=device).float() * 0.37
    elif kind == "short":
        n_valid = torch.randint(0, max(1, min(N, k)), (R,), generator=gen, device=device)
        n_valid[0] = 0
    elif kind == "neginf":
        scores = scores.masked_fill(torch.rand(R, N, generator=gen, device=device) < 0.3, float("-inf"))
        scores[-1] = float("-inf")
    elif kind == "nan":
        scores = scores.masked_fill(torch.rand(R, N, generator=gen, device=device) < 0.05, float("nan"))
    elif kind == "equal":
        scores = torch.full((R, N), 0.75, device=device)
    elif kind == "signed_zero":
        pick = torch.randint(0, 4, (R, N), generator=gen, device=device)
        scores = torch.where(pick == 0, 0.0, torch.where(pick == 1, -0.0, scores * 1e-30))
    elif kind == "crowded":
        scores = 1.0 + 0.25 * torch.rand(R, N, generator=gen, device=device)
    elif kind != "random":
        raise ValueError(f"unknown case {kind!r}: one of {CASES}")
    if R > 1:
        n_valid[1 % R] = min(N, k - 1) if kind != "short" else n_valid[1 % R]  # one row with fewer candidates than k
    return scores.float().contiguous(), n_valid.to(torch.int32).contiguous()
