"""Communication arithmetic: bytes, requests and link rates of a run before it runs.

docs/algorithms.md section 8 made code, object by object, so that ``diloco estimate``
and the traffic benchmark check the same formulas a measured run obeys (a test holds
them within 5% of a tiny run's counted bodies). Pure functions, no I/O.

Notation: N parameters, M workers, T inner steps, H steps between two syncs of a
fragment, P fragments of n_p values each, t seconds per inner step, tau overlap.

**Objects.** A coded vector of n values is a zarr array: ``zarr.json`` (exact bytes
from storage/arrays.py) and ``ceil(n / c)`` chunk objects of ``expected_nbytes(c) + 4``
bytes (payload + crc32c; ``c = n`` up to 2^26 values). Dense payloads:
``4n`` (none), ``2n`` (fp16), ``4 ceil(n/B) + n`` (int8), ``4 ceil(n/B) + ceil(n/2)``
(int4, fp4); sparse ``16 + 8 ceil(n/C) + ceil(bK/8) + ceil(rK/8)`` plus the unary
quotients of the Rice-coded gaps, their mean for positions spread at random, with K
kept values (k per chunk of C), b = 2 (topk2) or 4 (topk4), r = floor(log2(C/k)).

**Per fragment round.** A worker uploads ``A_up(n_p) + R_delta`` (array + commit
record). With ``mean_from: aggregator`` it downloads ``R_mean + A_down(n_p)``; with
``peers`` it downloads the weights record ``R_weights`` and the M-1 other
contributions, ``(M-1)(R_delta + A_up(n_p))``. The aggregator downloads the M
contributions, uploads the mean (aggregator mode) and the fragment's canonical
checkpoint: float32 params, momentum when mu > 0, residual when it feeds back the
down codec's error, and its commit record.

**Per run.** Rounds per fragment ``r_p = Schedule.rounds_in_run(T, alpha)`` (about
T/H, plus a final round). Every party first reads the manifest and the P initial
float32 fragments (with their commit records). Status: every party overwrites its
status object at most once a second (``T t / status_every_s`` puts: a small share
of the bytes, but a request each).

**Requests.** Per object one PUT or GET; a delta commit is preceded by an existence
check (HEAD), a mean by one poll (GET that misses) per round at least; the aggregator
lists the round's commits at least once per round. Class A (S3 pricing): PUT, LIST;
class B: GET, HEAD. HTTP overhead per request: ``HTTP_UP`` bytes up and ``HTTP_DOWN``
down, what s3fs's requests to an S3 server carry (measured through a counting proxy:
docs/algorithms.md section 8).

**Data-parallel.** A float32 ring all-reduce sends and receives
``2 (M-1)/M * 4N`` bytes per worker per step each way.

**Link rate for 95% compute utilisation** (bit/s per worker, bytes on the wire,
upload then download in series): communication may take 5/95 of compute when it is
not hidden. Data-parallel ``8 V / (t * 5/95)`` with V the bytes each way per step;
blocking DiLoCo ``8 (U + D) / (H t * 5/95)`` with U, D a worker's bytes of all
fragments' rounds; streaming ``8 (u_p + d_p) / (tau t)`` (one fragment's exchange
hidden behind tau steps; tau = 0 is blocking per fragment: ``/ (H/P t * 5/95)``) and
its average ``8 (U + D) / (H t)``; eager ``8 (u_p + d_p) / (H/P t)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from diloco.config import MeanFrom, SyncConfig
from storage.arrays import _chunks, _metadata
from storage.codecs import CodecSpec, expected_nbytes

# Sizes rounded from what runs wrote and sent (docs/algorithms.md section 8 has the
# measurements)
HTTP_UP = 1300  # bytes of request line and headers per request
HTTP_DOWN = 750  # bytes of response line and headers per request
MANIFEST_BYTES = 3000  # run.json of a small model
STATUS_BYTES = 400  # one worker's status object (members/<w>/status.json)
UTILISATION = 0.95
_NONCE = "0123456789abcdef"
_SHA = "0" * 64
_CREATED = "2026-01-01T00:00:00.000000+00:00"
_NORM = 0.12345678901234567


@dataclass(frozen=True)
class Traffic:
    """Bodies and requests of one party (or a sum), split by direction and class."""

    up: int = 0
    down: int = 0
    puts: int = 0  # class A: PUT (incl. create-only), LIST
    lists: int = 0
    gets: int = 0  # class B: GET, HEAD (incl. misses)
    heads: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def __mul__(self, k: int) -> Traffic:
        return Traffic(*(a * k for a in self.astuple()))

    __rmul__ = __mul__

    def astuple(self) -> tuple[int, ...]:
        return (self.up, self.down, self.puts, self.lists, self.gets, self.heads)

    @property
    def requests(self) -> int:
        return self.puts + self.lists + self.gets + self.heads

    @property
    def class_a(self) -> int:
        return self.puts + self.lists

    @property
    def class_b(self) -> int:
        return self.gets + self.heads

    def wire(self) -> tuple[int, int]:
        """(up, down) bytes with the HTTP overhead of every request."""
        n = self.requests
        return self.up + n * HTTP_UP, self.down + n * HTTP_DOWN


@dataclass(frozen=True)
class Setup:
    """What the arithmetic needs to know about a run (defaults: a streaming run)."""

    params: int
    workers: int = 2
    steps: int = 1000
    sync_every: int = 100
    fragments: int = 1
    up: CodecSpec = field(default_factory=lambda: CodecSpec("none"))
    down: CodecSpec = field(default_factory=lambda: CodecSpec("none"))
    mean_from: MeanFrom = "aggregator"
    overlap: int = 0
    hide_steps: int | None = None  # steps a round may take unseen (overlap: auto: H/P - 1)
    merge_alpha: float = 0.5
    momentum: bool = True  # the aggregator checkpoints a momentum buffer (mu > 0)
    residual: bool = False  # ... and a residual (error feedback on the down codec)
    step_time_s: float = 1.0
    status_every_s: float | None = 1.0  # None: no status writes (the test harness)
    sizes: tuple[int, ...] | None = None  # exact fragment sizes, when known
    manifest_bytes: int = MANIFEST_BYTES

    @property
    def fragment_sizes(self) -> tuple[int, ...]:
        return self.sizes or split_sizes(self.params, self.fragments, self.up.block_size)

    @classmethod
    def of(cls, sync: SyncConfig, params: int, workers: int, steps: int,
           step_time_s: float = 1.0, **more: object) -> Setup:
        """A run with this sync config: the codecs, way down, overlap and what the
        aggregator checkpoints as the config decides them (``diloco estimate`` and the
        traffic benchmark both start here)."""
        return cls(params=params, workers=workers, steps=steps, sync_every=sync.schedule.sync_every,
                   fragments=sync.schedule.fragments, up=sync.up, down=sync.down,
                   mean_from=sync.codec.mean_from, overlap=sync.schedule.send_offset,
                   hide_steps=(sync.schedule.sync_every // sync.schedule.fragments - 1
                               if sync.schedule.auto else None),
                   merge_alpha=sync.schedule.merge_alpha, momentum=sync.outer.momentum > 0,
                   residual=sync.codec.feedback_down and sync.codec.mean_from == "aggregator",
                   step_time_s=step_time_s, **more)


def split_sizes(n: int, parts: int, block: int = 128) -> tuple[int, ...]:
    """Fragment sizes with ``split_tensors``: the flattened model cut at
    ``floor(i N / P / B) B`` (diloco/fragments.py), so each is N/P to within a block."""
    cuts = [i * n // parts // block * block for i in range(parts)] + [n]
    return tuple(b - a for a, b in zip(cuts, cuts[1:], strict=False))


def metadata_nbytes(n: int, spec: CodecSpec | None) -> int:
    """Bytes of the ``zarr.json`` of a 1-D float32 vector of n values (coded or not)."""
    return len(_metadata(n, spec))


def array_traffic(n: int, spec: CodecSpec | None) -> tuple[int, int]:
    """(bytes, objects) of a vector stored as a zarr array: metadata + chunks."""
    chunk = _chunks((n,), spec)[0]
    count = -(-n // chunk)
    body = 4 * chunk if spec is None else expected_nbytes(chunk, spec)
    return metadata_nbytes(n, spec) + count * (body + 4), 1 + count


def _objects(n: int, count: int) -> dict[str, dict[str, object]]:
    names = ["zarr.json"] + [f"c/{i}" for i in range(count - 1)]
    return {k: {"size": n, "sha256": _SHA} for k in names}


def delta_record_nbytes(n: int, spec: CodecSpec, worker: str = "w0", run: str = "run") -> int:
    """A delta commit record (storage/exchange.py ``publish_prepared``), typical values."""
    body = {"kind": "delta", "run": run, "fragment": 0, "round": 0, "worker": worker,
            "tokens": 4096, "numel": n, "codec": {"name": spec.name, "block_size": 128},
            "payload": f"frag/0/r000000/delta/{worker}/{_NONCE}",
            "objects": _objects(100000, array_traffic(n, spec)[1]), "created": _CREATED,
            "final": False, "step": 1000}
    return len(json.dumps(body, sort_keys=True))


def mean_record_nbytes(n: int, spec: CodecSpec | None, workers: int, run: str = "run") -> int:
    """A mean commit record (``publish_mean`` and the aggregator's extra fields) for M
    workers; ``spec`` None: the weights-only record of ``mean_from: peers``."""
    names = [f"w{i}" for i in range(workers)]
    body = {"kind": "mean", "run": run, "fragment": 0, "round": 0, "writer": "aggregator",
            "weights": {w: 1 / workers for w in names}, "numel": n,
            "created": _CREATED, "rejected": {}, "participants": names, "expected": names,
            "late": [], "dropped": [], "absent": [], "owed": [], "grace_s": 0.5,
            "norms": {w: _NORM for w in names}}
    if spec is not None:
        body |= {"codec": {"name": spec.name, "block_size": 128},
                 "payload": f"frag/0/r000000/mean/aggregator/{_NONCE}",
                 "objects": _objects(100000, array_traffic(n, spec)[1])}
    return len(json.dumps(body, sort_keys=True))


def checkpoint_record_nbytes(n: int, arrays: int, workers: int) -> int:
    """A canonical checkpoint's commit record (storage/checkpoints.py)."""
    base = f"global/frag/0/r000000/{_NONCE[:12]}"
    entries = {name: {"prefix": f"{base}/{name}", "shape": [n], "dtype": "<f4",
                      "objects": _objects(100000, array_traffic(n, None)[1])}
               for name in ("params", "momentum", "residual")[:arrays]}
    meta = {"fragment": 0, "round": 0, "writer": "aggregator",
            "weights": {f"w{i}": 1 / workers for i in range(workers)}}
    return len(json.dumps({"arrays": entries, "meta": meta}, sort_keys=True))


def _array(n: int, spec: CodecSpec | None, *, up: bool) -> Traffic:
    nbytes, objects = array_traffic(n, spec)
    return Traffic(up=nbytes, puts=objects) if up else Traffic(down=nbytes, gets=objects)


def worker_round(s: Setup, n: int) -> Traffic:
    """One worker's traffic for one round of a fragment of n values."""
    delta = delta_record_nbytes(n, s.up)
    sent = _array(n, s.up, up=True) + Traffic(up=delta, puts=1, heads=1)
    if s.mean_from == "aggregator":
        got = Traffic(down=mean_record_nbytes(n, s.down, s.workers), gets=2) \
            + _array(n, s.down, up=False)
    else:
        others = (_array(n, s.up, up=False) + Traffic(down=delta, gets=1)) * (s.workers - 1)
        got = Traffic(down=mean_record_nbytes(n, None, s.workers), gets=2) + others
    return sent + got


def aggregator_round(s: Setup, n: int) -> Traffic:
    """The aggregator's traffic for one round of a fragment of n values."""
    m = s.workers
    read = (_array(n, s.up, up=False)
            + Traffic(down=delta_record_nbytes(n, s.up), gets=1)) * m + Traffic(lists=1)
    peers = s.mean_from == "peers"
    mean = Traffic(up=mean_record_nbytes(n, None if peers else s.down, m), puts=1, gets=1)
    if not peers:
        mean += _array(n, s.down, up=True)
    arrays = 1 + int(s.momentum) + int(s.residual and not peers)
    ckpt = _array(n, None, up=True) * arrays \
        + Traffic(up=checkpoint_record_nbytes(n, arrays, m), puts=1, heads=1)
    return read + mean + ckpt


def startup(s: Setup) -> Traffic:
    """What every party reads first: the manifest and the P initial fragments."""
    t = Traffic(down=s.manifest_bytes, gets=1)
    for n in s.fragment_sizes:
        t += _array(n, None, up=False) + Traffic(down=checkpoint_record_nbytes(n, 1, 0), gets=1)
    return t


def rounds(s: Setup) -> list[int]:
    """Rounds per fragment in the run, the final one included (diloco/schedule.py)."""
    from diloco.schedule import Schedule  # noqa: PLC0415  (keeps this module light)

    sched = Schedule(s.sync_every, s.fragments, s.overlap)
    return sched.rounds_in_run(s.steps, s.merge_alpha)


def status_writes(s: Setup) -> Traffic:
    """A party's status puts over the run (per wall-clock second, not per round)."""
    if not s.status_every_s:
        return Traffic()
    count = math.ceil(s.steps * s.step_time_s / max(s.status_every_s, s.step_time_s))
    return Traffic(up=count * STATUS_BYTES, puts=count)


def per_round(s: Setup) -> dict[str, Traffic]:
    """Steady-state traffic of one round of every fragment (H steps): worker, aggregator."""
    w, a = Traffic(), Traffic()
    for n in s.fragment_sizes:
        w, a = w + worker_round(s, n), a + aggregator_round(s, n)
    return {"worker": w, "aggregator": a}


def per_run(s: Setup) -> dict[str, Traffic]:
    """A whole run: one worker, the aggregator, and every party together."""
    w, a = startup(s) + status_writes(s), startup(s) + status_writes(s)
    for n, r in zip(s.fragment_sizes, rounds(s), strict=True):
        w, a = w + worker_round(s, n) * r, a + aggregator_round(s, n) * r
    return {"worker": w, "aggregator": a, "all": w * s.workers + a}


def data_parallel_per_step(params: int, workers: int) -> float:
    """Bytes each way per worker per step of a float32 ring all-reduce."""
    return 2 * (workers - 1) / workers * 4 * params


def ratio_to_data_parallel(s: Setup) -> float:
    """How many times fewer bytes a worker uploads per step than data-parallel."""
    up_per_step = per_round(s)["worker"].up / s.sync_every
    return data_parallel_per_step(s.params, s.workers) / up_per_step


def link_rates(s: Setup) -> dict[str, float]:
    """Bit/s per worker (wire bytes) each mode needs for 95% compute utilisation."""
    slack = (1 - UTILISATION) / UTILISATION
    t = s.step_time_s
    dp = data_parallel_per_step(s.params, s.workers) + 2 * HTTP_UP  # one way, full duplex
    rnd = per_round(s)["worker"].wire()
    total = sum(rnd)
    big = max(s.fragment_sizes)
    one = sum(worker_round(s, big).wire())
    stride = s.sync_every // s.fragments
    hide = s.overlap if s.hide_steps is None else s.hide_steps
    streaming = 8 * one / (hide * t) if hide else 8 * one / (stride * t * slack)
    return {
        "data-parallel": 8 * dp / (t * slack),
        "diloco": 8 * total / (s.sync_every * t * slack),
        "streaming": streaming,
        "streaming-average": 8 * total / (s.sync_every * t),
        "eager": 8 * one / (stride * t),
    }


def contenders(s: Setup) -> dict[str, Setup]:
    """The setups ``diloco estimate --contenders`` compares (same N, M, T, H)."""
    f32, sparse = CodecSpec("none"), CodecSpec("topk2", s.up.block_size, s.up.chunk, s.up.k)
    int4, int8 = CodecSpec("int4", s.up.block_size), CodecSpec("int8", s.up.block_size)
    blocking = replace(s, fragments=1, sizes=None, up=f32, down=f32, overlap=0, merge_alpha=0.0)
    return {
        "diloco float32": blocking,
        "streaming int4/int8": replace(s, up=int4, down=int8, mean_from="aggregator"),
        "streaming topk2, mean int8": replace(s, up=sparse, down=int8, mean_from="aggregator"),
        "streaming topk2, peers": replace(s, up=sparse, down=sparse, mean_from="peers"),
    }


def regions(store: str, crossing: str, worker_provider: str = "other") -> tuple[str, str]:
    """(worker region, store region) for a scenario: the store at provider ``store``,
    workers across ``crossing`` from it (``internet``: at ``worker_provider``, whose
    egress prices their uploads; ``inter-region``: another region of the store's
    provider; ``none``: beside it). ValueError for an impossible pair."""
    from storage.billing import CROSSINGS, provider_name  # noqa: PLC0415

    where, workers = f"{provider_name(store)}:store", provider_name(worker_provider)
    if crossing not in CROSSINGS:
        raise ValueError(f"crossing: must be one of {', '.join(CROSSINGS)}, got {crossing!r}")
    if crossing == "none":
        return where, where
    if crossing == "inter-region":
        return f"{provider_name(store)}:elsewhere", where
    if workers == provider_name(store):
        raise ValueError(f"worker provider: workers at {workers} reach a {workers} store "
                         "without crossing the internet; use --crossing inter-region or none")
    return f"{workers}:workers", where


def dollars(s: Setup, store: str, crossing: str = "internet",
            worker_provider: str = "other", prices: dict | None = None) -> dict[str, float]:
    """The run's bill via storage.billing.bill (the same code that prices a measured
    run): M workers at ``regions(...)``, the aggregator beside the store (its egress
    free, its requests billed)."""
    from storage.billing import DEFAULT_PRICES, bill  # noqa: PLC0415

    table = prices or DEFAULT_PRICES
    worker, where = regions(store, crossing, worker_provider)
    run = per_run(s)
    out = {"egress_up_usd": 0.0, "egress_down_usd": 0.0, "requests_usd": 0.0}
    for party, t, count in ((worker, run["worker"], s.workers), (where, run["aggregator"], 1)):
        b = bill(bytes_up=t.up, bytes_down=t.down, class_a=t.class_a, class_b=t.class_b,
                 party=party, store=where, prices=table)
        for k in out:
            out[k] += count * b[k]
    out["total_usd"] = sum(out.values())
    return out


def data_parallel_dollars(s: Setup, store: str, crossing: str = "internet",
                          worker_provider: str = "other", prices: dict | None = None) -> float:
    """Data-parallel's all-reduce leaves each worker's provider like an upload over
    the same crossing: M * T * 2(M-1)/M * 4N bytes priced at the workers' egress."""
    from storage.billing import DEFAULT_PRICES, bill  # noqa: PLC0415

    worker, where = regions(store, crossing, worker_provider)
    sent = round(data_parallel_per_step(s.params, s.workers) * s.steps)
    b = bill(bytes_up=sent, bytes_down=0, class_a=0, class_b=0, party=worker, store=where,
             prices=prices or DEFAULT_PRICES)
    return s.workers * b["total_usd"]
