"""A worker or aggregator process that dies, or plants a bad payload, on cue.

    python tests/fault_job.py -- --run URL --worker region-a      # as python -m workers
    python tests/fault_job.py -- --run URL --aggregate

The fault campaign (tests/test_fault_campaign.py) launches this script instead of
``python -m workers`` (forked by tests/zygote.py, which runs it as ``__main__``,
imports done). It reads its faults from the environment variable
``DILOCO_FAULTS`` (a JSON list, see `Fault`), wraps the product methods where each
fault belongs, then calls the real entry point, `workers.__main__.main`, with the
arguments after ``--``. No product code changes: the wrappers sit around
`ObjectStore.put_if_absent` (the create-only commit of every record),
`Exchange.publish_prepared` (a worker's send) and the `Aggregator`'s ``fault``
hook, which the product calls after "published", "stepped" and "checkpointed".

Kills are SIGKILL sent to this very process: no ``finally``, no checkpoint, no
flush, exactly what a machine that loses power does. Before dying (or after
planting) the script appends one line to the file named by ``DILOCO_FAULT_LOG``,
so a test knows the fault really fired and never passes vacuously. Each fault
fires once; with ``DILOCO_FAULT_FIRED`` (a file) once across the restarts of the
job, so that one job can carry several kills (see `first_time`).

A fault is a dict::

    {"action": "kill", "at": BOUNDARY, "fragment": p, "round": r}
    {"action": "plant", "kind": KIND, "fragment": p, "round": r}

Kill boundaries of a worker: ``before-commit`` (its delta payload is uploaded, its
commit record not yet created), ``after-commit`` (the record was just created),
``after-publish`` (its send of (p, r) returned, whatever it adopted). Of the
aggregator: ``before-mean-commit`` (mean payload written, ``mean.json`` not yet
created), and the product's hook stages ``published``, ``stepped``,
``checkpointed``.

Kills at any key (elastic membership, tests/test_elastic_faults.py), ``key`` a
glob (fnmatch) of store keys, firing the first time one matches::

    {"action": "kill", "at": "before-put", "key": "members/*/left.json"}
    {"action": "kill", "at": "after-put", "key": "frag/*/commits/region-c.json"}
    {"action": "kill", "at": "after-get", "key": "members/region-c/admission.json"}

``before-put`` / ``after-put``: around the create-only `ObjectStore.put_if_absent`
of that key (every membership record, admission, left record and commit is one);
``after-get``: just after `ObjectStore.get` of that key returned its bytes (an
absent key raises and does not fire): e.g. a joiner that has read its admission
and not yet bootstrapped.

A wait holds the job, its imports done, until a store key exists, then starts it
(a job that must begin at a point of the run does not pay its start-up after it)::

    {"action": "wait", "key": "frag/0/r000000/mean.json"}

Plant kinds, all written into this worker's own slot of (p, r): ``flip`` (one
byte of the chunk object flipped after hashing: bit rot), ``nan`` (a NaN block
scale with valid checksums), ``shape`` (a vector one block too long, honestly
described), ``replay`` (the record of round r-1 copied to round r before the
worker commits), ``huge`` (the real delta with one value set to 1e30, published
first through the public `Exchange.publish_delta`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository is not on the path
    sys.path.insert(0, str(ROOT))

FAULTS_ENV = "DILOCO_FAULTS"
FAULT_LOG_ENV = "DILOCO_FAULT_LOG"
FIRED_ENV = "DILOCO_FAULT_FIRED"

WORKER_KILLS = ("before-commit", "after-commit", "after-publish")
KEY_KILLS = ("before-put", "after-put", "after-get")
AGGREGATOR_KILLS = ("before-mean-commit", "published", "stepped", "checkpointed")
PLANTS = ("flip", "nan", "shape", "replay", "huge")

_fired: set[int] = set()
_lock = threading.Lock()
_planting = threading.local()  # set while a plant publishes through the public API


def note(text: str) -> None:
    """Append ``text`` to the fault log (fsynced: the next thing may be SIGKILL)."""
    path = os.environ.get(FAULT_LOG_ENV)
    if not path:
        return
    with open(path, "a") as out:
        out.write(text + "\n")
        out.flush()
        os.fsync(out.fileno())


def die(text: str) -> None:
    """Note why, then SIGKILL this process: nothing after this line runs."""
    note(text)
    os.kill(os.getpid(), signal.SIGKILL)


def first_time(index: int) -> bool:
    """True the first time fault ``index`` matches (a retried call must not plant
    or die twice); with ``DILOCO_FAULT_FIRED`` (a file of this job's own) the first
    time across its restarts, so that a job killed by one fault can be started again
    with the same list and meet the next one (the file is written before the fault
    acts: the next thing may be SIGKILL)."""
    with _lock:
        if index in _fired:
            return False
        _fired.add(index)
        path = os.environ.get(FIRED_ENV)
        if not path:
            return True
        try:
            with open(path) as done:
                if str(index) in done.read().split():
                    return False
        except FileNotFoundError:
            pass
        with open(path, "a") as out:
            out.write(f"{index}\n")
            out.flush()
            os.fsync(out.fileno())
        return True


def party(argv: list[str]) -> str:
    """This process's name as the store knows it: the worker, or ``aggregator``."""
    if "--aggregate" in argv:
        return "aggregator"
    return argv[argv.index("--worker") + 1]


def install(faults: list[dict], me: str) -> None:
    """Wrap the product methods where ``faults`` act (see the module docstring)."""
    from diloco.aggregator import Aggregator
    from storage import layout
    from storage.exchange import Exchange
    from storage.objectstore import ObjectStore

    def commit_key(f: dict) -> str:
        if me == "aggregator":
            return layout.mean_commit(f["fragment"], f["round"])
        return layout.delta_commit(f["fragment"], f["round"], me)

    commit_kills = [(i, f, commit_key(f)) for i, f in enumerate(faults)
                    if f["action"] == "kill" and f["at"] in (
                        "before-commit", "after-commit", "before-mean-commit")]
    if commit_kills:
        real_put_if_absent = ObjectStore.put_if_absent

        def put_if_absent(self, key, data):
            for i, f, k in commit_kills:
                if key == k and f["at"] != "after-commit" and first_time(i):
                    die(f"{me} killed at {f['at']} {f['fragment']} {f['round']}")
            created = real_put_if_absent(self, key, data)
            for i, f, k in commit_kills:
                if key == k and f["at"] == "after-commit" and first_time(i):
                    die(f"{me} killed at after-commit {f['fragment']} {f['round']} "
                        f"(created {created})")
            return created

        ObjectStore.put_if_absent = put_if_absent

    install_key_kills(faults, me)

    sends = [(i, f) for i, f in enumerate(faults)
             if f["action"] == "plant" or f.get("at") == "after-publish"]
    if sends:
        real_publish = Exchange.publish_prepared

        def publish_prepared(self, prepared, *, tokens, extra=None):
            if getattr(_planting, "on", False):  # the plant's own publish_delta
                return real_publish(self, prepared, tokens=tokens, extra=extra)
            mine = [(i, f) for i, f in sends
                    if (f["fragment"], f["round"]) == (prepared.fragment, prepared.round)]
            published = None
            for i, f in mine:
                if f["action"] == "plant" and first_time(i):
                    _planting.on = True
                    try:
                        published = plant(self, prepared, f["kind"], tokens, extra,
                                          real_publish)
                    finally:
                        _planting.on = False
                    note(f"{me} planted {f['kind']} {f['fragment']} {f['round']}")
            if published is None:
                published = real_publish(self, prepared, tokens=tokens, extra=extra)
            for i, f in mine:
                if f.get("at") == "after-publish" and first_time(i):
                    die(f"{me} killed at after-publish {f['fragment']} {f['round']}")
            return published

        Exchange.publish_prepared = publish_prepared

    hooks = [(i, f) for i, f in enumerate(faults)
             if f.get("at") in ("published", "stepped", "checkpointed")]
    if hooks:
        real_init = Aggregator.__init__

        def fault(stage: str, p: int, r: int) -> None:
            for i, f in hooks:
                if (f["at"], f["fragment"], f["round"]) == (stage, p, r) and first_time(i):
                    die(f"{me} killed at {stage} {p} {r}")

        def init(self, *args, **kwargs):
            kwargs["fault"] = fault
            real_init(self, *args, **kwargs)

        Aggregator.__init__ = init


def install_key_kills(faults: list[dict], me: str) -> None:
    """Kills at any store key (``before-put``, ``after-put``, ``after-get``)."""
    from fnmatch import fnmatchcase

    from storage.objectstore import ObjectStore

    kills = [(i, f) for i, f in enumerate(faults)
             if f["action"] == "kill" and f["at"] in KEY_KILLS]
    if not kills:
        return

    def check(at: str, key: str) -> None:
        for i, f in kills:
            if f["at"] == at and fnmatchcase(key, f["key"]) and first_time(i):
                die(f"{me} killed at {at} {key}")

    if any(f["at"] != "after-get" for _, f in kills):
        inner_put = ObjectStore.put_if_absent  # maybe already wrapped above

        def put_if_absent(self, key, data):
            check("before-put", key)
            created = inner_put(self, key, data)
            check("after-put", key)
            return created

        ObjectStore.put_if_absent = put_if_absent
    if any(f["at"] == "after-get" for _, f in kills):
        inner_get = ObjectStore.get

        def get(self, key, *args, **kwargs):
            data = inner_get(self, key, *args, **kwargs)
            check("after-get", key)
            return data

        ObjectStore.get = get


def plant(ex, prepared, kind: str, tokens: int, extra, real_publish):
    """Put a bad contribution of kind ``kind`` into this worker's slot of the round
    of ``prepared``. Returns what the send returns when the bad bytes ARE this
    send (the worker itself goes on with its honest decoded value: only the store
    is bad), or None when the honest send must still follow (and find the slot
    taken)."""
    from dataclasses import replace

    import numpy as np

    from storage import layout
    from storage.arrays import encode_array
    from storage.exchange import Published

    p, r, worker = prepared.fragment, prepared.round, prepared.worker
    chunk = f"{prepared.payload}/c/0"
    if kind == "replay":
        old = ex.store.get(layout.delta_commit(p, r - 1, worker))
        ex.store.put_if_absent(layout.delta_commit(p, r, worker), old)
        return None
    if kind == "huge":
        x = np.array(prepared.decoded, dtype=np.float32)
        x[0] = np.float32(1e30)
        ex.publish_delta(p, r, worker, x, tokens=tokens, extra=extra)
        return None
    if kind == "flip":
        blob = bytearray(prepared.blobs[chunk])
        blob[len(blob) // 2] ^= 0x40
        bad = replace(prepared, blobs={**prepared.blobs, chunk: bytes(blob)})
    elif kind == "nan":
        bad = _with_nan_scale(prepared, chunk)
    elif kind == "shape":
        n = prepared.decoded.size + ex.up.block_size
        blobs, record, decoded = encode_array(prepared.payload, np.ones(n, np.float32), ex.up)
        bad = replace(prepared, blobs=blobs, record=record, decoded=decoded)
    else:
        raise ValueError(f"unknown plant kind {kind!r}")
    published = real_publish(ex, bad, tokens=tokens, extra=extra)
    return Published(prepared.decoded, published.commit, published.created)


def _with_nan_scale(prepared, chunk: str):
    """``prepared`` with its first block scale set to NaN, every checksum (the
    chunk's crc32c, the record's size and sha256) made to match: only decoding
    can tell."""
    import hashlib
    import struct
    from dataclasses import replace

    import google_crc32c

    payload = bytearray(prepared.blobs[chunk][:-4])  # the codec's bytes, then a crc32c
    payload[0:4] = struct.pack("<f", float("nan"))
    blob = bytes(payload) + struct.pack("<I", google_crc32c.value(bytes(payload)))
    name = chunk[len(prepared.payload) + 1:]
    record = {**prepared.record,
              name: {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    return replace(prepared, blobs={**prepared.blobs, chunk: blob}, record=record)


def wait_for(faults: list[dict], argv: list[str], timeout: float = 600.0) -> None:
    """Hold until every key of a ``wait`` fault exists in the run's store (the
    imports of the job done first: it then starts at once)."""
    keys = [f["key"] for f in faults if f["action"] == "wait"]
    if not keys:
        return
    import workers.loop  # noqa: F401 - what the job imports, before the wait
    from storage.objectstore import ObjectStore

    store = ObjectStore(argv[argv.index("--run") + 1], storage_options=json.loads(
        os.environ.get("DILOCO_STORAGE_OPTIONS") or "{}"))
    deadline = time.monotonic() + timeout
    while not all(store.exists(key) for key in keys):
        if time.monotonic() > deadline:
            raise SystemExit(f"fault_job: waited {timeout:.0f} s for {keys}")
        time.sleep(0.05)
    note(f"{party(argv)} waited for {', '.join(keys)}")


def main() -> int:
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    faults = json.loads(os.environ.get(FAULTS_ENV) or "[]")
    install(faults, party(argv))
    from workers.__main__ import main as real_main

    wait_for(faults, argv)
    return real_main(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
