"""How the attention kernels declare their two KV caches.

Each cache (the FP8 window KV, the FP4 main KV) is either one tensor per batch row, ``[B, N, C]`` compact (a
contiguous cache), or one pool that every batch row reads: a paged cache's page pool or a state-slot pool, handed to
the kernel as ``[B, N, C]`` with batch stride 0 (``pool.expand(B, -1, -1)``), the rows a batch row reads named by its
indices. The kernel body is the same for both (its reads index ``[b, row, c]``); only the declared strides differ, so
a shared pool costs no gather copy and no extra instruction per row.
"""

import tilelang.language as T


def kv_buffer(shape: list, dtype: str, shared: bool):
    """The kernel argument for one KV tensor ``[B, N, C]``: compact, or with batch stride 0 when ``shared``. A
    placeholder of another rank (the bf16 kernel's unused ``[1]`` scales) is always compact."""
    if not shared or len(shape) != 3:
        return T.Tensor(shape, dtype)
    return T.StridedTensor(shape, [0, shape[2], 1], dtype)
