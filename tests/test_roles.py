"""The bucket roles against a server that enforces them, and against a real run.

Two servers, each enforcing IAM (tests/iam_server.py): moto's, aligned with AWS,
and SeaweedFS's own. Each has one IAM user per role
holding the document `infra.policies.role_policies` derives from
`storage.layout.KEYS`:

- every kind of key: its owner may write it (and delete it where it prunes),
  every other role is denied, and `infra.iam.allowed` says the same as the server;
- a run with each party on its own credentials, as in different clouds (on
  SeaweedFS, whose IAM also enforces ListBucket's ``s3:prefix`` conditions): this
  process is the launcher (creates the run, prepares the data, tracks it in MLflow,
  cancels it mid-run and resumes it), the aggregator and each worker are processes
  with their role's keys. It finishes with nothing denied (status writes that fail
  are only warnings, so the logs are read too), and every key it wrote is declared
  in the layout and writable by its owner's policy only;
- a worker that tries another worker's keys or the aggregator's mean is refused
  (on both servers; moto's holds a copy of the run).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError
from cli_runs import SHORT
from iam_server import IAMS3Server, SeaweedIAMServer
from typer.testing import CliRunner

from cli.bucket import bucket_app
from infra.iam import allowed
from infra.policies import policy_file_name, role_policies
from storage import layout

BUCKET, PREFIX = "diloco-roles", "runs"
WORKERS = ["region-a", "region-b"]
RUN = "tiny-roles"
#: What a denied write looks like in a job's log (errors and the status warnings).
DENIED = re.compile(r"AccessDenied|Access Denied|Forbidden|PermissionError|could not",
                    re.IGNORECASE)


def _enforcing(kind: str) -> Any:
    with (IAMS3Server() if kind == "moto" else SeaweedIAMServer()) as srv:
        srv.client("s3", srv.admin).create_bucket(Bucket=BUCKET)
        documents = role_policies(BUCKET, PREFIX, WORKERS)
        envs = {role: srv.user(policy_file_name(role)[: -len(".json")], doc)
                for role, doc in documents.items()}
        yield srv, documents, envs


@pytest.fixture(scope="module")
def moto_iam() -> Any:
    """moto's IAM, aligned with AWS: ``(server, documents, environments)``."""
    yield from _enforcing("moto")


@pytest.fixture(scope="module")
def seaweedfs_iam() -> Any:
    """SeaweedFS's own IAM (a real object store): ``(server, documents, environments)``."""
    yield from _enforcing("seaweedfs")


# Both servers, for what each enforces itself: the table of every key and role, the
# setup refusal and a worker refused through the store (moto refuses a DeleteObjects
# as a whole, SeaweedFS key by key in its answer: two paths of the store). The real
# run goes to SeaweedFS only (`role_run`).
@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def server(request) -> Any:
    """The enforcing server, the bucket, and ``(documents, environments)`` per role:
    moto's IAM aligned with AWS, and SeaweedFS's own IAM (a real object store)."""
    return request.getfixturevalue(f"{request.param}_iam")


# -- the table ---------------------------------------------------------------------------


def test_every_key_the_layout_builds_is_declared_once_with_its_writer():
    """The functions the writers call and the table the policies come from agree."""
    built = {
        layout.MANIFEST: "launcher",
        f"{layout.global_init(2)}.json": "launcher",
        f"{layout.global_init(2)}/5f0c/params/c/0": "launcher",
        f"{layout.DATASET}/tokens/00000.bin": "launcher",
        layout.TRACKING: "launcher",
        layout.LAUNCHER_RECORD: "launcher",
        layout.member_status(layout.TRAIN): "launcher",
        layout.CANCEL: "launcher",
        layout.cancelled("20260101T000000Z"): "launcher",
        layout.leave_request("eu"): "launcher",
        layout.admission("eu"): "aggregator",
        layout.left("eu"): "worker:eu",
        layout.mean_payload(2, 13, "aggregator", "5f0c") + "/c/0": "aggregator",
        layout.mean_commit(2, 13): "aggregator",
        layout.rejected(2, 13, "eu"): "aggregator",
        layout.decision(2, 13): "aggregator",
        layout.shard_check(2, 13, 1, "eu"): "aggregator",
        layout.mean_part(2, 13, 3): "aggregator",
        layout.global_part(2, 13, 3) + ".json": "aggregator",
        layout.global_commit(2, 13): "aggregator",
        layout.global_state(2, 13) + "/5f0c/params/zarr.json": "aggregator",
        layout.member(layout.AGGREGATOR): "aggregator",
        layout.member_status(layout.AGGREGATOR): "aggregator",
        layout.delta_payload(2, 13, "eu", "5f0c") + "/c/0": "worker:eu",
        layout.delta_commit(2, 13, "eu"): "worker:eu",
        layout.member("eu"): "worker:eu",
        layout.member_status("eu"): "worker:eu",
        layout.worker_checkpoints("eu") + "/00000120.json": "worker:eu",
        layout.worker_checkpoints("eu") + "/00000120/5f0c/adam/c/0": "worker:eu",
    }
    assert {key: layout.owner(key) for key in built} == built
    assert {layout.declared(key)[0] for key in built} == set(layout.KEYS)
    for pattern in layout.KEYS:  # no key matches two patterns
        assert [p for p in layout.KEYS if p.match(pattern.example()) is not None] == [pattern]
    for key in ("members/launcher/status.json", "frag/0/r000001/other.json", "logs/x.log",
                "frag/0/r1/mean.json", "workers/eu/ckpt/latest.json"):
        with pytest.raises(layout.UndeclaredKey, match="not declared"):
            layout.owner(key)


@pytest.mark.parametrize("name", ["aggregator", "launcher", "train"])
def test_a_worker_cannot_take_another_partys_name(name):
    with pytest.raises(ValueError, match="reserved"):
        layout.check_name("worker", name)
    assert layout.check_name("writer", name) == name  # the aggregator's writer name


def _outcome(method: Any, **kwargs: Any) -> bool:
    """Whether the S3 call went through (False: AccessDenied)."""
    try:
        method(Bucket=BUCKET, **kwargs)
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "AccessDenied", exc
        return False
    return True


def _exists(s3: Any, key: str) -> bool:
    return s3.list_objects_v2(Bucket=BUCKET, Prefix=key).get("KeyCount", 0) > 0


def test_each_role_writes_its_own_keys_and_no_other(server):
    srv, documents, envs = server
    admin = srv.client("s3", srv.admin)
    clients = {role: srv.client("s3", env) for role, env in envs.items()}
    for pattern in layout.KEYS:
        key = f"{PREFIX}/matrix/{pattern.example('region-a')}"
        owner = layout.owner(pattern.example("region-a"))
        admin.put_object(Bucket=BUCKET, Key=key, Body=b"x")
        for role, s3 in clients.items():
            wrote = _outcome(s3.put_object, Key=key, Body=b"x")
            assert wrote == (role == owner), (role, key)
            assert wrote == allowed(documents[role], "s3:PutObject", BUCKET, key), (role, key)
            assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"x"
        # deletes: refused to everyone but a pruning owner and, for what gc collects,
        # the launcher (s3fs deletes with DeleteObjects, which reports a refusal in its
        # answer, not as an error)
        for role, s3 in clients.items():
            admin.put_object(Bucket=BUCKET, Key=key, Body=b"x")
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": key}]})
            deleted = not _exists(admin, key)
            assert deleted == (role == owner and pattern.prunes
                               or role == layout.LAUNCHER and pattern.collected), (role, key)
            assert deleted == allowed(documents[role], "s3:DeleteObject", BUCKET, key)
        admin.delete_object(Bucket=BUCKET, Key=key)
    outside = "elsewhere/run.json"
    admin.put_object(Bucket=BUCKET, Key=outside, Body=b"x")
    for role, s3 in clients.items():
        assert not _outcome(s3.get_object, Key=outside), role
        assert not _outcome(s3.put_object, Key=outside, Body=b"y"), role


def test_setup_on_a_bucket_these_credentials_may_not_use_is_one_line(server, monkeypatch,
                                                                     tmp_path):
    """As someone whose keys cannot use the bucket (here: the viewer's; on AWS, a
    bucket name another account owns): exit 2, one line naming it, nothing written."""
    _, _, envs = server
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in envs[layout.VIEWER].items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "policies"
    result = CliRunner().invoke(bucket_app, ["setup", f"s3://{BUCKET}/{PREFIX}", "--workers",
                                             "region-a", "--policies-out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: bucket '{BUCKET}' exists but is not accessible with these credentials "
        f"(403); choose another name or fix the credentials")
    assert not out.exists()


# -- a real run, each party on its own credentials ------------------------------------


def _overrides() -> list[str]:
    """The short run of tests/cli_runs.py, long enough to cancel mid-run, keeping one
    canonical checkpoint per fragment so that the aggregator prunes as in a long run."""
    kept = [value for flag, value in zip(SHORT[::2], SHORT[1::2], strict=True)
            if flag == "--set" and not value.startswith("train.steps=")]
    return [*kept, "train.steps=40", "train.keep_checkpoints=1",
            f"store=s3://{BUCKET}/{PREFIX}", f"workers={WORKERS}"]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _keys(admin: Any) -> list[str]:
    """Every key of the run, listed with the admin's credentials."""
    return [obj["Key"] for page in admin.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"{PREFIX}/{RUN}/") for obj in page.get("Contents", [])]


@pytest.fixture(scope="module")
def role_run(seaweedfs_iam, tmp_path_factory) -> dict[str, Any]:
    """The run, cancelled after its first checkpoint and resumed: the two reports,
    every key in the bucket, the jobs' logs and this process's warnings.

    On SeaweedFS only (one run: six job processes): its IAM enforces all that moto's
    does on the keys of a run and more (the ``s3:prefix`` conditions of ListBucket,
    which moto does not evaluate); both servers enforce the table of every key and
    role above. The worker refused below runs on both, moto's on a copy of this run."""
    from flows.control import request_cancel
    from flows.launchers import AGGREGATOR, LocalLauncher
    from flows.train import run_train
    from storage.objectstore import ObjectStore
    from workers.config import load_config
    from workers.status import read_all

    srv, documents, envs = seaweedfs_iam
    tmp = tmp_path_factory.mktemp("roles")
    job_env = {name: envs[AGGREGATOR if name == AGGREGATOR else f"worker:{name}"]
               for name in [AGGREGATOR, *WORKERS]}

    class RoleLauncher(LocalLauncher):
        """Each job with its own role's keys, as if it ran in its own cloud."""

        def start(self, run_url: str, name: str) -> None:
            self.env = job_env[name]
            super().start(run_url, name)

    patch = pytest.MonkeyPatch()
    for name in os.environ:
        if name.startswith(("AWS_", "DILOCO_", "MLFLOW_")):
            patch.delenv(name)
    for name, value in envs[layout.LAUNCHER].items():  # this process is the launcher
        patch.setenv(name, value)
    patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    patch.setenv("DILOCO_SYSTEM_METRICS", "off")  # not this test's subject (CPU)
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    url = f"s3://{BUCKET}/{PREFIX}/{RUN}"
    try:
        cfg = load_config("tiny", _overrides())
        store = ObjectStore(url)

        done = threading.Event()

        def cancel_after_a_checkpoint() -> None:  # what `diloco cancel` does
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not done.is_set():
                try:
                    steps = [(s or {}).get("step", 0) for s in read_all(store, WORKERS).values()]
                except Exception:  # noqa: BLE001 - the run is not there yet
                    steps = [0]
                if min(steps) >= 8:
                    request_cancel(store, reason="test: cancel, then resume")
                    return
                time.sleep(0.2)

        canceller = threading.Thread(target=cancel_after_a_checkpoint, daemon=True)
        canceller.start()
        logs = tmp / "logs"
        started = time.monotonic()
        first = run_train(cfg, url, launcher=RoleLauncher(log_dir=logs), poll_s=0.3,
                          stop_grace_s=60)
        canceller.join(5)
        cancelled_keys = _keys(srv.client("s3", srv.admin))
        second = run_train(None, url, launcher=RoleLauncher(log_dir=logs), resume=True,
                           poll_s=0.3, stop_grace_s=60)
        seconds = time.monotonic() - started
    finally:
        done.set()
        logging.getLogger().removeHandler(warnings)
        patch.undo()
    admin = srv.client("s3", srv.admin)
    return {"first": first, "second": second, "keys": _keys(admin), "seconds": seconds,
            "cancelled_keys": cancelled_keys,
            "logs": {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")},
            "warnings": warnings.lines, "admin": admin, "server": srv,
            "documents": documents}


@pytest.mark.slow
def test_a_run_with_each_party_on_its_own_credentials_finishes(role_run):
    first, second = role_run["first"], role_run["second"]
    assert first["state"] == "cancelled", first
    assert second["state"] == "finished", second
    assert second["global"]["aggregator_state"] == "finished"
    assert [w["state"] for w in second["workers"]] == ["finished", "finished"]
    assert second["global"]["rounds"] == second["global"]["total_rounds"]
    assert set(role_run["logs"]) == {"aggregator.log", "region-a.log", "region-b.log"}
    for name, text in role_run["logs"].items():
        denied = [line for line in text.splitlines() if DENIED.search(line)]
        assert not denied, f"{name}: {denied[:5]}"
    denied = [line for line in role_run["warnings"] if DENIED.search(line)]
    assert not denied, f"the launcher: {denied[:5]}"
    # what needed a delete happened, under enforcement: the launcher withdrew the
    # cancel request, the aggregator pruned the canonical checkpoints
    keys = {k.split("/", 2)[2] for k in role_run["keys"]}
    assert layout.CANCEL not in keys and any(k.startswith("control/cancelled/") for k in keys)
    commits = [k for k in keys if re.fullmatch(r"global/frag/\d+/r\d+\.json", k)]
    assert len(commits) == 2, sorted(commits)  # keep_checkpoints=1, two fragments
    # and the launcher's gc after the finished run: the workers' checkpoints, there
    # when the run was cancelled, are gone
    assert any("/ckpt/" in k for k in role_run["cancelled_keys"])
    assert not [k for k in keys if "/ckpt/" in k]


@pytest.mark.slow
def test_every_key_of_the_run_is_declared_and_only_its_owner_may_write_it(role_run):
    documents = role_run["documents"]
    undeclared, wrong = [], []
    seen: set[str] = set()
    for key in sorted({*role_run["keys"], *role_run["cancelled_keys"]}):
        relative = key.split("/", 2)[2]  # runs/<run>/...
        try:
            pattern, owner = layout.declared(relative)
        except layout.UndeclaredKey:
            undeclared.append(relative)
            continue
        seen.add(pattern.template)
        for role, document in documents.items():
            if allowed(document, "s3:PutObject", BUCKET, key) != (role == owner):
                wrong.append((role, relative))
    assert not undeclared, f"keys no pattern of storage/layout.py declares: {undeclared[:10]}"
    assert not wrong, f"roles allowed what they do not own, or denied what they do: {wrong[:10]}"
    # the run exercised the whole table but
    unused = {p.template for p in layout.KEYS} - seen
    # (the cancel request is in the listing taken while the run was cancelled; the
    # train job's status holds the run's size after gc)
    # no contribution was bad, and no worker joined or left (tests/test_elastic.py);
    # the aggregator is not sharded (tests/test_aggregator_shards.py)
    assert unused == {"frag/{fragment}/{round}/rejected/{worker}.json",
                      "frag/{fragment}/{round}/decision.json",
                      "frag/{fragment}/{round}/part/{shard}.json",
                      "frag/{fragment}/{round}/check/{shard}/{worker}.json",
                      "control/leave/{worker}.json", "members/{worker}/admission.json",
                      "members/{worker}/left.json"}, unused
    assert len(role_run["keys"]) > 100


@pytest.mark.slow
def test_a_worker_is_refused_another_workers_keys_and_the_mean(role_run, server):
    """Through the store the product uses: region-a, on its own credentials."""
    from storage.exchange import Exchange
    from storage.objectstore import ObjectStore, RetryPolicy
    from storage.spec import read_manifest

    srv, _, envs = server
    admin = srv.client("s3", srv.admin)
    if srv is not role_run["server"]:  # moto: the run's objects, copied by the admins
        for key in role_run["keys"]:
            body = role_run["admin"].get_object(Bucket=BUCKET, Key=key)["Body"].read()
            admin.put_object(Bucket=BUCKET, Key=key, Body=body)
    env = envs["worker:region-a"]
    options = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
               "endpoint_url": srv.endpoint_url, "client_kwargs": {"region_name": "us-east-1"}}
    store = ObjectStore(f"s3://{BUCKET}/{PREFIX}/{RUN}", storage_options=options,
                        retry=RetryPolicy(attempts=1))
    exchange = Exchange(store, read_manifest(store))
    x = np.linspace(-1.0, 1.0, exchange.manifest.numel(0), dtype=np.float32)
    last = exchange.manifest.rounds[0] + 5  # a round the run never reached
    with pytest.raises(PermissionError):
        exchange.publish_prepared(exchange.prepare_delta(0, last, "region-b", x), tokens=1)
    with pytest.raises(PermissionError):
        exchange.publish_mean(0, last, layout.AGGREGATOR, x, weights={"region-a": 1.0})
    with pytest.raises(PermissionError):
        store.put(layout.member_status("region-b"), b'{"state": "finished"}')
    # its own keys it may write
    published = exchange.publish_prepared(exchange.prepare_delta(0, last, "region-a", x),
                                          tokens=1)
    assert published.created
    # another's checkpoint it cannot delete, and is told so (s3fs's own rm would
    # drop the refusal of its quiet DeleteObjects): one key, then a whole prefix
    theirs = [k for k in role_run["cancelled_keys"] if "/workers/region-b/ckpt/" in k]
    commit = next(k for k in theirs if k.endswith(".json")).split("/", 2)[2]
    admin.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{RUN}/{commit}", Body=b"{}")  # gc took it
    with pytest.raises(PermissionError, match="AccessDenied"):
        store.delete(commit)
    with pytest.raises(PermissionError, match="AccessDenied"):
        store.delete_prefix(layout.worker_checkpoints("region-b"))
    assert _exists(admin, f"{PREFIX}/{RUN}/{commit}")
