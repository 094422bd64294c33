"""ObjectStore on every backend: the guarantees the exchange protocol relies on.

Each test runs on memory://, file:// and s3:// (moto's server and SeaweedFS on
loopback, or DILOCO_TEST_S3_ENDPOINT) through the ``make_store`` fixture of
conftest.py; the S3-only tests use ``s3_endpoint``, on both servers too.
Run: ``.venv/bin/pytest tests/test_objectstore.py -q``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from tenacity import RetryCallState, Retrying

from storage.backends import CredentialsInURL, secret_options
from storage.errors import ObjectMissing, TransientStoreError
from storage.objectstore import ObjectStore, RetryPolicy
from storage.retry import is_transient
from storage.traffic import TrafficCounter

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)


# -- basics -------------------------------------------------------------------------


def test_put_get_round_trip(make_store):
    store = make_store()
    body = bytes(range(256)) * 4
    store.put("frag/0/r1/delta/w1/c/0", body)
    assert store.get("frag/0/r1/delta/w1/c/0") == body
    assert store.exists("frag/0/r1/delta/w1/c/0")
    assert store.size("frag/0/r1/delta/w1/c/0") == 1024
    store.put("frag/0/r1/delta/w1/c/0", b"again")  # overwrite is allowed
    assert store.get("frag/0/r1/delta/w1/c/0") == b"again"
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.size("empty") == 0


def test_other_instances_see_the_same_objects(make_store):
    a, b = make_store("a"), make_store("b")
    a.put("x/y", b"from a")
    assert b.get("x/y") == b"from a"


def test_get_missing_raises_object_missing_naming_the_url(make_store):
    store = make_store()
    with pytest.raises(ObjectMissing) as info:
        store.get("no/such/key")
    assert store.full_url("no/such/key") in str(info.value)
    assert store.url in str(info.value)
    with pytest.raises(ObjectMissing, match="no/such/key"):
        store.size("no/such/key")
    assert not store.exists("no/such/key")


def test_a_prefix_is_not_an_object(make_store):
    store = make_store()
    store.put("dir/leaf", b"1")
    assert not store.exists("dir")
    with pytest.raises(ObjectMissing):
        store.get("dir")
    with pytest.raises(ObjectMissing):
        store.size("dir")


def test_put_if_absent_first_writer_wins(make_store):
    store = make_store()
    assert store.put_if_absent("frag/0/r1/mean/commit.json", b"first") is True
    assert store.put_if_absent("frag/0/r1/mean/commit.json", b"second") is False
    assert make_store().put_if_absent("frag/0/r1/mean/commit.json", b"third") is False
    assert store.get("frag/0/r1/mean/commit.json") == b"first"


def test_eight_threads_race_put_if_absent_exactly_one_wins(make_store):
    n = 8
    stores = [make_store(f"w{i}") for i in range(n)]
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def race(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stores[i].put_if_absent("commit", f"writer {i}".encode())
        except Exception as exc:  # surfaced below
            results[i] = exc

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(r, bool) for r in results), results
    winners = [i for i, r in enumerate(results) if r]
    assert len(winners) == 1, results
    assert stores[0].get("commit") == f"writer {winners[0]}".encode()


def test_threads_share_one_store(make_store):
    """One instance used from 8 threads at once: puts, gets and listings interleave."""
    store = make_store()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(10):
                store.put(f"t/{i}/{j}", f"{i}-{j}".encode())
                assert store.get(f"t/{i}/{j}") == f"{i}-{j}".encode()
                store.list("t")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(store.list("t")) == 80
    assert store.traffic.objects_up.keys() == {f"t/{i}/{j}" for i in range(8) for j in range(10)}


# -- listing and deleting ---------------------------------------------------------


def test_list_is_recursive_relative_and_sorted(make_store):
    store = make_store()
    assert store.list("") == []
    assert store.list("a") == []
    for key in ["a/b/c", "a/b/d/e", "a/x", "ab/y", "top"]:
        store.put(key, b"v")
    assert store.list("a") == ["a/b/c", "a/b/d/e", "a/x"]
    assert store.list("a/") == ["a/b/c", "a/b/d/e", "a/x"]
    assert store.list("a/b") == ["a/b/c", "a/b/d/e"]
    assert store.list("a/b/d/e") == []  # an object, not a prefix
    assert store.list("") == ["a/b/c", "a/b/d/e", "a/x", "ab/y", "top"]
    assert store.list("nothing/here") == []


def test_a_memory_listing_survives_a_writer_outside_the_store(monkeypatch):
    """torch DCP's fsspec writer puts checkpoint files into the memory dict without
    this class's lock; a listing whose copy of the dict it disturbed is taken again
    (once, it crashed the aggregator thread of an in-process run)."""
    import uuid

    store = ObjectStore(f"memory://diloco-test-{uuid.uuid4().hex}")
    store.put("a/1", b"x")
    real, disturbed = store._fs.find, []

    def find(*args: Any, **kwargs: Any) -> Any:
        if not disturbed:
            disturbed.append(True)
            store._fs.pipe(store.fs_path("a/2"), b"y")  # the outside writer
            raise RuntimeError("dictionary changed size during iteration")
        return real(*args, **kwargs)

    monkeypatch.setattr(store._fs, "find", find)
    assert store.list("a") == ["a/1", "a/2"]
    monkeypatch.setattr(store._fs, "find", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="something else"):
        store.list("a")


def test_delete_prefix(make_store):
    store = make_store()
    for key in ["run/a/1", "run/a/2/3", "run/ab/4", "other"]:
        store.put(key, b"v")
    store.delete_prefix("run/a")
    assert store.list("") == ["other", "run/ab/4"]
    store.delete_prefix("never/was")  # missing prefixes are fine
    with pytest.raises(ValueError):
        store.delete_prefix("")


def test_child_is_a_view_sharing_traffic(make_store):
    store = make_store()
    run = store.child("run-1")
    assert run.url == f"{store.url}/run-1"
    assert run.traffic is store.traffic and run.retry is store.retry
    run.put("members/w1.json", b"{}")
    assert store.get("run-1/members/w1.json") == b"{}"
    assert run.list("") == ["members/w1.json"]
    assert run.full_url("members/w1.json") == f"{store.url}/run-1/members/w1.json"
    assert store.traffic.objects_up == {"run-1/members/w1.json": 2}
    assert run.child("members").get("w1.json") == b"{}"


def test_get_many_and_put_many(make_store):
    store = make_store()
    items = {f"chunks/{i}": bytes([i]) * (i + 1) for i in range(40)}
    store.put_many(items)
    assert store.list("chunks") == sorted(items)
    got = make_store().get_many(list(items))
    assert got == items
    assert list(got) == list(items)  # in the order asked for
    with pytest.raises(ObjectMissing, match="chunks/missing"):
        store.get_many(["chunks/1", "chunks/missing"])
    assert store.get_many([]) == {}


# -- keys and URLs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["", "/abs", "a//b", "a/../b", "..", "./a", "a/", "a/*", "glob?", "a/[x]", "a/b~tmp~c", "a\\b"],
)
def test_bad_keys_are_rejected(make_store, key):
    store = make_store()
    with pytest.raises(ValueError):
        store.put(key, b"v")
    with pytest.raises(ValueError):
        store.get(key)
    with pytest.raises(ValueError):
        store.put_if_absent(key, b"v")


def test_unknown_scheme_names_url_and_allowed_schemes():
    with pytest.raises(ValueError) as info:
        ObjectStore("gs://bucket/prefix")
    message = str(info.value)
    assert "gs://bucket/prefix" in message
    for scheme in ("memory://", "file://", "s3://"):
        assert scheme in message


def test_plain_path_is_a_file_store(tmp_path: Path):
    store = ObjectStore(str(tmp_path / "plain"))
    store.put("k/v", b"1")
    assert (tmp_path / "plain" / "k" / "v").read_bytes() == b"1"
    assert store.full_url("k/v") == f"{tmp_path}/plain/k/v"


@pytest.mark.parametrize("url", [
    "s3://AKIAEXAMPLE:supersecret@bucket/prefix",
    "s3://AKIAEXAMPLE:super/secret@bucket/prefix",  # a secret with a '/' in it
    "s3://AKIAEXAMPLE@bucket/prefix",
    "s3://bucket/prefix?secret=supersecret",
    "s3://bucket/prefix?X-Amz-Security-Token=supersecret",
    "s3://bucket/prefix?aws_secret_access_key=supersecret&versionId=2",
    "file://me:supersecret@/tmp/store",
])
def test_a_url_with_credentials_is_refused(url):
    """Credentials come from the environment: a URL carrying them would be stored
    with the run, put on command lines and printed. One line, naming the URL
    without them and the variables to use."""
    with pytest.raises(CredentialsInURL) as info:
        ObjectStore(url)
    message = str(info.value)
    assert "\n" not in message and "supersecret" not in message and "AKIAEXAMPLE" not in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert "AWS_ENDPOINT_URL_S3" in message


def test_paths_and_harmless_urls_are_not_credentials(tmp_path: Path):
    assert ObjectStore("s3://bucket/runs/user@host/r1").url == "s3://bucket/runs/user@host/r1"
    plain = tmp_path / "me@host"
    ObjectStore(str(plain)).put("k", b"1")
    assert (plain / "k").read_bytes() == b"1"


@pytest.mark.s3
def test_bucket_exists(s3_endpoint, s3_bucket, tmp_path: Path):
    _, options = s3_endpoint
    assert ObjectStore(f"s3://{s3_bucket}/any", storage_options=options).bucket_exists()
    missing = ObjectStore("s3://diloco-no-such-bucket-7f3a/runs", storage_options=options)
    assert missing.bucket == "diloco-no-such-bucket-7f3a"
    assert not missing.bucket_exists()
    assert ObjectStore(str(tmp_path)).bucket_exists() and ObjectStore(str(tmp_path)).bucket is None


def test_secret_options_are_found_where_they_hide():
    options = {"key": "AKIA", "endpoint_url": "http://x", "anon": False, "token": None,
               "client_kwargs": {"region_name": "eu", "aws_secret_access_key": "s"},
               "config_kwargs": {"retries": {"mode": "standard"}}, "sse_kms_key_id": "k1"}
    assert secret_options(options) == ["storage_options.key",
                                       "storage_options.client_kwargs.aws_secret_access_key"]
    assert secret_options({"endpoint_url": "http://x"}) == [] == secret_options(None)


def test_file_temp_files_are_invisible_and_cleaned(tmp_path: Path):
    store = ObjectStore(tmp_path.as_uri())
    store.put("a/b", b"1")
    assert store.put_if_absent("a/c", b"2")
    assert not store.put_if_absent("a/c", b"3")
    (tmp_path / "a" / "d.~tmp~deadbeef").write_bytes(b"half")  # a writer killed mid-write
    assert store.list("") == ["a/b", "a/c"]
    assert sorted(os.listdir(tmp_path / "a")) == ["b", "c", "d.~tmp~deadbeef"]


# -- traffic -------------------------------------------------------------------------


def test_traffic_counts_bodies_requests_and_categories(make_store):
    store = make_store()
    store.put("frag/0/delta/w1", b"x" * 10)
    store.put("frag/0/delta/w2", b"x" * 20)
    store.put_if_absent("frag/0/commit", b"c" * 5)
    store.put_if_absent("frag/0/commit", b"d" * 5)  # lost: 5 bytes sent, nothing stored
    store.put_many({"frag/1/delta/w1": b"y" * 7, "frag/1/delta/w2": b"y" * 3})
    assert store.get("frag/0/delta/w1") == b"x" * 10
    assert len(store.get_many(["frag/0/delta/w2", "frag/1/delta/w1"])) == 2
    store.list("frag")
    store.exists("frag/0/commit")
    store.size("frag/0/commit")

    t = store.traffic
    assert t.bytes_up == 10 + 20 + 5 + 5 + 7 + 3
    assert t.bytes_down == 10 + 20 + 7
    assert t.requests == 6 + 3 + 3  # 6 writes, 3 reads, list + exists + size
    assert t.objects_up == {
        "frag/0/delta/w1": 10,
        "frag/0/delta/w2": 20,
        "frag/0/commit": 5,
        "frag/1/delta/w1": 7,
        "frag/1/delta/w2": 3,
    }
    assert t.objects_down == {"frag/0/delta/w1": 10, "frag/0/delta/w2": 20, "frag/1/delta/w1": 7}
    cats = t.by_category()
    # default category: the key without its last segment
    assert cats["frag/0/delta"].bytes_up == 30 and cats["frag/0/delta"].bytes_down == 30
    assert cats["frag/0/delta"].requests == 4
    assert cats["frag/1/delta"].bytes_up == 10 and cats["frag/1/delta"].bytes_down == 7
    assert cats["frag/0"].requests == 4 and cats["frag/0"].bytes_up == 10
    assert cats["frag"].requests == 1  # the listing of frag/
    assert sum(c.bytes_up for c in cats.values()) == t.bytes_up
    assert sum(c.requests for c in cats.values()) == t.requests

    snap = t.snapshot()
    assert snap["bytes_up"] == t.bytes_up and snap["by_op"]["put_if_absent"] == 2
    t.reset()
    assert t.snapshot()["requests"] == 0 and t.objects_up == {}


def test_traffic_category_function(make_store):
    counter = TrafficCounter(category=lambda key: key.split("/")[0])
    store = make_store(traffic=counter)
    store.put("a/1/2", b"12")
    store.put("b/3", b"3")
    assert {k: v.bytes_up for k, v in counter.by_category().items()} == {"a": 2, "b": 1}


# -- retries -------------------------------------------------------------------------


class Flaky:
    """Wraps a filesystem method: raises ``error`` for the first ``failures`` calls."""

    def __init__(self, method: Any, error: BaseException, failures: int) -> None:
        self.method, self.error, self.failures, self.calls = method, error, failures, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.method(*args, **kwargs)


def test_transient_errors_are_retried(make_store, monkeypatch, caplog):
    store = make_store("w1", retry=FAST)
    store.put("k", b"value")
    flaky = Flaky(store.fs.cat_file, ConnectionResetError("injected reset"), failures=2)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with caplog.at_level(logging.WARNING, logger="storage.objectstore"):
        assert store.get("k") == b"value"
    assert flaky.calls == 3
    assert store.traffic.retries == 2
    assert store.traffic.snapshot()["retries_by_op"] == {"get": 2}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "store w1: get" in warnings[0] and "attempt 1 of 4" in warnings[0]
    assert store.full_url("k") in warnings[0]


def test_retries_give_up_with_transient_store_error(make_store, monkeypatch):
    store = make_store(retry=RetryPolicy(attempts=3, base_delay=0.001))
    store.put("k", b"value")
    flaky = Flaky(store.fs.cat_file, TimeoutError("injected timeout"), failures=10**6)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with pytest.raises(TransientStoreError) as info:
        store.get("k")
    assert flaky.calls == 3
    message = str(info.value)
    assert "get" in message and store.full_url("k") in message
    assert "3 attempts" in message and "TimeoutError: injected timeout" in message
    assert store.traffic.retries == 2 and store.traffic.requests == 4  # 1 put + 3 tries


def test_file_not_found_is_not_retried(make_store, monkeypatch):
    store = make_store(retry=FAST)
    flaky = Flaky(store.fs.cat_file, FileNotFoundError("k"), failures=10**6)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with pytest.raises(ObjectMissing):
        store.get("k")
    assert flaky.calls == 1 and store.traffic.retries == 0


def test_permission_error_is_not_retried_and_names_the_url(make_store, monkeypatch):
    store = make_store(retry=FAST)
    flaky = Flaky(store.fs.cat_file, PermissionError("Access Denied"), failures=10**6)
    monkeypatch.setattr(store.fs, "cat_file", flaky)
    with pytest.raises(PermissionError) as info:
        store.get("k")
    assert flaky.calls == 1
    assert any(store.full_url("k") in note for note in info.value.__notes__)


def test_put_if_absent_whose_answer_was_lost_still_reports_created(make_store, monkeypatch):
    """The first attempt lands but its response is lost; the retry finds the key
    taken with our own bytes, so we did create it."""
    store = make_store(retry=FAST)
    original = store._create_raw
    calls = []

    def lands_then_resets(path: str, data: bytes) -> bool:
        calls.append(path)
        created = original(path, data)
        if len(calls) == 1:
            raise ConnectionResetError("reset after the body was sent")
        return created

    monkeypatch.setattr(store, "_create_raw", lands_then_resets)
    assert store.put_if_absent("commit", b"mine") is True
    assert len(calls) == 2
    assert store.put_if_absent("commit", b"theirs") is False


def test_get_many_retries_only_the_failed_keys(make_store, monkeypatch):
    store = make_store(retry=FAST)
    items = {f"c/{i}": bytes([i]) * 3 for i in range(6)}
    store.put_many(items)
    seen: list[str] = []
    failed_once: set[str] = set()

    def fail_odd_once(path: str) -> None:
        seen.append(path)
        if path.endswith(("/1", "/3")) and path not in failed_once:
            failed_once.add(path)
            raise ConnectionResetError(f"reset on {path}")

    if store.url.startswith("s3://"):
        inner = store.fs._cat_file

        async def cat(path: str, *args: Any, **kwargs: Any) -> bytes:
            fail_odd_once(path)
            return await inner(path, *args, **kwargs)

        monkeypatch.setattr(store.fs, "_cat_file", cat)
    else:
        inner_sync = store.fs.cat_file

        def cat_sync(path: str, *args: Any, **kwargs: Any) -> bytes:
            fail_odd_once(path)
            return inner_sync(path, *args, **kwargs)

        monkeypatch.setattr(store.fs, "cat_file", cat_sync)
    assert store.get_many(list(items)) == items
    assert len(seen) == 6 + 2
    assert store.traffic.retries == 2


def test_retry_policy_backoff_bounds():
    """After the n-th failure the wait is c * U(0.5, 1), c = min(max_delay,
    base_delay * 2**(n-1)). base 0.2, max 1.0: c = 0.2, 0.4, 0.8, then 1.0 (capped)."""
    policy = RetryPolicy(attempts=6, base_delay=0.2, max_delay=1.0)
    wait = policy.wait()
    state = RetryCallState(Retrying(), None, (), {})
    for n, ceiling in ((1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)):
        state.attempt_number = n
        waits = [wait(state) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (n, min(waits), max(waits))
        assert max(waits) - min(waits) > ceiling / 10  # jittered, not fixed
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)


def test_is_transient_classification():
    def client_error(status: int, code: str) -> ClientError:
        return ClientError(
            {
                "Error": {"Code": code, "Message": code},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "PutObject",
        )

    def translated(exc: ClientError, err: int) -> OSError:
        wrapped = OSError(err, "translated by s3fs")
        wrapped.__cause__ = exc
        return wrapped

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.ECONNREFUSED, "refused"))
    assert is_transient(client_error(503, "SlowDown"))
    assert is_transient(client_error(500, "InternalError"))
    assert is_transient(client_error(400, "RequestTimeout"))
    assert is_transient(client_error(400, "ThrottlingException"))
    assert is_transient(client_error(409, "ConditionalRequestConflict"))
    assert is_transient(translated(client_error(503, "SlowDown"), errno.EBUSY))
    assert is_transient(translated(client_error(400, "Throttling"), errno.EIO))
    assert not is_transient(client_error(501, "NotImplemented"))
    assert not is_transient(client_error(412, "PreconditionFailed"))
    assert not is_transient(translated(client_error(403, "AccessDenied"), errno.EACCES))
    assert not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError())
    assert not is_transient(ValueError())


# -- S3 specifics ---------------------------------------------------------------------


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self) -> bytes:
        return self.data


def inject_s3_errors(store: ObjectStore, operation: str, status: int, code: str, times: int):
    """Make the next ``times`` calls of ``operation`` answer ``status``/``code``
    without reaching the server, through botocore's before-send event. Returns the
    list of intercepted requests and a function that removes the handler."""
    from aiobotocore.awsrequest import AioAWSResponse

    intercepted: list[str] = []

    def handler(request: Any, **_: Any) -> Any:
        if len(intercepted) >= times:
            return None
        intercepted.append(request.url)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>injected {code}</Message></Error>"
        ).encode()
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        return AioAWSResponse(request.url, status, headers, _Body(body))

    events = store.fs.s3.meta.events
    event = f"before-send.s3.{operation}"
    events.register(event, handler)
    return intercepted, lambda: events.unregister(event, handler)


@pytest.fixture
def s3_store(s3_endpoint, s3_bucket, request) -> ObjectStore:
    _, options = s3_endpoint
    prefix = request.node.name.replace("[", "-").replace("]", "")
    return ObjectStore(f"s3://{s3_bucket}/{prefix}", storage_options=options, retry=FAST)


@pytest.mark.s3
def test_s3_slowdown_503_is_retried(s3_store):
    intercepted, remove = inject_s3_errors(s3_store, "PutObject", 503, "SlowDown", times=2)
    try:
        s3_store.put("slow/key", b"payload")
    finally:
        remove()
    assert len(intercepted) == 2
    assert s3_store.traffic.retries == 2
    assert s3_store.get("slow/key") == b"payload"


@pytest.mark.s3
def test_s3_error_mapping_is_what_we_expect(s3_store):
    """Pins how s3fs 2026.9 reports a 503 SlowDown (its errors.translate_boto_error):
    OSError(EBUSY) caused by botocore's ClientError; we retry it, then give up."""
    s3_store.retry = RetryPolicy(attempts=2, base_delay=0.001)
    intercepted, remove = inject_s3_errors(s3_store, "GetObject", 503, "SlowDown", times=99)
    try:
        s3_store.put("k", b"v")
        with pytest.raises(TransientStoreError) as info:
            s3_store.get("k")
    finally:
        remove()
    assert len(intercepted) == 2  # botocore and s3fs did not retry on their own
    translated = info.value.__cause__
    assert isinstance(translated, OSError) and translated.errno == errno.EBUSY
    assert isinstance(translated.__cause__, ClientError)
    assert translated.__cause__.response["Error"]["Code"] == "SlowDown"


@pytest.mark.s3
def test_s3_internal_error_500_on_get_is_retried(s3_store):
    s3_store.put("k", b"value")
    intercepted, remove = inject_s3_errors(s3_store, "GetObject", 500, "InternalError", times=1)
    try:
        assert s3_store.get("k") == b"value"
    finally:
        remove()
    assert len(intercepted) == 1 and s3_store.traffic.retries == 1


@pytest.mark.s3
def test_s3_conditional_request_conflict_409_is_retried(s3_store):
    """AWS: "On a 409 failure you should retry the upload." The retry then either
    creates the key or meets the winner's 412."""
    intercepted, remove = inject_s3_errors(
        s3_store, "PutObject", 409, "ConditionalRequestConflict", times=1
    )
    try:
        assert s3_store.put_if_absent("commit", b"first") is True
    finally:
        remove()
    assert len(intercepted) == 1
    assert s3_store.put_if_absent("commit", b"second") is False
    assert s3_store.get("commit") == b"first"


@pytest.mark.s3
def test_s3_create_only_sends_if_none_match(s3_store):
    """The real server (not a lock of ours) rejects the second create with 412."""
    headers: list[dict[str, str]] = []

    def capture(request: Any, **_: Any) -> None:
        headers.append(dict(request.headers))

    events = s3_store.fs.s3.meta.events
    events.register("before-send.s3.PutObject", capture)
    try:
        assert s3_store.put_if_absent("once", b"1") is True
        assert s3_store.put_if_absent("once", b"2") is False
    finally:
        events.unregister("before-send.s3.PutObject", capture)
    assert [h.get("If-None-Match") for h in headers] == [b"*", b"*"]
    assert s3_store.get("once") == b"1"


@pytest.mark.s3
@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_s3_endpoint_from_environment(s3_endpoint, s3_bucket, monkeypatch, variable):
    endpoint, options = s3_endpoint
    options = {k: v for k, v in options.items() if k != "endpoint_url"}
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv(variable, endpoint)
    store = ObjectStore(f"s3://{s3_bucket}/env-{variable}", storage_options=options, retry=FAST)
    store.put("k", b"via env")
    assert store.get("k") == b"via env"
    assert store.fs.endpoint_url == endpoint


@pytest.mark.s3
def test_s3_secret_never_logged(s3_endpoint, s3_bucket, monkeypatch, caplog):
    endpoint, options = s3_endpoint
    store = ObjectStore(f"s3://{s3_bucket}/logs", storage_options=options, retry=FAST, name="w")
    store.put("k", b"v")
    intercepted, remove = inject_s3_errors(store, "GetObject", 503, "SlowDown", times=1)
    try:
        with caplog.at_level(logging.DEBUG):
            assert store.get("k") == b"v"
    finally:
        remove()
    assert intercepted and "retrying" in caplog.text
    secret = options.get("secret")
    if secret:
        our_lines = [r.getMessage() for r in caplog.records if r.name == "storage.objectstore"]
        assert our_lines and not any(secret in line for line in our_lines)


def test_s3_unreachable_endpoint_is_transient():
    """Nothing listens on the port: botocore's EndpointConnectionError, which s3fs
    passes through untranslated, is retried and then reported with the URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = ObjectStore(
        "s3://bucket/run",
        storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
        retry=RetryPolicy(attempts=2, base_delay=0.001),
    )
    with pytest.raises(TransientStoreError, match="EndpointConnectionError") as info:
        store.get("k")
    assert "s3://bucket/run/k" in str(info.value) and "2 attempts" in str(info.value)


def test_traffic_counter_is_thread_safe():
    counter = TrafficCounter()

    def hammer(i: int) -> None:
        for j in range(500):
            counter.record("put", f"cat{i % 2}/obj{i}-{j}", up=3, stored=True)
            counter.record("get", f"cat{i % 2}/obj{i}-{j}", down=2, fetched=True)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.requests == 8 * 500 * 2
    assert counter.bytes_up == 8 * 500 * 3 and counter.bytes_down == 8 * 500 * 2
    assert len(counter.objects_up) == len(counter.objects_down) == 8 * 500
    cats = counter.by_category()
    assert cats["cat0"].requests == cats["cat1"].requests == 4000
