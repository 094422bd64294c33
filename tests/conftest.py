"""Shared fixtures: one store API, three backends, a real S3 server on loopback.

Fixtures other test files build on (keep these stable):

``store_url`` (function scope), parametrized over ids ``memory``, ``file``, ``s3``
    ``{"url": str, "storage_options": dict}`` naming a fresh, empty root unique to
    the test: ``memory://diloco-test-<uuid>``, a ``file://`` URL under ``tmp_path``,
    or ``s3://<bucket>/<uuid>``. The ``s3`` case carries ``pytest.mark.s3`` (select
    or skip it with ``-m s3`` / ``-m "not s3"``) and starts the S3 server only
    when first needed.

``make_store`` (function scope)
    ``make_store(name="", **overrides) -> ObjectStore`` on the current
    ``store_url``. Every call returns a new `ObjectStore` with its own
    `TrafficCounter`, as separate workers would have; they all see the same
    objects (memory:// is process-global). ``overrides`` go to the constructor
    (``retry=``, ``traffic=``).

``s3_endpoint`` (session scope)
    ``(endpoint_url, storage_options)`` of the S3 server, with the test bucket
    created. By default moto's server in a child process on 127.0.0.1 (see
    ``tests/s3server.py``). To test against MinIO or another server instead::

        DILOCO_TEST_S3_ENDPOINT=http://127.0.0.1:9000 \\
        DILOCO_TEST_S3_KEY=... DILOCO_TEST_S3_SECRET=... \\
        DILOCO_TEST_S3_BUCKET=diloco-test   # optional, this is the default
        .venv/bin/pytest -m s3

``s3_bucket`` (session scope)
    The test bucket's name.

``s3_env`` (session scope)
    Environment variables (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...)
    that point a subprocess, or an ObjectStore built without storage_options, at
    the same server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import fsspec
import pytest

from storage.objectstore import ObjectStore, RetryPolicy

try:  # tests/ is on sys.path under pytest's default import mode
    from s3server import DUMMY_KEY, DUMMY_SECRET, REGION, MotoS3Server
except ImportError:  # tests imported as a package
    from tests.s3server import DUMMY_KEY, DUMMY_SECRET, REGION, MotoS3Server

DEFAULT_TEST_BUCKET = "diloco-test"


@dataclass
class S3Target:
    """Where the S3 tests send their requests."""

    endpoint_url: str
    bucket: str
    storage_options: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


def _create_bucket(target: S3Target) -> None:
    opts = target.storage_options
    client = boto3.client(
        "s3",
        endpoint_url=target.endpoint_url,
        aws_access_key_id=opts.get("key"),
        aws_secret_access_key=opts.get("secret"),
        region_name=opts["client_kwargs"]["region_name"],
    )
    try:
        client.create_bucket(Bucket=target.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    except client.exceptions.BucketAlreadyExists:
        pass


def _target(endpoint: str, key: str | None, secret: str | None, region: str) -> S3Target:
    options: dict[str, Any] = {"endpoint_url": endpoint, "client_kwargs": {"region_name": region}}
    env = {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_DEFAULT_REGION": region}
    if key is not None:
        options["key"] = key
        env["AWS_ACCESS_KEY_ID"] = key
    if secret is not None:
        options["secret"] = secret
        env["AWS_SECRET_ACCESS_KEY"] = secret
    bucket = os.environ.get("DILOCO_TEST_S3_BUCKET", DEFAULT_TEST_BUCKET)
    return S3Target(endpoint, bucket, options, env)


@pytest.fixture(scope="session")
def _s3_target() -> Iterator[S3Target]:
    external = os.environ.get("DILOCO_TEST_S3_ENDPOINT")
    if external:
        target = _target(
            external,
            os.environ.get("DILOCO_TEST_S3_KEY"),
            os.environ.get("DILOCO_TEST_S3_SECRET"),
            os.environ.get("DILOCO_TEST_S3_REGION", REGION),
        )
        _create_bucket(target)
        yield target
        return
    with MotoS3Server() as server:
        target = _target(server.endpoint_url, DUMMY_KEY, DUMMY_SECRET, REGION)
        _create_bucket(target)
        yield target


@pytest.fixture(scope="session")
def s3_endpoint(_s3_target: S3Target) -> tuple[str, dict[str, Any]]:
    """``(endpoint_url, storage_options)`` of the test S3 server (bucket created)."""
    return _s3_target.endpoint_url, dict(_s3_target.storage_options)


@pytest.fixture(scope="session")
def s3_bucket(_s3_target: S3Target) -> str:
    """Name of the test bucket on ``s3_endpoint``."""
    return _s3_target.bucket


@pytest.fixture(scope="session")
def s3_env(_s3_target: S3Target) -> dict[str, str]:
    """Environment variables that point botocore (and so s3fs) at the test server."""
    return dict(_s3_target.env)


@pytest.fixture(
    params=["memory", "file", pytest.param("s3", marks=pytest.mark.s3)],
    ids=["memory", "file", "s3"],
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh, empty store root per test on each backend (see module docstring)."""
    unique = f"diloco-test-{uuid.uuid4().hex[:12]}"
    if request.param == "memory":
        yield {"url": f"memory://{unique}", "storage_options": {}}
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{unique}"):
            fs.rm(f"/{unique}", recursive=True)
    elif request.param == "file":
        root = tmp_path / "store"
        yield {"url": root.as_uri(), "storage_options": {}}
    else:
        target: S3Target = request.getfixturevalue("_s3_target")
        yield {
            "url": f"s3://{target.bucket}/{unique}",
            "storage_options": dict(target.storage_options),
        }
        _cleanup_s3(target, unique)


def _cleanup_s3(target: S3Target, prefix: str) -> None:
    """Best effort: a shared MinIO should not fill up with test runs."""
    store = ObjectStore(
        f"s3://{target.bucket}",
        storage_options=target.storage_options,
        retry=RetryPolicy(attempts=1),
    )
    with suppress(Exception):  # cleanup must never fail a test
        store.delete_prefix(prefix)


@pytest.fixture
def make_store(store_url: dict[str, Any]) -> Callable[..., ObjectStore]:
    """Factory of independent ObjectStores (own TrafficCounter each) on ``store_url``."""

    def make(name: str = "", **overrides: Any) -> ObjectStore:
        return ObjectStore(
            store_url["url"],
            storage_options=store_url["storage_options"],
            name=name,
            **overrides,
        )

    return make
