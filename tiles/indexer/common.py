"""The indexer's fixed sizes and comparison tolerances, shared by its kernels, launchers and tiles."""

HEADS, HEAD_DIM, GROUP = 32, 128, 32  # indexer heads, dims, FP4 group (E8M0 scales)
SCORE_RTOL = 1e-5  # relative L2 of scores: fp32 sums in another order
TIE_RTOL = 1e-5  # a top-k set difference is a tie when its scores equal the k-th within this
NEG_INF = float("-inf")
