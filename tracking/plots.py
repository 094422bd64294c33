"""The PNGs of tracked runs, drawn with matplotlib from `tracking.curves.RunCurves`.

`plot_run` draws one run (the train job logs these as artifacts); `plot_overlay`
draws several runs on the same axes (``diloco compare``). A data-parallel run's
bytes are the ring all-reduce formula's (see `tracking.curves`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tracking.curves import RunCurves, Series

RUN_PLOTS = (
    "eval_loss_vs_step.png",
    "eval_loss_vs_tokens.png",
    "eval_loss_vs_bytes.png",
    "eval_loss_vs_wall_time.png",
    "traffic_per_worker.png",
)
OVERLAY_PLOTS = (
    "compare_eval_loss_vs_step.png",
    "compare_eval_loss_vs_tokens.png",
    "compare_eval_loss_vs_bytes.png",
    "compare_eval_loss_vs_wall_time.png",
)

LOSS_LABEL = "eval loss (nats/token)"
_MARKERS = ("s", "^", "D", "v", "P", "X", "<", ">")
AXES = {
    "step": "inner step (optimizer steps per worker)",
    "tokens": "tokens processed (all workers)",
    "bytes": "bytes exchanged (all workers, up + down)",
    "wall": "wall time since the run started",
}


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _wall_unit(max_seconds: float) -> tuple[float, str]:
    if max_seconds > 2 * 3600:
        return 3600.0, "h"
    if max_seconds > 600:
        return 60.0, "min"
    return 1.0, "s"


def _style_axis(ax: Any, x: str, wall_unit: str = "s") -> None:
    from matplotlib.ticker import EngFormatter  # noqa: PLC0415

    label = AXES[x]
    if x == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    elif x == "bytes":
        ax.xaxis.set_major_formatter(_eng_bytes())
    elif x == "wall":
        label = f"{label} ({wall_unit})"
    ax.set_xlabel(label)
    ax.set_ylabel(LOSS_LABEL)
    ax.grid(True, alpha=0.3)


def _x_of(curves: RunCurves, s: Series, x: str, wall_scale: float = 1.0) -> np.ndarray:
    if x == "step":
        return s.steps
    if x == "tokens":
        return curves.tokens_at(s.steps)
    if x == "bytes":
        return curves.bytes_at(s.steps)
    return curves.wall_s(s.times) / wall_scale


def _log_bytes_if_wide(ax: Any, xs: list[np.ndarray]) -> None:
    """Bytes of DiLoCo and data-parallel differ by orders of magnitude: log scale
    when the lines' ranges are more than 20x apart."""
    tops = [float(np.nanmax(x)) for x in xs if len(x) and np.isfinite(np.nanmax(x))]
    tops = [t for t in tops if t > 0]
    if len(tops) >= 2 and max(tops) / min(tops) > 20:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_eng_bytes())


def _eng_bytes() -> Any:
    """Tick labels in B, kB, MB, GB (never milli-bytes)."""
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    def label(value: float, _pos: int) -> str:
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:g} {unit}"
        return f"{value:g} B"

    return FuncFormatter(label)


def plot_run(curves: RunCurves, out_dir: Path) -> list[Path]:
    """The train job's plots of one run (`RUN_PLOTS`), written into ``out_dir``."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    canon = curves.canonical_eval()
    wall_max = max([float(curves.wall_s(canon.times).max())] if len(canon) else [0.0])
    for w in curves.workers.values():
        if len(w.get("eval_loss")):
            wall_max = max(wall_max, float(curves.wall_s(w.get("eval_loss").times).max()))
    scale, unit = _wall_unit(wall_max)
    written = []
    for x, fname in zip(("step", "tokens", "bytes", "wall"), RUN_PLOTS[:4], strict=True):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        xs = []
        if len(canon):
            cx = _x_of(curves, canon, x, scale)
            xs.append(cx)
            ax.plot(cx, canon.values, color="black", linewidth=2.2, marker="o",
                    markersize=4, label=curves.canonical_label, zorder=3)
        for i, w in enumerate(curves.workers.values()):
            ev = w.get("eval_loss")
            if not len(ev):
                continue
            wx = _x_of(curves, ev, x, scale)
            xs.append(wx)
            ax.plot(wx, ev.values, color=f"C{i}", linewidth=1.2, linestyle="--",
                    marker=_MARKERS[i % len(_MARKERS)], markersize=4, alpha=0.85,
                    label=f"{w.name} (worker replica)")
        _style_axis(ax, x, unit)
        if x == "bytes" and curves.data_parallel:
            ax.set_xlabel(f"{AXES['bytes']}, computed: ring all-reduce")
        ax.set_title(f"{curves.label}: eval loss vs {AXES[x].split(' (')[0]}")
        if xs:
            ax.legend(loc="best", fontsize=9)
        else:
            ax.text(0.5, 0.5, "no eval loss logged", ha="center", va="center",
                    transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out_dir / fname)
        plt.close(fig)
        written.append(out_dir / fname)
    written.append(_plot_traffic(plt, curves, out_dir / RUN_PLOTS[4]))
    return written


def _plot_traffic(plt: Any, curves: RunCurves, path: Path) -> Path:
    """Cumulative bytes up and down of each worker (and the aggregator) over time."""
    parties = list(curves.workers.values()) + ([curves.aggregator] if curves.aggregator else [])
    ends = [curves.wall_s(curves.traffic(p, k).times).max() for p in parties
            for k in ("bytes_up", "bytes_down") if len(curves.traffic(p, k))]
    scale, unit = _wall_unit(max(ends, default=0.0))
    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, sharex=True)
    drawn = False
    where = ("sent (up: store + all-reduce)", "received (down: store + all-reduce)") \
        if curves.data_parallel else ("sent to the store (up)", "received from the store (down)")
    for ax, key, what in zip(axes, ("bytes_up", "bytes_down"), where, strict=True):
        for i, p in enumerate(parties):
            s = curves.traffic(p, key)
            if not len(s):
                continue
            is_agg = p is curves.aggregator
            ax.plot(curves.wall_s(s.times) / scale, s.values,
                    marker="." if is_agg else _MARKERS[i % len(_MARKERS)], markersize=4,
                    color="black" if is_agg else f"C{i}", linestyle=":" if is_agg else "-",
                    alpha=1.0 if is_agg else 0.85,
                    label=p.name if is_agg else f"{p.name} (worker)")
            drawn = True
        ax.set_ylabel("cumulative bytes")
        ax.yaxis.set_major_formatter(_eng_bytes())
        ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
        ax.set_title(f"bytes {what}", fontsize=10)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=9)
    axes[1].set_xlabel(f"{AXES['wall']} ({unit})")
    if not drawn:
        fig.text(0.5, 0.5, "no traffic logged", ha="center", va="center")
    if curves.data_parallel:
        fig.suptitle(f"{curves.label}: traffic per worker\n"
                     "(all-reduce computed: 2 (M-1)/M x 4 bytes x params per step each way)",
                     fontsize=11)
    else:
        fig.suptitle(f"{curves.label}: store traffic per worker")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_overlay(runs: list[RunCurves], out_dir: Path) -> list[Path]:
    """Eval loss of several runs on the same axes (`OVERLAY_PLOTS`), one line per run."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    canon = [(r, r.canonical_eval()) for r in runs]
    wall_max = max((float(r.wall_s(c.times).max()) for r, c in canon if len(c)), default=0.0)
    scale, unit = _wall_unit(wall_max)
    written = []
    for x, fname in zip(("step", "tokens", "bytes", "wall"), OVERLAY_PLOTS, strict=True):
        # past a few runs the legend goes below the axes, where it can hide no point
        below = len(canon) > 3
        fig, ax = plt.subplots(figsize=(8, 5 + (0.22 * len(canon) if below else 0)), dpi=110)
        xs = []
        for i, (run, c) in enumerate(canon):
            if not len(c):
                continue
            cx = _x_of(run, c, x, scale)
            xs.append(cx)
            label = run.label
            if x == "bytes" and run.data_parallel:
                label += ", all-reduce bytes computed"
            ax.plot(cx, c.values, marker="o", markersize=3, linewidth=1.6,
                    color=f"C{i}", label=label)
        _style_axis(ax, x, unit)
        if x == "bytes":
            _log_bytes_if_wide(ax, xs)
        ax.set_title(f"eval loss vs {AXES[x].split(' (')[0]}")
        if xs and below:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8,
                      frameon=False)
        elif xs:
            ax.legend(loc="best", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / fname, bbox_inches="tight")
        plt.close(fig)
        written.append(out_dir / fname)
    return written

