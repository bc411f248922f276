"""The FP4 tiles' search space, its validity rules and the default config per arch family."""

from __future__ import annotations

from tiles.core.arch import Arch
from tiles.core.contract import Config, Constraint, Param, SearchSpace, Shape
from tiles.fp4.kernel import CODES, PACKED_WHY, SCALE_GROUP


# --------------------------------------------------------------------------------------
# Search space, defaults, inputs
# --------------------------------------------------------------------------------------
def _param(config: Config, key: str, scale_format: str):
    """``config[key]``, or the default's value when the config leaves it out (a stored winner from before the key existed)."""
    return config.get(key, fp4_default_config(scale_format, quantise=True)[key])


def staging_fits(config: Config, shape: Shape, arch: Arch, value_bytes: int, scale_format: str) -> str | None:
    """The shared staging needs whole rows per block tile and the tile inside the shared-memory budget."""
    if _param(config, "staging", scale_format) != "shared" or _param(config, "mapping", scale_format) != "thread":
        return None  # lanes + shared is refused by its own constraint
    group = SCALE_GROUP[scale_format]
    threads = _param(config, "threads", scale_format)
    elems = threads * _param(config, "groups_per_thread", scale_format) * group
    if elems % shape["dim"]:
        return f"{threads} threads x {elems // threads} values do not cover whole rows of {shape['dim']}"
    rows = elems // shape["dim"]
    smem = rows * (shape["dim"] * value_bytes + shape["dim"] // 2 + shape["dim"] // group)
    if smem > arch.smem_per_block:
        return f"shared memory {smem / 1024:.0f} KiB > {arch.smem_per_block / 1024:.0f} KiB"
    return None


def _units_divide(config: Config, shape: Shape, arch: Arch, scale_format: str) -> str | None:
    if _param(config, "mapping", scale_format) != "thread":
        return None  # lanes: groups_per_thread is not used
    n_groups = shape["dim"] // SCALE_GROUP[scale_format]
    gpt = _param(config, "groups_per_thread", scale_format)
    if n_groups % gpt:
        return f"groups_per_thread={gpt} does not divide the {n_groups} groups of a row"
    return None


def _lanes_registers(config: Config, shape: Shape, arch: Arch, scale_format: str) -> str | None:
    if _param(config, "mapping", scale_format) == "lanes" and _param(config, "staging", scale_format) != "registers":
        return "mapping=lanes moves coalesced 16-byte chunks straight to registers; shared staging goes with mapping=thread"
    return None


def _thresholds_input(config: Config, value_bytes: int, scale_format: str) -> str | None:
    code = _param(config, "code", scale_format)
    if value_bytes != 2 and code in ("thresholds", "packed"):
        return f"code={code} is exact for bf16 inputs only (8-bit mantissas), not {8 * value_bytes}-bit floats: use code=divide"
    return None


def _packed_structure(config: Config, scale_format: str) -> str | None:
    if _param(config, "code", scale_format) != "packed":
        return None
    if scale_format != "e4m3" or _param(config, "mapping", scale_format) != "lanes":
        return f"code=packed needs mapping=lanes and E4M3 scales: {PACKED_WHY}"
    return None


def _unused_size_at_default(config: Config, scale_format: str, quantise: bool) -> str | None:
    """The size a mapping ignores stays at its default, so each kernel has one spelling in the space: without
    this the tuner compiled and timed the same kernel up to 12 times (576 valid configs, 176 distinct)."""
    default = fp4_default_config(scale_format, quantise)
    if (
        config.get("mapping", "lanes") == "lanes"
        and config.get("groups_per_thread", default["groups_per_thread"]) != default["groups_per_thread"]
    ):
        return f"groups_per_thread is unused with mapping=lanes: leave it at {default['groups_per_thread']}"
    if (
        config.get("mapping", "lanes") == "thread"
        and config.get("chunks_per_thread", default["chunks_per_thread"]) != default["chunks_per_thread"]
    ):
        return f"chunks_per_thread is unused with mapping=thread: leave it at {default['chunks_per_thread']}"
    return None


def fp4_search_space(scale_format: str, value_bytes: int = 2, quantise: bool = True) -> SearchSpace:
    """Structural choices of the FP4 kernels; ``value_bytes`` is the width of the unquantised side (2 for bf16).

    ``groups_per_thread`` only matters with ``mapping='thread'`` and ``chunks_per_thread`` only with
    ``'lanes'``: the unused size must stay at its default (one spelling per kernel), which configs stored
    before ``mapping`` existed satisfy when merged with the default. ``staging='shared'`` needs ``mapping='thread'``
    and ``code='thresholds'`` needs bf16 input: both are refused otherwise, with the reason.
    """
    code = Param(
        "code",
        CODES if scale_format == "e4m3" else tuple(c for c in CODES if c != "packed"),
        "E2M1 code: |x| against m_k * s by binary search in fp32 (bf16 only), the same on bf16x2 pairs (lanes, E4M3), "
        "or IEEE x / s against the midpoints",
    )
    return SearchSpace(
        params=(
            Param(
                "mapping", ("lanes", "thread"), "lanes: 16-byte chunks per lane, group amax by shuffles; thread: whole groups per thread"
            ),
            *((code,) if quantise else ()),
            Param("chunks_per_thread", (1, 2, 4), "lanes only: 8-value chunks per thread and tile step, a block apart"),
            Param(
                "staging",
                ("registers", "shared"),
                "thread only: 16-byte vectors straight to registers, or a row tile through shared memory",
            ),
            Param("groups_per_thread", (1, 2, 4, 8), "thread only: scale groups per thread, the vector width of the packed loads/stores"),
            Param("threads", (64, 128, 256, 512), "threads per block"),
            Param("grid", ("tiles", "persistent"), "one block per tile of units, or a persistent grid striding over tiles"),
        ),
        constraints=(
            Constraint("whole groups", lambda c, s, a: _units_divide(c, s, a, scale_format)),
            Constraint("shared tile", lambda c, s, a: staging_fits(c, s, a, value_bytes, scale_format)),
            Constraint("lanes staging", lambda c, s, a: _lanes_registers(c, s, a, scale_format)),
            Constraint("one spelling", lambda c, s, a: _unused_size_at_default(c, scale_format, quantise)),
            *(
                (
                    Constraint("thresholds input", lambda c, s, a: _thresholds_input(c, value_bytes, scale_format)),
                    Constraint("packed codes", lambda c, s, a: _packed_structure(c, scale_format)),
                )
                if quantise
                else ()
            ),
        ),
    )


def fp4_default_config(scale_format: str, quantise: bool = True) -> Config:
    """Lanes mapping, 256 threads, one block per tile. Quantise: four 16-byte chunks per thread in flight;
    E4M3 codes by the bf16x2 threshold search (``packed``: 3.53 TB/s against 2.43 for fp32 ``thresholds``),
    E8M0 codes by the exact multiply by 2^-e (``divide``, which is no division there). Dequantise: two
    chunks. All from the H200 sweeps at bulk_1m (notes/fp4.md).

    ``groups_per_thread`` keeps the first kernel's 16-byte packed vectors (2 groups of 16 or 1 of
    32) for ``mapping='thread'``.
    """
    config = {
        "mapping": "lanes",
        "code": "packed" if scale_format == "e4m3" else "divide",
        "chunks_per_thread": 4 if quantise else 2,
        "staging": "registers",
        "groups_per_thread": 2 if scale_format == "e4m3" else 1,
        "threads": 256,
        "grid": "tiles",
    }
    if not quantise:
        del config["code"]
    return config
