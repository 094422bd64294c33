"""The retry policies of storage/retry.py, on tenacity, without a store or real sleeps.

`RetryPolicy` (one request: bounded attempts, equal-jitter backoff, then
`TransientStoreError`), its async twin that a large object's parts use
(`storage.multipart.Tally`), and `OutagePolicy` / `outlast` (ride out an outage
until a deadline counted from the first failure, then re-raise the last error).
Every test injects tenacity's ``sleep`` or uses zero pauses, so nothing waits.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from storage.errors import TransientStoreError
from storage.multipart import Tally
from storage.retry import OutagePolicy, RetryPolicy, is_transient, log_retry, outlast
from storage.traffic import TrafficCounter

log = logging.getLogger("test_retry")


class Script:
    """A callable that raises the given errors in turn, then returns ``value``."""

    def __init__(self, *errors: BaseException, value: str = "ok") -> None:
        self.errors, self.value, self.calls = list(errors), value, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def reset() -> ConnectionResetError:
    return ConnectionResetError("connection reset by peer")


def store_retrying(policy: RetryPolicy, slept: list[float], **kwargs: object):  # noqa: ANN201
    retrying = policy.retrying(describe=lambda _exc: "get memory://t/k",
                               before_sleep=lambda _state: None, **kwargs)
    return retrying.copy(sleep=slept.append)


def test_a_transient_error_is_retried_until_it_gets_through() -> None:
    slept: list[float] = []
    op = Script(reset(), TimeoutError("read timed out"))
    assert store_retrying(RetryPolicy(attempts=3), slept)(op) == "ok"
    assert op.calls == 3
    # equal jitter: after the n-th failure c * U(0.5, 1), c = 0.2 * 2**(n - 1)
    assert 0.1 <= slept[0] <= 0.2 and 0.2 <= slept[1] <= 0.4


def test_a_transient_error_that_persists_gives_up_naming_the_operation() -> None:
    slept: list[float] = []
    op = Script(*(reset() for _ in range(5)))
    with pytest.raises(TransientStoreError, match=r"^get memory://t/k failed after 4 attempts; "
                                                  r"last error: ConnectionResetError") as err:
        store_retrying(RetryPolicy(attempts=4), slept)(op)
    assert op.calls == 4 and len(slept) == 3
    assert isinstance(err.value.__cause__, ConnectionResetError)
    assert is_transient(err.value)  # an outer retry (outlast's) may try again


def test_a_permanent_error_is_raised_at_once_unchanged() -> None:
    slept: list[float] = []
    for error in (FileNotFoundError("no such key"), PermissionError("denied"), ValueError("bad")):
        op = Script(error)
        with pytest.raises(type(error)) as err:
            store_retrying(RetryPolicy(attempts=6), slept)(op)
        assert err.value is error and op.calls == 1
    assert slept == []


def test_the_store_logs_each_retry_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    retrying = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0).retrying(
        describe=lambda _exc: "put",
        before_sleep=lambda state: log_retry(log, "w1", "put s3://b/k", 3, state))
    with caplog.at_level(logging.WARNING, logger="test_retry"):
        assert retrying(Script(reset())) == "ok"
    assert [r.getMessage() for r in caplog.records] == [
        "store w1: put s3://b/k failed (attempt 1 of 3): ConnectionResetError: "
        "connection reset by peer; retrying in 0.00s"]


def tally(attempts: int = 3) -> Tally:
    policy = RetryPolicy(attempts=attempts, base_delay=0.0, max_delay=0.0)
    return Tally(policy, TrafficCounter(), "big/obj", "s3://b/big/obj", name="w1")


def test_a_part_is_retried_alone_and_counted() -> None:
    t = tally()
    op = Script(reset())
    numbers: list[int] = []

    async def send(attempt: int) -> str:
        numbers.append(attempt)
        return op()

    assert asyncio.run(t.retrying("put", "part 2", send)) == "ok"
    assert numbers == [1, 2]
    assert t.traffic.retries == 1 and t.traffic.snapshot()["by_op"] == {"put": 1}


def test_a_part_that_keeps_failing_gives_up_without_a_chain() -> None:
    """The store's whole-object retry follows causes (`is_transient`): a part that
    gave up must not look transient to it, or the whole object would start over."""
    t = tally(attempts=3)
    op = Script(*(reset() for _ in range(5)))

    async def send(_attempt: int) -> str:
        return op()

    with pytest.raises(TransientStoreError, match=r"^part 3 of s3://b/big/obj failed after 3 "
                                                  r"attempts; last error: Connection") as err:
        asyncio.run(t.retrying("put", "part 3", send))
    assert op.calls == 3 and t.traffic.retries == 2
    assert t.traffic.snapshot()["by_op"] == {"put": 3}  # every failed attempt is a request
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert not is_transient(err.value)


def test_a_part_with_a_permanent_error_is_not_retried() -> None:
    t = tally()
    op = Script(PermissionError("AccessDenied"))

    async def send(_attempt: int) -> str:
        return op()

    with pytest.raises(PermissionError):
        asyncio.run(t.retrying("put", "part 1", send))
    assert op.calls == 1 and t.traffic.retries == 0


def test_the_async_policy_sleeps_with_the_event_loop() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    retrying = RetryPolicy(attempts=3, base_delay=1.0, max_delay=1.0).async_retrying(
        describe=lambda _exc: "x", before_sleep=lambda _state: None).copy(sleep=fake_sleep)
    op = Script(reset(), reset())

    async def call() -> str:
        return op()

    assert asyncio.run(retrying(call)) == "ok"
    assert len(slept) == 2 and all(0.5 <= s <= 1.0 for s in slept)


def outage(policy: OutagePolicy, slept: list[float], **kwargs: object):  # noqa: ANN201
    retrying = policy.retrying(retry_on=is_transient, what="x: down", log=log, **kwargs)
    return retrying.copy(sleep=slept.append)


def test_an_outage_policy_pauses_double_up_to_the_cap() -> None:
    slept: list[float] = []
    op = Script(*(reset() for _ in range(6)))
    policy = OutagePolicy(patience_s=60.0, pause_s=0.2, max_pause_s=1.0)
    assert outage(policy, slept)(op) == "ok"
    assert slept == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    slept.clear()
    assert outage(OutagePolicy(patience_s=60.0, pause_s=2.0), slept)(Script(reset(), reset()))
    assert slept == [2.0, 2.0]  # no cap given: a fixed pause


def test_an_outage_policy_reraises_the_last_error_after_its_patience() -> None:
    errors = [TimeoutError(f"timeout {i}") for i in range(50)]
    op = Script(*errors)
    policy = OutagePolicy(patience_s=0.05, pause_s=0.01)
    with pytest.raises(TimeoutError) as err:
        policy.retrying(retry_on=is_transient, what="x", log=log)(op)
    assert 2 <= op.calls < 50 and err.value is errors[op.calls - 1]


def test_an_outage_policy_counts_its_patience_from_the_first_failure() -> None:
    """A long operation (a checkpoint's write) that fails after longer than the
    patience is still tried again: the outage began when it failed."""
    calls = []

    def slow_then_down() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.3)
        raise ConnectionResetError("reset")

    policy = OutagePolicy(patience_s=0.1, pause_s=0.02)
    with pytest.raises(ConnectionResetError):
        policy.retrying(retry_on=is_transient, what="x", log=log)(slow_then_down)
    assert len(calls) >= 3


def test_an_outage_policy_stops_when_told_and_on_a_permanent_error() -> None:
    slept: list[float] = []
    op = Script(reset(), reset())
    with pytest.raises(ConnectionResetError):
        outage(OutagePolicy(patience_s=60.0), slept, stop=lambda: True)(op)
    assert op.calls == 1 and slept == []
    op = Script(reset(), FileNotFoundError("gone"))
    with pytest.raises(FileNotFoundError):
        outage(OutagePolicy(patience_s=60.0), slept)(op)
    assert op.calls == 2 and len(slept) == 1


def test_an_outage_policy_logs_after_its_quiet_retries(caplog: pytest.LogCaptureFixture) -> None:
    slept: list[float] = []
    policy = OutagePolicy(patience_s=900.0, pause_s=0.2, quiet_retries=2)
    with caplog.at_level(logging.WARNING, logger="test_retry"):
        outage(policy, slept)(Script(*(reset() for _ in range(4))))
    messages = [r.getMessage() for r in caplog.records]
    assert len(slept) == 4 and len(messages) == 2
    assert messages[0] == "x: down (0 s of at most 900 s): connection reset by peer"


def test_outlast_retries_only_what_the_store_gave_up_on(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`outlast` outlasts `TransientStoreError` (the store's verdict after its own
    retries); a raw error, transient or not, is the operation's to handle."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # tenacity's default sleep calls it
    op = Script(TransientStoreError("get k failed after 6 attempts"), value="mean")
    with caplog.at_level(logging.WARNING, logger="test_retry"):
        assert outlast(op, patience_s=60, what="wait for the mean", log=log, pause_s=2.0) == "mean"
    assert slept == [2.0] and [r.getMessage() for r in caplog.records] == [
        "wait for the mean: the store keeps failing (0 s of at most 60 s): "
        "get k failed after 6 attempts"]
    for error in (reset(), FileNotFoundError("k")):
        op = Script(error)
        with pytest.raises(type(error)):
            outlast(op, patience_s=60, what="x", log=log)
        assert op.calls == 1
    with pytest.raises(TransientStoreError):  # no patience: the first failure is the last
        outlast(Script(TransientStoreError("down")), patience_s=0, what="x", log=log)
    assert slept == [2.0]


def test_policies_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="OutagePolicy times must be >= 0"):
        OutagePolicy(patience_s=-1.0)
