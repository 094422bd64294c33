"""Bucket set-up (infra/bucket.py) against the S3 server (the local stack's compose
file is checked in test_compose.py).

Each S3 test creates buckets of its own (``diloco-bt-<random>``), so it never
touches the bucket other tests share.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import boto3
import pytest

from storage import layout

# infra/ is not an installed package: importable from the repository root,
# which `python -m pytest` puts on sys.path and the `pytest` script does not.
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from infra.bucket import (  # noqa: E402
    apply_bucket_policy,
    apply_lifecycle,
    bucket_policy,
    ensure_bucket,
    lifecycle_rule,
    main,
    role_policies,
)

INFRA = Path(__file__).resolve().parents[1] / "infra" / "minio"


@pytest.fixture
def s3_client(s3_endpoint) -> Any:
    endpoint, options = s3_endpoint
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        region_name=options["client_kwargs"]["region_name"],
    )


@pytest.fixture
def fresh_bucket(s3_client) -> Any:
    """A bucket name nobody uses yet; the bucket is removed afterwards if created."""
    name = f"diloco-bt-{uuid.uuid4().hex[:12]}"
    yield name
    with suppress(Exception):  # best-effort cleanup
        s3_client.delete_bucket(Bucket=name)


# -- ensure_bucket -------------------------------------------------------------------


@pytest.mark.s3
def test_ensure_bucket_creates_once(s3_client, fresh_bucket):
    assert ensure_bucket(fresh_bucket, client=s3_client) is True
    assert ensure_bucket(fresh_bucket, client=s3_client) is False
    s3_client.head_bucket(Bucket=fresh_bucket)
    names = [b["Name"] for b in s3_client.list_buckets()["Buckets"]]
    assert names.count(fresh_bucket) == 1


@pytest.mark.s3
def test_ensure_bucket_from_endpoint_and_environment(
    s3_endpoint, s3_env, fresh_bucket, monkeypatch
):
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    endpoint, _ = s3_endpoint
    assert ensure_bucket(fresh_bucket, endpoint_url=endpoint, region="us-east-1") is True
    assert ensure_bucket(fresh_bucket, endpoint_url=endpoint, region="us-east-1") is False


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # regions are moto/AWS behaviour; SeaweedFS has one
def test_ensure_bucket_outside_us_east_1_sets_location(s3_endpoint, s3_client, fresh_bucket):
    if os.environ.get("DILOCO_TEST_S3_ENDPOINT"):
        pytest.skip("regions are moto/AWS behaviour; MinIO has one region")
    endpoint, options = s3_endpoint
    eu = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        region_name="eu-west-1",
    )
    assert ensure_bucket(fresh_bucket, client=eu) is True
    assert s3_client.get_bucket_location(Bucket=fresh_bucket)["LocationConstraint"] == "eu-west-1"


# -- lifecycle -------------------------------------------------------------------------


@pytest.mark.s3
def test_lifecycle_rules_read_back_equal(s3_client, fresh_bucket):
    ensure_bucket(fresh_bucket, client=s3_client)
    runs = apply_lifecycle(fresh_bucket, "runs/exp1", abort_multipart_days=2, client=s3_client)
    scratch = apply_lifecycle(fresh_bucket, "/scratch/", expire_days=7, client=s3_client)
    assert runs == {
        "ID": "diloco:runs/exp1",
        "Filter": {"Prefix": "runs/exp1/"},
        "Status": "Enabled",
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 2},
    }
    assert scratch["Expiration"] == {"Days": 7} and scratch["Filter"] == {"Prefix": "scratch/"}

    def rules() -> dict[str, dict]:
        found = s3_client.get_bucket_lifecycle_configuration(Bucket=fresh_bucket)["Rules"]
        return {r["ID"]: r for r in found}

    assert rules() == {runs["ID"]: runs, scratch["ID"]: scratch}
    # Re-applying replaces our rule (same ID) and keeps the others.
    changed = apply_lifecycle(fresh_bucket, "runs/exp1", expire_days=30, client=s3_client)
    assert rules() == {runs["ID"]: changed, scratch["ID"]: scratch}


def test_lifecycle_rule_validation():
    assert lifecycle_rule("")["Filter"] == {"Prefix": ""}
    with pytest.raises(ValueError):
        lifecycle_rule("runs", abort_multipart_days=0)
    with pytest.raises(ValueError):
        lifecycle_rule("runs", expire_days=0)
    with pytest.raises(ValueError):
        lifecycle_rule("runs/../other")


# -- policies ----------------------------------------------------------------------------


def _allowed(policy: dict, action: str, resource: str) -> bool:
    """Does an Allow statement of ``policy`` grant ``action`` on ``resource``?
    (IAM's '*' matches any characters including '/', as fnmatch's does.)"""
    for statement in policy["Statement"]:
        actions = statement["Action"]
        resources = statement["Resource"]
        resources = [resources] if isinstance(resources, str) else resources
        if (
            statement["Effect"] == "Allow"
            and action in actions
            and any(fnmatch.fnmatchcase(resource, pattern) for pattern in resources)
        ):
            return True
    return False


def _obj(key: str) -> str:
    return f"arn:aws:s3:::bkt/runs/{key}"


def test_role_policies_are_valid_json_with_expected_shape():
    policies = role_policies("bkt", "/runs/", workers=["w1", "w2"])
    assert set(policies) == {"reader", "aggregator", "worker:w1", "worker:w2"}
    for role, policy in policies.items():
        assert json.loads(json.dumps(policy)) == policy
        assert policy["Version"] == "2012-10-17"
        for statement in policy["Statement"]:
            assert statement["Effect"] == "Allow", role
            assert all(a.startswith("s3:") and "*" not in a for a in statement["Action"]), role
            resources = statement["Resource"]
            for arn in [resources] if isinstance(resources, str) else resources:
                assert arn == "arn:aws:s3:::bkt" or arn.startswith("arn:aws:s3:::bkt/runs/"), arn
    reader_actions = {a for s in policies["reader"]["Statement"] for a in s["Action"]}
    assert reader_actions == {"s3:GetObject", "s3:ListBucket"}
    listing = policies["reader"]["Statement"][0]
    assert listing["Resource"] == "arn:aws:s3:::bkt"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["runs", "runs/*"]}}


def test_role_policies_follow_the_key_layout():
    p = role_policies("bkt", "runs", workers=["w1", "w2"])
    w1, agg, reader = p["worker:w1"], p["aggregator"], p["reader"]
    nonce = "n0"
    own = [
        layout.delta_payload(0, 3, "w1", nonce) + "/c/0",
        layout.delta_commit(0, 3, "w1"),
        layout.worker_checkpoints("w1") + "/120/params",
        "members/w1.json",
    ]
    others = [
        layout.delta_payload(0, 3, "w2", nonce) + "/c/0",
        layout.delta_commit(0, 3, "w2"),
        layout.delta_commit(0, 3, "w10"),
        layout.mean_commit(0, 3),
        layout.mean_payload(0, 3, "agg", nonce) + "/c/0",
        layout.global_commit(0, 3),
        layout.worker_checkpoints("w2") + "/120/params",
        layout.MANIFEST,
    ]
    for key in own:
        assert _allowed(w1, "s3:PutObject", _obj(key)), key
    for key in others:
        assert not _allowed(w1, "s3:PutObject", _obj(key)), key
    agg_writes = [
        layout.mean_commit(0, 3),
        layout.mean_payload(0, 3, "agg", nonce) + "/c/0",
        layout.rejected(0, 3, "w2"),
        layout.global_commit(0, 3),
        layout.global_state(0, 3) + "/params/c/0",
        layout.global_init(0) + "/c/0",
        layout.MANIFEST,
    ]
    for key in agg_writes:
        assert _allowed(agg, "s3:PutObject", _obj(key)), key
    assert not _allowed(agg, "s3:PutObject", _obj(layout.delta_commit(0, 3, "w1")))
    for key in own + others:
        assert _allowed(reader, "s3:GetObject", _obj(key))
        assert _allowed(w1, "s3:GetObject", _obj(key)) and _allowed(agg, "s3:GetObject", _obj(key))
        assert not _allowed(reader, "s3:PutObject", _obj(key))
    assert not _allowed(reader, "s3:GetObject", "arn:aws:s3:::bkt/elsewhere/x")
    with pytest.raises(ValueError):
        role_policies("bkt", "runs", workers=["w/1"])


MICRO = [
    "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
    "data.seq_len=32", "data.batch_size=8", "optim.warmup_steps=4", "optim.lr=0.01",
    "train.eval_every=0", "train.eval_batches=2", "train.threads=1", "sync.sync_every=8",
    "sync.fragments=2", "sync.overlap=1", "train.steps=24", "train.checkpoint_every=8",
    "train.keep_checkpoints=1",  # so that the aggregator prunes, as it does in a long run
]

WRITES = {"put": "s3:PutObject", "put_if_absent": "s3:PutObject", "put_many": "s3:PutObject",
          "delete": "s3:DeleteObject", "delete_prefix": "s3:DeleteObject"}


def _record_writes(monkeypatch, root: Path) -> list[tuple[str, str]]:
    """Every key written or deleted through any ObjectStore of this process, as
    (S3 action, key relative to ``root``); zarr payloads go through put_many too."""
    from storage.objectstore import ObjectStore

    seen: list[tuple[str, str]] = []
    base = str(root).rstrip("/") + "/"

    def note(store, op, keys):
        for key in keys:
            path = store.fs_path(key)
            if path.startswith(base):
                seen.append((WRITES[op], path[len(base):]))

    for op in WRITES:
        original = getattr(ObjectStore, op)

        def wrapper(self, arg, *rest, _op=op, _original=original, **kw):
            keys = (list(arg) if _op == "put_many" else
                    self.list(arg) if _op == "delete_prefix" else [arg])
            note(self, _op, keys)
            return _original(self, arg, *rest, **kw)

        monkeypatch.setattr(ObjectStore, op, wrapper)
    return seen


@pytest.mark.slow
def test_the_aggregator_policy_allows_every_key_the_aggregator_writes(tmp_path, monkeypatch):
    """The aggregator job on a real (micro) run, its two workers as processes: every
    key it writes or deletes, recorded as it happens, is allowed by the aggregator's
    role policy. (Its registration members/aggregator.json and its status
    members/aggregator/status.json were missing: Access Denied at start.)"""
    from flows.aggregator import run_aggregator_job
    from flows.launchers import LocalLauncher
    from workers.config import load_config
    from workers.data.prepare import prepare_data
    from workers.runs import create_run

    monkeypatch.setenv("DILOCO_TRACKING", "off")
    data = str(tmp_path / "data")
    prepare_data(["builtin:shakespeare/tragedies/*"], data, max_bytes=200_000)
    cfg = load_config("tiny", [*MICRO, f"data.dataset={data}", f"store={tmp_path}"])
    run = tmp_path / "run"
    create_run(cfg, str(run))
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    for worker in cfg.workers:
        launcher.start(str(run), worker)
    written = _record_writes(monkeypatch, run)
    try:
        out = run_aggregator_job(str(run), evaluate=True)
    finally:
        launcher.stop(cfg.workers, grace=60)
    assert out["state"] == "finished", out
    keys = {key for _, key in written}
    assert {"members/aggregator.json", "members/aggregator/status.json"} <= keys
    assert any(a == "s3:DeleteObject" and k.startswith("global/") for a, k in written)
    policy = role_policies("bkt", "runs")["aggregator"]
    denied = sorted({(a, k) for a, k in written if not _allowed(policy, a, _obj(k))})
    assert not denied, f"the aggregator's policy denies what it writes: {denied[:10]}"


@pytest.mark.s3
def test_bucket_policy_applies_and_reads_back(s3_client, fresh_bucket):
    if os.environ.get("DILOCO_TEST_S3_ENDPOINT"):
        pytest.skip("MinIO bucket policies take no IAM user ARNs as principals")
    ensure_bucket(fresh_bucket, client=s3_client)
    principals = {
        "reader": "arn:aws:iam::123456789012:user/reader",
        "aggregator": "arn:aws:iam::123456789012:role/aggregator",
        "worker:w1": ["arn:aws:iam::123456789012:role/worker-w1"],
    }
    policy = bucket_policy(fresh_bucket, "runs", principals)
    sids = [s["Sid"] for s in policy["Statement"]]
    assert len(sids) == len(set(sids))
    assert all("Principal" in s for s in policy["Statement"])
    apply_bucket_policy(fresh_bucket, policy, client=s3_client)
    stored = json.loads(s3_client.get_bucket_policy(Bucket=fresh_bucket)["Policy"])
    assert stored == policy
    with pytest.raises(ValueError, match="unknown role"):
        bucket_policy(fresh_bucket, "runs", {"admin": "arn:aws:iam::1:user/x"})


# -- python -m infra.bucket ---------------------------------------------------------------


def test_cli_policies_writes_one_file_per_role(tmp_path, capsys):
    out = tmp_path / "policies"
    assert main(["policies", "--bucket", "bkt", "--prefix", "runs",
                 "--workers", "w1, w2", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["aggregator.json", "reader.json", "worker-w1.json", "worker-w2.json"]
    expected = role_policies("bkt", "runs", workers=["w1", "w2"])
    assert json.loads((out / "worker-w2.json").read_text()) == expected["worker:w2"]
    assert json.loads((out / "aggregator.json").read_text()) == expected["aggregator"]
    assert "worker:w1: " in capsys.readouterr().err
    # without --out, every role's document goes to stdout as one JSON object
    assert main(["policies", "--bucket", "bkt", "--prefix", "runs", "--workers", "w1"]) == 0
    assert json.loads(capsys.readouterr().out) == role_policies("bkt", "runs", workers=["w1"])


def test_cli_bucket_policy_collects_principals(capsys):
    arn1, arn2 = "arn:aws:iam::1:role/w1", "arn:aws:iam::1:role/w1b"
    assert main(["bucket-policy", "--bucket", "bkt", "--prefix", "runs",
                 "--principal", f"worker:w1={arn1}", "--principal", f"worker:w1={arn2}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == bucket_policy("bkt", "runs", {"worker:w1": [arn1, arn2]})
    with pytest.raises(SystemExit, match="expected ROLE=ARN"):
        main(["bucket-policy", "--bucket", "bkt", "--principal", "reader"])


@pytest.mark.s3
def test_cli_create_and_lifecycle(s3_endpoint, s3_env, fresh_bucket, monkeypatch, capsys):
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    endpoint, _ = s3_endpoint
    where = ["--endpoint", endpoint, "--region", "us-east-1"]
    assert main([*where, "create", "--bucket", fresh_bucket]) == 0
    assert main([*where, "create", "--bucket", fresh_bucket]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"bucket {fresh_bucket}: created", f"bucket {fresh_bucket}: exists"]
    assert main([*where, "lifecycle", "--bucket", fresh_bucket, "--prefix", "runs"]) == 0
    assert json.loads(capsys.readouterr().out) == lifecycle_rule("runs")
