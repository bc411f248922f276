"""The rematch: a study's winner timed again against the default, alternating in one GPU worker, before it is stored.

A study times each trial once, minutes apart from the others, while the host compiles more configs; a config can
come out a few percent ahead that is not. On the H200 the winner of a 32-trial ``sparse_attn_prefill`` study at
prefill_s4k (4% ahead of the default in its study; a00e7a1) was 1-2% behind the default in three later same-run
comparisons. So a winner that is not the default is timed against it REMATCH_ROUNDS more times each, alternating
which goes first, on fresh inputs each round (each evaluation checks against the reference again), and stays the
winner only if it is faster than the default in every round and its median beats the default's by REMATCH_MARGIN.
Otherwise the default is the study's result. The rematch is recorded with the result either way (``tuning.export``).

Why every round: the two evaluations of a round run back to back, so a round is a paired comparison, and the rounds'
spread on the H200 (one evaluation of the same config 3-4% from another minutes later) is wider than the gains the
margin lets through. That prefill_s4k winner was kept by the median alone (a00e7a1; 1.7% ahead: 2.4% ahead,
1.5% behind, 2.9% ahead) and came out a tie in four other same-run comparisons. Under no real difference a challenger wins
all of three rounds one time in eight.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tiles.core import harness
from tiles.core.contract import Config, Shape, Tile
from tuning.space import config_key
from tuning.workers import WorkerPool, tile_ref

REMATCH_SEED = 1_000_000  # the rematch's input seeds start here, apart from the trials' (their trial numbers)
# How much faster the winner's median must be. The first rematches on the H200 (a00e7a1, three rounds) put those two
# prefill_s4k configs 0.06% apart (0.6764 / 0.6768 ms) and the decode_b128_s2 pair 0.2% apart; same-run A/B runs of
# the prefill pair had differed by -2.5% to +0.7%, and one round of the default ran 3% under its other two. A
# difference under 1% is not a result a stored winner should rest on.
REMATCH_MARGIN = 0.01


def clears_margin(speedup: float) -> bool:
    """A challenger ``speedup`` times faster than the default (the default's time over the challenger's) beats it by
    REMATCH_MARGIN: what a stored winner must show."""
    return speedup > 1 / (1 - REMATCH_MARGIN)


@dataclass
class Rematch:
    """Times of one rematch, ms per evaluation; ``error``: why it stopped early (the default then wins)."""

    challenger: Config
    challenger_ms: list[float] = field(default_factory=list)
    default_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        """The default's median over the challenger's; None when the rematch stopped early."""
        if self.error or not self.challenger_ms or not self.default_ms:
            return None
        return statistics.median(self.default_ms) / statistics.median(self.challenger_ms)

    @property
    def rounds_won(self) -> int:
        """Rounds in which the challenger's time was under the default's (the two evaluations of round i, paired)."""
        return sum(c < d for c, d in zip(self.challenger_ms, self.default_ms))

    @property
    def kept(self) -> bool:
        """The challenger stays the winner: every round ran, the challenger won each of them, and its median beats the
        default's by REMATCH_MARGIN."""
        if self.speedup is None or self.rounds_won != len(self.default_ms):
            return False
        return clears_margin(self.speedup)

    def to_dict(self) -> dict:
        return {
            "challenger": {k: self.challenger[k] for k in sorted(self.challenger)},
            "challenger_ms": [round(ms, 6) for ms in self.challenger_ms],
            "default_ms": [round(ms, 6) for ms in self.default_ms],
            "speedup": None if self.speedup is None else round(self.speedup, 4),
            "rounds_won": self.rounds_won,
            "kept": self.kept,
            "error": self.error,
        }


def _time_once(gpu_pool: WorkerPool, tile: Tile, shape: Shape, config: Config, seed: int, opts) -> float:
    """One evaluation in the GPU worker by ``opts.evaluator`` (check, then time), ``opts.runs`` timed launches; raises
    RuntimeError with the reason when it gives no time."""
    res = gpu_pool.evaluate(opts.evaluator, (tile_ref(tile), shape.name, config, opts.arch.name, seed, opts.runs), opts.trial_timeout_s)
    if res.get("outcome") != harness.OK or res.get("ms") is None:
        raise RuntimeError(f"{res.get('outcome')}: {res.get('message') or ''}".strip())
    return float(res["ms"])


def rematch(challenger: Config, default: Config, tile: Tile, shape: Shape, opts, gpu_pool: WorkerPool, rounds: int) -> Rematch:
    """``challenger`` against ``default`` for ``rounds`` rounds of one evaluation each, alternating which goes first
    (``opts``: the run's ``tuning.study.TuneOptions``)."""
    result = Rematch(dict(challenger))
    for i in range(rounds):
        order = [("challenger", challenger), ("default", default)]
        for who, config in order if i % 2 == 0 else order[::-1]:
            try:
                ms = _time_once(gpu_pool, tile, shape, config, REMATCH_SEED + 2 * i + (who == "default"), opts)
            except RuntimeError as exc:
                result.error = f"{who}, round {i + 1}: {exc}"
                return result
            (result.challenger_ms if who == "challenger" else result.default_ms).append(ms)
    return result


def needs_rematch(best_config: Config | None, default: Config | None, default_timed: bool) -> bool:
    """A winner that is not the default, and a default the study timed (there is something to stand against)."""
    return best_config is not None and default is not None and default_timed and config_key(best_config) != config_key(default)
