"""A launch through Prefect deployments outlasts an API that answers 5xx or drops the
connection for a few seconds (seen: an overloaded server's 503 failed a whole train
run), and fails at once, in one line, on an error another try cannot mend."""

from __future__ import annotations

import types

import httpx
import pytest

import flows.launchers as launchers
from flows.launchers import DeploymentLauncher, LaunchError


def _answer(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/deployments/x/create_flow_run")
    return httpx.HTTPStatusError(f"{code}", request=request,
                                 response=httpx.Response(code, request=request))


@pytest.fixture
def calls(monkeypatch):
    """The launches `run_deployment` was asked for; each entry of ``calls.plan`` is what
    one call does (an exception to raise, or None: it returns a flow run)."""
    import prefect.deployments

    record = types.SimpleNamespace(made=[], plan=[])

    def fake(deployment, **kwargs):
        record.made.append((deployment, kwargs["idempotency_key"]))
        outcome = record.plan.pop(0) if record.plan else None
        if outcome is not None:
            raise outcome
        return types.SimpleNamespace(id="7f1d")

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake)
    monkeypatch.setattr(launchers, "LAUNCH_WAIT_S", 0.01)
    return record


def test_a_launch_outlasts_a_503_and_a_dropped_connection(calls, caplog):
    calls.plan = [_answer(503), httpx.ConnectError("connection refused")]
    launcher = DeploymentLauncher(key="k")
    launcher.start("s3://bucket/runs/tiny-1", "region-b")
    assert launcher.flow_runs == {"region-b": "7f1d"}
    # the same idempotency key every time: Prefect gives back one flow run, never two
    assert calls.made == [("worker/region-b", "k:region-b")] * 3
    assert caplog.text.count("Prefect's API failed a launch") == 2


def test_an_error_another_try_cannot_mend_fails_at_once(calls):
    calls.plan = [_answer(404)]
    with pytest.raises(LaunchError, match="could not launch aggregator on deployment "
                                          "'aggregator/aggregator': HTTPStatusError: 404"):
        DeploymentLauncher(key="k").start("s3://bucket/runs/tiny-1", "aggregator")
    assert len(calls.made) == 1


def test_an_api_down_for_longer_fails_the_launch_after_its_tries(calls):
    calls.plan = [_answer(503)] * 10
    with pytest.raises(LaunchError, match="HTTPStatusError: 503"):
        DeploymentLauncher(key="k").start("s3://bucket/runs/tiny-1", "region-a")
    assert len(calls.made) == launchers.LAUNCH_TRIES
