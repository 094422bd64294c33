"""What the command line prints after a run and for ``diloco status``: the tables
(each as wide as the console allows: `fitted` abbreviates headers, then drops the
least useful columns, never cuts a figure), the canonical model's line, the traffic,
cost and store lines (`packed` breaks them only between figures), `print_report` and
`print_status`. The live progress while a run trains is `cli.progress`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from cli.console import runnable
from flows.shard_status import shard_state, shard_statuses, silent_for
from storage.exchange import Exchange
from storage.traffic import human_bytes
from workers.gc import Usage
from workers.report import (
    cost_line,
    human_seconds,
    participation,
    participation_text,
    run_cost,
    snapshot,
    traffic_totals,
)

_STATE_STYLE = {"finished": "green", "running": "cyan", "cancelled": "yellow",
                "interrupted": "yellow", "failed": "red", "silent": "red"}


def loss_cell(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def state_cell(value: str | None) -> str:
    """A party's state, coloured (``waiting`` before it has one)."""
    value = value or "waiting"
    return f"[{_STATE_STYLE.get(value, 'dim')}]{value}[/]"


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
    rows = [(w["worker"], state_cell(w["state"]), f"{w['steps']}/{w['total_steps']}",
             f"{w['tokens']:,}", human_bytes(w["bytes_up"]), human_bytes(w["bytes_down"]),
             f"{w['wait_s']:.1f} s", loss_cell(w["loss"]), loss_cell(w["eval_loss"]))
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
                      f"affected): not logged: {what} (counted when the wait ended; a "
                      "task then under way, such as the plots, still finishes before "
                      "exit)", highlight=False)
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
    rows = [(w, state_cell(s.get("state")), f"{s.get('step', 0)}/{m.total_steps}",
             loss_cell(s.get("loss")), loss_cell(s.get("eval_loss")), f"{s.get('tokens', 0):,}",
             human_bytes(s.get("bytes_up")), human_bytes(s.get("bytes_down")),
             f"{s.get('wait_s', 0.0):.1f} s", (s.get("updated") or "")[11:19])
            for w, s in snap["workers"].items()]
    a = snap["aggregator"]
    rows.append(("aggregator", state_cell(a.get("state")),
                 f"{a.get('rounds', 0)}/{sum(m.rounds)} rounds", "", loss_cell(a.get("eval_loss")),
                 "", human_bytes(a.get("bytes_up")), human_bytes(a.get("bytes_down")), "",
                 (a.get("updated") or "")[11:19]))
    shards = shard_statuses(exchange)
    for name, st in shards.items():
        rows.append((name, state_cell(shard_state(st)),
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
