"""Creating and opening a run: the manifest plus the initial canonical parameters.

Every worker starts from the parameters stored here, not from its own random
initialisation, so replicas in different regions begin bit-identical.

Opening a run needs no torch: `diloco status`, `cancel` and `gc` read a run in a
third of the CPU time without it, so torch is imported where a model is handled.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from diloco.config import SyncConfig
from diloco.schedule import Schedule
from storage import layout
from storage.backends import refuse_credentials
from storage.checkpoints import committed_keys, read_checkpoint, write_checkpoint
from storage.errors import ManifestInvalid, ObjectMissing, RunNotFound
from storage.exchange import Exchange
from storage.objectstore import ObjectStore
from storage.reach import patiently, reach_store, safe_url
from storage.retry import RetryPolicy
from storage.spec import CodecEntry, RunManifest, read_manifest, write_manifest

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diloco.fragments import FragmentPlan


def _store(url_or_store: str | ObjectStore, storage_options: dict | None) -> ObjectStore:
    if isinstance(url_or_store, ObjectStore):
        return url_or_store
    return ObjectStore(url_or_store, storage_options=storage_options)


def plan_for(model: nn.Module, config: SyncConfig, **kwargs: Any) -> FragmentPlan:
    """The fragment plan the config asks for (pattern, P, separate rest, and whether
    tensors may be split so each fragment holds 1/P of the parameters)."""
    from diloco.fragments import plan_fragments  # noqa: PLC0415 - torch (module docstring)

    kwargs.setdefault("split", config.schedule.split_tensors)
    kwargs.setdefault("block_size", config.codec.block_size)
    return plan_fragments(
        model,
        config.schedule.fragments,
        pattern=config.schedule.pattern,
        separate_rest=config.schedule.separate_rest,
        **kwargs,
    )


def new_run(
    url_or_store: str | ObjectStore,
    model: nn.Module,
    config: SyncConfig,
    *,
    workers: Sequence[str],
    total_steps: int,
    plan: FragmentPlan | None = None,
    run_id: str | None = None,
    user_config: dict[str, Any] | None = None,
    storage_options: dict | None = None,
) -> Exchange:
    """Create a run at ``url_or_store`` from ``model``'s current parameters.

    Raises RunExists if a run is already there. Returns an Exchange on the new run.
    """
    store = _store(url_or_store, storage_options)
    plan = plan or plan_for(model, config)
    schedule = Schedule.of(config.schedule)
    manifest = RunManifest(
        run_id=run_id or store.url.rstrip("/").rsplit("/", 1)[-1] or uuid.uuid4().hex[:8],
        workers=list(workers),
        total_steps=total_steps,
        rounds=schedule.rounds_in_run(total_steps, config.schedule.merge_alpha),
        codec_up=CodecEntry.of(config.up),
        codec_down=CodecEntry.of(config.down),
        fragments=plan.describe(),
        sync=config.model_dump(),
        config=user_config or {},
    )
    # Initial parameters first, the manifest last: a run is visible only when whole.
    for p in range(len(plan)):
        write_checkpoint(
            store,
            layout.global_init(p),
            f"{layout.global_init(p)}.json",
            {"params": plan.gather(model, p).numpy()},
            {"fragment": p},
        )
    write_manifest(store, manifest)
    return Exchange(store, manifest)


def open_run(url_or_store: str | ObjectStore, storage_options: dict | None = None, *,
             patience_s: float = 0.0, retry: RetryPolicy | None = None,
             what: str = "run") -> Exchange:
    """The run at ``url_or_store``, its manifest validated: the one way every command,
    job and script opens a run.

    `RunNotFound` if there is no manifest there (`BucketMissing` instead when an S3
    bucket does not exist, which is the likelier mistake), `CredentialsInURL` naming
    ``what`` for a URL that carries credentials, `ManifestInvalid` for a manifest
    that does not validate. A store outage is ridden out for ``patience_s`` (a job
    started unattended; a command fails fast). ``retry``: the store's policy for
    each request (a command passes `storage.reach.REACH_POLICY` to fail fast).
    """
    if isinstance(url_or_store, ObjectStore):
        store = url_or_store
    else:
        refuse_credentials(url_or_store, what=what)
        store = ObjectStore(url_or_store, storage_options=storage_options,
                            **({"retry": retry} if retry else {}))
    url = store.url
    try:
        return patiently(lambda: Exchange(store, read_manifest(store)), patience_s,
                         f"open the run {safe_url(url)}")
    except RunNotFound as exc:
        if "://" in url and not url.startswith(("file://", "memory://")):
            reach_store(url, storage_options, what=what, patience_s=patience_s)
        given = url_or_store if isinstance(url_or_store, str) else url
        raise RunNotFound(f"no run at {given} (its manifest run.json cannot be read)"
                          ) from exc


def load_initial(exchange: Exchange, fragments: int) -> list[torch.Tensor]:
    """The run's initial canonical parameters, one flat float32 vector per fragment."""
    import torch  # noqa: PLC0415 - module docstring

    out = []
    for p in range(fragments):
        key = f"{layout.global_init(p)}.json"
        try:
            arrays, _ = read_checkpoint(exchange.store, key)
        except ObjectMissing as exc:
            raise ManifestInvalid(
                f"run {exchange.manifest.run_id}: initial parameters of fragment {p} are "
                f"missing ({exchange.store.full_url(key)})"
            ) from exc
        out.append(torch.from_numpy(arrays["params"].copy()))
    return out


def latest_global(exchange: Exchange, fragment: int) -> tuple[int, str] | None:
    """(round, commit key) of the newest canonical checkpoint of ``fragment``."""
    keys = committed_keys(exchange.store, layout.global_states(fragment))
    best = None
    for key in keys:
        r = layout.parse_round(key.rsplit("/", 1)[-1][: -len(".json")])
        if r is not None and (best is None or r > best[0]):
            best = (r, key)
    return best


def load_canonical(exchange: Exchange, plan: FragmentPlan, model: nn.Module) -> list[int]:
    """Load the newest canonical parameters into ``model``; returns the number of
    rounds applied per fragment (0 where only the initial parameters exist)."""
    import torch  # noqa: PLC0415 - module docstring

    init = load_initial(exchange, len(plan))
    applied = []
    for p in range(len(plan)):
        latest = latest_global(exchange, p)
        if latest is None:
            plan.scatter(model, p, init[p])
            applied.append(0)
        else:
            arrays, _ = read_checkpoint(exchange.store, latest[1])
            plan.scatter(model, p, torch.from_numpy(arrays["params"].copy()))
            applied.append(latest[0] + 1)
    return applied
