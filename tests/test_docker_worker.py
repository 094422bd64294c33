"""The region Docker worker's report of a job killed for memory (flows/docker_worker.py),
without an engine: whose job a flow run is, the one line it says, and that line in the
job's status where `diloco status` reads it. The container trial itself is in
tests/test_docker_pools.py (`make containers`)."""

from __future__ import annotations

import pytest

from flows.docker_worker import _record, job_name, killed_for_memory
from storage.objectstore import ObjectStore
from workers.status import read_status


@pytest.mark.parametrize(("name", "params", "expected"), [
    ("tiny-1/region-b", {"run_url": "s3://b/r", "worker": "region-b"}, "region-b"),
    ("tiny-1/aggregator", {"run_url": "s3://b/r"}, "aggregator"),
    ("tiny-1/aggregator-s1", {"run_url": "s3://b/r", "shard": 1}, None),
    ("tiny-1", {"config": {}}, None),  # the train flow
])
def test_each_flow_run_is_mapped_to_the_party_whose_status_it_may_write(name, params,
                                                                           expected):
    assert job_name(name, params) == expected


def test_the_line_names_the_limit_and_what_to_do():
    line = killed_for_memory("150m")
    assert line == ("killed for memory: over its container's limit of 150m (OOMKilled); "
                    "raise the work pool's mem_limit job variable, then diloco resume the run")
    assert "\n" not in killed_for_memory(None) and "its container's memory" in \
        killed_for_memory(None)


def test_the_line_lands_in_the_jobs_status(tmp_path):
    url = str(tmp_path / "run")
    _record({"run_url": url}, "region-b", killed_for_memory("150m"))
    status = read_status(ObjectStore(url), "region-b")
    assert status["state"] == "failed"
    assert status["error"] == killed_for_memory("150m")


def test_a_store_it_cannot_reach_leaves_a_warning_not_an_error(caplog):
    _record({"run_url": "s3://", "storage_options": None}, "region-b", "x")
    assert "could not record in the store that region-b was killed for memory" in caplog.text
