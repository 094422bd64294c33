"""The run manifest: created once per run, validated whenever a run is opened.

It carries what every party must agree on before exchanging a byte: the workers,
the fragment map (names, shapes, sizes), the codecs, how many rounds each fragment
has, and the user's whole configuration (opaque to the storage layer).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from storage.codecs import CodecSpec
from storage.errors import ManifestInvalid, RunExists, RunNotFound
from storage.layout import MANIFEST, check_name
from storage.objectstore import ObjectStore

FORMAT = "diloco-flows/run/1"


class ParamEntry(BaseModel):
    """A parameter of a fragment, or with ``slice`` the ``[start, stop)`` piece of it
    (flattened) that the fragment holds when tensors are split."""

    model_config = ConfigDict(extra="forbid")
    name: str
    shape: list[int]
    slice: list[int] | None = None  # whole-tensor entries have none, as before

    @model_validator(mode="after")
    def _slice(self) -> ParamEntry:
        if self.slice is not None:
            ok = len(self.slice) == 2 and 0 <= self.slice[0] < self.slice[1] <= self.size
            if not ok:
                raise ValueError(
                    f"parameter {self.name}: slice {self.slice} must be [start, stop) with "
                    f"0 <= start < stop <= {self.size}"
                )
        return self

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        """Whole-tensor entries serialise as before (no slice)."""
        return {k: v for k, v in handler(self).items() if k != "slice" or v is not None}

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def numel(self) -> int:
        """Values of this entry in the fragment (the slice's length, if any)."""
        return self.size if self.slice is None else self.slice[1] - self.slice[0]


class FragmentEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    numel: int = Field(gt=0)
    params: list[ParamEntry]

    @model_validator(mode="after")
    def _sizes(self) -> FragmentEntry:
        total = sum(p.numel for p in self.params)
        if total != self.numel:
            raise ValueError(
                f"fragment {self.index}: numel {self.numel} != sum of parameter sizes {total}"
            )
        return self


class CodecEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    block_size: int
    chunk: int | None = None  # sparse codecs only (older manifests have neither)
    k: int | None = None

    @model_validator(mode="after")
    def _valid(self) -> CodecEntry:
        self.spec()  # ValueError naming the codec and the allowed ones, at this field
        return self

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        """Dense entries serialise as before (no chunk/k), so their manifests do too."""
        return {k: v for k, v in handler(self).items() if v is not None}

    def spec(self) -> CodecSpec:
        sparse = {} if self.chunk is None else {"chunk": self.chunk, "k": self.k}
        return CodecSpec(self.name, self.block_size, **sparse)

    @classmethod
    def of(cls, spec: CodecSpec) -> CodecEntry:
        """The manifest entry of ``spec`` (chunk and k only for the sparse codecs)."""
        sparse = {"chunk": spec.chunk, "k": spec.k} if spec.is_sparse else {}
        return cls(name=spec.name, block_size=spec.block_size, **sparse)


class RunManifest(BaseModel):
    """What a run is; see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["diloco-flows/run/1"] = FORMAT
    run_id: str
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    workers: list[str]
    total_steps: int = Field(ge=0)
    rounds: list[int] = Field(description="rounds per fragment, final round included")
    codec_up: CodecEntry
    codec_down: CodecEntry
    fragments: list[FragmentEntry]
    sync: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RunManifest:
        if not self.workers:
            raise ValueError("workers: at least one worker is needed")
        for w in self.workers:
            check_name("worker", w)
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"workers: duplicate names in {self.workers}")
        if [f.index for f in self.fragments] != list(range(len(self.fragments))):
            raise ValueError("fragments: indices must be 0, 1, ... in order")
        if len(self.rounds) != len(self.fragments):
            raise ValueError(
                f"rounds: {len(self.rounds)} entries for {len(self.fragments)} fragments"
            )
        return self

    def numel(self, fragment: int) -> int:
        return self.fragments[fragment].numel

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True).encode()


def _upgrade(data: Any) -> Any:
    """Read a manifest written before fragments could split tensors as what it was.

    Those manifests have no ``split_tensors`` in ``sync`` (nor in the user config's
    ``sync``), and the default is now to split, so a worker resuming such a run would
    plan other fragments than the run has; they get ``split_tensors: false``. The
    keys are set only where absent: a new manifest always carries them (as
    ``sync.schedule.split_tensors``).
    """
    if not isinstance(data, dict):
        return data
    data = {**data, "sync": data.get("sync", {})}
    if isinstance(data.get("config"), dict):
        data["config"] = dict(data["config"])
    for holder in (data, data.get("config")):
        sync = holder.get("sync") if isinstance(holder, dict) else None
        # a flat sync (no sections: before sync.schedule) without the key is that old
        if isinstance(sync, dict) and "split_tensors" not in sync and "schedule" not in sync:
            holder["sync"] = {**sync, "split_tensors": False}
    return data


def write_manifest(store: ObjectStore, manifest: RunManifest) -> None:
    """Write the manifest with a create-only write; refuse an existing run."""
    if not store.put_if_absent(MANIFEST, manifest.to_json()):
        raise RunExists(
            f"a run already exists at {store.full_url(MANIFEST)}; "
            f"use a new run URL or open the existing run"
        )


def read_manifest(store: ObjectStore) -> RunManifest:
    """Read and validate the manifest of the run at ``store``."""
    url = store.full_url(MANIFEST)
    try:
        raw = store.get(MANIFEST)
    except Exception as exc:  # ObjectMissing, TransientStoreError (the cause), permission...
        raise RunNotFound(f"no run at {store.url} (its manifest run.json cannot be read: "
                          f"{exc})") from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestInvalid(f"the run manifest {url} is not valid JSON: {exc}") from exc
    try:
        return RunManifest.model_validate(_upgrade(data))
    except ValidationError as exc:
        raise ManifestInvalid(f"the run manifest {url} does not validate:\n{exc}") from exc
