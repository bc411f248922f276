"""Live progress with rich: trials done, best so far, speedup over the default, failures by kind; a final table.

A compile-only study has no times to show: its row counts the configs compiled, refused by a constraint (invalid)
and failed (by kind), live and in the final table.
"""

from __future__ import annotations

import threading
from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tiles.core import harness
from tuning.study import find_default_trial


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.3f} ms"


class TuneProgress:
    """Receives events from :class:`tuning.study.StudyRunner` (thread-safe) and renders them."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._lock = threading.Lock()
        self._state: dict[int, dict] = {}
        self.summaries: list = []

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def note(self, text: str) -> None:
        self.progress.console.print(text)

    def start_study(self, runner) -> None:
        """A row for the study: a walk of the grid counts every point, otherwise the bar counts the budget's configs."""
        total = runner.space.size() if runner.walk else runner.budget
        with self._lock:
            st = {"task": None, "best": None, "default": None, "outcomes": Counter(), "done": 0}
            st["task"] = self.progress.add_task(f"{runner.tile.name} {runner.shape.name}", total=total, status=_status(runner, st))
            self._state[id(runner)] = st

    def on_trial(self, runner, number: int, attrs: dict, config: dict | None = None, source: str | None = None) -> None:
        """One finished trial: the live row, and (measured or failed, not refused by a constraint or a repeat) a line
        in the log: what ran (the config's difference from the default), where it came from, its time or outcome."""
        outcome = attrs.get("outcome")
        with self._lock:
            st = self._state.get(id(runner))
            if st is None or outcome == "duplicate":
                return
            if outcome != harness.INVALID and "repeat_of" not in attrs and not runner.opts.compile_only:
                self.progress.console.print(trial_line(runner, number, attrs, config or {}, source), highlight=False)
            if runner.walk or (outcome != harness.INVALID and "repeat_of" not in attrs):
                st["done"] += 1  # what the bar's total counts (start_study)
            st["outcomes"][outcome] += 1  # as the summary counts them (tuning.study.summarize): repeats too
            measured = outcome == harness.OK and not runner.opts.compile_only and attrs.get("ms") is not None
            if measured and (st["best"] is None or attrs["ms"] < st["best"]):
                st["best"] = attrs["ms"]
            if st["default"] is None and not runner.opts.compile_only:
                st["default"] = _default_ms(runner)
            self.progress.update(st["task"], completed=st["done"], status=_status(runner, st))

    def end_study(self, runner, summary) -> None:
        self.summaries.append(summary)
        with self._lock:
            st = self._state.get(id(runner))
            if st is not None:
                self.progress.update(st["task"], completed=summary.trials, total=max(summary.trials, 1))

    def final_table(self, summaries: list | None = None):
        """The per-(tile, shape) table, then each winner's config on its own line (configs are too wide for a column);
        compile-only: configs compiled, invalid and failed (:func:`compile_table`)."""
        from rich.console import Group
        from rich.text import Text

        summaries = self.summaries if summaries is None else summaries
        if any(s.compile_only for s in summaries):
            return compile_table(summaries)
        table = Table(title="lab tune")
        for col in ("tile", "shape", "trials"):
            table.add_column(col, overflow="fold")
        for col in ("best", "default", "speedup", "rematch"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("outcomes", overflow="fold")
        winners = Text()
        for s in summaries:
            outcomes = " ".join(f"{k}:{v}" for k, v in sorted(s.outcomes.items()))
            speedup = f"{s.speedup:.2f}x" if s.speedup else "-"
            table.add_row(
                s.tile, s.shape, str(s.trials), _fmt_ms(s.best_ms), _fmt_ms(s.default_ms), speedup, _rematch_text(s.rematch), outcomes
            )
            if s.best:
                winners.append(f"{s.tile} {s.shape}: " + " ".join(f"{k}={v}" for k, v in sorted(s.best.params.items())) + "\n")
        return Group(table, winners) if winners else table


def compile_counts(outcomes: dict[str, int]) -> tuple[int, int, int, str]:
    """``(compiled, invalid, failed, failures)`` of a compile-only study's outcome counts: configs that built, configs a
    constraint refused before compiling, configs whose compile failed, and those failures by kind
    (``compile_error:2 timeout:1``, or ``-``)."""
    failures = {k: v for k, v in sorted(outcomes.items()) if k not in (harness.OK, harness.INVALID)}
    text = " ".join(f"{k}:{v}" for k, v in failures.items()) or "-"
    return outcomes.get(harness.OK, 0), outcomes.get(harness.INVALID, 0), sum(failures.values()), text


def compile_table(summaries: list) -> Table:
    """`lab tune --compile-only`'s table: per (tile, shape) the configs compiled, invalid and failed, the failures by
    kind, and the configs this run got through per minute."""
    table = Table(title="lab tune --compile-only")
    for col in ("tile", "shape"):
        table.add_column(col, overflow="fold")
    for col in ("compiled", "invalid", "failed"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("failures", overflow="fold")
    table.add_column("configs/min", justify="right", no_wrap=True)
    for s in summaries:
        compiled, invalid, failed, failures = compile_counts(s.outcomes)
        rate = f"{60 * s.ran / s.wall_s:.1f}" if s.wall_s > 0 and s.ran else "-"
        table.add_row(s.tile, s.shape, str(compiled), str(invalid), str(failed), failures, rate)
    return table


def _status(runner, st: dict) -> str:
    """The live row's text: best time, speedup over the default and failures by kind; compile-only, the counts of
    :func:`compile_counts`."""
    if runner.opts.compile_only:
        compiled, invalid, failed, failures = compile_counts(st["outcomes"])
        return f"compiled {compiled}  invalid {invalid}  failed {failed}" + (f" ({failures})" if failed else "")
    speedup = f"{st['default'] / st['best']:.2f}" if st["best"] and st["default"] else "-"
    fails = " ".join(f"{k}:{v}" for k, v in sorted(st["outcomes"].items()) if k != harness.OK)
    return f"best {_fmt_ms(st['best'])}  x{speedup}  {fails}".rstrip()


def trial_line(runner, number: int, attrs: dict, config: dict, source: str | None) -> str:
    """``<tile> <shape> #<n> <outcome> <time>  <params that differ from the default>  (<source>)``: one line a trial."""
    changed = {k: v for k, v in sorted(config.items()) if runner.default.get(k) != v}
    what = " ".join(f"{k}={v}" for k, v in changed.items()) or "the default"
    result = _fmt_ms(attrs.get("ms")) if attrs.get("outcome") == harness.OK else (attrs.get("message") or "")[:120]
    line = f"{runner.tile.name} {runner.shape.name} #{number} {attrs.get('outcome')} {result}  {what}"
    return line + (f"  ({source})" if source else "")


def _default_ms(runner) -> float | None:
    """The default's time so far in the running study (the same trial summarize() will report), or None."""
    trial = find_default_trial(runner.study.get_trials(deepcopy=False), runner.default)
    return trial.user_attrs.get("ms") if trial else None


def _rematch_text(rematch: dict | None) -> str:
    """The rematch column (``tuning.rematch.Rematch.to_dict``): the challenger's median speedup over the default's, the
    rounds it won, and whether it was kept."""
    if rematch is None:
        return "-"
    if rematch["speedup"] is None:
        return "failed"
    won = f" {rematch['rounds_won']}/{len(rematch['default_ms'])}" if "rounds_won" in rematch else ""  # absent before f775407
    return f"{rematch['speedup']:.3f}x{won} {'kept' if rematch['kept'] else 'lost'}"
