"""Timing ablations of the ws kernel: cuts of one role's work, built only by the GPU scripts (gpu/attn_ablation.py,
gpu/attn_block_scaling.py) to measure what a block costs. Their results are wrong by design; never in a search space."""

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


def _cuts(dims, part: str) -> bool:
    """True when the producer's ablation (``dims.ablate``) leaves ``part`` of its work out (see _PRODUCER_CUTS)."""
    return part in _PRODUCER_CUTS.get(dims.ablate, ())
