"""What the command line shows: live progress while a run trains, the figures after.

`LiveProgress` reads the run's status board from the store once a second (as
anyone anywhere could) and draws a bar per worker (step / total, loss) and one for
the aggregator's rounds (with the canonical model's eval loss). `PlainProgress`
reads the same and prints a plain line per change (a round applied, an eval, a
party's state): what a pipe, a log file or CI gets (`progress_for` chooses).
`print_report` prints the final table, `print_status` what ``diloco status`` shows.

Everything fits the console it is printed on, 80 columns and up: the bars
shrink, not the text; the tables abbreviate their headers, then drop their
least useful columns, and never cut a figure (`fitted`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from cli.figures import loss_cell, state_cell
from storage.exchange import Exchange
from storage.traffic import human_bytes
from tracking.exit_threads import join_before_exit
from workers.report import snapshot

#: The widest and narrowest progress bar (the bar gives way to the text).
BAR_MAX, BAR_MIN = 32, 4


def progress_for(console: Console) -> Callable[..., Any]:
    """The progress display for ``console``: bars in a terminal, plain lines when
    piped or in CI (the ``CI`` environment variable set)."""
    if console.is_terminal and not os.environ.get("CI"):
        return LiveProgress
    return PlainProgress


class _Polling:
    """Reads the run's status board every ``interval`` seconds in a thread, and once
    more on exit; a subclass defines ``refresh()`` (read once, show what changed)
    and may add to `_started` / `_stopped`."""

    def __init__(self, open_run: Any, console: Console, interval: float, name: str):
        """``open_run()`` returns the run's Exchange (raises until it exists)."""
        self.open_run = open_run
        self.console = console
        self.interval = interval
        self._exchange: Exchange | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _started(self) -> None:
        """Before the thread starts."""

    def _stopped(self) -> None:
        """After the last refresh."""

    def __enter__(self) -> _Polling:
        self._started()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        join_before_exit(self._thread)  # a slow last read: before the interpreter ends
        with contextlib.suppress(Exception):  # the run may not exist (an error before it)
            self.refresh()  # type: ignore[attr-defined]
        self._stopped()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()  # type: ignore[attr-defined] - the subclass's
            except Exception:  # noqa: BLE001 - not created yet, or a store hiccup
                continue


class LiveProgress(_Polling):
    """A progress bar per worker and the aggregator's rounds, from the store.

    Each refresh fits the line to the console: the bar takes what the name, the
    count, the text and the time leave (BAR_MAX at most); where it would be
    narrower than BAR_MIN, the names of the workers a stalled round waits for go
    (its duration stays), then the bar, then the time. The figures are never cut."""

    def __init__(self, open_run: Any, console: Console, interval: float = 1.0):
        super().__init__(open_run, console, interval, "live-progress")
        self.bar = BarColumn(bar_width=BAR_MAX)
        self.name = TextColumn("{task.description:<12}", table_column=Column(no_wrap=True))
        self.count = MofNCompleteColumn(table_column=Column(no_wrap=True))
        self.info = TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True))
        self.elapsed = TimeElapsedColumn(table_column=Column(no_wrap=True))
        self.progress = Progress(
            self.name, self.bar, self.count, self.info, self.elapsed,
            console=console, transient=False, redirect_stderr=True, redirect_stdout=True,
            refresh_per_second=2,
        )
        self.tasks: dict[str, Any] = {}
        self._waiting = self.progress.add_task("preparing", total=None, info="creating the run")

    def _started(self) -> None:
        self.progress.start()

    def _stopped(self) -> None:
        self.progress.stop()

    def refresh(self) -> None:
        if self._exchange is None:
            self._exchange = self.open_run()
            self.progress.remove_task(self._waiting)
            m = self._exchange.manifest
            for w in m.workers:
                self.tasks[w] = self.progress.add_task(w, total=m.total_steps, info="starting")
            self.tasks["aggregator"] = self.progress.add_task(
                "aggregator", total=sum(m.rounds), info="rounds")
        snap = snapshot(self._exchange)
        infos = {}
        for w, s in snap["workers"].items():
            info = f"{state_cell(s.get('state'))} loss {loss_cell(s.get('loss'))}"
            if s.get("eval_loss") is not None:
                info += f" eval {loss_cell(s['eval_loss'])}"
            infos[w] = (s.get("step", 0), info)
        a = snap["aggregator"]
        info = f"{state_cell(a.get('state'))} rounds"
        if a.get("eval_loss") is not None:
            info += f" eval {loss_cell(a['eval_loss'])}"
        short = info
        if a.get("stalled") and a.get("state") == "running":
            missing = sorted({w for st in a["stalled"] for w in st.get("missing", [])})
            stalled = f"stalled {max(st.get('waited_s', 0) for st in a['stalled']):.0f} s"
            info += f" [yellow]{stalled}: {', '.join(missing) or 'reduction'}[/]"
            short += f" [yellow]{stalled}[/]"
        for text in (info, short):  # the names waited for go before the bar does
            infos["aggregator"] = (a.get("rounds", 0), text)
            if self.layout([i for _, i in infos.values()]):
                break
        for name, (completed, info) in infos.items():
            self.progress.update(self.tasks[name], completed=completed, info=info)

    def layout(self, infos: Sequence[str]) -> bool:
        """Choose the columns and the bar's width for these texts; whether the bar
        has a place (else the bar goes, then the time if need be)."""
        tasks = self.progress.tasks
        name = max([12, *(len(t.description) for t in tasks)])
        count = max([3, *(2 * len(str(int(t.total or 0))) + 1 for t in tasks)])
        text = max([0, *(Text.from_markup(i).cell_len for i in infos)])
        elapsed = 7 if all((t.elapsed or 0) < 36000 for t in tasks) else 8
        left = self.console.width - (name + count + text + 2)  # two gaps of one
        if left >= elapsed + 1 + BAR_MIN + 1:
            self.bar.bar_width = min(BAR_MAX, left - elapsed - 2)
            self.progress.columns = (self.name, self.bar, self.count, self.info, self.elapsed)
            return True
        if left >= elapsed + 1:
            self.progress.columns = (self.name, self.count, self.info, self.elapsed)
        else:
            self.progress.columns = (self.name, self.count, self.info)
        return False


class PlainProgress(_Polling):
    """Plain lines as the run goes, for a pipe, a log file or CI: one per round the
    aggregator applies, per new eval loss and per change of a party's state (no
    bars, no line that repeats). Reads the store as `LiveProgress` does.

    A round's line::

        round 3/6  step 120/240  loss 2.345  eval 2.301  sent 1.2 MB  recv 3.4 MB  waited 0.4 s

    ``step`` is the slowest worker's, ``loss`` the workers' mean, ``sent``/``recv``
    the workers' totals, ``waited`` the longest any worker has waited for a mean.
    """

    def __init__(self, open_run: Any, console: Console, interval: float = 1.0):
        super().__init__(open_run, console, interval, "plain-progress")
        self._lock = threading.Lock()
        self._rounds = 0
        self._evals: dict[str, Any] = {}
        self._states: dict[str, str] = {}
        self._stalled: str | None = None

    def say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def refresh(self) -> None:
        with self._lock:  # the last refresh (on exit) and the thread's never interleave
            self._refresh()

    def _refresh(self) -> None:
        if self._exchange is None:
            exchange = self.open_run()
            m = exchange.manifest
            self.say(f"{m.run_id}: {len(m.workers)} workers, {m.total_steps} steps, "
                     f"{sum(m.rounds)} rounds")
            self._exchange = exchange
        for line in self.changes(snapshot(self._exchange)):
            self.say(line)

    def changes(self, snap: dict[str, Any]) -> list[str]:
        """The lines ``snap`` adds to what was printed before."""
        lines = []
        a, workers = snap["aggregator"], snap["workers"]
        for name, s in [*workers.items(), ("aggregator", a)]:
            state = s.get("state")
            if state and state != self._states.get(name):
                self._states[name] = state
                where = (f" at step {s.get('step', 0)}/{snap['total_steps']}"
                         if name in workers and state != "running" else "")
                lines.append(f"{name} {state}{where}")
        rounds = a.get("rounds") or 0
        if rounds > self._rounds:
            self._rounds = rounds
            self._evals["aggregator"] = a.get("eval_loss")
            lines.append(round_line(snap))
        elif a.get("eval_loss") is not None and a["eval_loss"] != self._evals.get("aggregator"):
            self._evals["aggregator"] = a["eval_loss"]
            lines.append(f"eval {loss_cell(a['eval_loss'])}  (canonical model, round "
                         f"{rounds}/{snap['total_rounds']})")
        for name, s in workers.items():
            if s.get("eval_loss") is not None and s["eval_loss"] != self._evals.get(name):
                self._evals[name] = s["eval_loss"]
                lines.append(f"{name}  step {s.get('step', 0)}/{snap['total_steps']}  "
                             f"eval {loss_cell(s['eval_loss'])}")
        stalled = a.get("stalled") if a.get("state") == "running" else None
        since = stalled[0].get("since") if stalled else None
        if since != self._stalled:
            self._stalled = since
            if stalled:
                lines.extend(f"stalled: {st.get('text', '')}" for st in stalled)
        return lines


def round_line(snap: dict[str, Any]) -> str:
    """``round 3/6  step 120/240  loss 2.345  eval 2.301  sent ...  recv ...  waited ...``"""
    a, workers = snap["aggregator"], list(snap["workers"].values())
    steps = [s.get("step") or 0 for s in workers]
    losses = [s["loss"] for s in workers if s.get("loss") is not None]
    parts = [f"round {a.get('rounds') or 0}/{snap['total_rounds']}",
             f"step {min(steps, default=0)}/{snap['total_steps']}"]
    if losses:
        parts.append(f"loss {loss_cell(sum(losses) / len(losses))}")
    if a.get("eval_loss") is not None:
        parts.append(f"eval {loss_cell(a['eval_loss'])}")
    parts += [f"sent {human_bytes(sum(s.get('bytes_up') or 0 for s in workers))}",
              f"recv {human_bytes(sum(s.get('bytes_down') or 0 for s in workers))}",
              f"waited {max([0.0, *(s.get('wait_s') or 0.0 for s in workers)]):.1f} s"]
    return "  ".join(parts)
