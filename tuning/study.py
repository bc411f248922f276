"""One Optuna study per (tile, arch, shape): ask, prune by constraints, compile, check, time, tell.

Trials move through three stages, each in its own place so no config can end the study:
constraints are checked here (an invalid config is pruned with its reason and never
compiled); the kernel is compiled in the compile pool; it is run, checked against the
reference on fresh inputs and timed in a GPU worker. Every trial records its outcome
(``tiles.core.harness`` outcome kinds) and metrics as user attributes. Only ``ok`` trials are
COMPLETE with a value, so a wrong or nondeterministic result can never be the best trial.

Several lanes (threads) run trials concurrently so compilation overlaps timing; several
processes or hosts may share one study through any Optuna storage. A run that is killed
resumes: finished trials count toward ``--trials``, and trials left RUNNING by a dead
process on this host are failed as ``interrupted`` and their configs enqueued again. An
interrupted run (Ctrl-C) records nothing more: its trials in flight are retried the same way.

Compile-only studies compile a space's every config, walking its grid one point at a time,
or, for a space larger than :data:`tuning.space.MAX_COMPILE_GRID` or a ``--trials`` smaller
than the space, a sample: the seeds, then random proposals (each invalid one replaced by the
nearest valid config, as when tuning).
"""

from __future__ import annotations

import datetime
import math
import os
import shlex
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from tiles.core import harness
from tiles.core.arch import Arch, require_present
from tiles.core.config_store import results_dir
from tiles.core.contract import Config, Shape, Tile
from tuning.credentials import mask_argv, mask_url, scrub
from tuning.rematch import needs_rematch, rematch
from tuning.space import (
    MAX_COMPILE_GRID,
    NearbyValidConfigs,
    ValidConfigs,
    config_key,
    distributions,
    grid_configs,
    seed_configs,
    valid_configs,
)
from tuning.workers import WorkerDied, WorkerPool, WorkerTimeout, tile_ref

INTERRUPTED, DUPLICATE = "interrupted", "duplicate"
# A RUNNING trial without an owner older than this was killed right after ask().
ORPHAN_GRACE_S = 60.0
# Metrics copied from an Evaluation into the trial's user attributes.
METRICS = ("ms", "p10_ms", "p90_ms", "tflops", "gbps", "compile_s", "error", "message")
# Configs measured per study when --trials is not given (and sampled by compile-only from a space too large to walk).
DEFAULT_TRIALS = 40


class TuneError(ValueError):
    """Bad tuning input (storage URL, worker count, study name), said in one line."""


@dataclass
class TuneOptions:
    arch: Arch
    trials: int | None = None  # configs measured per study (None: DEFAULT_TRIALS); compile-only: compiled (see study_plan)
    timeout_s: float | None = None  # wall-clock budget per study
    trial_timeout_s: float = 120.0  # one GPU evaluation (load + check + time); a hang past it is killed
    compile_timeout_s: float = 300.0
    storage: str | None = None
    workers: int = 1  # GPU workers, one per local GPU
    compile_jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    compile_only: bool = False
    seed: int = 0
    runs: int = 50
    rematch_rounds: int = 3  # a winner that is not the default, timed again against it this many times each (tuning.rematch)
    results_root: Path | None = None
    evaluator: str = "tuning.workers:evaluate_on_gpu"
    compiler: str = "tuning.workers:compile_task"
    require_gpu: bool = True  # refuse to time for an arch that is not the GPU present
    export: bool = True
    # what results files record as the command that made them, passwords masked (tuning.credentials)
    command: str = field(default_factory=lambda: shlex.join(["lab", *mask_argv(sys.argv[1:])]) if sys.argv else "")


@dataclass
class StudySummary:
    tile: str
    shape: str
    study: str
    trials: int  # finished trials that count toward --trials
    outcomes: dict[str, int]
    best: FrozenTrial | None
    compile_only: bool = False
    ran: int = 0  # trials this process finished (compiled or timed) in this run
    wall_s: float = 0.0
    default: dict | None = None  # the default config (a winner stops counting when the default changes)
    default_trial: FrozenTrial | None = None  # the trial that timed the default, if one did
    rematch: dict | None = None  # the winner's rematch against the default (tuning.rematch.Rematch.to_dict), if one ran

    @property
    def best_ms(self) -> float | None:
        return self.best.user_attrs.get("ms") if self.best else None

    @property
    def default_ms(self) -> float | None:
        return self.default_trial.user_attrs.get("ms") if self.default_trial else None

    @property
    def speedup(self) -> float | None:
        return self.default_ms / self.best_ms if self.default_ms and self.best_ms else None


# --- storage ---------------------------------------------------------------------------------


# SQLAlchemy dialects Optuna's RDB storage runs on (a driver may follow the name: postgresql+psycopg2://).
RDB_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb")
STORAGE_FORMS = "sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB, mysql://USER:PASSWORD@HOST/DB or journal:PATH"
# A server that does not answer is reported after this long, not after the operating system's TCP timeout (minutes).
CONNECT_TIMEOUT_S = 10


def open_storage(url: str | None, root: Path | None = None):
    """An Optuna storage for ``url``: RDB URLs (sqlite/postgresql/mysql), ``journal:PATH`` or a ``*.log`` path; default
    SQLite under results/. Every way a URL can be wrong is a :class:`TuneError` of one line, its password masked
    (:mod:`tuning.credentials`)."""
    if url is None:
        url = f"sqlite:///{(root or results_dir()).resolve() / 'tuning.db'}"
    if url.startswith("journal:") or ("://" not in url and url.endswith((".log", ".jsonl", ".journal"))):
        return _journal_storage(url.removeprefix("journal:"))
    if "://" not in url:
        raise TuneError(f"storage {mask_url(url)!r} is not an Optuna storage URL: use {STORAGE_FORMS}")
    dialect = url.partition("://")[0].partition("+")[0].lower()
    if dialect not in (*RDB_DIALECTS, "postgres"):
        raise TuneError(f"storage {mask_url(url)}: unknown scheme {dialect + '://'!r}: use {STORAGE_FORMS}")
    if dialect == "sqlite":
        _ensure_directory(_sqlite_file(url), url)
    return _rdb_storage(url)


def _journal_storage(path: str):
    """Optuna's journal file storage at ``path`` (its directory made if missing)."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if not path.strip():
        raise TuneError("storage journal: names no file: give journal:PATH, e.g. journal:results/tuning.log")
    file = Path(path).expanduser()
    _ensure_directory(file, f"journal:{path}")
    try:
        return JournalStorage(JournalFileBackend(str(file)))
    except OSError as exc:
        raise TuneError(f"cannot open storage journal:{path}: {exc.strerror or exc}") from None


def _sqlite_file(url: str) -> Path:
    """The database file of a ``sqlite:///PATH`` URL. An in-memory database is refused: SQLAlchemy gives each thread
    its own connection, hence its own empty database, so the study's lanes would not see each other's trials, and no
    other process (a second `lab tune`, `lab tune --replay`) could open it afterwards."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError as exc:
        raise TuneError(f"storage {mask_url(url)}: {exc}: use {STORAGE_FORMS}") from None
    path = (parsed.database or "").removeprefix("file:").partition("?")[0]
    if path in ("", ":memory:") or parsed.query.get("mode") == "memory" or "mode=memory" in (parsed.database or ""):
        raise TuneError(
            f"storage {mask_url(url)} is an in-memory SQLite database, which the tuner's threads and processes cannot share: "
            "give a file, sqlite:///PATH (or leave --storage out for results/tuning.db)"
        )
    return Path(path).expanduser()


def _ensure_directory(file: Path, shown: str) -> None:
    """Make the directory ``file`` goes in; a :class:`TuneError` naming it when it cannot be made or written to."""
    directory = file.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a directory" if blocking else exc.strerror or str(exc)
        raise TuneError(f"storage {mask_url(shown)}: cannot make its directory {directory}: {why}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TuneError(f"storage {mask_url(shown)}: its directory {directory} is not writable: choose a path you can write to")
    if file.is_dir():
        raise TuneError(f"storage {mask_url(shown)}: {file} is a directory: name a file in it")


def _rdb_storage(url: str):
    """Optuna's RDB storage on ``url``; a missing driver, a server that refuses or does not answer, a file SQLite cannot
    open: one line each, the password masked."""
    shown = mask_url(url)
    dialect = url.partition("://")[0].partition("+")[0].lower()
    engine_url = _with_available_driver(url)
    if dialect == "sqlite":
        # SQLite serialises writers; a generous busy timeout lets several lanes and processes share the file.
        kwargs = {"connect_args": {"timeout": 120}}
    else:
        kwargs = {"pool_pre_ping": True}
        if "connect_timeout" not in url:
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        storage = optuna.storages.RDBStorage(engine_url, engine_kwargs=kwargs)
    except ImportError:
        raise TuneError(
            f"storage {shown}: no database driver for {dialect} is installed: PostgreSQL needs psycopg (pip install "
            "'psycopg[binary]'), MySQL needs mysqlclient (or pymysql, with mysql+pymysql://)"
        ) from None
    except Exception as exc:  # noqa: BLE001  (server down, bad credentials, unreadable file: all one line for the user)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TuneError(scrub(f"cannot open storage {shown}: {type(exc).__name__}: {message}", url)) from None
    if dialect == "sqlite":
        _sqlite_wal(storage.engine)
    return storage


def _sqlite_wal(engine) -> None:
    """WAL lets readers and one writer proceed together; synchronous=NORMAL skips an fsync per commit yet survives a killed process."""
    import sqlalchemy

    def on_connect(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    sqlalchemy.event.listen(engine, "connect", on_connect)
    engine.dispose()  # connections made before the listener existed are dropped


def _with_available_driver(url: str) -> str:
    """``postgresql://`` means psycopg 3 to SQLAlchemy 2.1; use psycopg2 when only it is installed. ``postgres://`` (what
    Heroku and others hand out) is PostgreSQL's other name, which SQLAlchemy no longer takes."""
    import importlib.util

    if url.startswith("postgres://"):
        url = "postgresql://" + url.split("://", 1)[1]
    no_psycopg3 = importlib.util.find_spec("psycopg") is None
    if url.startswith("postgresql://") and no_psycopg3 and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def study_name(tile: Tile, arch: Arch, shape: Shape, compile_only: bool = False) -> str:
    return f"{tile.name}:{arch.name}:{shape.name}" + (":compile" if compile_only else "")


def study_plan(space_size: int, trials: int | None, compile_only: bool) -> tuple[bool, int | None]:
    """``(walk, budget)`` of a study: whether it walks the whole grid (compile-only, one point at a time) and how many
    configs it may measure or compile (None: no limit but the grid's end).

    Tuning measures ``trials`` (default :data:`DEFAULT_TRIALS`). Compile-only without ``--trials`` compiles every config
    of a space up to :data:`MAX_COMPILE_GRID` points and a sample of :data:`DEFAULT_TRIALS` from a larger one; with
    ``--trials N`` it compiles at most N configs, the whole grid when that has at most N points."""
    if not compile_only:
        return False, trials or DEFAULT_TRIALS
    if trials is None:
        return (True, None) if space_size <= MAX_COMPILE_GRID else (False, DEFAULT_TRIALS)
    return space_size <= trials, trials


def _sampler(seed: int, compile_only: bool = False):
    if compile_only:
        # a compile-only sample should cover the space; TPE would chase the shortest compile times
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar keeps concurrent lanes from all sampling the same point while results are pending.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=8)


# --- trial bookkeeping -----------------------------------------------------------------------


def trial_config(t: FrozenTrial) -> Config:
    """A trial's config: its params, or for a trial still waiting in the queue, its enqueued params."""
    return dict(t.params) if t.params else dict(t.system_attrs.get("fixed_params", {}))


def counts_toward_budget(t: FrozenTrial) -> bool:
    """Finished trials with a recorded outcome (what a study has done)."""
    return t.state.is_finished() and t.user_attrs.get("outcome") not in (None, INTERRUPTED, DUPLICATE)


def uses_budget(t: FrozenTrial) -> bool:
    """Trials that cost a compile or a GPU run: ``--trials`` counts configs measured. A config pruned by a constraint
    costs nothing (in the first H200 run 7 of 10 attention trials were pruned, leaving 3 measured configs per shape),
    nor does a repeat answered from the record (once TPE models a study it proposes its best config again)."""
    return counts_toward_budget(t) and t.user_attrs.get("outcome") != harness.INVALID and "repeat_of" not in t.user_attrs


# Pruned configs allowed per trial of budget before a study stops asking (a space that is
# almost all invalid for a shape must still end).
MAX_INVALID_PER_TRIAL = 20


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_interrupted(study: optuna.Study) -> int:
    """Fail trials left RUNNING by a dead process on this host and enqueue their configs again; returns how many."""
    host = socket.gethostname()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "owner" not in t.user_attrs:
            # Killed between ask() and recording its owner (milliseconds apart): dead on any host once old enough.
            started = t.datetime_start
            if started is None or (datetime.datetime.now(started.tzinfo) - started).total_seconds() < ORPHAN_GRACE_S:
                continue
        else:
            owner_host, _, pid = str(t.user_attrs["owner"]).rpartition(":")
            if owner_host != host or not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
                continue
        study._storage.set_trial_user_attr(t._trial_id, "outcome", INTERRUPTED)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        if trial_config(t):
            study.enqueue_trial(trial_config(t), user_attrs={"source": f"retry of trial {t.number}"})
        n += 1
    return n


def _timed_ok(t: FrozenTrial) -> bool:
    """A finished trial that timed a config which passed its checks (a repeat's time is its first trial's)."""
    return t.state == TrialState.COMPLETE and t.user_attrs.get("outcome") == harness.OK and "repeat_of" not in t.user_attrs


def find_default_trial(trials: list[FrozenTrial], default: Config) -> FrozenTrial | None:
    """The first of ``trials`` that timed ``default`` and passed, or None (the study's baseline for speedups)."""
    key = config_key(default)
    return next((t for t in trials if _timed_ok(t) and t.user_attrs.get("config_key") == key), None)


def summarize(study: optuna.Study, tile: Tile, shape: Shape, default: Config, compile_only: bool) -> StudySummary:
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if counts_toward_budget(t)]
    outcomes = Counter(t.user_attrs["outcome"] for t in done)
    ok = [t for t in done if _timed_ok(t)]
    best = None if compile_only or not ok else min(ok, key=lambda t: t.value)
    default_trial = find_default_trial(done, default)
    return StudySummary(
        tile.name,
        shape.name,
        study.study_name,
        len(done),
        dict(outcomes),
        best,
        compile_only,
        default=dict(default),
        default_trial=default_trial,
    )


# --- running one study ----------------------------------------------------------------------


class StudyRunner:
    """Runs trials of one study across lanes that share the compile pool and the GPU workers."""

    def __init__(
        self, tile: Tile, shape: Shape, opts: TuneOptions, storage, compile_pool: WorkerPool, gpu_pool: WorkerPool | None, progress=None
    ):
        self.tile, self.shape, self.opts = tile, shape, opts
        self.arch = opts.arch
        self.space = tile.search_space(self.arch)
        self.dists = distributions(self.space)
        self.default = dict(tile.default_config(self.arch))
        self.compile_pool, self.gpu_pool, self.progress = compile_pool, gpu_pool, progress
        self.name = study_name(tile, self.arch, shape, opts.compile_only)
        self.walk, self.budget = study_plan(self.space.size(), opts.trials, opts.compile_only)
        self.study = optuna.create_study(
            storage=storage,
            study_name=self.name,
            direction="minimize",
            sampler=_sampler(opts.seed, opts.compile_only),
            load_if_exists=True,
        )
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._in_flight = 0
        self._consecutive_repeats = 0
        self._ran = 0
        # set by prepare() where invalid proposals are replaced (see ValidConfigs, NearbyValidConfigs)
        self.valid: ValidConfigs | NearbyValidConfigs | None = None
        # a walk's grid, read as lanes ask for trials, and the configs the study holds or this run queued
        self._grid: Iterator[Config] | None = None
        self._queued: set[str] = set()
        # set when the run is interrupted: lanes record nothing more (their trials are retried as interrupted)
        self._stopping = threading.Event()

    # -- setup --
    def prepare(self) -> None:
        """Recover interrupted trials; on a new study, enqueue the seeds (default first), or the whole grid where the
        budget covers it; a compile-only walk queues its grid's points one at a time instead (:meth:`_queue_from_grid`)."""
        self.study.set_user_attr("tile", self.tile.name)
        self.study.set_user_attr("arch", self.arch.name)
        self.study.set_user_attr("shape", self.shape.name)
        self.study.set_user_attr("default_key", config_key(self.default))
        recover_interrupted(self.study)
        self._queued = {config_key(trial_config(t)) for t in self.study.get_trials(deepcopy=False)}
        if self.walk:
            self._grid = grid_configs(self.space, self.default)
            return
        configs = seed_configs(self.tile, self.shape, self.arch, self.opts.results_root)
        if self.space.size() <= self.budget:
            # The budget covers the whole grid: measuring every config beats sampling it.
            configs += [(c, "grid") for c in grid_configs(self.space)]
        elif self.space.constraints:
            self.valid = valid_configs(self.space, self.shape, self.arch, seed=self.opts.seed, kernel_key=self._kernel_key)
        if self.opts.compile_only and self.opts.trials is None and self.progress is not None:
            self.progress.note(
                f"{self.tile.name} {self.shape.name}: {self.space.size():,} configs, too many to compile each: "
                f"{self.budget} sampled (--trials N for another number)"
            )
        for config, source in configs:
            if config_key(config) not in self._queued:
                self._queued.add(config_key(config))
                self.study.enqueue_trial(config, user_attrs={"source": source})

    def _queue_from_grid(self) -> bool:
        """Enqueue the walk's next grid point the study does not hold yet; False at the grid's end. A point another
        process queues at the same moment is compiled once (the later trial is a duplicate, see :meth:`run_trial`)."""
        for config in self._grid:
            key = config_key(config)
            if key not in self._queued:
                self._queued.add(key)
                self.study.enqueue_trial(config, user_attrs={"source": "grid"})
                return True
        return False

    # -- the loop --
    def _next_trial(self, deadline: float | None):
        with self._lock:
            if self._stopping.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            trials = self.study.get_trials(deepcopy=False)
            if self.budget is not None and sum(uses_budget(t) for t in trials) + self._in_flight >= self.budget:
                return None
            if self.walk:
                # the grid is finite and every point is asked for once: none of the sampler's stopping rules apply
                if not any(t.state == TrialState.WAITING for t in trials) and not self._queue_from_grid():
                    return None
                trial = self.study.ask(self.dists)
                self._in_flight += 1
                return trial
            if sum(t.user_attrs.get("outcome") == harness.INVALID for t in trials) >= MAX_INVALID_PER_TRIAL * self.budget:
                return None
            if self._consecutive_repeats >= max(20, 2 * self.space.size() if self.space.size() <= 4096 else 20):
                return None  # the sampler keeps returning configs already measured: the space is exhausted
            if (
                self.valid is not None
                and self.valid.exhaustible
                and self.valid.ready
                and len(self._tried_kernels(trials)) >= len(self.valid)
            ):
                return None  # every valid config has been tried or is in flight: nothing new to measure
            trial = self.study.ask(self.dists)
            self._in_flight += 1
            return trial

    def lane(self, deadline: float | None) -> None:
        while (trial := self._next_trial(deadline)) is not None:
            try:
                self.run_trial(trial)
            except Exception:
                if not self._stopping.is_set():
                    raise
                return  # interrupted: the pools were shut under this trial, which the next run retries
            finally:
                with self._lock:
                    self._in_flight -= 1

    def run(self) -> StudySummary:
        self.prepare()
        t0 = time.monotonic()
        deadline = None if self.opts.timeout_s is None else t0 + self.opts.timeout_s
        n_lanes = len(self.compile_pool.workers) + (len(self.gpu_pool.workers) if self.gpu_pool else 0)
        lanes = [threading.Thread(target=self.lane, args=(deadline,), daemon=True) for _ in range(max(1, n_lanes))]
        for t in lanes:
            t.start()
        try:
            for t in lanes:
                # joined in short waits: a Ctrl-C that the kernel hands to another thread (the main thread blocks SIGINT
                # while it starts a worker) is only acted on when this thread runs Python again, and a plain join()
                # would not return until the study ended
                while t.is_alive():
                    t.join(0.1)
        except KeyboardInterrupt:
            # Ctrl-C reaches this thread only; the lanes stop recording, and tune() shuts the workers down
            self._stopping.set()
            raise
        summary = summarize(self.study, self.tile, self.shape, self.default, self.opts.compile_only)
        self._rematch(summary)
        summary.ran, summary.wall_s = self._ran, time.monotonic() - t0
        return summary

    def _rematch(self, summary: StudySummary) -> None:
        """A winner that is not the default stays the study's result only if it beats the default again, timed
        alternately in the same worker (:mod:`tuning.rematch`); otherwise the default's trial takes its place."""
        if self.gpu_pool is None or self.opts.rematch_rounds < 1 or summary.best is None:
            return
        challenger = trial_config(summary.best)
        if not needs_rematch(challenger, self.default, summary.default_trial is not None):
            return
        result = rematch(challenger, self.default, self.tile, self.shape, self.opts, self.gpu_pool, self.opts.rematch_rounds)
        summary.rematch = result.to_dict()
        if not result.kept:
            summary.best = summary.default_trial
        if self.progress is not None:
            verdict = "kept" if result.kept else "the default stays"
            how = (
                f"stopped: {result.error}"
                if result.error
                else f"winner {result.speedup:.3f}x the default (medians), faster in {result.rounds_won} of {len(result.default_ms)} rounds"
            )
            self.progress.note(f"{self.tile.name} {self.shape.name}: rematch {how}: {verdict}")

    # -- one trial --
    def _finish(self, trial: optuna.Trial, attrs: dict, state: TrialState, value: float | None = None) -> None:
        if self._stopping.is_set():
            return  # interrupted: a compile cut short is no result; the trial stays RUNNING and the next run retries it
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        with self._lock:
            self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
            if attrs.get("outcome") != DUPLICATE and "repeat_of" not in attrs:
                self._ran += 1
        if self.progress is not None:
            self.progress.on_trial(self, trial.number, attrs, dict(trial.params), trial.user_attrs.get("source"))

    def _kernel_key(self, config: Config) -> str:
        """The tile's key for the kernel ``config`` builds at this shape (:meth:`tiles.core.contract.Tile.kernel_key`); a
        tile whose key raises on some config keys it by the config alone (a bad config never stops the study)."""
        try:
            return self.tile.kernel_key(self.shape, config, self.arch)
        except Exception:  # noqa: BLE001
            return config_key(config)

    def _trial_kernel(self, t: FrozenTrial) -> str:
        return t.user_attrs.get("kernel_key") or self._kernel_key(trial_config(t))

    def _tried_kernels(self, trials: list[FrozenTrial]) -> set[str]:
        """Distinct kernels measured, failed or in flight (the configs a constraint refused build none)."""
        skip = (harness.INVALID, DUPLICATE, INTERRUPTED)
        return {self._trial_kernel(t) for t in trials if t.state != TrialState.WAITING and t.user_attrs.get("outcome") not in skip}

    def _enqueue_nearest_valid(self, number: int, config: Config) -> None:
        """Queue the untried valid config nearest to an invalid proposal (:class:`tuning.space.ValidConfigs`, or
        :class:`tuning.space.NearbyValidConfigs` for a space too large to enumerate)."""
        if self.valid is None:
            return
        self.valid.wait()  # for the enumeration, outside the lock, so other lanes can record their results meanwhile
        with self._lock:
            trials = self.study.get_trials(deepcopy=False)
            tried, tried_kernels = {config_key(trial_config(t)) for t in trials}, self._tried_kernels(trials)
        # outside the lock: a search around the proposal (NearbyValidConfigs) can take a few hundred milliseconds; two
        # lanes that queue the same config meanwhile measure it once (the second is a duplicate or a repeat)
        nearest = self.valid.nearest(config, exclude=tried, exclude_kernels=tried_kernels)
        if nearest is not None:
            with self._lock:
                self.study.enqueue_trial(nearest, user_attrs={"source": f"nearest valid to trial {number}"})

    def _same_kernel_as_another(self, trial: optuna.Trial, config: Config) -> bool:
        """Record the trial's kernel key; when another config built that kernel, answer from its record (a repeat, no
        budget) or, while it is in flight, leave it to that trial (duplicate). Checked and recorded under the lock, so
        two lanes with two configs of one kernel run it once. True when the trial is finished here."""
        kernel, key = self._kernel_key(config), config_key(config)
        with self._lock:
            others = [
                t
                for t in self.study.get_trials(deepcopy=False)
                if t.number != trial.number
                and t.user_attrs.get("kernel_key") == kernel
                and t.user_attrs.get("outcome") not in (INTERRUPTED, DUPLICATE, harness.INVALID)
            ]
            trial.set_user_attr("kernel_key", kernel)
            finished = sorted((t for t in others if counts_toward_budget(t)), key=lambda t: ("repeat_of" in t.user_attrs, t.number))
            self._consecutive_repeats = self._consecutive_repeats + 1 if finished else 0
        if finished:
            src = finished[0]  # the measurement itself where there is one, else a repeat of it
            first = src.user_attrs.get("repeat_of", src.number)
            skip = ("owner", "source", "config_key", "kernel_key", "repeat_of", "same_kernel_as")
            attrs = {k: v for k, v in src.user_attrs.items() if k not in skip} | {"repeat_of": first, "same_kernel_as": first}
            self._finish(trial, attrs, src.state, src.value)
            return True
        if others:
            msg = f"same kernel as trial {others[0].number} (config {config_key(trial_config(others[0]))}, here {key})"
            self._finish(trial, {"outcome": DUPLICATE, "message": msg}, TrialState.PRUNED)
            return True
        return False

    def run_trial(self, trial: optuna.Trial) -> None:
        config = {name: trial.params[name] for name in self.space.names()}
        key = config_key(config)
        trial.set_user_attr("owner", self.owner)
        trial.set_user_attr("config_key", key)
        if self.walk and "fixed_params" not in self.study._storage.get_trial_system_attrs(trial._trial_id):
            # A compile-only walk runs the enqueued grid. A trial the sampler made up (another lane or process took the last
            # queued one between the check and the ask) is dropped: processes sharing a study sample with the same seed,
            # so two of them can make up the same config at once, each before the other's params are written, and the
            # duplicate check below would see neither (CI, PostgreSQL: one config compiled twice).
            self._finish(trial, {"outcome": DUPLICATE, "message": "compile-only: not from the grid's queue"}, TrialState.PRUNED)
            return
        earlier = [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.number < trial.number
            and config_key(trial_config(t)) == key
            and t.user_attrs.get("outcome") not in (INTERRUPTED, DUPLICATE)
        ]
        finished = [t for t in earlier if counts_toward_budget(t)]
        if finished:
            # A config measured before: its recorded result informs the sampler without a second compile.
            with self._lock:
                self._consecutive_repeats += 1
            src = finished[0]
            attrs = {k: v for k, v in src.user_attrs.items() if k not in ("owner", "source", "config_key")} | {"repeat_of": src.number}
            self._finish(trial, attrs, src.state, src.value)
            return
        if earlier:
            # The same config is queued or running elsewhere (another lane, process or host): it is done there, once.
            self._finish(trial, {"outcome": DUPLICATE, "message": f"same config as trial {earlier[0].number}"}, TrialState.PRUNED)
            return

        reasons = self.space.violations(config, self.shape, self.arch)
        if reasons:
            with self._lock:
                self._consecutive_repeats = 0
            self._enqueue_nearest_valid(trial.number, config)  # before the tell: this lane's next ask takes it
            self._finish(trial, {"outcome": harness.INVALID, "message": "; ".join(reasons)}, TrialState.PRUNED)
            return
        if self._same_kernel_as_another(trial, config):
            return

        ref = tile_ref(self.tile)
        try:
            ev = self.compile_pool.call(self.opts.compiler, (ref, self.shape.name, config, self.arch.name), self.opts.compile_timeout_s)
        except WorkerTimeout as exc:
            ev = {"outcome": harness.TIMEOUT, "message": f"compile: {exc}"}
        except (WorkerDied, RuntimeError) as exc:
            ev = {"outcome": harness.COMPILE_ERROR, "message": f"compile worker: {exc}"}
        compile_s = ev.get("compile_s")
        if ev["outcome"] != harness.OK or self.opts.compile_only:
            attrs = {k: ev.get(k) for k in ("outcome", *METRICS)} | (ev.get("extra") or {})
            ok = ev["outcome"] == harness.OK
            self._finish(trial, attrs, TrialState.COMPLETE if ok else TrialState.FAIL, compile_s if ok else None)
            return

        args = (ref, self.shape.name, config, self.arch.name, trial.number, self.opts.runs)
        res = self.gpu_pool.evaluate(self.opts.evaluator, args, self.opts.trial_timeout_s)
        attrs = {k: res.get(k) for k in ("outcome", *METRICS)} | (res.get("extra") or {})
        attrs["compile_s"] = compile_s  # the pool's real compile time; the GPU worker's cache load is load_s
        ok = res["outcome"] == harness.OK and res.get("ms") is not None and math.isfinite(res["ms"])
        self._finish(trial, attrs, TrialState.COMPLETE if ok else TrialState.FAIL, res.get("ms") if ok else None)


# --- the whole run --------------------------------------------------------------------------


def select_shapes(tile: Tile, which: str) -> list[Shape]:
    """``decode``, ``prefill``, ``all`` (shapes whose phase is ``any`` belong to both), or
    comma-separated shape names (a tile without any of the named shapes gets none)."""
    if which in ("decode", "prefill", "all"):
        return [s for s in tile.shapes() if which == "all" or s.phase in (which, "any")]
    names = {n.strip() for n in which.split(",") if n.strip()}
    if not names:
        raise TuneError(f"--shapes {which!r}: choose decode, prefill, all or shape names")
    return [s for s in tile.shapes() if s.name in names]


def tune(tiles: list[Tile], opts: TuneOptions, shapes: str = "all", progress=None) -> list[StudySummary]:
    """Tune (or, compile-only, validate) every tile on every selected shape; exports winners unless compile-only."""
    from tuning.export import export_results

    if opts.trials is not None and opts.trials < 1:
        raise TuneError(f"--trials {opts.trials}: need at least 1")
    for flag, seconds in (
        ("--timeout", opts.timeout_s),
        ("--trial-timeout", opts.trial_timeout_s),
        ("--compile-timeout", opts.compile_timeout_s),
    ):
        if seconds is not None and not seconds > 0:
            raise TuneError(f"{flag} {seconds:g}: give a number of seconds above 0")
    if not any(select_shapes(tile, shapes) for tile in tiles):
        known = sorted({s.name for tile in tiles for s in tile.shapes()})
        raise TuneError(f"--shapes {shapes!r} selects no shape of these tiles: use decode, prefill, all or names from {', '.join(known)}")
    if opts.workers < 1 or opts.compile_jobs < 1:
        raise TuneError("--workers and --compile-jobs need at least 1")
    if opts.rematch_rounds < 0:
        raise TuneError(f"--rematch {opts.rematch_rounds}: give the rounds of a winner's rematch against the default, 0 for none")
    if not opts.compile_only and opts.require_gpu:
        require_present(opts.arch)
        import torch

        if torch.cuda.device_count() < opts.workers:
            raise TuneError(f"--workers {opts.workers} but only {torch.cuda.device_count()} GPU(s) are present: one worker per GPU")
    storage = open_storage(opts.storage, opts.results_root)
    compile_pool = WorkerPool.compile_pool(opts.compile_jobs)
    gpu_pool = None if opts.compile_only else WorkerPool.gpu_pool(opts.workers)
    summaries: list[StudySummary] = []
    grace_s = 3.0  # for a busy worker to finish at the end of a run; none on Ctrl-C
    try:
        for tile in tiles:
            why = tile.support_reason(opts.arch)
            if why:
                if progress is not None:
                    progress.note(f"{tile.name}: skipped on {opts.arch.name} ({why})")
                continue
            by_tile = []
            for shape in select_shapes(tile, shapes):
                runner = StudyRunner(tile, shape, opts, storage, compile_pool, gpu_pool, progress)
                if progress is not None:
                    progress.start_study(runner)
                summary = runner.run()
                if progress is not None:
                    progress.end_study(runner, summary)
                by_tile.append(summary)
            summaries += by_tile
            if opts.export and not opts.compile_only and any(s.best for s in by_tile):
                path = export_results(tile, opts.arch, by_tile, opts.command, opts.results_root)
                if progress is not None:
                    progress.note(f"{tile.name}: winners written to {path}")
    except KeyboardInterrupt:
        grace_s = 0.0
        raise
    finally:
        compile_pool.close(grace_s)
        if gpu_pool is not None:
            gpu_pool.close(grace_s)
    return summaries
