"""`lab tune` as a user meets it on a CPU: storage URLs (passwords masked, every bad one a one-line error), argument
checks, `--trials` with `--compile-only`, a compile-only walk or sample that never lists a space whole, the compile-only
table, TileLang's log off stdout, a clean Ctrl-C, git-ignored SQLite side files and a `lab --help` that imports no torch.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_tuning_toys as toys
from rich.console import Console

from lab.cli import build_parser, main
from tiles.core import harness
from tiles.core.arch import get_arch
from tiles.core.contract import Constraint, Param, SearchSpace
from tuning.credentials import mask_argv, mask_url, scrub
from tuning.progress import TuneProgress
from tuning.space import MAX_COMPILE_GRID, grid_configs
from tuning.study import DEFAULT_TRIALS, StudySummary, TuneError, TuneOptions, open_storage, study_plan, tune, uses_budget

REPO = Path(__file__).resolve().parent.parent
SM90 = get_arch("sm90")
PASSWORD = "s3cr3t-Pw"
# nothing listens on port 1: the connection is refused at once
UNREACHABLE = f"postgresql://lab:{PASSWORD}@127.0.0.1:1/studies"
# one small shape of a small space: compiles in seconds on a CPU
FP4_COMPILE = ["tune", "--arch", "sm90", "--tile", "fp4_quant_main", "--shapes", "decode_b64", "--compile-only"]


def _tune_args(tmp_path: Path, *extra: str) -> list[str]:
    return [*FP4_COMPILE, "--results", str(tmp_path / "results"), *extra]


def _one_line_error(capsys) -> str:
    """The single line `lab` printed on stderr (nothing on stdout, no traceback)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    return lines[0]


# --- passwords ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://lab:s3cret@db.example:5432/studies", "postgresql://lab:***@db.example:5432/studies"),
        ("postgresql+psycopg2://lab:s3cret@db/studies", "postgresql+psycopg2://lab:***@db/studies"),
        ("mysql+pymysql://root:pa@ss/word@db/studies", "mysql+pymysql://root:***@db/studies"),
        ("postgresql://lab:p%40ss@db/studies", "postgresql://lab:***@db/studies"),
        ("postgresql://lab@db/studies?password=s3cret&sslmode=require", "postgresql://lab@db/studies?password=***&sslmode=require"),
        ("postgresql://lab@db/studies", "postgresql://lab@db/studies"),
        ("postgresql://db:5432/studies", "postgresql://db:5432/studies"),
        ("sqlite:////tmp/a@b/tuning.db", "sqlite:////tmp/a@b/tuning.db"),
        ("journal:results/tuning.log", "journal:results/tuning.log"),
    ],
    ids=["postgres", "driver", "raw-at-and-slash", "percent-encoded", "query", "no-password", "no-user", "sqlite-at", "journal"],
)
def test_mask_url_hides_the_password_and_nothing_else(url, shown):
    assert mask_url(url) == shown
    assert mask_argv(["--storage", url, f"--storage={url}"]) == ["--storage", shown, f"--storage={shown}"]


def test_scrub_blanks_a_password_quoted_anywhere_in_a_message():
    url = "postgresql://lab:p%40ss@db/studies"
    text = f"cannot connect to {url}: password 'p@ss' rejected (p%40ss)"
    assert scrub(text, url) == "cannot connect to postgresql://lab:***@db/studies: password '***' rejected (***)"


def test_a_failing_connection_never_shows_the_password():
    with pytest.raises(TuneError) as err:
        open_storage(UNREACHABLE)
    message = str(err.value)
    assert PASSWORD not in message and "\n" not in message
    assert "postgresql://lab:***@127.0.0.1:1/studies" in message


def test_the_recorded_command_masks_the_password(tmp_path, monkeypatch):
    """The `command:` a results file records is ``args.invocation`` (tuning.export writes TuneOptions.command)."""
    import tuning.study

    seen = {}
    monkeypatch.setattr(tuning.study, "tune", lambda tiles, opts, shapes, progress: seen.setdefault("opts", opts) and [])
    assert main(_tune_args(tmp_path, "--storage", UNREACHABLE)) == 0
    command = seen["opts"].command
    assert PASSWORD not in command and "--storage postgresql://lab:***@127.0.0.1:1/studies" in " ".join(shlex.split(command))
    # the default command of TuneOptions made by a script: the process's own argv
    monkeypatch.setattr(sys, "argv", ["lab", "tune", f"--storage={UNREACHABLE}"])
    assert PASSWORD not in TuneOptions(arch=SM90).command


# --- storage URLs: one line each ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        ("sqlite://", "storage sqlite:// is an in-memory SQLite database, which the tuner's threads and processes cannot share"),
        ("sqlite:///:memory:", "storage sqlite:///:memory: is an in-memory SQLite database"),
        ("journal:", "storage journal: names no file: give journal:PATH"),
        ("journal:{tmp}/plain.txt/study.log", "cannot make its directory {tmp}/plain.txt: {tmp}/plain.txt is a file, not a directory"),
        ("sqlite:///{tmp}/plain.txt/tuning.db", "{tmp}/plain.txt is a file, not a directory"),
        ("journal:/proc/self/study.log", "its directory /proc/self is not writable"),
        ("journal:{tmp}", "is a directory: name a file in it"),
        ("mongodb://lab:s3cr3t-Pw@db/studies", "storage mongodb://lab:***@db/studies: unknown scheme 'mongodb://'"),
        ("results/tune.db", "storage 'results/tune.db' is not an Optuna storage URL"),
        (UNREACHABLE, "cannot open storage postgresql://lab:***@127.0.0.1:1/studies: OperationalError"),
    ],
    ids=["sqlite-no-path", "sqlite-memory", "journal-empty", "journal-dir-is-file", "sqlite-dir-is-file", "unwritable", "journal-dir",
         "unknown-scheme", "no-scheme", "unreachable-postgres"],
)  # fmt: skip
def test_every_bad_storage_is_a_one_line_error(tmp_path, capsys, storage, expected):
    (tmp_path / "plain.txt").write_text("a file where a directory is expected")
    rc = main(_tune_args(tmp_path, "--storage", storage.format(tmp=tmp_path)))
    line = _one_line_error(capsys)
    assert rc == 2 and line.startswith("lab tune: error: ")
    assert expected.format(tmp=tmp_path) in line and PASSWORD not in line


def test_a_missing_directory_is_made_for_the_study(tmp_path):
    open_storage(f"journal:{tmp_path / 'new' / 'dir' / 'study.log'}")
    open_storage(f"sqlite:///{tmp_path / 'other' / 'tuning.db'}")
    assert (tmp_path / "new" / "dir" / "study.log").is_file() and (tmp_path / "other" / "tuning.db").is_file()


# --- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--timeout", "-5", "argument --timeout: -5 is not a time limit: give a number of seconds above 0"),
        ("--timeout", "0", "argument --timeout: 0 is not a time limit"),
        ("--timeout", "nan", "argument --timeout: nan is not a time limit"),
        ("--trial-timeout", "-1", "argument --trial-timeout: -1 is not a time limit"),
        ("--compile-timeout", "0", "argument --compile-timeout: 0 is not a time limit"),
        ("--timeout", "soon", "argument --timeout: 'soon' is not a number of seconds"),
        ("--trials", "0", "argument --trials: 0 is not a positive count: give 1 or more"),
        ("--trials", "-3", "argument --trials: -3 is not a positive count"),
        ("--workers", "0", "argument --workers: 0 is not a positive count"),
        ("--compile-jobs", "0", "argument --compile-jobs: 0 is not a positive count"),
        ("--compile-jobs", "2.5", "argument --compile-jobs: '2.5' is not a whole number"),
        ("--rematch", "-1", "argument --rematch: -1 is negative: give 0 or more"),
    ],
)
def test_bad_numbers_are_refused_while_parsing(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        main([*FP4_COMPILE, flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith(f"lab tune: error: {message}")


def test_good_numbers_parse():
    args = build_parser().parse_args(
        ["tune", "--timeout", "2.5", "--trials", "3", "--workers", "1", "--compile-jobs", "2", "--rematch", "0"]
    )
    assert (args.timeout, args.trials, args.workers, args.compile_jobs, args.rematch) == (2.5, 3, 1, 2, 0)
    assert build_parser().parse_args(["tune"]).trials is None  # the study's own default (study_plan)


def test_the_api_refuses_what_the_parser_refuses(tmp_path):
    base = {"arch": SM90, "storage": f"sqlite:///{tmp_path / 't.db'}", "require_gpu": False, "compile_only": True}
    for kw, flag in [({"timeout_s": -5}, "--timeout -5"), ({"trial_timeout_s": 0}, "--trial-timeout 0"), ({"trials": 0}, "--trials 0")]:
        with pytest.raises(TuneError, match=flag):
            tune([toys.ScaleToy()], TuneOptions(**(base | kw)))


# --- --trials with --compile-only ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "trials", "compile_only", "plan"),
    [
        (36, None, False, (False, DEFAULT_TRIALS)),
        (36, 10, False, (False, 10)),
        (36, None, True, (True, None)),
        (MAX_COMPILE_GRID, None, True, (True, None)),
        (MAX_COMPILE_GRID + 1, None, True, (False, DEFAULT_TRIALS)),
        (53_747_712, 20, True, (False, 20)),
        (36, 36, True, (True, 36)),
        (36, 3, True, (False, 3)),
    ],
    ids=["tune-default", "tune-trials", "walk", "walk-largest", "sample-larger", "sample-compressor", "trials-cover-grid", "sample"],
)
def test_study_plan(size, trials, compile_only, plan):
    assert study_plan(size, trials, compile_only) == plan


def _opts(tmp_path: Path, **kw) -> TuneOptions:
    base = {
        "arch": SM90,
        "storage": f"sqlite:///{tmp_path / 'tune.db'}",
        "compile_jobs": 1,
        "require_gpu": False,
        "results_root": tmp_path / "results",
        "compile_only": True,
        "command": "pytest",
    }
    return TuneOptions(**(base | kw))


def _study_trials(opts: TuneOptions, summary: StudySummary) -> list:
    import optuna

    return optuna.load_study(study_name=summary.study, storage=open_storage(opts.storage)).get_trials()


def test_compile_only_honours_trials(tmp_path):
    """`--trials 3 --compile-only`: three configs compiled (a constraint's refusals are free), the default first."""
    opts = _opts(tmp_path, trials=3)
    [summary] = tune([toys.ScaleToy()], opts, "decode")
    trials = _study_trials(opts, summary)
    assert sum(uses_budget(t) for t in trials) == 3
    assert trials[0].params == toys.ScaleToy().default_config(SM90) and trials[0].user_attrs["source"] == "default"


def test_compile_only_without_trials_walks_the_whole_grid(tmp_path):
    opts = _opts(tmp_path)
    [summary] = tune([toys.ScaleToy()], opts, "decode")
    space = toys.ScaleToy().search_space(SM90)
    assert summary.trials == space.size() == summary.outcomes[harness.OK] + summary.outcomes[harness.INVALID]
    assert _study_trials(opts, summary)[0].params == toys.ScaleToy().default_config(SM90)


class HugeToy(toys.ScaleToy):
    """ScaleToy with 24 more parameters of 10 choices: 10^24 points, a space no one can list (the compressor's 53.7M
    points took 22.7 GB listed); one config in ten is valid."""

    name = "toy_huge"

    def search_space(self, arch):
        base = super().search_space(arch)
        extra = tuple(Param(f"knob{i}", tuple(range(10))) for i in range(24))
        odd = Constraint("knob0 is 0", lambda c, s, a: None if c.get("knob0", 0) == 0 else "knob0 must be 0")
        return SearchSpace(base.params + extra, (*base.constraints, odd))

    def default_config(self, arch):
        return super().default_config(arch) | {f"knob{i}": 0 for i in range(24)}


TILES = [HugeToy()]


def test_compile_only_samples_a_space_too_large_to_list(tmp_path):
    """`lab tune --tile all --compile-only` was killed at 22.7 GB resident listing the compressor's grid; a space of
    10^24 points now finishes with --trials configs compiled, each refused proposal replaced by a valid neighbour."""
    tile = HugeToy()
    first = next(grid_configs(tile.search_space(SM90), tile.default_config(SM90)))  # lazy: the default, at once
    assert first == tile.default_config(SM90)
    opts = _opts(tmp_path, trials=4, compile_jobs=2)
    [summary] = tune([tile], opts, "decode")
    trials = _study_trials(opts, summary)
    assert sum(uses_budget(t) for t in trials) == 4 and summary.outcomes[harness.OK] >= 4


# --- the compile-only display -------------------------------------------------------------------------


def _render(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_compile_only_table_counts_compiled_invalid_and_failed():
    outcomes = {harness.OK: 5, harness.INVALID: 12, harness.COMPILE_ERROR: 2, harness.TIMEOUT: 1}
    summary = StudySummary("fp4_quant_main", "decode_b64", "s", 20, outcomes, None, compile_only=True, ran=8, wall_s=60.0)
    text = _render(TuneProgress().final_table([summary]))
    header = next(line for line in text.splitlines() if "tile" in line)
    row = next(line for line in text.splitlines() if "decode_b64" in line)
    columns = ["tile", "shape", "compiled", "invalid", "failed", "failures", "configs/min"]
    assert [c.strip() for c in header.strip("┃│ ").split("┃")] == columns
    cells = [c.strip() for c in row.strip("┃│ ").split("│")]
    assert cells == ["fp4_quant_main", "decode_b64", "5", "12", "3", f"{harness.COMPILE_ERROR}:2 {harness.TIMEOUT}:1", "8.0"]
    assert "best" not in text and "x-" not in text


def test_compile_only_live_row_counts_compiled_invalid_and_failed():
    runner = SimpleNamespace(
        tile=SimpleNamespace(name="fp4_quant_main"),
        shape=SimpleNamespace(name="decode_b64"),
        opts=SimpleNamespace(compile_only=True),
        space=SimpleNamespace(size=lambda: 10),
        walk=True,
        budget=None,
        default={},
    )
    progress = TuneProgress(Console(file=open(os.devnull, "w")))  # noqa: SIM115  (the console keeps it)
    progress.start_study(runner)
    for outcome in (harness.OK, harness.INVALID, harness.OK, harness.COMPILE_ERROR, "duplicate"):
        progress.on_trial(runner, 0, {"outcome": outcome, "compile_s": 1.0})
    [task] = progress.progress.tasks
    assert task.fields["status"] == f"compiled 2  invalid 1  failed 1 ({harness.COMPILE_ERROR}:1)"
    assert (task.completed, task.total) == (4, 10)  # every grid point but the duplicate


# --- stdout, Ctrl-C -----------------------------------------------------------------------------------


def _lab(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`python -m lab ARGS` with an empty TileLang cache (so kernels compile, and TileLang logs), in its own session
    (so a signal to its group reaches what a terminal's Ctrl-C reaches)."""
    env = os.environ | {"TILELANG_CACHE_DIR": str(tmp_path / "tilelang-cache"), "COLUMNS": "200"}  # the table on one line a row
    cmd = [sys.executable, "-m", "lab", *args]
    # SIGINT at its default in the child, as in a terminal: a test run started in the background (`cmd &`, nohup, some CI
    # runners) has it ignored, the child inherits that, and Python then installs no KeyboardInterrupt for it
    # (preexec_fn: one signal() call between fork and exec, no lock taken)
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(cmd, cwd=REPO, env=env, **pipes, start_new_session=True, preexec_fn=restore)  # noqa: PLW1509


def test_tilelang_logs_of_compile_workers_stay_off_stdout(tmp_path):
    """The compile workers logged every compile on stdout (116 TileLang lines in one run); stdout is the table."""
    proc = _lab(tmp_path, *_tune_args(tmp_path, "--trials", "3", "--compile-jobs", "1", "--storage", f"sqlite:///{tmp_path / 't.db'}"))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "[TileLang" in err  # the workers did log: on stderr
    assert "[TileLang" not in out and "TileLang" not in out
    assert "compiled" in out and "decode_b64" in out


def _workers_of(pid: int) -> list[int]:
    """``pid``'s child processes that are compile workers (not multiprocessing's resource tracker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                found.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("after_s", [0.0, 3.0], ids=["worker-starting", "worker-compiling"])
def test_ctrl_c_stops_lab_tune_without_a_traceback(tmp_path, after_s):
    """A terminal's Ctrl-C signals the whole process group: the workers printed their tracebacks. Now the parent alone
    reports it (`lab tune: interrupted`, exit 130) and its workers are gone, with no warning about leaked semaphores."""
    proc = _lab(tmp_path, *_tune_args(tmp_path, "--compile-jobs", "2", "--storage", f"sqlite:///{tmp_path / 't.db'}"))
    deadline = time.monotonic() + 120
    while not (workers := _workers_of(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers, "no compile worker started"
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "leaked" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "lab tune: interrupted"
    time.sleep(1)
    assert not [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]]


# --- git, help ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git checkout")
def test_sqlite_side_files_are_git_ignored():
    """The default study (results/tuning.db) and a user's SQLite study anywhere in the tree: its WAL, shared-memory and
    journal files never show up as changes."""
    ignored = [
        "results/tuning.db",
        "results/tuning.db-wal",
        "results/tuning.db-shm",
        "results/tuning.db-journal",
        "results/sm90/study.db-wal",
        "tune.db-wal",
        "tune.db-shm",
        "tests/scratch/study.db-journal",
    ]
    kept = ["results/sm90/fp4_quant_main.yaml", "tuning/study.py"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *ignored, *kept], check=False, cwd=REPO, capture_output=True, text=True)
    assert done.stdout.split() == ignored, done.stderr


def test_lab_help_is_fast():
    """Building the parser imported every command's module, and with them torch: `lab --help` took 1.6 s. Measured as
    the child's CPU time (user + system), which another test compiling on the same cores does not inflate as it does
    the wall time."""
    import resource

    times = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-m", "lab", "--help"], check=False, cwd=REPO, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        assert done.returncode == 0 and "tune" in done.stdout
    assert min(times) < 0.5, times


def test_building_the_parser_imports_no_command_module():
    heavy = "('torch', 'tilelang', 'optuna', 'tiles', 'model', 'tuning')"
    code = f"import sys, lab.cli; lab.cli.build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy} or m.startswith('lab.commands.')))"
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_command_loads_when_it_is_parsed(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = capsys.readouterr().out
    assert "--compile-only" in out and "sm90" in out  # its arguments, the arch names among them
    assert set(build_parser()._subparsers._group_actions[0].choices) >= {"model", "kv", "bench", "check", "tune", "e2e", "report"}
