"""``diloco cancel`` waits for a sharded aggregator's other shards too (a deployments
launch, whose jobs it can only see through their status boards), but not for a shard
that died without saying so; the end-of-run report lists them the same way."""

from __future__ import annotations

import time
from types import SimpleNamespace

from flows import cancel
from flows.control import shard_board
from flows.jobs import with_shards
from storage.objectstore import ObjectStore
from workers.status import StatusBoard

REMOTE = {"backend": "deployments"}  # no local PIDs: only the status boards tell


def _run(tmp_path, shard_state: str, **shard_fields):
    store = ObjectStore(str(tmp_path))
    ex = SimpleNamespace(store=store, shards=2,
                         manifest=SimpleNamespace(workers=["w0"], total_steps=10, rounds=[5]))
    StatusBoard(store, "w0").update("finished", force=True)
    StatusBoard(store, "aggregator").update("finished", force=True)
    StatusBoard(store, shard_board(1)).update(shard_state, force=True, **shard_fields)
    return ex


def test_a_running_shard_keeps_the_cancel_waiting(tmp_path):
    ex = _run(tmp_path, "running", heartbeat_s=5.0)
    assert cancel.still_running(ex, REMOTE)
    assert not cancel.wait_until_stopped(ex, REMOTE, timeout=0.3, poll=0.1)
    assert cancel.party_states(ex) == {"w0": "finished", "aggregator": "finished",
                                       "aggregator-s1": "running"}


def test_a_stopped_shard_ends_the_wait(tmp_path):
    ex = _run(tmp_path, "interrupted")
    assert not cancel.still_running(ex, REMOTE)
    assert cancel.party_states(ex)["aggregator-s1"] == "interrupted"


def test_a_silent_shard_is_not_waited_for(tmp_path):
    # its last heartbeat is far older than a few of its heartbeats: its job is gone
    ex = _run(tmp_path, "running", heartbeat_s=0.01)
    time.sleep(0.1)
    assert not cancel.still_running(ex, REMOTE)
    assert cancel.party_states(ex)["aggregator-s1"] == "silent"


def test_the_report_lists_the_other_shards(tmp_path):
    ex = _run(tmp_path, "finished", rounds=7, total_rounds=7)
    shards = with_shards({}, ex)["aggregator_shards"]
    assert shards == {"aggregator-s1": {"state": "finished", "rounds": 7, "total_rounds": 7,
                                        "silent_s": None}}
    ex.shards = 1  # one aggregator: nothing to add
    assert with_shards({}, ex) == {}
