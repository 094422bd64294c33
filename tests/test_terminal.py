"""What the command prints fits the terminal it is printed in: the final table, the
status table and the progress bars at 80 columns and up (columns drop, headers
shorten, the bars shrink; no figure or name is ever cut to "1…"); piped, a plain
line per round, eval and state change as the run goes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runs import SHORT, clean_env
from rich.console import Console

from cli import figures as figures_module
from cli import progress
from cli.console import PIPED_WIDTH, width_for
from cli.figures import print_report, print_status
from cli.progress import (
    BAR_MIN,
    LiveProgress,
    PlainProgress,
    progress_for,
    round_line,
)

DILOCO = str(Path(sys.executable).parent / "diloco")
NAMES = ("us-east-1-a100-island", "eu-west-4-h100-island-b")


def report() -> dict:
    """A long run's figures: long worker names, big numbers."""
    return {
        "run_id": "gpu-1b-20261124-234500", "run_url": "/runs/x", "state": "interrupted",
        "message": "", "wall_seconds": 86_399.0, "not_logged": {},
        "workers": [
            {"worker": NAMES[0], "state": "interrupted", "steps": 123_456,
             "total_steps": 200_000, "tokens": 1_234_567_890, "bytes_up": 156_300_000,
             "bytes_down": 265_100_000, "wait_s": 12_345.6, "loss": 1.784, "eval_loss": 1.9123},
            {"worker": NAMES[1], "state": "finished", "steps": 200_000,
             "total_steps": 200_000, "tokens": 2_000_000_000, "bytes_up": 15_300_000_000,
             "bytes_down": 1_265_100_000, "wait_s": 0.4, "loss": 2.3456, "eval_loss": None},
        ],
        "global": {"eval_loss": 1.8, "perplexity": 6.05, "rounds": 1234, "total_rounds": 2000,
                   "rejected": 3, "participation": 0.97},
    }


#: Every figure of `report` as printed: none may be cut. The columns that may be
#: dropped at 80 (tokens, waited, received, sent) are checked where they are shown.
ALWAYS = [*NAMES, "interrupted", "finished", "123456/200000", "200000/200000", "1.784",
          "1.912", "2.346"]
DROPPABLE = ["1,234,567,890", "2,000,000,000", "156.3 MB", "15.3 GB", "265.1 MB", "1.3 GB",
             "12345.6 s"]


def rendered(width: int, draw) -> list[str]:
    console = Console(width=width, record=True)
    draw(console)
    return console.export_text().splitlines()


def assert_fits(lines: list[str], width: int, figures: list[str]) -> None:
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, "\n".join(too_wide)
    text = "\n".join(lines)
    assert "…" not in text, text
    for figure in figures:
        assert figure in text, (figure, text)


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_the_final_table_fits_and_cuts_nothing(width):
    lines = rendered(width, lambda c: print_report(c, report()))
    assert_fits(lines, width, ALWAYS + (DROPPABLE if width >= 160 else []))
    text = "\n".join(lines)
    assert "gpu-1b-20261124-234500 interrupted in" in text
    assert "1234/2000 rounds" in text


def test_columns_go_in_order_and_headers_shorten():
    """Narrower, the headers shorten first, then tokens go, then the time waited,
    the bytes received and the bytes sent, in that order; at 200 every column is
    there with its full title."""
    def header(width: int) -> list[str]:
        lines = rendered(width, lambda c: print_report(c, report()))
        return [t.strip() for t in next(li for li in lines if "worker" in li).split("┃")]

    assert header(200) == ["worker", "state", "steps", "tokens", "sent", "received",
                           "waited", "loss", "eval loss"]
    shown = [header(w) for w in range(200, 79, -1)]
    assert ["worker", "state", "steps", "tokens", "sent", "recv", "wait", "loss",
            "eval"] in shown
    gone = []
    for before, after in zip(shown, shown[1:], strict=False):
        gone += [t for t in before if t not in after and t not in ("received", "waited",
                                                                     "eval loss")]
    assert gone == ["tokens", "wait", "recv", "sent"], gone
    assert shown[-1] == ["worker", "state", "steps", "loss", "eval"]


def test_a_hint_stays_on_one_line_whatever_the_width():
    hint = "s3://a-bucket/with/a/long/prefix/gpu-1b-20261124-234500-past-eighty-columns"
    lines = rendered(80, lambda c: print_report(c, report(), where=[("store", hint)]))
    assert f"  store    {hint}" in lines, lines


def status_snapshot() -> dict:
    w = report()["workers"]
    workers = {x["worker"]: {"state": x["state"], "step": x["steps"], "loss": x["loss"],
                             "eval_loss": x["eval_loss"], "tokens": x["tokens"],
                             "bytes_up": x["bytes_up"], "bytes_down": x["bytes_down"],
                             "wait_s": x["wait_s"], "updated": "2026-11-24T23:45:00.123+00:00"}
               for x in w}
    return {"workers": workers, "total_steps": 200_000, "total_rounds": 2000,
            "aggregator": {"state": "running", "rounds": 1234, "eval_loss": 1.8,
                           "updated": "2026-11-24T23:46:01.5+00:00"}}


def fake_exchange(workers=NAMES, total_steps=200_000, rounds=(1000, 1000)) -> SimpleNamespace:
    manifest = SimpleNamespace(run_id="gpu-1b-20261124-234500", created="2026-11-24T23:45:00",
                               workers=list(workers), total_steps=total_steps,
                               rounds=list(rounds))
    return SimpleNamespace(manifest=manifest, store=None, shards=1)


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_status_fits_and_cuts_nothing(width, monkeypatch):
    monkeypatch.setattr(figures_module, "snapshot", lambda exchange: status_snapshot())
    lines = rendered(width, lambda c: print_status(c, fake_exchange(), "runs/x", None, None))
    figures = [*ALWAYS, "1234/2000 rounds", "1.800"]
    assert_fits([line for line in lines if not line.startswith("gpu-1b")], width,
                figures + (DROPPABLE if width >= 160 else []))
    if width >= 120:
        assert "23:46:01" in "\n".join(lines)


def draw_live(width: int, snap: dict, monkeypatch) -> tuple[LiveProgress, list[str]]:
    monkeypatch.setattr(progress, "snapshot", lambda exchange: snap)
    console = Console(width=width, record=True)
    live = LiveProgress(lambda: fake_exchange(list(snap["workers"]), snap["total_steps"],
                                              [snap["total_rounds"]]), console)
    live.refresh()
    console.print(live.progress.get_renderable())
    return live, console.export_text().splitlines()


def tiny_snapshot() -> dict:
    """A tiny run's (short names, small numbers)."""
    workers = {w: {"state": "running", "step": 120, "loss": 2.3456, "eval_loss": 2.3012}
               for w in ("region-a", "region-b")}
    return {"workers": workers, "total_steps": 240, "total_rounds": 17,
            "aggregator": {"state": "running", "rounds": 8, "eval_loss": 2.301,
                           "stalled": [{"missing": ["region-b"], "waited_s": 75}]}}


@pytest.mark.parametrize("width", [80, 120])
def test_the_progress_bars_shrink_not_the_text(width, monkeypatch):
    live, lines = draw_live(width, tiny_snapshot(), monkeypatch)
    assert_fits(lines, width, ["120/240", "8/17", "loss 2.346 eval 2.301",
                               "rounds eval 2.301 stalled 75 s"])
    assert live.bar in live.progress.columns and live.elapsed in live.progress.columns
    assert BAR_MIN <= live.bar.bar_width <= 32
    assert "━" in lines[0] and "0:00:00" in lines[0]
    if width == 120:  # room for whom the stalled round waits for
        assert "stalled 75 s: region-b" in "\n".join(lines)


@pytest.mark.parametrize("width", [80, 120])
def test_too_narrow_for_a_bar_the_bar_goes_first(width, monkeypatch):
    """Long names and big counts: the bar goes, then the time, then the names of
    the workers a stalled round waits for; the figures stay whole."""
    snap = status_snapshot()
    snap["aggregator"]["stalled"] = [{"missing": [NAMES[1]], "waited_s": 75}]
    live, lines = draw_live(width, snap, monkeypatch)
    figures = [*NAMES, "123456/200000", "1234/2000", "loss 1.784 eval 1.912",
               "rounds eval 1.800 stalled 75 s"]
    assert_fits(lines, width, figures + ([f"stalled 75 s: {NAMES[1]}"] if width > 80 else []))
    if width == 80:
        assert live.bar not in live.progress.columns


def test_plain_lines_once_per_change():
    """A line per round, per new eval and per state change; nothing twice."""
    plain = PlainProgress(fake_exchange, Console(width=80))
    snap = status_snapshot()
    snap["aggregator"].update(rounds=0, eval_loss=None, state="running")
    for s in snap["workers"].values():
        s.update(state="running", eval_loss=None)
    first = plain.changes(snap)
    assert first == [f"{NAMES[0]} running", f"{NAMES[1]} running", "aggregator running"]
    assert plain.changes(snap) == []
    snap["aggregator"].update(rounds=3, eval_loss=2.301)
    (line,) = plain.changes(snap)
    assert line == round_line(snap)
    assert re.fullmatch(r"round 3/2000  step 123456/200000  loss 2\.065  eval 2\.301  "
                        r"sent 15\.5 GB  recv 1\.5 GB  waited 12345\.6 s", line), line
    assert plain.changes(snap) == []
    snap["aggregator"]["eval_loss"] = 2.2
    assert plain.changes(snap) == ["eval 2.200  (canonical model, round 3/2000)"]
    snap["workers"][NAMES[0]].update(eval_loss=2.5, state="finished", step=200_000)
    assert plain.changes(snap) == [f"{NAMES[0]} finished at step 200000/200000",
                                   f"{NAMES[0]}  step 200000/200000  eval 2.500"]
    assert plain.changes(snap) == []


def test_piped_the_display_is_plain_lines(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert progress_for(Console(force_terminal=True)) is LiveProgress
    assert progress_for(Console(force_terminal=False)) is PlainProgress
    monkeypatch.setenv("CI", "true")
    assert progress_for(Console(force_terminal=True)) is PlainProgress


def test_piped_width_is_wide_enough(monkeypatch):
    class Pipe:
        def isatty(self):
            return False

    monkeypatch.delenv("COLUMNS", raising=False)
    assert width_for(Pipe()) == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "132")
    assert width_for(Pipe()) == 132
    monkeypatch.setenv("COLUMNS", "40")  # below what the tables are made for
    assert width_for(Pipe()) == PIPED_WIDTH


@pytest.mark.slow
def test_piped_run_prints_rounds_as_it_goes(tmp_path):
    """`diloco run` into a pipe: a plain line per round while it trains (read as it
    comes, before the figures at the end), not only the figures at the end."""
    # the lines are the subject, not Prefect: the test process's server (tests/cli_runs.py);
    # nor MLflow: tracking off; nor the number of workers: one (a job process less; the
    # lines of two workers' figures are test_plain_lines_once_per_change's)
    env = clean_env(tmp_path, shared_prefect=True, DILOCO_TRACKING="off")
    proc = subprocess.Popen([DILOCO, "run", *SHORT, "--set", "workers=[region-a]"],
                            cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:
            seen.append((time.monotonic(), line.rstrip("\n")))
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    text = "\n".join(line for _, line in seen)
    assert proc.returncode == 0, text + proc.stderr.read()[-4000:]
    rounds = [(t, line) for t, line in seen if line.startswith("round ")]
    assert rounds, text
    total = int(rounds[0][1].split()[1].split("/")[1])
    assert rounds[-1][1].startswith(f"round {total}/{total}  step "), text
    for _, line in rounds:  # the loss once the workers have reported one
        assert re.match(r"round \d+/\d+  step \d+/24  (loss \d+\.\d{3}  )?", line), line
        assert " sent " in line and " recv " in line and " waited " in line
    assert any(" loss " in line and " eval " in line for _, line in rounds), text
    assert len({line for _, line in rounds}) == len(rounds)  # no line repeated
    report = next(i for i, (_, line) in enumerate(seen) if " finished in " in line)
    assert all(seen.index(r) < report for r in rounds)
    assert rounds[0][0] < ended - 1.0, "the first round line came only at the end"
    assert "region-a finished at step 24/24" in text


@pytest.mark.parametrize(("width", "runs"), [(80, 2), (80, 7), (120, 3), (240, 7)])
def test_compare_fits_and_cuts_nothing(width, runs):
    """A row per run where it fits, else a column per run, in as many tables as
    it takes: names and figures whole at any width from 80."""
    import tracking.compare as cmp  # noqa: PLC0415
    from cli.compare import rich_table  # noqa: PLC0415

    rows = [cmp.CompareRow(
        run=f"streaming-int4-m-4-h-50-run-{i}", run_id=f"{i:032x}", strategy="diloco",
        mode="streaming", workers=4, final_eval_loss=1.6 + i / 100, best_eval_loss=1.6,
        tokens=2_457_600_000, bytes_exchanged=86e9, bytes_source="measured (store)",
        reduction_vs_dp=12295.2, reduction_basis="all-reduce formula", wall_s=12217.0,
        wait_s_per_worker=14.8) for i in range(runs)]
    lines = rendered(width, lambda c: c.print(rich_table(rows, c.width)))
    figures = [f"1.6{i}00" for i in range(runs)] + ["2,457,600,000", "12,295.2x",
                                                   "12,217.0 s", "all-reduce formula"]
    assert_fits(lines, width, [r.run for r in rows] + figures)


def test_traffic_and_store_lines_break_between_figures_never_inside_one():
    """The traffic and store lines of the final report and ``diloco status``: at 80
    columns every line fits, and each figure stays on one line with its unit."""
    import re

    from rich.console import Console

    from cli.figures import packed, store_line, traffic_line
    from workers.report import traffic_totals

    console = Console(width=80, record=True)
    g = traffic_totals([{"bytes_up": 31_400_000, "bytes_down": 87_200_000}] * 2,
                       {"bytes_up": 266_600_000, "bytes_down": 44_500_000,
                        "bytes_checkpoints": 236_100_000})
    sized = {"bytes": 87_500_000, "freed_bytes": 182_100_000, "by_kind": {
        k: {"bytes": 12_345_678} for k in ("canonical checkpoints", "contributions", "means",
                                           "initial parameters", "data", "records")}}
    for parts in (traffic_line(g), store_line(sized)):
        console.print(packed(console, parts), soft_wrap=True)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert not any(re.match(r"\s*(B|kB|MB|GB)\b", line) for line in lines), lines
    flat = " ".join(text.split())
    assert "workers sent 62.8 MB, received 174.4 MB" in flat, flat
    assert "the aggregator sent 266.6 MB (canonical checkpoints 236.1 MB)" in flat, flat
    assert "traffic: 548.3 MB through the store" in flat, flat  # 62.8+174.4+266.6+44.5
    assert "gc deleted 182.1 MB it no longer needs" in " ".join(text.split())
