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
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

from cli.console import runnable
from flows.shard_status import shard_state, shard_statuses, silent_for
from storage.exchange import Exchange
from workers.gc import Usage
from workers.report import (
    cost_line,
    human_bytes,
    human_seconds,
    participation,
    participation_text,
    run_cost,
    snapshot,
    traffic_totals,
)

_STATE_STYLE = {"finished": "green", "running": "cyan", "cancelled": "yellow",
                "interrupted": "yellow", "failed": "red", "silent": "red"}

def _loss(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def _state(value: str | None) -> str:
    value = value or "waiting"
    return f"[{_STATE_STYLE.get(value, 'dim')}]{value}[/]"


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

    def __init__(self, open_exchange: Any, console: Console, interval: float, name: str):
        """``open_exchange()`` returns the run's Exchange (raises until it exists)."""
        self.open_exchange = open_exchange
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

    def __init__(self, open_exchange: Any, console: Console, interval: float = 1.0):
        super().__init__(open_exchange, console, interval, "live-progress")
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
            self._exchange = self.open_exchange()
            self.progress.remove_task(self._waiting)
            m = self._exchange.manifest
            for w in m.workers:
                self.tasks[w] = self.progress.add_task(w, total=m.total_steps, info="starting")
            self.tasks["aggregator"] = self.progress.add_task(
                "aggregator", total=sum(m.rounds), info="rounds")
        snap = snapshot(self._exchange)
        infos = {}
        for w, s in snap["workers"].items():
            info = f"{_state(s.get('state'))} loss {_loss(s.get('loss'))}"
            if s.get("eval_loss") is not None:
                info += f" eval {_loss(s['eval_loss'])}"
            infos[w] = (s.get("step", 0), info)
        a = snap["aggregator"]
        info = f"{_state(a.get('state'))} rounds"
        if a.get("eval_loss") is not None:
            info += f" eval {_loss(a['eval_loss'])}"
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

    def __init__(self, open_exchange: Any, console: Console, interval: float = 1.0):
        super().__init__(open_exchange, console, interval, "plain-progress")
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
            exchange = self.open_exchange()
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
            lines.append(f"eval {_loss(a['eval_loss'])}  (canonical model, round "
                         f"{rounds}/{snap['total_rounds']})")
        for name, s in workers.items():
            if s.get("eval_loss") is not None and s["eval_loss"] != self._evals.get(name):
                self._evals[name] = s["eval_loss"]
                lines.append(f"{name}  step {s.get('step', 0)}/{snap['total_steps']}  "
                             f"eval {_loss(s['eval_loss'])}")
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
        parts.append(f"loss {_loss(sum(losses) / len(losses))}")
    if a.get("eval_loss") is not None:
        parts.append(f"eval {_loss(a['eval_loss'])}")
    parts += [f"sent {human_bytes(sum(s.get('bytes_up') or 0 for s in workers))}",
              f"recv {human_bytes(sum(s.get('bytes_down') or 0 for s in workers))}",
              f"waited {max([0.0, *(s.get('wait_s') or 0.0 for s in workers)]):.1f} s"]
    return "  ".join(parts)


@dataclass(frozen=True)
class Col:
    """A column of a table that fits: its title, the shorter one, and when it goes.

    ``drop``: 0 never; else columns go in increasing ``drop`` order, as many as the
    width needs. ``fold``: a name, which may fold onto a second line if nothing
    else is left to drop; figures never fold and are never cut."""

    title: str
    short: str = ""
    justify: str = "right"
    drop: int = 0
    fold: bool = False


def fitted(console: Console, columns: Sequence[Col], rows: Sequence[Sequence[str]]) -> Table:
    """A table of ``rows`` as wide as fits ``console``: all columns with their
    titles if they fit, else short titles, else without the columns that drop
    first (then the next ones) until it fits."""
    ranks = sorted({c.drop for c in columns if c.drop})
    tries = [(False, 0), *((True, n) for n in range(len(ranks) + 1))]
    for short, n in tries:
        gone = set(ranks[:n])
        table = Table(show_edge=False, header_style="bold")
        keep = [i for i, c in enumerate(columns) if c.drop not in gone]
        for i in keep:
            c = columns[i]
            table.add_column((c.short or c.title) if short else c.title, justify=c.justify,
                             no_wrap=not c.fold, overflow="fold" if c.fold else "ellipsis")
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        # measured unbounded: bounded by the console, every table would "fit"
        if console.measure(table, options=console.options.update_width(1 << 20)).maximum \
                <= console.width:
            break
    return table


#: The final table's columns; at narrow widths tokens go first, then the time
#: waited, then the bytes received, then the bytes sent.
WORKER_COLUMNS = (
    Col("worker", justify="left", fold=True), Col("state", justify="left"), Col("steps"),
    Col("tokens", drop=1), Col("sent", drop=4), Col("received", "recv", drop=3),
    Col("waited", "wait", drop=2), Col("loss"), Col("eval loss", "eval"),
)


def worker_table(report: dict[str, Any], console: Console | None = None) -> Table:
    """The workers' figures, fitted to ``console`` (all columns without one)."""
    rows = [(w["worker"], _state(w["state"]), f"{w['steps']}/{w['total_steps']}",
             f"{w['tokens']:,}", human_bytes(w["bytes_up"]), human_bytes(w["bytes_down"]),
             f"{w['wait_s']:.1f} s", _loss(w["loss"]), _loss(w["eval_loss"]))
            for w in report["workers"]]
    return fitted(console or Console(width=10_000), WORKER_COLUMNS, rows)


def canonical_line(report: dict[str, Any], initial: float | None = None) -> str:
    g = report["global"]
    if g["eval_loss"] is None:
        loss = "not evaluated yet"
    else:
        start = f"{initial:.3f} -> " if initial is not None else ""
        loss = f"eval loss {start}{g['eval_loss']:.3f} (perplexity {g['perplexity']:.2f})"
    return (f"canonical model: {loss}; {g['rounds']}/{g['total_rounds']} rounds, "
            f"{participation_text(g)}, {g['rejected']} rejected")


def shards_line(shards: dict[str, dict[str, Any]]) -> list[str]:
    """A sharded aggregator's other shards at the end: the parts of one line."""
    return ["aggregator shards:", *(
        f"{n} {s.get('state')} "
        f"({s.get('rounds', 0)}/{s.get('total_rounds') or '?'} rounds)" for n, s in shards.items())]


def traffic_line(g: dict[str, Any]) -> list[str]:
    """Every byte every party moved through the store, the aggregator's checkpoints
    named (they are most of what it sends): the parts of one line (see `packed`)."""
    return [f"traffic: {human_bytes(g.get('bytes_total'))} through the store;",
            f"workers sent {human_bytes(g.get('workers_bytes_up'))},",
            f"received {human_bytes(g.get('workers_bytes_down'))};",
            f"the aggregator sent {human_bytes(g.get('aggregator_bytes_up'))}",
            f"(canonical checkpoints {human_bytes(g.get('bytes_checkpoints'))}),",
            f"received {human_bytes(g.get('aggregator_bytes_down'))}"]


def store_line(store: dict[str, Any]) -> list[str]:
    """The run's size in the store by kind, and what gc deleted when the run
    finished: the parts of one line (see `packed`)."""
    kinds = [(k, v["bytes"]) for k, v in (store.get("by_kind") or {}).items() if v.get("bytes")]
    parts = [f"store: {human_bytes(store.get('bytes'))}"]
    parts += [f"{'(' if i == 0 else ''}{k} {human_bytes(b)}{')' if i == len(kinds) - 1 else ','}"
              for i, (k, b) in enumerate(kinds)]
    if store.get("freed_bytes"):
        parts[-1] += ";"
        parts.append(f"gc deleted {human_bytes(store['freed_bytes'])} it no longer needs")
    return parts


def packed(console: Console, parts: Sequence[str]) -> str:
    """``parts`` joined by spaces, broken into lines that fit ``console`` only
    between parts, so that no figure is parted from its unit."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 1 + len(part) <= console.width:
            lines[-1] += " " + part
        else:
            lines.append(part if not lines else "  " + part)
    return "\n".join(lines)


def print_report(console: Console, report: dict[str, Any], *,
                 initial_eval: float | None = None, where: list[tuple[str, str]] = ()) -> None:
    style = _STATE_STYLE.get(report["state"], "bold")
    console.print()
    took = f" in {human_seconds(report['wall_seconds'])}" if report["wall_seconds"] else ""
    console.print(f"[bold {style}]{report['run_id']} {report['state']}[/]{took}")
    console.print(worker_table(report, console))
    console.print(canonical_line(report, initial_eval))
    if report.get("aggregator_shards"):
        console.print(packed(console, shards_line(report["aggregator_shards"])),
                      soft_wrap=True, highlight=False)
    console.print(packed(console, traffic_line(report["global"])), soft_wrap=True,
                  highlight=False)
    if report.get("cost"):
        console.print(packed(console, cost_line(report["cost"])), soft_wrap=True,
                      highlight=False)
    if report.get("store"):
        console.print(packed(console, store_line(report["store"])), soft_wrap=True,
                      highlight=False)
    if report.get("message"):
        console.print(report["message"])
    lost = report.get("not_logged") or {}
    if lost:
        what = "; ".join(f"{party}: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items()))
                         for party, c in sorted(lost.items()))
        console.print(f"[yellow]MLflow did not get everything[/] (training was not "
                      f"affected): not logged: {what}", highlight=False)
    console.print()
    for label, value in where:
        # one line each, never wrapped: a hint is pasted as printed
        console.print(f"  {label:<8} {runnable(value)}", highlight=False, soft_wrap=True)


#: What ``diloco status`` shows per party; at narrow widths tokens go first, then
#: the time waited, the bytes received, the time of the last update, the bytes sent.
STATUS_COLUMNS = (
    Col("party", justify="left", fold=True), Col("state", justify="left"),
    Col("progress", justify="left"), Col("loss"), Col("eval loss", "eval"),
    Col("tokens", drop=1), Col("sent", drop=5), Col("received", "recv", drop=3),
    Col("waited", "wait", drop=2), Col("updated (UTC)", "updated", drop=4),
)


def print_status(console: Console, exchange: Exchange, run_url: str,
                 launcher: dict | None, cancel: dict | None, usage: Usage | None = None) -> None:
    snap = snapshot(exchange)
    m = exchange.manifest
    console.print(f"[bold]{m.run_id}[/]  {run_url}")
    console.print(f"created {m.created}; {len(m.workers)} workers, {m.total_steps} steps, "
                  f"{sum(m.rounds)} rounds")
    rows = [(w, _state(s.get("state")), f"{s.get('step', 0)}/{m.total_steps}",
             _loss(s.get("loss")), _loss(s.get("eval_loss")), f"{s.get('tokens', 0):,}",
             human_bytes(s.get("bytes_up")), human_bytes(s.get("bytes_down")),
             f"{s.get('wait_s', 0.0):.1f} s", (s.get("updated") or "")[11:19])
            for w, s in snap["workers"].items()]
    a = snap["aggregator"]
    rows.append(("aggregator", _state(a.get("state")),
                 f"{a.get('rounds', 0)}/{sum(m.rounds)} rounds", "", _loss(a.get("eval_loss")),
                 "", human_bytes(a.get("bytes_up")), human_bytes(a.get("bytes_down")), "",
                 (a.get("updated") or "")[11:19]))
    shards = shard_statuses(exchange)
    for name, st in shards.items():
        rows.append((name, _state(shard_state(st)),
                     f"{st.get('rounds', 0)}/{sum(m.rounds)} rounds", "", "", "", "", "", "",
                     (st.get("updated") or "")[11:19]))
    console.print(fitted(console, STATUS_COLUMNS, rows))
    if a.get("counted_rounds"):  # what became of the contributions the rounds expected
        console.print(participation_text(participation(a, list(snap["workers"]))))
    workers = [{"bytes_up": s.get("bytes_up"), "bytes_down": s.get("bytes_down")}
               for s in snap["workers"].values()]
    console.print(packed(console, traffic_line(traffic_totals(workers, a))), soft_wrap=True,
                  highlight=False)
    console.print(packed(console, cost_line(run_cost(snap, getattr(m, "config", None)))),
                  soft_wrap=True, highlight=False)
    if usage is not None:
        console.print(packed(console, store_line({"bytes": usage.total_bytes,
                                                  "by_kind": usage.as_dict()})),
                      soft_wrap=True, highlight=False)
    for w, s in snap["workers"].items():
        waiting = s.get("waiting")
        if waiting and s.get("state") == "running":
            console.print(f"[yellow]{w} waits[/] for the mean of fragment "
                          f"{waiting.get('fragment')} round {waiting.get('round')} "
                          f"({waiting.get('waited_s', 0):.0f} s at {(s.get('updated') or '')[11:19]} UTC)")
    if a.get("stalled") and a.get("state") == "running":
        console.print("[yellow]stalled[/]: no round applied since "
                      f"{a['stalled'][0].get('since', '')[11:19]} UTC")
        for st in a["stalled"]:
            console.print(f"  {st.get('text', '')}")
    for name, st in shards.items():
        silent = silent_for(st)
        if silent:
            console.print(f"[red]{name} is silent[/]: no poll since "
                          f"{st['updated'][11:19]} UTC ({silent:.0f} s; it polls every "
                          f"{st.get('heartbeat_s', 5):.0f} s): is its job alive? No mean "
                          "is committed without its part", highlight=False)
        elif st.get("state") == "failed":
            console.print(f"[red]{name} failed[/]: {st.get('error')}", highlight=False)
        elif st.get("stalled") and st.get("state") == "running":
            console.print(f"[yellow]{name} stalled[/]: "
                          + "; ".join(x.get("text", "") for x in st["stalled"]),
                          highlight=False)
    if cancel:
        console.print(f"[yellow]cancel requested[/] {cancel.get('requested', '')[:19]} by "
                      f"{cancel.get('by')}: {cancel.get('reason')}")
    if launcher:
        jobs = launcher.get("jobs", {})
        what = [f"{n} pid {j['pid']}" if "pid" in j else f"{n} flow run {j['flow_run']}"
                for n, j in jobs.items()]
        what = [w + ("," if i < len(what) - 1 else "") for i, w in enumerate(what)]
        console.print(packed(console, [f"launched ({launcher.get('backend')}) from "
                                       f"{launcher.get('host')}:", *what]),
                      soft_wrap=True, highlight=False)
