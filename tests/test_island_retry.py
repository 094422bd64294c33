"""`Island.outlast_save`'s retries (an `OutagePolicy`), on one process with a stand-in
for `save_state`: a fresh directory per attempt, rank 0's log line, giving up with the
last failure once the patience is spent, no retry of what a retry cannot fix. The
collective side (every rank retries or every rank raises) runs in tests/test_fsdp.py,
two processes under gloo."""

from __future__ import annotations

import logging
import time

import pytest
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from storage.objectstore import ObjectStore
from workers.island import Island


def _failed(rank: int, error: BaseException) -> CheckpointException:
    """What DCP raises on every rank when ``rank``'s writes fail with ``error``."""
    return CheckpointException("save", {rank: (error, None)})


class _Saves:
    """Stands in for `Island.save_state`: fails with ``errors`` in turn, then writes."""

    def __init__(self, *errors: BaseException):
        self.errors, self.keys = list(errors), []

    def __call__(self, opt, store, key: str, extra=None) -> dict:
        self.keys.append(key)
        if self.errors:
            raise self.errors.pop(0)
        return {"key": key}


def _island(saves: _Saves) -> Island:
    island = Island(nn.Linear(1, 1), plan=None, rank=0, size=1)
    island.save_state = saves  # type: ignore[method-assign]
    return island


def _keys():
    n = iter(range(100))
    return lambda: f"shards/{next(n)}"


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)  # tenacity's default sleep calls it
    return pauses


def test_a_transient_failure_is_written_again_into_a_fresh_directory(
        tmp_path, slept, caplog: pytest.LogCaptureFixture) -> None:
    saves = _Saves(_failed(1, ConnectionResetError("reset")), _failed(0, TimeoutError()))
    store = ObjectStore(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="workers.island"):
        ref = _island(saves).outlast_save(None, store, _keys(), patience_s=60, pause_s=2.0)
    assert ref == {"key": "shards/2"} and saves.keys == ["shards/0", "shards/1", "shards/2"]
    assert slept == [2.0, 2.0]  # a fixed pause, as the whole-state checkpoint's
    first, second = (r.getMessage() for r in caplog.records)
    assert store.full_url("shards/0") in first and "attempt 1;" in first
    assert "up to 60 s" in first and "rank 1: ConnectionResetError: reset" in first
    assert store.full_url("shards/1") in second and "rank 0: TimeoutError" in second


def test_nothing_to_save_writes_nothing(tmp_path, slept) -> None:
    saves = _Saves()
    island = _island(saves)
    assert island.outlast_save(None, ObjectStore(str(tmp_path)), lambda: None,
                               patience_s=60) is None
    assert saves.keys == [] and slept == []


def test_a_persisting_outage_raises_the_last_failure_after_the_patience(tmp_path) -> None:
    failures = [_failed(1, ConnectionResetError(str(i))) for i in range(1000)]
    saves = _Saves(*failures)
    start = time.monotonic()
    with pytest.raises(CheckpointException) as raised:
        _island(saves).outlast_save(None, ObjectStore(str(tmp_path)), _keys(),
                                    patience_s=0.05, pause_s=0.01)
    assert 0.05 <= time.monotonic() - start < 5
    assert 2 <= len(saves.keys) < 1000
    assert raised.value is failures[len(saves.keys) - 1]  # the last one, unchanged


def test_no_patience_gives_up_after_the_first_failure(tmp_path, slept) -> None:
    failure = _failed(1, ConnectionResetError())
    saves = _Saves(failure)
    with pytest.raises(CheckpointException) as raised:
        _island(saves).outlast_save(None, ObjectStore(str(tmp_path)), _keys(), patience_s=0)
    assert raised.value is failure and saves.keys == ["shards/0"] and slept == []


@pytest.mark.parametrize("error", [
    _failed(1, PermissionError("denied")),  # a retry cannot fix it
    CheckpointException("save", {0: (ConnectionResetError(), None),
                                 1: (PermissionError("denied"), None)}),  # nor one rank's
    RuntimeError("not DCP's"),
], ids=["denied", "one-rank-denied", "other-error"])
def test_what_a_retry_cannot_fix_is_raised_at_once(tmp_path, slept, error) -> None:
    saves = _Saves(error)
    with pytest.raises(type(error)) as raised:
        _island(saves).outlast_save(None, ObjectStore(str(tmp_path)), _keys(), patience_s=60)
    assert raised.value is error and saves.keys == ["shards/0"] and slept == []
