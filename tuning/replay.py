"""Replays samplers offline against a study's recorded trials: how many trials each needs to get within 3% of the best.

The recorded finished trials form a lookup table (config -> latency, or failure). Each
sampler runs a fresh in-memory study over the same distributions, starting like a real run
from the tile's default config; a config that was never recorded maps to the nearest
recorded one (fewest differing parameters). No kernel is compiled or run.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import dataclass, field

import optuna
from optuna.trial import TrialState

from tiles.core import harness
from tuning.space import config_key
from tuning.study import TuneError, counts_toward_budget, open_storage


@dataclass
class SamplerResult:
    sampler: str
    needed: list[int | None] = field(default_factory=list)  # per seed; None = not within the budget
    note: str = ""

    @property
    def reached(self) -> int:
        return sum(n is not None for n in self.needed)

    @property
    def mean(self) -> float | None:
        hits = [n for n in self.needed if n is not None]
        return statistics.mean(hits) if hits else None


@dataclass
class ReplayReport:
    study: str
    recorded: int
    best_ms: float
    budget: int
    within: float
    results: list[SamplerResult]


def _samplers() -> dict[str, tuple[object | None, str]]:
    """name -> (factory(seed) or None, note)."""
    s = optuna.samplers
    out: dict[str, tuple[object | None, str]] = {
        "tpe": (lambda seed: s.TPESampler(seed=seed, multivariate=True, n_startup_trials=8), ""),
        "random": (lambda seed: s.RandomSampler(seed=seed), ""),
    }
    if importlib.util.find_spec("scipy") is None:
        out["gp"] = (None, "skipped: GPSampler needs scipy, which is not installed")
    else:
        out["gp"] = (lambda seed: s.GPSampler(seed=seed), "")
    if importlib.util.find_spec("cmaes") is None:
        out["cmaes"] = (None, "skipped: CmaEsSampler needs the cmaes package, which is not installed")
    else:
        out["cmaes"] = (
            lambda seed: s.CmaEsSampler(seed=seed),
            "categorical parameters fall back to its independent (random) sampler",
        )
    return out


def _nearest(params: dict, table: dict[str, tuple[dict, TrialState, float | None]]) -> tuple[TrialState, float | None]:
    def distance(cfg: dict) -> int:
        return sum(cfg.get(k) != v for k, v in params.items())

    _, state, value = min(table.values(), key=lambda e: (distance(e[0]), config_key(e[0])))
    return state, value


def replay(storage_url: str | None, study_name: str, seeds: int = 5, budget: int | None = None, within: float = 0.03) -> ReplayReport:
    storage = open_storage(storage_url)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        names = optuna.get_all_study_names(storage)
        raise TuneError(f"no study {study_name!r} in the storage: recorded studies are {', '.join(names) or '(none)'}") from None
    table: dict[str, tuple[dict, TrialState, float | None]] = {}
    dists: dict = {}
    for t in study.get_trials(deepcopy=False):
        if not counts_toward_budget(t) or "repeat_of" in t.user_attrs or not t.params:
            continue
        dists.update(t.distributions)
        ok = t.state == TrialState.COMPLETE and t.user_attrs.get("outcome") == harness.OK
        table.setdefault(config_key(t.params), (dict(t.params), TrialState.COMPLETE if ok else t.state, t.value if ok else None))
    values = [v for _, st, v in table.values() if st == TrialState.COMPLETE]
    if not values:
        raise TuneError(f"study {study_name!r} has no successful trials to replay")
    best = min(values)
    budget = budget or max(30, 3 * len(table))
    default_key = study.user_attrs.get("default_key")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = []
    for name, (factory, note) in _samplers().items():
        res = SamplerResult(name, note=note)
        if factory is not None:
            for seed in range(seeds):
                res.needed.append(_run_one(factory(seed), dists, table, best * (1 + within), budget, default_key))
        results.append(res)
    return ReplayReport(study_name, len(table), best, budget, within, results)


def _run_one(sampler, dists: dict, table: dict, target: float, budget: int, default_key: str | None) -> int | None:
    study = optuna.create_study(sampler=sampler, direction="minimize")
    if default_key:
        study.enqueue_trial(json.loads(default_key))
    for i in range(1, budget + 1):
        trial = study.ask(dists)
        key = config_key(trial.params)
        state, value = (table[key][1], table[key][2]) if key in table else _nearest(trial.params, table)
        study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        if state == TrialState.COMPLETE and value <= target:
            return i
    return None
