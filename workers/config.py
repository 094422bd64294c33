"""The whole configuration of a training run, loaded from a YAML recipe.

One pydantic tree: ``model`` (a preset name plus overrides), ``data``, ``optim``,
``train``, ``sync`` (the synchroniser's SyncConfig) and the run's ``workers`` and
``store``. Every field has a default that works for the tiny local run; every
error names the field, the file and what is allowed. ``--set key=value`` overrides
use dotted paths (``sync.schedule.sync_every=20``, ``model.n_layers=2``).
"""

from __future__ import annotations

import copy
import json
import warnings
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from diloco.config import DeprecatedKey, SyncConfig, quiet_deprecations
from diloco.flat_keys import nest_flat_keys
from storage import layout
from storage.backends import open_backend, refuse_credentials, safe_url
from workers.hf_config import from_hf_config
from workers.model_config import PRESETS, ModelConfig
from workers.sections import AggregatorConfig, BillingConfig, RetentionConfig, _Strict

#: The shipped recipes (``workers/recipes/*.yaml``): package data, so a wheel installed
#: anywhere (the image, a pip install) resolves ``tiny`` whatever the working directory.
RECIPES: Traversable = files("workers") / "recipes"


class ModelSection(_Strict):
    """A preset, or a Hugging Face config.json, plus overrides of any ModelConfig field.

    ``hf_config`` is read once, where the run is configured, into ``hf`` (the parsed
    dict): the whole section is stored in the run manifest, and a worker on another
    machine validates that copy without access to the user's path. ``init_from``
    (pretrained safetensors, HF layout) is read by ``workers.runs.create_run`` only.
    """

    preset: str = Field(default="tiny", description="the model shape to start from")
    hf_config: str | None = Field(
        default=None, description="path or URL of a Hugging Face config.json (Llama, "
        "Mistral, Qwen2); replaces the preset"
    )
    hf: dict[str, Any] | None = Field(
        default=None, description="the parsed hf_config, filled in from the file"
    )
    init_from: str | None = Field(
        default=None, description="pretrained weights to start from: a .safetensors file "
        "or a directory/URL with model.safetensors[.index.json]"
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="fields of the shape that replace the preset's or the config.json's")

    @field_validator("hf_config", "init_from")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return _url_without_credentials(url)

    @model_validator(mode="before")
    @classmethod
    def _read_hf_config(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("hf_config") and data.get("hf") is None:
            return {**data, "hf": _read_json(str(data["hf_config"]))}
        return data

    @model_validator(mode="after")
    def _valid(self) -> ModelSection:
        if self.preset not in PRESETS:
            raise ValueError(
                f"model.preset {self.preset!r} is not known; allowed: {', '.join(PRESETS)}"
            )
        if self.hf is not None and self.preset != "tiny":
            raise ValueError(
                f"model.preset {self.preset!r} and model.hf_config are both set; use one"
            )
        self.resolve()
        return self

    def resolve(self) -> ModelConfig:
        if self.hf is not None:
            source = self.hf_config or "model.hf"
            base = from_hf_config(self.hf, source=source).model_dump()
        else:
            base = PRESETS[self.preset].model_dump()
        unknown = sorted(set(self.overrides) - set(base))
        if unknown:
            raise ValueError(
                f"model.overrides: unknown field(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(base)}"
            )
        return ModelConfig(**{**base, **self.overrides})


def _read_json(url: str) -> dict[str, Any]:
    """The JSON object at ``url`` (a path or fsspec URL), or one line naming it."""
    try:
        backend = open_backend(url)
        with backend.fs.open(backend.root, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.hf_config {url}: cannot read a JSON config.json ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.hf_config {url}: expected a JSON object")
    return data


class DataConfig(_Strict):
    """Where the tokens come from and how each worker reads its part."""

    dataset: str | None = Field(
        default=None, description="URL of a prepared dataset; default: <store>/data"
    )
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:shakespeare"],
        description="what prepare-data reads when the dataset does not exist yet",
    )
    tokenizer: str = Field(
        default="byte",
        description="'byte', a Hugging Face tokenizer .json file, or ids:N (token shards "
                    "without a tokenizer: a vocabulary of N ids, no text)",
    )
    dtype: Literal["uint16", "uint32"] | None = Field(
        default=None,
        description="id type of raw .bin shards (nanoGPT); unset: uint16, or what a .npy "
                    "or llm.c header says (a header it disagrees with is an error)",
    )
    column: str | None = Field(
        default=None,
        description="the text or token column of Parquet/Arrow sources; unset: 'text', "
                    "else the first of input_ids, tokens, ids",
    )
    val_fraction: float = Field(default=0.01, gt=0.0, lt=0.5, description="share of every source file's tokens (its last) held out for validation")
    split: Literal["even", "by_file"] = Field(default="even", description="even: each worker an equal range of the same mix of files; by_file: file i to worker i mod W (non-i.i.d.)")
    seq_len: int = Field(default=128, ge=2, description="tokens per sequence (at most the model's max_seq_len)")
    batch_size: int = Field(default=16, ge=1, description="sequences per inner step per worker")
    worker_batch_size: dict[str, int] = Field(
        default_factory=dict,
        description="batch_size of named workers (heterogeneous GPUs); means weigh by tokens",
    )
    slots: int = Field(
        default=0, ge=0,
        description="equal shares the train tokens are cut into, one per member; 0: twice "
        "the workers (split even, leaving room for as many joiners) or the workers (by_file)",
    )
    slot_blocks: int = Field(
        default=64, ge=1,
        description="split even: blocks each slot is made of, spread over the whole corpus "
        "(slot s holds blocks s, s + slots, ...), so every slot, and so the starting workers "
        "when there are more slots than workers, reads from every part of a corpus stored in "
        "order; fewer when a block would hold under 16 sequences; 1: one contiguous range "
        "per slot (runs created before this key existed)",
    )

    @field_validator("worker_batch_size")
    @classmethod
    def _positive_batches(cls, sizes: dict[str, int]) -> dict[str, int]:
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"worker_batch_size.{name} must be >= 1, got {size}")
        return sizes

    def slot_count(self, workers: int) -> int:
        """The number of data slots of a run created with ``workers`` workers."""
        if self.slots:
            return self.slots
        return 2 * workers if self.split == "even" else workers

    @field_validator("dataset")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return _url_without_credentials(url)

    @field_validator("sources")
    @classmethod
    def _no_credentials_in_sources(cls, sources: list[str]) -> list[str]:
        return [_url_without_credentials(s) for s in sources]


class OptimConfig(_Strict):
    """The inner optimizer: AdamW with linear warmup then cosine decay."""

    lr: float = Field(default=3e-3, gt=0.0, description="peak inner learning rate, reached after warmup_steps")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW's beta1, beta2")
    weight_decay: float = Field(default=0.1, ge=0.0, description="AdamW's decoupled weight decay")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW's epsilon")
    warmup_steps: int = Field(default=50, ge=0, description="inner steps of linear warmup from 0 to lr")
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="the cosine decay ends at min_lr_ratio * lr at the last step")
    grad_clip: float = Field(default=1.0, ge=0.0, description="0 disables clipping")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per inner step")


class TrainConfig(_Strict):
    """Length of the run, evaluation, checkpoints."""

    steps: int = Field(default=600, ge=1, description="inner steps per worker")
    eval_every: int = Field(default=100, ge=0, description="0: only at the end")
    eval_batches: int = Field(default=8, ge=1, description="validation batches (of batch_size sequences) per evaluation")
    checkpoint_every: int = Field(default=100, ge=0, description="0: only on SIGTERM")
    log_every: int = Field(default=10, ge=1, description="inner steps between two reports of loss and throughput")
    seed: int = Field(default=0, description="seed of the model's initialisation and of the batches drawn")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available, else cpu")
    strategy: Literal["diloco", "data_parallel"] = Field(
        default="diloco",
        description="data_parallel: the baseline, gradients all-reduced every step",
    )
    threads: int = Field(default=0, ge=0, description="torch threads per worker; 0 = default")
    island: Literal["replicate", "fsdp"] = Field(
        default="replicate",
        description="a worker of several torchrun processes: replicate the model on each "
                    "(gradients all-reduced) or shard it with FSDP2 (fully_shard)",
    )
    log_model: bool = Field(
        default=True,
        description="when the run finishes, log its canonical model (safetensors, "
                    "config.json, tokenizer) as the MLflow parent run's artifact model/",
    )
    keep_checkpoints: int = Field(
        default=1, ge=0,
        description="round checkpoints of the canonical model the aggregator keeps per "
                    "fragment (float32 parameters and momentum each); 0 keeps all. One is "
                    "enough to resume: later rounds replay from their committed means",
    )


class RunConfig(_Strict):
    """Everything a run needs; stored whole in the run manifest."""

    name: str = Field(default="tiny", description="the run's name: its URL is <store>/<name>-<time>")
    store: str = Field(default="runs", description="root URL under which runs are created")
    workers: list[str] = Field(default_factory=lambda: ["region-a", "region-b"], description="the workers the run starts with, by name (a region)")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    billing: BillingConfig = Field(default_factory=BillingConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    parent_run: str | None = Field(
        default=None,
        description="the run whose canonical model this run starts from (a continuation)",
    )

    @field_validator("store", "parent_run")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        return _url_without_credentials(url)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if not self.workers:
            raise ValueError("workers: at least one worker is needed")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"workers: names must be unique, got {self.workers}")
        for name in self.workers:  # before anything is written: names become keys
            try:
                layout.check_name("worker", name)
            except ValueError as exc:
                raise ValueError(f"workers: {exc}") from None
        unknown = sorted(set(self.billing.regions) - {*self.workers, "aggregator"})
        if unknown:
            raise ValueError(
                f"billing.regions: unknown name(s) {', '.join(unknown)}; known: "
                f"{', '.join([*self.workers, 'aggregator'])}"
            )
        if self.data.slots and self.data.slots < len(self.workers):
            raise ValueError(
                f"data.slots = {self.data.slots} is below the {len(self.workers)} workers: "
                "every member holds one slot (0: automatic)"
            )
        model = self.model.resolve()
        if self.data.seq_len > model.max_seq_len:
            raise ValueError(
                f"data.seq_len = {self.data.seq_len} exceeds the model's max_seq_len = "
                f"{model.max_seq_len}"
            )
        return self

    @classmethod
    def stored(cls, data: dict[str, Any]) -> RunConfig:
        """The config stored in a run manifest, whatever version wrote it: an old run's
        flat ``sync`` keys are read without the deprecation warning a recipe gets."""
        data = _before_slot_blocks(data)
        with quiet_deprecations():
            return cls.model_validate(data)

    @property
    def model_config_resolved(self) -> ModelConfig:
        return self.model.resolve()

    def dataset_url(self, run_url: str) -> str:
        return self.data.dataset or f"{run_url.rstrip('/')}/{layout.DATASET}"


def _before_slot_blocks(stored: dict[str, Any]) -> dict[str, Any]:
    """A manifest written before ``data.slot_blocks`` existed: its slots were one
    contiguous range each, and a resumed run must read the data it started on."""
    data = stored.get("data")
    if isinstance(data, dict) and "slot_blocks" not in data:
        return {**stored, "data": {**data, "slot_blocks": 1}}
    return stored


def _url_without_credentials(url: str | None) -> str | None:
    """The whole config is stored in the run manifest, MLflow and Prefect: a URL
    in it must not carry credentials (they come from the environment)."""
    return url if url is None else refuse_credentials(url, what="URL")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``key.path=value`` with the value parsed as YAML (numbers, lists, true/false)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: the key is empty")
    return key, yaml.safe_load(raw) if raw.strip() else ""


def recipe_names() -> list[str]:
    """The names of the shipped recipes (``tiny``, ``small``, ...), sorted."""
    return sorted(p.name.removesuffix(".yaml") for p in RECIPES.iterdir()
                  if p.name.endswith(".yaml"))


def resolve_recipe(name_or_path: str | Path) -> Path | Traversable:
    """A YAML file (a file that exists wins over a recipe of that name), or the name of a shipped recipe
    (``tiny`` -> workers/recipes/tiny.yaml, read from the installed package)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = RECIPES / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    raise ConfigError(
        f"config {str(name_or_path)!r} is neither a file nor a recipe; recipes: "
        f"{', '.join(recipe_names())}"
    )


def _blamed(recipe: dict[str, Any], overrides: list[str], where: str) -> str:
    """Who to name for an invalid configuration: the recipe itself if it is invalid,
    else the ``--set`` from which on the configuration stayed invalid (an earlier
    one a later ``--set`` made valid again is not to blame)."""
    tree = copy.deepcopy(recipe)
    blamed: str | None = None
    for item in [None, *overrides]:
        if item is not None:
            key, value = parse_override(item)
            for nested, v in _nested_override(key, value, tree):
                _set_dotted(tree, nested, v)
        try:
            RunConfig.model_validate(tree)
            blamed = None
        except ValidationError:
            if item is None:
                return where
            # a URL value is shown without user info or query: it may carry
            # credentials, which are never printed
            raw = item.partition("=")[2].strip()
            shown = (safe_url(value) if isinstance(value, str) and "://" in value
                     else "..." if "://" in raw else raw)
            blamed = blamed or f"--set {key}={shown}"
    return blamed or where


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what the parser expected and where (line and column, 1-based)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def load_config(
    source: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Load a recipe (path, recipe name, dict, or None for the defaults) and apply
    ``key=value`` overrides. Raises ConfigError naming the file and the field."""
    where, recipe, tree = _read_tree(source, overrides)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecatedKey)
            cfg = RunConfig.model_validate(tree)
    except ValidationError as exc:
        with quiet_deprecations():
            where = _blamed(recipe, overrides or [], where)
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}")
        if len(lines) == 1:  # one line, as every error the command prints
            raise ConfigError(f"{where}: invalid configuration: {lines[0].strip()}") from None
        raise ConfigError(f"{where}: invalid configuration\n" + "\n".join(lines)) from None
    for note in dict.fromkeys(str(w.message) for w in caught
                              if issubclass(w.category, DeprecatedKey)):
        warnings.warn(f"{where}: {note}", DeprecatedKey, stacklevel=2)
    return cfg


def config_tree(source: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | None = None) -> dict[str, Any]:
    """The recipe with its overrides as written, before validation: what a tool that
    changes fields further (``diloco estimate``'s flags) starts from, so that the
    defaults depending on those fields are resolved after its changes."""
    return _read_tree(source, overrides)[2]


def _read_tree(source: str | Path | dict[str, Any] | None, overrides: list[str] | None
               ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(where the config comes from, the recipe as read, the recipe with overrides)."""
    where = "defaults"
    if source is None:
        tree: dict[str, Any] = {}
    elif isinstance(source, dict):
        tree, where = copy.deepcopy(source), "the given config"
    else:
        path = resolve_recipe(source)
        where = str(path)
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML: {yaml_problem(exc)}") from exc
        if not isinstance(tree, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of sections")
    recipe = copy.deepcopy(tree)
    for item in overrides or []:
        for key, value in _nested_override(*parse_override(item), tree):
            _set_dotted(tree, key, value)
    return where, recipe, tree


def _nested_override(key: str, value: Any, tree: dict[str, Any]) -> list[tuple[str, Any]]:
    """``--set sync.<flat key>=v`` of earlier versions as the nested key(s) it sets,
    with one `DeprecatedKey` line: an override wins over the recipe's nested value,
    as any override does."""
    parts = key.split(".")
    if len(parts) != 2 or parts[0] != "sync":
        return [(key, value)]
    flat = {parts[1]: value}
    if parts[1] == "sparse_density":  # k = density x the chunk in force
        codec = (tree.get("sync") or {}).get("codec") or {}
        flat["sparse_chunk"] = codec.get("chunk", 4096)
    try:
        nested, notes = nest_flat_keys(flat)
    except ValueError as exc:
        raise ConfigError(f"--set {key}: {exc}") from None
    for note in notes:
        if not note.startswith("sync.sparse_chunk"):
            warnings.warn(f"--set {note}", DeprecatedKey, stacklevel=4)
    return [(f"sync.{section}.{field}", v) for section, fields in nested.items()
            if isinstance(fields, dict) for field, v in fields.items()] or [(key, value)]
