"""The select kernels: the exact top-k of each score row by radix select (one CTA per row or per part of it), and the
candidate pool's block max."""

import functools
import math

import tilelang
import tilelang.language as T
import tvm

from tiles.core.arch import cuda_target

LOADS_IN_FLIGHT = 16  # score loads each select thread issues before using the first (memory-level parallelism)

# Warp-aggregated histogram increment for the radix passes. A pass over fp32 scores puts most of a row
# in a handful of bins (the top bits are the sign and exponent), and shared-memory atomics to one
# address serialise: lanes with the same bin elect a leader that adds the group's count instead.
# Convergent: every lane of the warp calls it, inactive lanes with active = 0.
_HIST_CUDA = r"""
__device__ __forceinline__ void csa2_hist_add(int* hist, int bin, int active) {
  const unsigned voters = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(voters, bin);
  if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
}
"""


@functools.cache
def build_select_kernel(target: str, k: int, threads: int, radix_bits: int, remap_block: int):
    """Build the select kernel: exact top-k of each row by radix select, sorted by position.

    ``values [R, L]`` fp32, ``n_valid [R]`` int32 (columns >= n_valid are not candidates),
    ``blocks [R, Pb]`` int32 used only when ``remap_block`` > 0: column ``i`` is then reported
    as ``blocks[r, i // remap_block] * remap_block + i % remap_block`` (Reindex's compact
    candidate slots back to cache positions; ascending blocks keep the order).
    Output ``out [R, k]`` int32. -inf and NaN values are never chosen.
    """
    R, L, Pb = T.dynamic("R, L, Pb")
    radix = 1 << radix_bits
    per_thread = max(1, radix // threads)  # bins each thread sums in the threshold scan
    scan_threads = radix // per_thread
    widths = []
    left = 32
    while left > 0:
        widths.append(min(radix_bits, left))
        left -= widths[-1]
    log_threads = int(math.log2(threads))

    def ordered_key(x):
        bits = T.reinterpret(x, "uint32")
        return T.if_then_else(x < 0, ~bits, bits | T.uint32(0x80000000))

    @T.prim_func
    def select(
        values: T.Tensor((R, L), "float32"),
        n_valid: T.Tensor((R,), "int32"),
        blocks: T.Tensor((R, Pb), "int32"),
        out: T.Tensor((R, k), "int32"),
    ):
        with T.Kernel(R, threads=threads) as r:
            T.import_source(_HIST_CUDA)
            tx = T.get_thread_binding()
            hist = T.alloc_shared((radix,), "int32")
            xs = T.alloc_local((LOADS_IN_FLIGHT,), "float32")
            part = T.alloc_shared((threads + 1,), "int32")
            part2 = T.alloc_shared((threads + 1,), "int32")
            found = T.alloc_shared((2,), "int32")
            prefix = T.alloc_var("uint32")
            mask = T.alloc_var("uint32")
            remaining = T.alloc_var("int32")
            take_all = T.alloc_var("int32")
            run = T.alloc_var("int32")
            v = T.alloc_var("int32")
            cnt = T.alloc_var("int32")
            n_gt = T.alloc_var("int32")
            n_eq = T.alloc_var("int32")
            gt_before = T.alloc_var("int32")
            eq_before = T.alloc_var("int32")
            o = T.alloc_var("int32")
            eq_rank = T.alloc_var("int32")
            cnt = T.min(n_valid[r], L)
            prefix = T.uint32(0)
            mask = T.uint32(0)
            remaining = k
            take_all = 0
            shift = 32
            for width in widths:
                shift -= width
                if take_all == 0:
                    for i in T.serial(per_thread):
                        if tx * per_thread + i < radix:
                            hist[tx * per_thread + i] = 0
                    T.sync_threads()
                    # One CTA per row: with one 4-byte load in flight per thread a pass was latency-bound
                    # (~1 us per iteration, 1.4 ms per call on the H200); LOADS_IN_FLIGHT independent
                    # coalesced loads per thread are issued before any is used.
                    for it in T.serial(T.ceildiv(cnt, threads * LOADS_IN_FLIGHT)):
                        for e in T.unroll(LOADS_IN_FLIGHT):
                            j = (it * LOADS_IN_FLIGHT + e) * threads + tx
                            xs[e] = T.if_then_else(j < cnt, values[r, T.max(T.min(j, cnt - 1), 0)], -T.infinity("float32"))
                        for e in T.unroll(LOADS_IN_FLIGHT):
                            key = ordered_key(xs[e])
                            active = (xs[e] > -T.infinity("float32")) & ((key & mask) == prefix)
                            T.call_extern(
                                "handle",
                                "csa2_hist_add",
                                T.address_of(hist[0]),
                                T.Cast("int32", (key >> shift) & ((1 << width) - 1)),
                                T.Cast("int32", active),
                            )
                    T.sync_threads()
                    # Suffix sums per thread chunk of bins, then across threads (Hillis-Steele).
                    run = 0
                    if tx < scan_threads:
                        for i in T.serial(per_thread):
                            run = run + hist[tx * per_thread + i]
                        part[tx] = run
                    else:
                        part[tx] = 0
                    if tx == 0:
                        part[threads] = 0
                        found[0] = -1
                    T.sync_threads()
                    for lvl in T.serial(log_threads):
                        off = 1 << lvl
                        v = part[tx] + T.if_then_else(tx + off < threads, part[T.min(tx + off, threads - 1)], 0)
                        T.sync_threads()
                        part[tx] = v
                        T.sync_threads()
                    if part[0] <= remaining:
                        # Fewer candidates than slots left: everything matching the prefix is chosen.
                        take_all = 1
                    else:
                        if tx < scan_threads:
                            run = T.if_then_else(tx + 1 < threads, part[T.min(tx + 1, threads - 1)], 0)
                            for i in T.serial(per_thread):
                                bin_ = tx * per_thread + per_thread - 1 - i
                                if (run < remaining) & (run + hist[bin_] >= remaining):
                                    found[0] = bin_
                                    found[1] = run
                                run = run + hist[bin_]
                        T.sync_threads()
                        prefix = prefix | (T.Cast("uint32", found[0]) << shift)
                        mask = mask | (T.uint32((1 << width) - 1) << shift)
                        remaining = remaining - found[1]
                        T.sync_threads()
            T.sync_threads()  # every thread has read part[0] before the counts below overwrite it
            if take_all == 1:
                # Everything valid above the current prefix level is chosen: compare with key > 0
                # only inside the prefix, i.e. keep the prefix and take all equal-prefix keys.
                remaining = cnt + 1
            # Position-ordered output: contiguous segments per thread, exclusive prefix counts.
            seg = T.ceildiv(cnt, threads)
            n_gt = 0
            n_eq = 0
            for i in T.serial(seg):
                j = tx * seg + i
                if j < cnt:
                    x = values[r, j]
                    key = ordered_key(x)
                    if x > -T.infinity("float32"):
                        if (key & mask) > prefix:
                            n_gt = n_gt + 1
                        elif (key & mask) == prefix:
                            n_eq = n_eq + 1
            part[tx] = n_gt
            part2[tx] = n_eq
            T.sync_threads()
            for lvl in T.serial(log_threads):
                off = 1 << lvl
                gt_before = T.if_then_else(tx >= off, part[T.max(tx - off, 0)], 0)
                eq_before = T.if_then_else(tx >= off, part2[T.max(tx - off, 0)], 0)
                T.sync_threads()
                part[tx] = part[tx] + gt_before
                part2[tx] = part2[tx] + eq_before
                T.sync_threads()
            gt_before = part[tx] - n_gt
            eq_before = part2[tx] - n_eq
            o = gt_before + T.min(eq_before, remaining)
            eq_rank = eq_before
            for i in T.serial(seg):
                j = tx * seg + i
                if j < cnt:
                    x = values[r, j]
                    key = ordered_key(x)
                    if x > -T.infinity("float32"):
                        if ((key & mask) > prefix) | (((key & mask) == prefix) & (eq_rank < remaining)):
                            if remap_block > 0:
                                out[r, o] = blocks[r, j // max(remap_block, 1)] * remap_block + j % max(remap_block, 1)
                            else:
                                out[r, o] = j
                            o = o + 1
                        if (key & mask) == prefix:
                            eq_rank = eq_rank + 1
            total = part[threads - 1] + T.min(part2[threads - 1], remaining)
            for it in T.serial(T.ceildiv(k, threads)):
                j = it * threads + tx
                if (j < k) & (j >= total):
                    out[r, j] = -1

    return tilelang.compile(select, target=tvm.target.Target(cuda_target(target)))


@functools.cache
def block_max_kernel(target: str, block: int, threads: int):
    """Block scores of the candidate pool: max over ``block`` positions, the newest visible block forced to +inf.

    ``scores [R, N]`` fp32, ``n_visible [R]`` int32 -> ``out [R, ceil(N / block)]`` fp32.
    """
    R, N, NB = T.dynamic("R, N, NB")

    @T.prim_func
    def block_max(scores: T.Tensor((R, N), "float32"), n_visible: T.Tensor((R,), "int32"), out: T.Tensor((R, NB), "float32")):
        with T.Kernel(R, T.ceildiv(NB, threads), threads=threads) as (r, bx):  # rows in x: a 64K prefill has 65536
            best = T.alloc_var("float32")
            nb = bx * threads + T.get_thread_binding()
            if nb < NB:
                best = -T.infinity("float32")
                for i in T.serial(block):
                    j = nb * block + i
                    if j < N:
                        best = T.max(best, scores[r, j])
                newest = (n_visible[r] - 1) // block
                out[r, nb] = T.if_then_else((n_visible[r] > 0) & (nb == newest), T.infinity("float32"), best)

    return tilelang.compile(block_max, target=tvm.target.Target(cuda_target(target)))
