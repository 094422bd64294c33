"""Bucket set-up: infra/bucket.py (create, lifecycle, bucket policy), infra/policies.py
(the per-role documents derived from storage/layout.py), infra/iam.py (what a
document allows) and ``diloco bucket``, against the S3 servers of the tests (the local stack's compose file is checked in
test_compose.py; the documents against a server that enforces them, and against
every key of a real run, in test_roles.py).

Each S3 test creates buckets of its own (``diloco-bt-<random>``), so it never
touches the bucket other tests share.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import boto3
import pytest
from typer.testing import CliRunner

from cli.bucket import bucket_app
from infra import setup as bucket_setup
from infra.bucket import (
    apply_bucket_policy,
    apply_lifecycle,
    bucket_policy,
    ensure_bucket,
    lifecycle_rule,
    main,
    role_policies,
)
from infra.iam import allowed, matches
from storage import layout

EXTERNAL = bool(os.environ.get("DILOCO_TEST_S3_ENDPOINT"))


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
        for obj in s3_client.list_objects_v2(Bucket=name).get("Contents", []):
            s3_client.delete_object(Bucket=name, Key=obj["Key"])
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
    if EXTERNAL:
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


# -- what a document allows (infra/iam.py) ------------------------------------------------


def _doc(*statements: dict) -> dict:
    return {"Version": "2012-10-17", "Statement": list(statements)}


def test_iam_wildcards_match_as_iam_does():
    assert matches("runs/*/members/w1.json", "runs/r/members/w1.json")
    assert matches("runs/*/members/w1.json", "runs/a/b/members/w1.json")  # '*' crosses '/'
    assert not matches("runs/*/members/w1.json", "runs//members/w1.json"[:-1])
    assert not matches("runs/*/members/w1.json", "runs/r/members/w1xjson")  # '.' is literal
    assert not matches("runs/*/members/w1.json", "runs/r/members/w10.json")
    assert matches("r??????", "r000012") and not matches("r??????", "r00012")
    assert not matches("runs/*", "Runs/x")  # resources are case-sensitive
    assert matches("s3:get*", "s3:GetObject", ignore_case=True)  # actions are not


def test_iam_allow_deny_conditions_and_principals():
    listing = {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::bkt",
               "Condition": {"StringLike": {"s3:prefix": ["runs", "runs/*"]}}}
    read = {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::bkt/runs/*"}
    deny = {"Effect": "Deny", "Action": "s3:*", "Resource": "arn:aws:s3:::bkt/runs/secret/*"}
    policy = _doc(listing, read, deny)
    assert allowed(policy, "s3:ListBucket", "bkt", "runs/r1/")
    assert not allowed(policy, "s3:ListBucket", "bkt", "other/")
    assert not allowed(policy, "s3:ListBucket", "bkt", "")  # no s3:prefix: no match
    assert allowed(policy, "s3:GetObject", "bkt", "runs/r1/run.json")
    assert not allowed(policy, "s3:GetObject", "bkt", "runs/secret/x")  # an explicit Deny wins
    assert not allowed(policy, "s3:PutObject", "bkt", "runs/r1/run.json")  # nothing allows it
    assert not allowed(policy, "s3:GetObject", "other-bkt", "runs/r1/run.json")
    granted = _doc({**read, "Principal": {"AWS": ["arn:aws:iam::1:role/viewer"]}})
    assert allowed(granted, "s3:GetObject", "bkt", "runs/x", principal="arn:aws:iam::1:role/viewer")
    assert not allowed(granted, "s3:GetObject", "bkt", "runs/x", principal="arn:aws:iam::1:role/w")
    with pytest.raises(ValueError, match="NotAction"):
        allowed(_doc({"Effect": "Allow", "NotAction": "s3:PutObject", "Resource": "*"}),
                "s3:GetObject", "bkt", "k")
    with pytest.raises(ValueError, match="IpAddress"):
        allowed(_doc({**read, "Condition": {"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}}}),
                "s3:GetObject", "bkt", "runs/x")


# -- the documents, from storage.layout.KEYS ---------------------------------------------


def test_role_policies_are_valid_json_with_expected_shape():
    policies = role_policies("bkt", "/runs/", workers=["w1", "w2"])
    assert list(policies) == ["viewer", "launcher", "aggregator", "worker:w1", "worker:w2"]
    for role, policy in policies.items():
        assert json.loads(json.dumps(policy)) == policy
        assert policy["Version"] == "2012-10-17"
        assert len(json.dumps(policy, separators=(",", ":"))) < 2048, role  # IAM user inline
        for statement in policy["Statement"]:
            assert statement["Effect"] == "Allow", role
            assert all(a.startswith("s3:") and "*" not in a for a in statement["Action"]), role
            resources = statement["Resource"]
            for arn in [resources] if isinstance(resources, str) else resources:
                assert arn == "arn:aws:s3:::bkt" or arn.startswith("arn:aws:s3:::bkt/runs/"), arn
    viewer_actions = {a for s in policies["viewer"]["Statement"] for a in s["Action"]}
    assert viewer_actions == {"s3:GetObject", "s3:ListBucket"}
    listing = policies["viewer"]["Statement"][0]
    assert listing["Resource"] == "arn:aws:s3:::bkt"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["runs", "runs/*"]}}
    deleting = {role: {a for s in p["Statement"] for a in s["Action"]} >= {"s3:DeleteObject"}
                for role, p in policies.items()}
    assert deleting == {"viewer": False, "launcher": True, "aggregator": True,
                        "worker:w1": True, "worker:w2": True}
    with pytest.raises(ValueError, match="reserved"):
        role_policies("bkt", "runs", workers=["aggregator"])
    with pytest.raises(ValueError, match="not valid"):
        role_policies("bkt", "runs", workers=["w/1"])


@pytest.mark.parametrize("prefix", ["runs", "team/runs", ""])
def test_each_key_of_the_layout_is_written_by_its_owner_only(prefix):
    """For every kind of key a run writes, in a run under the prefix: its owner may
    write it (and delete it where it prunes; the launcher deletes what gc collects),
    every other role only reads it."""
    policies = role_policies("bkt", prefix, workers=["w1", "w2"])
    for pattern in layout.KEYS:
        relative = pattern.example("w1")
        key = "/".join(p for p in (prefix, "tiny-20260101-120000", relative) if p)
        owner = layout.owner(relative)
        for role, policy in policies.items():
            assert allowed(policy, "s3:PutObject", "bkt", key) == (role == owner), (role, key)
            assert allowed(policy, "s3:DeleteObject", "bkt", key) == (
                role == owner and pattern.prunes
                or role == layout.LAUNCHER and pattern.collected), (role, key)
            assert allowed(policy, "s3:GetObject", "bkt", key), (role, key)
    if prefix:  # outside the prefix, and keys not inside a run, are no one's
        for role, policy in policies.items():
            for key in ("elsewhere/r/run.json", f"{prefix}/run.json", f"{prefix}x/r/run.json"):
                assert not allowed(policy, "s3:PutObject", "bkt", key), (role, key)
            assert not allowed(policy, "s3:GetObject", "bkt", "elsewhere/r/run.json"), role
            assert allowed(policy, "s3:ListBucket", "bkt", f"{prefix}/r/"), role
            assert not allowed(policy, "s3:ListBucket", "bkt", "elsewhere/"), role


def test_the_keys_a_worker_writes_are_its_own_not_a_similar_name():
    policies = role_policies("bkt", "runs", workers=["w1", "w10"])
    for relative in (layout.delta_commit(0, 3, "w10"), layout.member("w10"),
                     layout.member_status("w10"), layout.worker_checkpoints("w10") + "/8.json",
                     layout.delta_payload(0, 3, "w10", "n") + "/c/0"):
        key = f"runs/r/{relative}"
        assert not allowed(policies["worker:w1"], "s3:PutObject", "bkt", key), key
        assert allowed(policies["worker:w10"], "s3:PutObject", "bkt", key), key


# -- the bucket policy ----------------------------------------------------------------


def _normal(policy: dict) -> list[dict]:
    """A policy's statements with every value that may be a string or a list as a
    sorted list: servers read a one-element list back as a string (SeaweedFS)."""

    def listed(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: listed(v) for k, v in value.items()}
        return sorted([value] if isinstance(value, str) else value)

    return [{k: (v if k in ("Sid", "Effect") else listed(v)) for k, v in s.items()}
            for s in policy["Statement"]]



def test_bucket_policy_replaces_its_own_statements_and_keeps_others():
    principals = {"viewer": "arn:aws:iam::1:user/viewer",
                  "worker:w1": ["arn:aws:iam::1:role/w1", "arn:aws:iam::2:role/w1"]}
    policy = bucket_policy("bkt", "runs", principals)
    sids = [s["Sid"] for s in policy["Statement"]]
    assert len(sids) == len(set(sids)) and all("Principal" in s for s in policy["Statement"])
    # what every role may (read, list) is one statement each, for all principals
    assert [s["Principal"]["AWS"] for s in policy["Statement"] if "List" in s["Sid"]] == [
        ["arn:aws:iam::1:user/viewer", "arn:aws:iam::1:role/w1", "arn:aws:iam::2:role/w1"]]
    key = "runs/r/" + layout.delta_commit(0, 3, "w1")
    assert allowed(policy, "s3:PutObject", "bkt", key, principal="arn:aws:iam::2:role/w1")
    assert not allowed(policy, "s3:PutObject", "bkt", key, principal="arn:aws:iam::1:user/viewer")
    assert allowed(policy, "s3:GetObject", "bkt", key, principal="arn:aws:iam::1:user/viewer")
    foreign = {"Sid": "TheirBackup", "Effect": "Allow", "Action": "s3:GetObject",
               "Principal": {"AWS": "arn:aws:iam::9:role/backup"}, "Resource": "arn:aws:s3:::bkt/*"}
    other_prefix = bucket_policy("bkt", "scratch", {"viewer": "arn:aws:iam::1:user/v"})
    existing = {"Version": "2012-10-17",
                "Statement": [foreign, *policy["Statement"], *other_prefix["Statement"]]}
    again = bucket_policy("bkt", "runs", {"launcher": "arn:aws:iam::1:role/ops"}, existing=existing)
    assert again["Statement"][0] == foreign
    assert all(s in again["Statement"] for s in other_prefix["Statement"])
    roles_now = {arn for s in again["Statement"][1:] for arn in _normal({"Statement": [s]})[0][
        "Principal"]["AWS"]}
    assert roles_now == {"arn:aws:iam::1:role/ops", "arn:aws:iam::1:user/v"}  # w1 replaced
    with pytest.raises(ValueError, match="unknown role"):
        bucket_policy("bkt", "runs", {"admin": "arn:aws:iam::1:user/x"})


def test_a_bucket_policy_over_the_aws_limit_is_refused_before_it_is_sent():
    workers = [f"region-{i:02d}" for i in range(40)]
    policy = bucket_policy("bkt", "runs", {f"worker:{w}": f"arn:aws:iam::1:role/{w}"
                                           for w in workers})
    with pytest.raises(ValueError, match="over AWS's 20480"):
        apply_bucket_policy("bkt", policy, client=object())  # no request is made


@pytest.mark.s3
def test_bucket_policy_applies_and_reads_back(s3_client, fresh_bucket):
    if EXTERNAL:
        pytest.skip("MinIO bucket policies take no IAM user ARNs as principals")
    ensure_bucket(fresh_bucket, client=s3_client)
    principals = {
        "viewer": "arn:aws:iam::123456789012:user/viewer",
        "aggregator": "arn:aws:iam::123456789012:role/aggregator",
        "worker:w1": ["arn:aws:iam::123456789012:role/worker-w1"],
    }
    policy = bucket_policy(fresh_bucket, "runs", principals)
    apply_bucket_policy(fresh_bucket, policy, client=s3_client)
    stored = json.loads(s3_client.get_bucket_policy(Bucket=fresh_bucket)["Policy"])
    assert _normal(stored) == _normal(policy)


# -- python -m infra.bucket ---------------------------------------------------------------


def test_cli_policies_writes_one_file_per_role(tmp_path, capsys):
    """The interface the compose stack's setup service relies on: these file names."""
    out = tmp_path / "policies"
    assert main(["policies", "--bucket", "bkt", "--prefix", "runs",
                 "--workers", "w1, w2", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["aggregator.json", "launcher.json", "viewer.json", "worker-w1.json",
                     "worker-w2.json"]
    expected = role_policies("bkt", "runs", workers=["w1", "w2"])
    assert json.loads((out / "worker-w2.json").read_text()) == expected["worker:w2"]
    assert json.loads((out / "launcher.json").read_text()) == expected["launcher"]
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
        main(["bucket-policy", "--bucket", "bkt", "--principal", "viewer"])


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


# -- diloco bucket ------------------------------------------------------------------------


def _diloco_bucket(*args: str) -> Any:
    """``diloco bucket ARGS``, in this process (its stdout, stderr, exit code)."""
    return CliRunner().invoke(bucket_app, list(args))


@pytest.fixture
def s3_user_env(s3_env, monkeypatch) -> dict[str, str]:
    """The environment of a user of the test server: its AWS_* variables only."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    return dict(s3_env)


@pytest.mark.s3
def test_setup_dry_run_says_what_it_would_do_and_changes_nothing(
        s3_user_env, s3_client, fresh_bucket, tmp_path):
    out = tmp_path / "policies"
    result = _diloco_bucket("setup", f"s3://{fresh_bucket}/runs", "--workers", "region-a,region-b",
                            "--dry-run", "--expire-days", "30", "--policies-out", str(out))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        f"would create bucket {fresh_bucket}",
        "would install lifecycle rule diloco:runs on prefix runs/: abort incomplete multipart "
        "uploads after 1 day, expire objects after 30 days",
        f"would write 5 policy documents to {out}: viewer.json, launcher.json, aggregator.json, "
        "worker-region-a.json, worker-region-b.json",
    ]
    assert any(line.strip().startswith("mc admin policy attach diloco diloco-worker-region-b")
               for line in lines)
    table = lines[lines.index(next(x for x in lines if x.startswith("what each role"))) + 1:]
    row = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert row["members/region-a.json"] == ["read", "read", "read", "write", "read"]
    assert row["control/cancel.json"] == ["read", "write,", "delete", "read", "read", "read"]
    assert len(row) == len(layout.KEYS)
    with pytest.raises(Exception, match="404|Not Found|NoSuchBucket"):
        s3_client.head_bucket(Bucket=fresh_bucket)
    assert not out.exists()


@pytest.mark.s3
def test_setup_creates_the_bucket_its_lifecycle_and_the_documents_once(
        s3_user_env, s3_client, fresh_bucket, tmp_path):
    out = tmp_path / "policies"
    url = f"s3://{fresh_bucket}/team/runs"
    args = ("setup", url, "--workers", "eu,us", "--policies-out", str(out),
            "--abort-multipart-days", "2")
    first = _diloco_bucket(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout.splitlines()[:3] == [
        f"created bucket {fresh_bucket}",
        "installed lifecycle rule diloco:team/runs on prefix team/runs/: abort incomplete "
        "multipart uploads after 2 days",
        f"wrote 5 policy documents to {out}: viewer.json, launcher.json, aggregator.json, "
        "worker-eu.json, worker-us.json",
    ]
    rules = s3_client.get_bucket_lifecycle_configuration(Bucket=fresh_bucket)["Rules"]
    assert rules == [lifecycle_rule("team/runs", abort_multipart_days=2)]
    expected = role_policies(fresh_bucket, "team/runs", ["eu", "us"])
    assert {p.name: json.loads(p.read_text()) for p in out.iterdir()} == {
        f"{role.replace(':', '-')}.json": doc for role, doc in expected.items()}
    again = _diloco_bucket(*args)
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines()[:2] == [
        f"bucket {fresh_bucket}: exists",
        "lifecycle rule diloco:team/runs on prefix team/runs/: abort incomplete multipart "
        "uploads after 2 days: already in place"]


@pytest.mark.s3
def test_setup_installs_the_bucket_policy_for_principals(s3_user_env, s3_client, fresh_bucket,
                                                       tmp_path):
    if EXTERNAL:
        pytest.skip("MinIO bucket policies take no IAM user ARNs as principals")
    ensure_bucket(fresh_bucket, client=s3_client)
    theirs = {"Sid": "TheirBackup", "Effect": "Allow", "Action": "s3:GetObject",
              "Principal": {"AWS": "arn:aws:iam::123456789012:role/backup"},
              "Resource": f"arn:aws:s3:::{fresh_bucket}/*"}
    s3_client.put_bucket_policy(Bucket=fresh_bucket, Policy=json.dumps(
        {"Version": "2012-10-17", "Statement": [theirs]}))
    arns = {"launcher": "arn:aws:iam::123456789012:role/ops",
            "worker:eu": "arn:aws:iam::210987654321:role/eu-worker"}
    result = _diloco_bucket("setup", f"s3://{fresh_bucket}/runs", "--workers", "eu",
                            "--policies-out", str(tmp_path / "p"),
                            *[f"--principal={role}={arn}" for role, arn in arns.items()])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == (
        "installed the bucket policy: 7 statements for launcher, worker:eu; "
        "1 statements of others kept")
    stored = json.loads(s3_client.get_bucket_policy(Bucket=fresh_bucket)["Policy"])
    assert _normal(stored) == _normal(bucket_policy(
        fresh_bucket, "runs", {k: [v] for k, v in arns.items()}, existing={"Statement": [theirs]}))
    key = f"runs/r/{layout.delta_commit(0, 1, 'eu')}"
    assert allowed(stored, "s3:PutObject", fresh_bucket, key, principal=arns["worker:eu"])
    assert not allowed(stored, "s3:PutObject", fresh_bucket, key, principal=arns["launcher"])


@pytest.mark.parametrize(("args", "message"), [
    (["s3://My_Bucket/runs", "--workers", "a"], "bucket name 'My_Bucket' is not valid"),
    (["https://bkt/runs", "--workers", "a"], "is not an s3://BUCKET[/PREFIX] URL"),
    (["s3://bkt/runs/../x", "--workers", "a"], "'..' segment"),
    (["s3://AKIAXX:secret@bkt/runs", "--workers", "a"], "credentials in a URL"),
    (["s3://bkt/runs", "--workers", "a,aggregator"], "worker name 'aggregator' is reserved"),
    (["s3://bkt/runs", "--workers", "a", "--expire-days", "0"], "--expire-days must be"),
    (["s3://bkt/runs", "--workers", "a", "--principal", "viewer"], "expected ROLE=ARN"),
    (["s3://bkt/runs", "--workers", "a", "--principal", "worker:b=arn:aws:iam::1:role/b"],
     "unknown role; known: viewer, launcher, aggregator, worker:a"),
    (["s3://bkt/runs", "--workers", "a", "--principal", "viewer=someone"], "not an ARN"),
    (["s3://bkt/runs", "--workers", ",".join(f"w{i}" for i in range(40)),
      *[f"--principal=worker:w{i}=arn:aws:iam::1:role/w{i}" for i in range(40)]],
     "over AWS's 20480: attach the per-role documents to IAM roles instead"),
])
def test_setup_refuses_bad_input_in_one_line_before_any_request(args, message, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
    out = tmp_path / "policies"
    result = _diloco_bucket("setup", *args, "--policies-out", str(out))
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output and not out.exists()


def test_setup_without_credentials_says_which_variables(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = _diloco_bucket("setup", "s3://bkt/runs", "--workers", "a", "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: no AWS credentials: set AWS_ACCESS_KEY_ID and "
                                     "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")


def test_policies_command_prints_the_documents_and_the_access_table(tmp_path):
    result = _diloco_bucket("policies", "s3://bkt/runs", "--workers", "eu,us")
    assert result.exit_code == 0, result.output
    text = result.stdout
    documents = json.loads(text[: text.index("\n}\n") + 2])
    assert documents == role_policies("bkt", "runs", ["eu", "us"])
    assert "workers/eu/ckpt/{step}.json" in text
    written = _diloco_bucket("policies", "s3://bkt/runs", "--workers", "eu", "--out",
                             str(tmp_path / "p"))
    assert written.exit_code == 0
    assert sorted(p.name for p in Path(tmp_path / "p").iterdir()) == [
        "aggregator.json", "launcher.json", "viewer.json", "worker-eu.json"]


def test_how_to_attach_the_documents_depends_on_the_server():
    aws = bucket_setup.attach_commands(["viewer", "worker:eu"], Path("p"), endpoint=None)
    assert aws == [
        "aws iam put-role-policy --role-name ROLE_OF_VIEWER --policy-name diloco-viewer "
        "--policy-document file://p/viewer.json",
        "aws iam put-role-policy --role-name ROLE_OF_WORKER_EU --policy-name diloco-worker-eu "
        "--policy-document file://p/worker-eu.json"]
    assert bucket_setup.attach_commands(
        ["viewer"], Path("p"), endpoint="https://s3.eu-west-1.amazonaws.com") == aws[:1]
    minio = bucket_setup.attach_commands(["worker:eu"], Path("p"), endpoint="http://minio:9000")
    assert minio == [
        'mc alias set diloco http://minio:9000 "$ADMIN_USER" "$ADMIN_PASSWORD"',
        "mc admin policy create diloco diloco-worker-eu p/worker-eu.json",
        'mc admin user add diloco worker-eu "$PASSWORD_OF_WORKER_EU"',
        "mc admin policy attach diloco diloco-worker-eu --user worker-eu"]


def test_setup_against_an_endpoint_nobody_answers_is_one_line(tmp_path, monkeypatch):
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    result = _diloco_bucket("setup", "s3://bkt/runs", "--workers", "a", "--endpoint",
                            f"http://127.0.0.1:{port}", "--policies-out", str(tmp_path / "p"))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: cannot reach the S3 endpoint: Could not connect")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()
