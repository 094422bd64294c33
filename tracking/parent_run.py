"""What the train job logs on its parent run besides metrics: the config as params,
the dataset as the run's input, and at the end the summary, config and plots.

Split out of `tracking.mlflow_hooks` (which schedules these on its thread); every
function here talks to MLflow and is called from that thread only.

The dataset (``mlflow.log_input``): a `MetaDataset` named after the config's
sources (``builtin:shakespeare``), its source the prepared data's URL (the config's
``data.dataset``, else the run's ``data/``; credentials stripped), its digest the
fingerprint of the tokens (`workers.data.streams.TokenDataset.fingerprint`, computed
from ``dataset.json`` alone, the shards' checksums and splits: equal digests mean
equal tokens), with the token counts and tokenizer as its profile. Logged once the run is created, which
is after the data was prepared; a run whose data cannot be read logs none.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from tracking.metrics import cost_totals, is_number, participation_totals
from tracking.runs import is_permanent, log_artifacts
from tracking.settings import clip, flatten, strip_credentials, without_credentials

log = logging.getLogger(__name__)

PARAMS_PER_BATCH = 100


def log_config(client: Any, parent: str, config: dict[str, Any],
               n_params: int | None) -> int:
    """The resolved config, flattened, as the parent's params (same values again on
    a resumed run, which MLflow accepts), plus the model's parameter count. Returns
    how many params a permanent error refused (transient errors raise)."""
    from mlflow.entities import Param  # noqa: PLC0415

    params = flatten(config)
    if n_params:
        params["model.parameters"] = str(n_params)
    items = [Param(k, v) for k, v in sorted(params.items())]
    dropped = 0
    for i in range(0, len(items), PARAMS_PER_BATCH):
        chunk = items[i : i + PARAMS_PER_BATCH]
        try:
            client.log_batch(parent, params=chunk, synchronous=True)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            dropped += len(chunk)
            log.warning("MLflow tracking: %d params not logged: %s", len(chunk),
                        clip(str(exc), 300))
    return dropped


def dataset_url(config: dict[str, Any], run_url: str) -> str:
    """Where the run's prepared data is (`workers.config.RunConfig.dataset_url`)."""
    from storage import layout  # noqa: PLC0415

    data = config.get("data") or {}
    return data.get("dataset") or f"{run_url.rstrip('/')}/{layout.DATASET}"


def dataset_digest(manifest: dict[str, Any]) -> str:
    """The fingerprint of the tokens, from ``dataset.json`` (the shards' checksums and
    splits; the same hash as `TokenDataset.fingerprint`)."""
    from workers.data.manifest import manifest_fingerprint  # noqa: PLC0415

    return manifest_fingerprint(manifest)


def log_dataset(client: Any, parent: str, config: dict[str, Any], run_url: str,
                storage_options: dict | None) -> bool:
    """The run's prepared data as the parent's input (module docstring). Returns
    whether it was logged; data that cannot be read is logged as a warning."""
    from mlflow.data.meta_dataset import MetaDataset  # noqa: PLC0415
    from mlflow.entities import Dataset, DatasetInput, InputTag  # noqa: PLC0415

    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers.data.manifest import MANIFEST  # noqa: PLC0415

    url = dataset_url(config, run_url)
    try:
        store = ObjectStore(url, storage_options=storage_options, name="tracking")
        manifest = json.loads(store.get(MANIFEST))
    except Exception as exc:  # noqa: BLE001 - no dataset to describe: say so, go on
        log.warning("MLflow tracking: the run's dataset at %s not logged as its input: %s",
                    strip_credentials(url), clip(str(exc), 300))
        return False
    try:
        shown = strip_credentials(url)
        sources = manifest.get("sources") or (config.get("data") or {}).get("sources") or []
        meta = MetaDataset(_source(shown), digest=dataset_digest(manifest),
                           name=clip(",".join(map(str, sources)) or shown, 500))
        entity = Dataset(
            name=meta.name, digest=meta.digest, source_type=meta.source._get_source_type(),
            source=meta.source.to_json(), profile=json.dumps({
                **(manifest.get("counts") or {}),
                "tokenizer": (manifest.get("tokenizer") or {}).get("name"),
                "dtype": manifest.get("dtype"), "val_fraction": manifest.get("val_fraction")}))
    except Exception as exc:  # noqa: BLE001 - a dataset.json not as expected: go on
        log.warning("MLflow tracking: the run's dataset at %s not logged as its input: %s",
                    strip_credentials(url), clip(f"{type(exc).__name__}: {exc}", 300))
        return False
    client.log_inputs(parent, datasets=[DatasetInput(
        entity, tags=[InputTag("mlflow.data.context", "training")])])
    return True


def _source(url: str) -> Any:
    """MLflow's dataset source for a URL (local path, s3://, ...), else HTTP's."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source  # noqa: PLC0415
    from mlflow.data.http_dataset_source import HTTPDatasetSource  # noqa: PLC0415

    try:
        with warnings.catch_warnings():  # MLflow registers its local source twice
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(url)
    except Exception:  # noqa: BLE001 - a scheme MLflow has no source for
        return HTTPDatasetSource(url)


def finish(client: Any, uri: str | None, parent: str, summary: dict[str, Any],
           config: dict[str, Any] | None, not_logged: dict[str, int]) -> None:
    """The end of the train job: summary, config and plots as the parent's
    artifacts, its results as its metrics (the caller ends the run)."""
    from mlflow.entities import Metric  # noqa: PLC0415

    from tracking import curves, plots  # noqa: PLC0415 - matplotlib only when needed

    run_curves = curves.load_run_curves(client, client.get_run(parent))
    results = run_curves.results()
    full = dict(summary)
    full["tracking"] = {"parent_run_id": parent, "tracking_uri": strip_credentials(uri or ""),
                        "not_logged_by_train_job": not_logged, "results": results}
    with tempfile.TemporaryDirectory(prefix="diloco-mlflow-") as tmp:
        out = Path(tmp)
        (out / "summary.json").write_text(json.dumps(full, indent=2, default=str))
        if config is not None:
            import yaml  # noqa: PLC0415

            (out / "config.yaml").write_text(
                yaml.safe_dump(without_credentials(config), sort_keys=False))
        plots.plot_run(run_curves, out / "plots")
        log_artifacts(client, uri, parent, out)
    ts = int(time.time() * 1000)
    metrics = [Metric(k, float(v), ts, 0) for k, v in results.items() if is_number(v)]
    totals = {**cost_totals(summary), **participation_totals(summary)}
    metrics += [Metric(k, v, ts, 0) for k, v in totals.items() if k not in results]
    if metrics:
        client.log_batch(parent, metrics=metrics, synchronous=True)


def log_model(client: Any, uri: str | None, parent: str, run_url: str,
              storage_options: dict | None) -> str:
    """The run's final canonical model as the parent run's artifact ``model/``: the
    directory `workers.export.export_run` writes (safetensors, config.json, the
    tokenizer file), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads
    once downloaded (``mlflow.artifacts.download_artifacts``). Plain files, not the
    MLflow transformers flavour: that flavour needs transformers in the train job and
    an AutoTokenizer, and a byte-tokenizer run has none. Returns a one-line summary."""
    from diloco.run import open_run  # noqa: PLC0415 - torch
    from storage.objectstore import ObjectStore  # noqa: PLC0415
    from workers.export import export_run  # noqa: PLC0415

    exchange = open_run(ObjectStore(run_url, storage_options=storage_options))
    with tempfile.TemporaryDirectory(prefix="diloco-model-") as tmp:
        done = export_run(exchange, Path(tmp) / "model", storage_options=storage_options)
        log_artifacts(client, uri, parent, done.out, "model")
    client.set_tag(parent, "diloco.model", f"model/ (round {done.rounds}/{done.total_rounds}, "
                                           f"{done.parameters} parameters)")
    return f"round {done.rounds}/{done.total_rounds}, {done.bytes} bytes"
