"""Shared fixtures: one store API, four backends, real S3 servers on loopback.

S3 tests run against two local servers, started once per session on 127.0.0.1 and
free ports, only when a test first needs them: ``moto`` (moto's server, a mock of
S3: tests/s3server.py) and ``seaweedfs`` (SeaweedFS, a real object store:
storage/seaweed.py). A test that needs one of them only says so with the marker
``@pytest.mark.s3_backends("moto")`` (and why, beside it). Test ids name the server
(``[s3-moto]``, ``[s3-seaweedfs]``); select with ``-k seaweedfs`` or ``-m s3``, or
skip every S3 test with ``-m "not s3"``.

To run every S3 test against MinIO, AWS or another endpoint instead (and start no
local server)::

    DILOCO_TEST_S3_ENDPOINT=http://127.0.0.1:9000 \\
    DILOCO_TEST_S3_KEY=... DILOCO_TEST_S3_SECRET=... \\
    DILOCO_TEST_S3_BUCKET=diloco-test   # optional, this is the default
    DILOCO_TEST_S3_REGION=us-east-1     # optional, this is the default
    .venv/bin/pytest -m s3

(ids ``[s3-endpoint]``; the bucket is created if missing; each test writes under a
fresh prefix and removes it.) See docs/local-s3.md.

Fixtures other test files build on (keep these stable):

``store_url`` (function scope), one test per backend: ``memory``, ``file``,
``s3-moto``, ``s3-seaweedfs`` (or ``s3-endpoint``)
    ``{"url": str, "storage_options": dict}`` naming a fresh, empty root unique to
    the test: ``memory://diloco-test-<uuid>``, a ``file://`` URL under ``tmp_path``,
    or ``s3://<bucket>/<uuid>``. The S3 cases carry ``pytest.mark.s3``.

``make_store`` (function scope)
    ``make_store(name="", **overrides) -> ObjectStore`` on the current
    ``store_url``. Every call returns a new `ObjectStore` with its own
    `TrafficCounter`, as separate workers would have; they all see the same
    objects (memory:// is process-global). ``overrides`` go to the constructor
    (``retry=``, ``traffic=``).

``s3_endpoint`` (session scope), one test per S3 server
    ``(endpoint_url, storage_options)`` of the S3 server, with the test bucket
    created.

``s3_bucket`` (session scope)
    The test bucket's name.

``s3_env`` (session scope)
    Environment variables (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...)
    that point a subprocess, or an ObjectStore built without storage_options, at
    the same server.

``s3_backend`` (session scope)
    The name of the server of this test: ``moto``, ``seaweedfs`` or ``endpoint``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One torch thread per process, set before anything imports torch, and inherited by
# every job a test starts: the suite runs two pytest workers on two cores, each
# starting jobs, and more OpenMP threads than cores only spin (the tiny recipe's jobs
# already take train.threads=1). 47 s instead of 69 s for tests/test_worker.py and
# tests/test_numerics.py on two cores; the numerics compare runs of one process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import boto3  # noqa: E402
import fsspec  # noqa: E402
import pytest  # noqa: E402

from storage.objectstore import ObjectStore, RetryPolicy  # noqa: E402

try:  # tests/ is on sys.path under pytest's default import mode
    from s3server import DUMMY_KEY, DUMMY_SECRET, REGION, MotoS3Server, SeaweedS3Server
except ImportError:  # tests imported as a package
    from tests.s3server import DUMMY_KEY, DUMMY_SECRET, REGION, MotoS3Server, SeaweedS3Server

DEFAULT_TEST_BUCKET = "diloco-test"
#: The local S3 servers every S3 test runs against (see the module docstring).
LOCAL_S3_BACKENDS = ("moto", "seaweedfs")


def s3_backends(node: pytest.Item | Any = None) -> list[str]:
    """The S3 servers a test runs against: ``["endpoint"]`` when
    DILOCO_TEST_S3_ENDPOINT names one, else the local servers its
    ``s3_backends`` marker allows (all of them without the marker)."""
    if os.environ.get("DILOCO_TEST_S3_ENDPOINT"):
        return ["endpoint"]
    marker = node.get_closest_marker("s3_backends") if node is not None else None
    if marker is None:
        return list(LOCAL_S3_BACKENDS)
    unknown = set(marker.args) - set(LOCAL_S3_BACKENDS)
    if unknown or not marker.args:
        raise pytest.UsageError(f"{node.nodeid}: s3_backends takes some of "
                                f"{', '.join(LOCAL_S3_BACKENDS)}, got {marker.args}")
    return [b for b in LOCAL_S3_BACKENDS if b in marker.args]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "s3_backends(*names): run this S3 test only against these local "
                   "servers (moto, seaweedfs); say why beside it")


#: The slowest files, slowest first (seconds of test time summed over both pytest
#: workers in a whole ``make test``, 2026-11-28, ``pytest --durations=0``). `make test`
#: hands whole files to its two workers in collection order
#: (``--no-loadscope-reorder``): started first, the long files no longer end the
#: suite on one worker while the other has nothing left to take. A file not listed
#: keeps its place after these; the figures need only be roughly right.
SLOWEST_FILES = (
    "test_elastic_faults.py", "test_fault_campaign.py", "test_deployments.py",
    "test_roles.py", "test_startup.py", "test_tracking.py", "test_seaweed.py",
    "test_secrets.py", "test_cli.py", "test_wheel.py", "test_aggregator_shards.py",
    "test_flows.py", "test_bench_scale.py", "test_prefect_view.py", "test_benchmarks.py",
    "test_terminal.py", "test_bench_claims.py", "test_island_flow.py", "test_gpu_ready.py",
    "test_worker.py", "test_overlap_auto.py", "test_shard_status.py", "test_distributed.py",
    "test_island_stop.py", "test_workpools.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (`SLOWEST_FILES`), each file's tests in their order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """``DILOCO_TEST_CPU=FILE``: append one JSON line per test to FILE with its wall
    seconds and the CPU seconds of the test process and of the children it reaped
    (servers shared between tests are not counted). A test whose CPU is far below
    its wall time waits on a clock: where a shorter timeout or poll saves time."""
    out = os.environ.get("DILOCO_TEST_CPU")
    if not out:
        return (yield)
    import json  # noqa: PLC0415
    import resource  # noqa: PLC0415
    import time  # noqa: PLC0415

    def cpu() -> tuple[float, float]:
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    (me0, kids0), wall0 = cpu(), time.perf_counter()
    try:
        return (yield)
    finally:
        (me1, kids1), wall = cpu(), time.perf_counter() - wall0
        with open(out, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "wall": round(wall, 3),
                                "cpu_self": round(me1 - me0, 3),
                                "cpu_children": round(kids1 - kids0, 3)}) + "\n")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per backend: ``store_url`` over memory, file and the S3 servers, and
    every test that needs an S3 server (``s3_endpoint``, ``s3_env``, ...) over the
    S3 servers. Both are parametrized here rather than by ``params=``, so that a
    marker can narrow the servers of one test."""
    servers = s3_backends(metafunc.definition)
    s3_params = [pytest.param(f"s3-{b}", marks=pytest.mark.s3, id=f"s3-{b}") for b in servers]
    if "store_url" in metafunc.fixturenames:
        metafunc.parametrize("store_url", ["memory", "file", *s3_params], indirect=True)
    if "s3_backend" in metafunc.fixturenames:
        metafunc.parametrize("s3_backend", s3_params, indirect=True, scope="session")


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


def _local_target(server: MotoS3Server | SeaweedS3Server) -> S3Target:
    target = _target(server.endpoint_url, DUMMY_KEY, DUMMY_SECRET, REGION)
    _create_bucket(target)
    return target


@pytest.fixture(scope="session")
def _moto_target() -> Iterator[S3Target]:
    """moto's S3 server, started the first time a test needs it."""
    with MotoS3Server() as server:
        yield _local_target(server)


@pytest.fixture(scope="session")
def _seaweedfs_target() -> Iterator[S3Target]:
    """SeaweedFS, started the first time a test needs it (in about a second)."""
    with SeaweedS3Server() as server:
        yield _local_target(server)


@pytest.fixture(scope="session")
def _endpoint_target() -> S3Target:
    """The server DILOCO_TEST_S3_ENDPOINT names (MinIO, AWS, ...)."""
    target = _target(
        os.environ["DILOCO_TEST_S3_ENDPOINT"],
        os.environ.get("DILOCO_TEST_S3_KEY"),
        os.environ.get("DILOCO_TEST_S3_SECRET"),
        os.environ.get("DILOCO_TEST_S3_REGION", REGION),
    )
    _create_bucket(target)
    return target


@pytest.fixture(scope="session")
def s3_backend(request: pytest.FixtureRequest) -> str:
    """The S3 server of this test: ``moto``, ``seaweedfs`` or ``endpoint`` (the first
    of `s3_backends` when a test asks for it by ``request.getfixturevalue``)."""
    param = getattr(request, "param", None) or f"s3-{s3_backends()[0]}"
    return param.removeprefix("s3-")


@pytest.fixture(scope="session")
def _s3_target(request: pytest.FixtureRequest, s3_backend: str) -> S3Target:
    return request.getfixturevalue(f"_{s3_backend}_target")


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


@pytest.fixture
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
        backend = request.param.removeprefix("s3-")
        target: S3Target = request.getfixturevalue(f"_{backend}_target")
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


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The ``diloco`` command in this process (fast), as a user with a clean
    environment would run it: no Prefect, MLflow, diloco or AWS settings from the
    caller, a PREFECT_HOME of its own, cwd = tmp_path. What the command sets in
    the environment for itself is removed afterwards."""
    from typer.testing import CliRunner

    for key in list(os.environ):
        if key.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.chdir(tmp_path)
    before = dict(os.environ)
    yield CliRunner()
    for key in set(os.environ) - set(before):  # what the command set for itself
        del os.environ[key]


# -- the container tests' session fixtures (docker_engine, image): one Docker engine
# and one image build per pytest session, whichever container test files run. They
# skip unless asked for (-m containers); tests/docker_engine.py.
pytest_plugins = ["docker_engine"]
