"""The attention's quantised caches expanded to bf16 once: the prefill tile's ``kv_staging="expand"``.

The gathering attention kernel (``kv_staging="gather"``) decodes every FP4 main row and FP8 window row it reads, in
its producer warpgroup, each time a token reads it. At decode that is the cheap way: a token's 640 rows are mostly
read by that token alone. At prefill it is not: a 4K prompt's 4096 tokens read 512 of at most 4096 main entries and
128 window rows each, so every entry is decoded by hundreds of tokens, and on the H200 the producer's decode work
paces the kernel (a282e30, 814c292, f32063c). Expanding both caches to bf16 first (one pass: read
288 B and write 1 KiB per main entry, read 528 B and write 1 KiB per window row) lets the bf16 attention kernel
gather rows by ``cp.async`` with nothing to decode.

The expansion calls the gathering producer's own decode helpers (``tiles.sparse_attn._DEQUANT_CUDA`` and, for
``fp4_decode="prmt"``, its byte-permute lookup), so the bf16 rows are bit for bit the ones the producer writes to
shared memory: ``e2m1 x e4m3`` and ``e4m3 x 2^k`` are exact in bf16.

Layout: 64 threads per row of 512 values, 8 values (one 16-byte store) per thread, 4 rows per 256-thread CTA; the
main rows' CTAs first, then the window rows'. One launch for both caches.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from tiles.core.arch import Arch

THREADS = 256
VALUES_PER_THREAD = 8  # one packed FP4 word, two FP8 words: 16 bytes of bf16
_PASS_CONFIGS = {"tl.enable_fast_math": False}


def expand_kernel_func(dim: int, helpers_cuda: str, fp4_word: str):
    """The expansion prim_func for rows of ``dim`` values (rows dynamic).

    Arguments: MainWords int32 [Nm, dim / 8] (packed FP4, 8 codes per word), MainScales uint8 [Nm, dim / 16] (E4M3),
    WinWords int32 [Nw, dim / 4] (FP8 E4M3 codes, 4 per word), WinScales uint8 [Nw, dim / 32] (E8M0); outputs
    MainKV bf16 [Nm, dim], WinKV bf16 [Nw, dim]. ``helpers_cuda``: the CUDA of the decode helpers it calls
    (``csa2_e4m3_scale2``, ``csa2_e8m0_scale2``, ``csa2_e4m3x4_bf16`` and ``fp4_word``, the FP4 word decode).
    """
    lanes = dim // VALUES_PER_THREAD  # threads per row
    rows_per_cta = THREADS // lanes
    Nm, Nw = T.dynamic("Nm"), T.dynamic("Nw")

    @T.prim_func
    def expand(
        MainWords: T.Tensor([Nm, dim // 8], "int32"),
        MainScales: T.Tensor([Nm, dim // 16], "uint8"),
        WinWords: T.Tensor([Nw, dim // 4], "int32"),
        WinScales: T.Tensor([Nw, dim // 32], "uint8"),
        MainKV: T.Tensor([Nm, dim], "bfloat16"),
        WinKV: T.Tensor([Nw, dim], "bfloat16"),
    ):
        main_ctas = T.ceildiv(Nm, rows_per_cta)
        with T.Kernel(main_ctas + T.ceildiv(Nw, rows_per_cta), threads=THREADS) as bx:
            T.import_source(helpers_cuda)
            tx = T.get_thread_binding()
            c = tx % lanes  # this thread's 8 values: columns 8c .. 8c + 7
            if bx < main_ctas:
                row = bx * rows_per_cta + tx // lanes
                if row < Nm:
                    s2 = T.call_extern("uint32", "csa2_e4m3_scale2", T.cast(MainScales[row, c // 2], "uint32"))
                    T.call_extern("handle", fp4_word, T.address_of(MainKV[row, c * 8]), MainWords[row, c], s2)
            else:
                row = (bx - main_ctas) * rows_per_cta + tx // lanes
                if row < Nw:
                    s2 = T.call_extern("uint32", "csa2_e8m0_scale2", T.cast(WinScales[row, c // 4], "uint32"))
                    T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(WinKV[row, c * 8]), WinWords[row, 2 * c], s2)
                    T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(WinKV[row, c * 8 + 4]), WinWords[row, 2 * c + 1], s2)

    return expand


@functools.cache
def expand_kernel(dim: int, helpers_cuda: str, fp4_word: str, arch: Arch):
    """The compiled expansion for ``arch`` (cached per argument set)."""
    func = expand_kernel_func(dim, helpers_cuda, fp4_word)
    target = tilelang.tvm.target.Target(arch.tilelang_target())
    return tilelang.compile(func, target=target, pass_configs=_PASS_CONFIGS)


def expand_caches(kernel, win_codes: torch.Tensor, win_scales: torch.Tensor, main_packed: torch.Tensor, main_scales: torch.Tensor):
    """Both caches in bf16: (window_kv [Bw, Nw, D], main_kv [Bm, Nc, D]).

    ``win_codes`` FP8 E4M3 [Bw, Nw, D] (uint8 or float8_e4m3fn), ``win_scales`` uint8 [Bw, Nw, D/32] (E8M0),
    ``main_packed`` packed FP4 [Bm, Nc, D/2] (uint8, or int32 [Bm, Nc, D/8] words), ``main_scales`` E4M3
    [Bm, Nc, D/16] (uint8 or float8_e4m3fn). All contiguous, on one device. Bw, Bm: the batch, or 1 for a pool
    shared by every batch row (expanded once, not per row).
    """
    bw, nw, D = win_codes.shape
    bm, nc = main_scales.shape[:2]
    win_kv = torch.empty(bw, nw, D, dtype=torch.bfloat16, device=win_codes.device)  # [Bw, Nw, D]
    main_kv = torch.empty(bm, nc, D, dtype=torch.bfloat16, device=win_codes.device)  # [Bm, Nc, D]
    kernel(
        main_packed.view(torch.int32).reshape(bm * nc, D // 8),
        main_scales.view(torch.uint8).reshape(bm * nc, D // 16),
        win_codes.view(torch.uint8).view(torch.int32).reshape(bw * nw, D // 4),
        win_scales.reshape(bw * nw, D // 32),
        main_kv.view(bm * nc, D),
        win_kv.view(bw * nw, D),
    )
    return win_kv, main_kv
