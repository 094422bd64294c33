"""Peak memory and time of moving one large object through the S3 store.

    .venv/bin/python -m benchmarks.bench_large [--mib 512] [--out benchmarks/results/large.json]

Starts SeaweedFS on loopback (storage/seaweed.py), then for each mode runs one child
process per phase, and the peak (``VmHWM``) is reset once the object to upload
exists (/proc/self/clear_refs), so it is the store's alone:

- ``parts``: the store's defaults (storage/multipart.py: multipart above 64 MiB in
  16 MiB parts, 4 in flight; ranged reads into one preallocated bytearray);
- ``single``: ``multipart_threshold`` above the object, i.e. the store as it was
  before: s3fs's own ``pipe_file`` (which slices ``bytes`` parts, copying them) and
  one plain GET (``cat_file``).

``put``: the child makes ``--mib`` MiB of random bytes, notes its RSS, puts them;
``get``: the child notes its RSS, gets the object, checks its sha256. Reported: the
seconds of the put/get, the peak RSS, and the peak above the RSS before the object
existed as a multiple of the object's size (1.0 = the object itself and nothing else).
Loopback and 2 shared cores: the seconds are this machine's, the multiples are not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

from benchmarks.rss import reset_peak, status

MIB = 1 << 20
MODES = {"parts": {}, "single": {"multipart_threshold": 1 << 40}}




def child(phase: str, url: str, options: dict, size: int, digest: str) -> dict:
    """One phase in this (fresh) process: the figures of `put` or `get`."""
    import numpy as np  # noqa: PLC0415 - after the baseline

    from storage.objectstore import ObjectStore  # noqa: PLC0415

    store = ObjectStore(url, storage_options=options)
    store.exists("warm-up")  # the client and its pool exist before the baseline
    start_rss = status("VmRSS")
    if phase == "put":
        data = np.random.default_rng(0).bytes(size)
        base = reset_peak() - size  # the object itself counts, as in a get
        start = time.perf_counter()
        store.put("large/obj", data)
    else:
        base = reset_peak()
        start = time.perf_counter()
        data = store.get("large/obj")
    seconds = time.perf_counter() - start
    peak = status("VmHWM")
    assert len(data) == size and (phase == "put" or hashlib.sha256(data).hexdigest() == digest)
    return {"phase": phase, "seconds": round(seconds, 2), "peak_rss_mib": round(peak / MIB),
            "base_rss_mib": round(start_rss / MIB), "peak_over_base_x": round((peak - base) / size, 2),
            "requests": store.traffic.snapshot()["by_op"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--out", default="")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mib * MIB
    if args.child:
        phase, url, options, digest = args.child
        print(json.dumps(child(phase, url, json.loads(options), size, digest)))
        return
    import numpy as np  # noqa: PLC0415

    from storage.seaweed import SeaweedFS, new_identity  # noqa: PLC0415

    digest = hashlib.sha256(np.random.default_rng(0).bytes(size)).hexdigest()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-large-") as tmp, SeaweedFS(
            tmp, admin=new_identity("bench")) as server:
        bucket = server.create_bucket("bench")
        for mode, extra in MODES.items():
            url = f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
            # the keys go by the environment, never on a command line
            options = json.dumps({"endpoint_url": server.endpoint,
                                  "client_kwargs": {"region_name": "us-east-1"}, **extra})
            for phase in ("put", "get"):
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.bench_large", "--mib", str(args.mib),
                     "--child", phase, url, options, digest],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, **server.env()}).stdout
                row = {"mode": mode, "mib": args.mib, **json.loads(out.splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
