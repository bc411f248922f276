"""Per-call resolution of the "auto" choices (tiles per score CTA, select split) and the two-pass select's config."""

from tiles.core.arch import Arch
from tiles.core.contract import Config
from tiles.indexer.radix_select import DEFAULT_CONFIG

TILES_PER_CTA = (1, 4, 16)
AUTO_CTAS_PER_SM = 0.75  # tiles_per_cta="auto": the most tiles per CTA that still give the grid this many CTAs per SM


def resolve_tiles_per_cta(setting, rows: int, n_out: int, block_n: int, arch: Arch) -> int:
    """Entry tiles per score CTA: ``setting`` itself, or for ``"auto"`` the most of :data:`TILES_PER_CTA` whose grid
    (``rows`` token rows x ``ceil(n_out / (block_n x tiles))``) still has ``AUTO_CTAS_PER_SM`` CTAs per SM, else 1.

    Fewer tiles per CTA pay the CTA's prologue (q, weights, tables) more often; too many leave SMs idle when the rows
    are few. H200, one run (f2c2480), one sequence over 128K entries: 16 tiles
    (32 CTAs) 20.9 us of score kernel, 4 tiles (128 CTAs) 6.7 us, 1 tile (512 CTAs) 7.7 us; auto picks 4 there, and 16
    at decode B=64 x 128K (2048 CTAs) and prefill, as before.
    """
    if setting != "auto":
        return int(setting)
    for tiles in sorted(TILES_PER_CTA, reverse=True):
        if rows * -(-n_out // (block_n * tiles)) >= AUTO_CTAS_PER_SM * arch.sm_count:
            return tiles
    return min(TILES_PER_CTA)


SELECT_SPLITS = (1, 2, 4, 8)


def resolve_select_split(setting, rows: int, n: int, k: int, arch: Arch) -> int:
    """Parts per score row for the select: ``setting`` itself, or for ``"auto"`` the fewest parts that give
    two CTAs per SM (the kernel runs one CTA per row part), keeping each part at least 4k entries wide so the
    second stage's candidates stay a small fraction of the row.

    On the H200, decode B=64 x 128K (64 rows): 1 part 1.32 ms of select, 4 parts 0.70 ms, 8 parts 0.44 ms
    (d47048f); auto picks 8 there and 1 for prefill-sized row counts.
    """
    if setting != "auto":
        return int(setting)
    parts = 1
    while parts < SELECT_SPLITS[-1] and rows * parts < 2 * arch.sm_count and n % (2 * parts) == 0 and n // (2 * parts) >= 4 * k:
        parts *= 2
    return parts


RADIX_DEFAULT = {
    "radix_threads": DEFAULT_CONFIG["threads"],
    "radix_stage": DEFAULT_CONFIG["stage"],
    "radix_parts": DEFAULT_CONFIG["parts"],
}


def radix_config(cfg: Config) -> Config:
    """The tiles.indexer.radix_select config of an indexer config (its ``radix_*`` keys; absent keys: radix_select's defaults)."""
    return {name.removeprefix("radix_"): cfg.get(name, default) for name, default in RADIX_DEFAULT.items()}
