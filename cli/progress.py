"""What the command line shows: live progress while a run trains, the figures after.

`LiveProgress` reads the run's status board from the store once a second (as
anyone anywhere could) and draws a bar per worker (step / total, loss) and one for
the aggregator's rounds (with the canonical model's eval loss). `print_report`
prints the final table, `print_status` what ``diloco status`` shows.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.console import runnable
from storage.exchange import Exchange
from workers.report import human_bytes, human_seconds, snapshot

_STATE_STYLE = {"finished": "green", "running": "cyan", "cancelled": "yellow",
                "interrupted": "yellow", "failed": "red"}


def _loss(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def _state(value: str | None) -> str:
    value = value or "waiting"
    return f"[{_STATE_STYLE.get(value, 'dim')}]{value}[/]"


class LiveProgress:
    """A progress bar per worker and the aggregator's rounds, from the store."""

    def __init__(self, open_exchange: Any, console: Console, interval: float = 1.0):
        """``open_exchange()`` returns the run's Exchange (raises until it exists)."""
        self.open_exchange = open_exchange
        self.console = console
        self.interval = interval
        self.progress = Progress(
            TextColumn("{task.description:<12}"), BarColumn(bar_width=32),
            MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
            console=console, transient=False, redirect_stderr=True, redirect_stdout=True,
            refresh_per_second=2,
        )
        self.tasks: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-progress", daemon=True)
        self._exchange: Exchange | None = None
        self._waiting = self.progress.add_task("preparing", total=None, info="creating the run")

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):  # the run may not exist (an error before it)
            self.refresh()
        self.progress.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - not created yet, or a store hiccup
                continue

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
        for w, s in snap["workers"].items():
            info = f"{_state(s.get('state'))} loss {_loss(s.get('loss'))}"
            if s.get("eval_loss") is not None:
                info += f" eval {_loss(s['eval_loss'])}"
            self.progress.update(self.tasks[w], completed=s.get("step", 0), info=info)
        a = snap["aggregator"]
        info = f"{_state(a.get('state'))} rounds"
        if a.get("eval_loss") is not None:
            info += f" canonical eval {_loss(a['eval_loss'])}"
        if a.get("stalled") and a.get("state") == "running":
            missing = sorted({w for st in a["stalled"] for w in st.get("missing", [])})
            info += (f" [yellow]stalled {max(st.get('waited_s', 0) for st in a['stalled']):.0f} s"
                     f", waiting for {', '.join(missing) or 'the reduction'}[/]")
        self.progress.update(self.tasks["aggregator"], completed=a.get("rounds", 0), info=info)


def worker_table(report: dict[str, Any]) -> Table:
    table = Table(show_edge=False, header_style="bold")
    for title, justify in (("worker", "left"), ("state", "left"), ("steps", "right"),
                           ("tokens", "right"), ("sent", "right"), ("received", "right"),
                           ("waited", "right"), ("loss", "right"), ("eval loss", "right")):
        table.add_column(title, justify=justify, no_wrap=True)
    for w in report["workers"]:
        table.add_row(w["worker"], _state(w["state"]), f"{w['steps']}/{w['total_steps']}",
                      f"{w['tokens']:,}", human_bytes(w["bytes_up"]),
                      human_bytes(w["bytes_down"]), f"{w['wait_s']:.1f} s", _loss(w["loss"]),
                      _loss(w["eval_loss"]))
    return table


def canonical_line(report: dict[str, Any], initial: float | None = None) -> str:
    g = report["global"]
    if g["eval_loss"] is None:
        loss = "not evaluated yet"
    else:
        start = f"{initial:.3f} -> " if initial is not None else ""
        loss = f"eval loss {start}{g['eval_loss']:.3f} (perplexity {g['perplexity']:.2f})"
    part = g["participation"]
    part = "-" if part != part else f"{100 * part:.0f}%"  # NaN: no round yet
    return (f"canonical model: {loss}; {g['rounds']}/{g['total_rounds']} rounds, "
            f"participation {part}, {g['rejected']} rejected")


def print_report(console: Console, report: dict[str, Any], *,
                 initial_eval: float | None = None, where: list[tuple[str, str]] = ()) -> None:
    style = _STATE_STYLE.get(report["state"], "bold")
    console.print()
    took = f" in {human_seconds(report['wall_seconds'])}" if report["wall_seconds"] else ""
    console.print(f"[bold {style}]{report['run_id']} {report['state']}[/]{took}")
    console.print(worker_table(report))
    console.print(canonical_line(report, initial_eval))
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
        console.print(f"  {label:<8} {runnable(value)}")


def print_status(console: Console, exchange: Exchange, run_url: str,
                 launcher: dict | None, cancel: dict | None) -> None:
    snap = snapshot(exchange)
    m = exchange.manifest
    console.print(f"[bold]{m.run_id}[/]  {run_url}")
    console.print(f"created {m.created}; {len(m.workers)} workers, {m.total_steps} steps, "
                  f"{sum(m.rounds)} rounds")
    table = Table(show_edge=False, header_style="bold")
    for col in ("party", "state", "progress", "loss", "eval loss", "tokens", "sent",
                "received", "waited", "updated (UTC)"):
        table.add_column(col, no_wrap=True)
    for w, s in snap["workers"].items():
        table.add_row(w, _state(s.get("state")), f"{s.get('step', 0)}/{m.total_steps}",
                      _loss(s.get("loss")), _loss(s.get("eval_loss")),
                      f"{s.get('tokens', 0):,}", human_bytes(s.get("bytes_up")),
                      human_bytes(s.get("bytes_down")), f"{s.get('wait_s', 0.0):.1f} s",
                      (s.get("updated") or "")[11:19])
    a = snap["aggregator"]
    table.add_row("aggregator", _state(a.get("state")),
                  f"{a.get('rounds', 0)}/{sum(m.rounds)} rounds", "", _loss(a.get("eval_loss")),
                  "", "", "", "", (a.get("updated") or "")[11:19])
    console.print(table)
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
    if cancel:
        console.print(f"[yellow]cancel requested[/] {cancel.get('requested', '')[:19]} by "
                      f"{cancel.get('by')}: {cancel.get('reason')}")
    if launcher:
        jobs = launcher.get("jobs", {})
        what = ", ".join(f"{n} pid {j['pid']}" if "pid" in j else f"{n} flow run {j['flow_run']}"
                         for n, j in jobs.items())
        console.print(f"launched ({launcher.get('backend')}) from {launcher.get('host')}: {what}")
