"""Which MLflow runs a training run's jobs log to, found through the run's store.

One parent run per training run (tags for the store URL, regions, code version,
mode and strategy), a child run per worker (named after it) and one for the
aggregator. Each carries MLflow's standard tags: ``mlflow.runName`` (the parent:
the store's run id; a child: the worker's name, or ``aggregator``),
``mlflow.source.type`` (JOB), ``mlflow.source.name`` (``diloco train``,
``diloco worker``, ``diloco aggregator``) and ``mlflow.source.git.commit`` when the
code runs from a git checkout (``diloco.code_version`` keeps ``git describe``). Every job of a run is its own process, possibly in another region, so
the parent is found through the run's store: the train job creates the parent and
writes ``tracking.json`` there (create-only, like every object of the protocol)::

    {"version": 1,
     "tracking_uri": "http://mlflow.internal:5000",   # credentials stripped
     "experiment_id": "3", "experiment_name": "diloco-flows",
     "parent_run_id": "4c1d...", "run_name": "run-42", "created": "2026-...",
     "strategy": "diloco", "mode": "streaming", "workers": ["region-a", "region-b"],
     "schedule": {"sync_every": 30, "fragments": 2, "overlap": 1,
                  "total_steps": 300, "tokens_per_step": 2048}}

Worker and aggregator jobs read it and create their child run (tag
``mlflow.parentRunId``), or continue the one a previous attempt of the same job
created (found by the ``diloco.child`` tag). They use ``MLFLOW_TRACKING_URI`` when
set in their own environment (a region may reach the server by another address,
and credentials come from the environment), else the URI in ``tracking.json``.

Every method here talks to MLflow or the store: only the hooks' own thread calls
them, never a hook call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from storage import layout
from tracking.settings import (
    RELATIVE_ARTIFACTS,
    artifact_location,
    clip,
    code_version,
    default_tracking_uri,
    relative_artifacts_db,
    schedule_of,
    source_tags,
    strip_credentials,
)

log = logging.getLogger(__name__)

TRACKING_KEY = layout.TRACKING

# MLflow error codes that a retry cannot fix.
PERMANENT_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
    "ENDPOINT_NOT_FOUND",
})


class NotReady(Exception):
    """Something another job writes (tracking.json) is not there yet."""


class Permanent(Exception):
    """A failure a retry cannot fix."""


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, Permanent):
        return True
    code = getattr(exc, "error_code", None)
    return isinstance(code, str) and code in PERMANENT_CODES


#: without it MLflow's UI opens an experiment on its GenAI overview, empty for us; this
#: value selects the model-training view
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def create_experiment(client: Any, name: str, uri: str) -> str:
    """Create experiment ``name``; in the embedded SQLite store in the working
    directory, with the relative artifact location ``mlartifacts`` (see
    `tracking.settings.artifact_location`): MLflow makes any local location
    absolute when it creates an experiment, so the location is set in the database
    right after. Every run created after it gets ``mlartifacts/<run id>/artifacts``,
    which MLflow (``mlflow ui``, the client) resolves against its working directory:
    the checkout, wherever it has moved."""
    exp_id = client.create_experiment(name, artifact_location=artifact_location(uri),
                                      tags=dict([EXPERIMENT_KIND]))
    db = relative_artifacts_db(uri)
    if db is not None:
        with contextlib.closing(sqlite3.connect(db)) as con, con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                        (RELATIVE_ARTIFACTS, int(exp_id)))
    return exp_id


def make_relative(uri: str, experiment_id: str, location: str) -> int:
    """An experiment of the embedded store created before artifact locations were
    relative (an absolute ``file:///.../mlartifacts``, possibly of a directory the
    checkout has since moved from): make it, and its runs' artifact URIs, relative
    to ``mlartifacts``, so they open from here. Returns the runs rewritten."""
    db = relative_artifacts_db(uri)
    if db is None or not location.startswith("file://") or location.rstrip("/").rsplit(
            "/", 1)[-1] != RELATIVE_ARTIFACTS:
        return 0
    prefix = location.rstrip("/") + "/"
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                    (RELATIVE_ARTIFACTS, int(experiment_id)))
        cur = con.execute(
            "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
            "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
            (RELATIVE_ARTIFACTS + "/", len(prefix) + 1, int(experiment_id), len(prefix),
             prefix))
        changed = cur.rowcount
    log.info("MLflow: artifact locations of experiment %s made relative (%s/, %d runs)",
             experiment_id, RELATIVE_ARTIFACTS, changed)
    return changed


def log_artifacts(client: Any, uri: str | None, run_id: str, local_dir: str | Path,
                  artifact_path: str | None = None) -> None:
    """``client.log_artifacts``, writing a relative artifact location beside the
    SQLite file it belongs with (this process's working directory may be another)."""
    run = client.get_run(run_id)
    where = run.info.artifact_uri or ""
    db = (uri or "").removeprefix("sqlite:///") if (uri or "").startswith("sqlite:///") else ""
    if db and where and "://" not in where and not where.startswith(("/", "file:")):
        from mlflow.store.artifact.local_artifact_repo import (  # noqa: PLC0415
            LocalArtifactRepository,
        )

        LocalArtifactRepository(str(Path(db).parent / where)).log_artifacts(
            str(local_dir), artifact_path)
        return
    client.log_artifacts(run_id, str(local_dir), artifact_path)


class RunLinks:
    """The MLflow client, the run's store and ``tracking.json`` of one job.

    ``uri``: the tracking URI when the job knows it (the train job always does);
    None to follow ``tracking.json``.
    """

    def __init__(self, run_url: str, *, uri: str | None, experiment: str,
                 storage_options: dict | None = None) -> None:
        self.run_url = run_url
        self.uri = uri
        self.experiment = experiment
        self.storage_options = storage_options
        self.run_name = run_url.rstrip("/").rsplit("/", 1)[-1] or "run"
        self.info: dict[str, Any] | None = None
        self._client: Any = None
        self._store: Any = None
        self._created_parent: Any = None

    @property
    def schedule(self) -> dict[str, int]:
        return (self.info or {}).get("schedule") or {}

    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient  # noqa: PLC0415

            if self.uri is None:
                self.uri = self.tracking_info().get("tracking_uri") or default_tracking_uri()
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def store(self) -> Any:
        if self._store is None:
            from storage.objectstore import ObjectStore, RetryPolicy  # noqa: PLC0415

            self._store = ObjectStore(
                self.run_url, storage_options=self.storage_options, name="tracking",
                retry=RetryPolicy(attempts=3, base_delay=0.2, max_delay=2.0))
        return self._store

    def tracking_info(self) -> dict[str, Any]:
        if self.info is None:
            from storage.errors import ObjectMissing  # noqa: PLC0415

            try:
                self.info = json.loads(self.store().get(TRACKING_KEY))
            except ObjectMissing:
                raise NotReady(
                    f"{TRACKING_KEY} is not in {self.store().url} yet (the train job "
                    "writes it when it creates the MLflow run; is tracking on there?)"
                ) from None
        return self.info

    def experiment_id(self) -> str:
        client = self.client()
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                client.restore_experiment(found.experiment_id)
            if found.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # an older one
                client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
            make_relative(self.uri or "", found.experiment_id, found.artifact_location)
            return found.experiment_id
        try:
            return create_experiment(client, self.experiment, self.uri or "")
        except Exception as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
            return client.get_experiment_by_name(self.experiment).experiment_id

    def start_parent(self, config: dict[str, Any], *, start_ms: int | None) -> str:
        """The train job: continue this run's parent (tracking.json is there) or
        create it and write tracking.json. Returns the parent's run id."""
        from storage.errors import ObjectMissing  # noqa: PLC0415

        client = self.client()
        try:
            self.info = json.loads(self.store().get(TRACKING_KEY))
        except ObjectMissing:
            self.info = None
        if self.info is not None:  # this run is tracked already: continue its parent
            parent = self.info["parent_run_id"]
            client.update_run(parent, status="RUNNING")
            log.info("MLflow: run %s continues parent run %s", self.run_name, parent)
            return parent
        exp = self.experiment_id()
        workers = [str(w) for w in config.get("workers") or []]
        train, sync = config.get("train") or {}, config.get("sync") or {}
        tags = {
            "diloco.role": "train",
            "diloco.run_id": self.run_name,
            "diloco.store": strip_credentials(self.store().url),
            "diloco.regions": ",".join(workers),
            "diloco.code_version": code_version(),
            # a run's config has sync.schedule; a config from before it a flat sync
            "diloco.mode": str((sync.get("schedule") or {}).get("mode", sync.get("mode", ""))),
            "diloco.strategy": str(train.get("strategy", "diloco")),
            "diloco.config_name": str(config.get("name", "")),
            "mlflow.runName": self.run_name,
            **source_tags("diloco train"),
        }
        if self._created_parent is None:  # a retry must not create a second one
            self._created_parent = client.create_run(
                exp, run_name=self.run_name, tags=tags, start_time=start_ms)
        run_id = self._created_parent.info.run_id
        info = {
            "version": 1,
            "tracking_uri": strip_credentials(self.uri or ""),
            "experiment_id": exp,
            "experiment_name": self.experiment,
            "parent_run_id": run_id,
            "run_name": self.run_name,
            "created": datetime.now(UTC).isoformat(),
            "strategy": tags["diloco.strategy"],
            "mode": tags["diloco.mode"],
            "workers": workers,
            "schedule": schedule_of(config),
        }
        if self.store().put_if_absent(TRACKING_KEY, json.dumps(info, indent=1).encode()):
            self.info = info
        else:  # another train job won the race: use its parent
            client.delete_run(run_id)
            self.info = json.loads(self.store().get(TRACKING_KEY))
        return self.info["parent_run_id"]

    def child(self, key: str) -> tuple[str, bool]:
        """Find (after a restart) or create the child run ``key`` ("worker:<name>",
        "aggregator") under the parent. Returns its id and whether it was found;
        raises `Permanent` when the parent cannot be used."""
        info = self.tracking_info()
        client = self.client()
        parent = info["parent_run_id"]
        role, _, name = key.partition(":")
        try:
            found = client.search_runs(
                [info["experiment_id"]],
                filter_string=(f"tags.`mlflow.parentRunId` = '{parent}' "
                               f"and tags.`diloco.child` = '{key}'"),
                max_results=1,
            )
            if found:
                run_id = found[0].info.run_id
                client.update_run(run_id, status="RUNNING")
                log.info("MLflow: %s continues child run %s", key, run_id)
                return run_id, True
            tags = {
                "mlflow.parentRunId": parent,
                "diloco.role": role,
                "diloco.child": key,
                "diloco.run_id": info.get("run_name", self.run_name),
                "diloco.strategy": str(info.get("strategy", "")),
                "diloco.mode": str(info.get("mode", "")),
            }
            if name:
                tags["diloco.worker"] = name
            tags.update({"mlflow.runName": name or role, **source_tags(f"diloco {role}")})
            run = client.create_run(info["experiment_id"], run_name=name or role, tags=tags)
            return run.info.run_id, False
        except Exception as exc:
            if not is_permanent(exc):
                raise
            raise Permanent(
                f"parent run {parent} of {self.run_name} not usable at "
                f"{strip_credentials(self.uri or '?')}: {clip(str(exc), 200)}") from exc

    def end(self, run_id: str, status: str, state: str) -> None:
        """Tag the job's end state and terminate the run (MLflow first sends what its
        asynchronous queue holds)."""
        client = self.client()
        client.set_tag(run_id, "diloco.state", state)
        client.set_terminated(run_id, status=status)
