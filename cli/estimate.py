"""``diloco estimate``: bytes, dollars and link bandwidth of a run before you pay.

The figures are `diloco.arithmetic` (object by object, as a run writes them; a test
holds them within 5% of a measured run) priced by `storage.billing.bill`, the code
that prices a measured run. This module parses the arguments and prints.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from cli.console import fail, user_errors
from diloco import arithmetic as ar
from diloco.config import SyncConfig
from diloco.flat_keys import nest_flat_keys
from storage.traffic import human_bytes

DEFAULT_PROVIDERS = ["aws", "gcp", "azure", "cloudflare"]


def _sync(base: dict[str, Any], changes: dict[str, dict[str, Any]]) -> SyncConfig:
    """The ``sync`` tree as written (``base``) with the command line's changes per
    section, validated like a config file: defaults that depend on a changed field
    (a sparse codec's k and way down) follow the change."""
    base, _ = nest_flat_keys(base)  # an old recipe's flat keys: load_config warned
    tree = {**base}
    for section, fields in changes.items():
        if fields:
            tree[section] = {**(base.get(section) or {}), **fields}
    try:
        return SyncConfig(**tree)
    except ValidationError as exc:
        first = exc.errors()[0]
        msg = str(first["msg"]).removeprefix("Value error, ")
        field = ".".join(str(x) for x in first["loc"])
        raise fail(f"{field}: {msg}" if field else msg) from None


def _base(config: str | None, overrides: list[str], params: float | None
          ) -> tuple[int | None, dict[str, Any], int, int]:
    """(parameters, the sync tree as written, workers, steps) from a recipe or YAML,
    or the defaults."""
    if config is None and not overrides:
        return None, {}, 2, 600
    from workers.config import config_tree, load_config  # noqa: PLC0415 - torch

    try:
        cfg = load_config(config, overrides)
        n = None if params is not None else cfg.model.resolve().num_parameters()
        sync = config_tree(config, overrides).get("sync") or {}
    except user_errors() as exc:
        raise fail(str(exc)) from None
    return n, sync, len(cfg.workers), cfg.train.steps


def rows(s: ar.Setup, mode: str, contenders: bool, provider: str, crossing: str,
         worker_provider: str) -> list[dict[str, Any]]:
    """One row per contender (data-parallel first) for the store at ``provider``."""
    dp = ar.data_parallel_per_step(s.params, s.workers)
    dp_usd = ar.data_parallel_dollars(s, provider, crossing, worker_provider)
    out = [{"contender": "data-parallel", "up_per_round": dp, "down_per_round": dp,
            "run_bytes": 2 * dp * s.steps * s.workers, "requests": 0,
            "egress_up_usd": dp_usd, "egress_down_usd": 0.0, "requests_usd": 0.0,
            "total_usd": dp_usd, "mbit_s": ar.link_rates(s)["data-parallel"] / 1e6,
            "less_than_dp": 1.0}]
    chosen = ar.contenders(s) if contenders else {f"this config ({mode})": s}
    for name, c in chosen.items():
        rate_key = "diloco" if name.startswith("diloco") or mode == "diloco" else (
            "eager" if mode == "eager" else "streaming")
        per_round, run = ar.per_round(c)["worker"], ar.per_run(c)["all"]
        usd = ar.dollars(c, provider, crossing, worker_provider)
        out.append({"contender": name, "up_per_round": per_round.up,
                    "down_per_round": per_round.down, "run_bytes": run.up + run.down,
                    "requests": run.requests, **usd,
                    "mbit_s": ar.link_rates(c)[rate_key] / 1e6,
                    "less_than_dp": ar.ratio_to_data_parallel(c)})
    return out


def table(provider: str, crossing: str, found: list[dict[str, Any]]) -> Table:
    t = Table(title=f"store at {provider} (workers across: {crossing})", header_style="bold")
    heads = ["contender", "up/round/worker", "down/round/worker", "run, all parties",
             "requests", "$ egress up", "$ egress down", "$ requests", "$ total",
             "Mbit/s for 95%", "x less up than DP"]
    for i, h in enumerate(heads):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for r in found:
        t.add_row(r["contender"], human_bytes(r["up_per_round"], 2),
                  human_bytes(r["down_per_round"], 2), human_bytes(r["run_bytes"], 2), f"{r['requests']:,}", f"{r['egress_up_usd']:,.2f}",
                  f"{r['egress_down_usd']:,.2f}", f"{r['requests_usd']:,.2f}",
                  f"{r['total_usd']:,.2f}", f"{r['mbit_s']:,.1f}", f"{r['less_than_dp']:,.0f}")
    return t


def estimate(
    params: Annotated[float | None, typer.Option(
        "--params", help="model parameters, e.g. 1e9 (default: counted from --config)")] = None,
    config: Annotated[str | None, typer.Option(
        "--config", help="a recipe name or YAML file: its model, workers, steps, sync")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE", help="override a config field (repeatable)")] = None,
    workers: Annotated[int | None, typer.Option("--workers", "-M", min=1)] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="inner steps")] = None,
    sync_every: Annotated[int | None, typer.Option("--sync-every", "-H")] = None,
    fragments: Annotated[int | None, typer.Option("--fragments", "-P")] = None,
    overlap: Annotated[str | None, typer.Option(
        "--overlap", help="tau: steps a round is in flight, or auto")] = None,
    codec_up: Annotated[str | None, typer.Option("--codec-up")] = None,
    codec_down: Annotated[str | None, typer.Option("--codec-down")] = None,
    mean_from: Annotated[str | None, typer.Option(
        "--mean-from", help="aggregator or peers")] = None,
    sparse_k: Annotated[int | None, typer.Option("--sparse-k")] = None,
    sparse_density: Annotated[float | None, typer.Option("--sparse-density")] = None,
    step_time: Annotated[float, typer.Option(
        "--step-time", help="seconds per inner step (link rates, status writes)")] = 1.0,
    providers: Annotated[list[str] | None, typer.Option(
        "--provider", help="the store's provider (repeatable; default aws, gcp, azure, "
                           "cloudflare)")] = None,
    crossing: Annotated[str, typer.Option(
        "--crossing", help="internet, inter-region or none")] = "internet",
    worker_provider: Annotated[str, typer.Option(
        "--worker-provider", help="prices the workers' uploads (other: no egress fee)")]
    = "other",
    contenders: Annotated[bool, typer.Option(
        "--contenders", help="DiLoCo float32, streaming int4/int8 and topk2 both ways down")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Estimate a run's bytes per round and per run, requests, dollars per provider
    and the link bandwidth each mode needs for 95% compute utilisation."""
    counted, base, m, t = _base(config, overrides or [], params)
    if params is None and counted is None:
        raise fail("--params: give a parameter count (e.g. 1e9) or --config RECIPE_OR_YAML")
    if not step_time > 0:
        raise fail(f"--step-time: must be > 0 seconds, got {step_time}")
    if overlap is not None and overlap != "auto" and not overlap.isdigit():
        raise fail(f"--overlap: a whole number of steps or auto, got {overlap!r}")
    tau = overlap if overlap in (None, "auto") else int(overlap)
    if sparse_k is not None and sparse_density is not None:
        raise fail("--sparse-k and --sparse-density: give one of them, not both")
    k = sparse_k
    if sparse_density is not None:
        if not 0.0 < sparse_density <= 1.0:
            raise fail(f"--sparse-density: must be in (0, 1], got {sparse_density}")
        chunk = int((base.get("codec") or {}).get("chunk", base.get("sparse_chunk", 4096)))
        k = max(1, min(chunk, round(sparse_density * chunk)))

    def given(**fields: Any) -> dict[str, Any]:
        return {name: v for name, v in fields.items() if v is not None}

    sync = _sync(base, {
        "schedule": given(sync_every=sync_every, fragments=fragments, overlap=tau),
        "codec": given(up=codec_up, down=codec_down, mean_from=mean_from, k=k)})
    n = int(params) if params is not None else counted
    if n < 1:
        raise fail(f"--params: must be >= 1, got {params}")
    s = ar.Setup.of(sync, n, workers or m, steps or t, step_time)
    try:
        found = {p: rows(s, sync.schedule.mode, contenders, p, crossing, worker_provider)
                 for p in providers or DEFAULT_PROVIDERS}
    except ValueError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print(json.dumps({"setup": {**{k: v for k, v in vars(replace(s)).items()
                                       if k not in ("up", "down")},
                                    "up": s.up.to_dict(), "down": s.down.to_dict()},
                          "providers": found}, indent=2, default=str))
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"{n:,} parameters, M = {s.workers}, {s.steps:,} steps, H = {s.sync_every}, "
                  f"P = {s.fragments}, {s.up.name} up / {s.down.name} down, mean from "
                  f"{s.mean_from}, {step_time} s a step", highlight=False)
    for p, r in found.items():
        console.print(table(p, crossing, r))
