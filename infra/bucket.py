"""Setting up a bucket for runs: create it, clean up after failed uploads, and
give each role only the access it needs.

This is the one-off administration a user does before the first run
(``diloco bucket setup``, infra/setup.py; the local stack in `infra/minio/` uses
the documents for its per-role users); the training path never calls it and never
needs more than `ObjectStore`. It uses boto3 directly because bucket
configuration (lifecycle, policies) is outside what fsspec offers. Credentials and
the endpoint come from the usual ``AWS_*`` variables (``AWS_ENDPOINT_URL_S3`` for
MinIO).

From the repository root (or anywhere the package is installed)::

    python -m infra.bucket create --bucket diloco
    python -m infra.bucket lifecycle --bucket diloco --prefix runs --abort-multipart-days 1
    python -m infra.bucket policies --bucket diloco --prefix runs --workers region-a,region-b \
        --out policies/   # viewer.json, launcher.json, aggregator.json, worker-region-a.json, ...
    python -m infra.bucket bucket-policy --bucket diloco --prefix runs \
        --principal aggregator=arn:aws:iam::123456789012:role/agg [--apply]

The roles and the keys each writes are declared once, in `storage.layout.KEYS`;
`role_policies` derives every document from that table, so a key added there is
granted to its owner and to no one else:

- ``worker:<name>``: reads everything, writes only its own keys (deltas and their
  commits, its registration and status, its checkpoints, which it prunes). A
  compromised or buggy worker cannot overwrite another's delta, the mean, or the
  canonical model.
- ``aggregator``: reads everything, writes the means, their commits, the rejection
  notes, the canonical state (which it prunes), its registration and status.
- ``launcher``: the operator (the train job, ``diloco run``/``resume``/``cancel``,
  ``python -m workers --create``): creates the run (manifest, initial parameters,
  prepared data), writes tracking.json, the launcher record, the train job's status
  and cancel requests (and deletes a request on resume).
- ``viewer``: read-only (dashboards, ``diloco status``, evaluation, comparisons).

A policy covers every run under ``s3://bucket/prefix``: the runs one level below
the prefix (``prefix/<run>/...``), which is how ``store: s3://bucket/prefix``
places them. The documents name each worker's keys explicitly rather than using
``${aws:username}``, so they work for IAM roles, MinIO users and any worker naming.
IAM's ``*`` also matches ``/``, so a grant reaches keys deeper than the layout's
(``.../members/x/members/region-a.json``): places no party reads, never another
role's keys (tests/test_roles.py checks that against every key of a real run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from infra.iam import allowed
from storage import layout

POLICY_VERSION = "2012-10-17"

READ_ACTIONS = ["s3:GetObject"]
LIST_ACTIONS = ["s3:ListBucket"]
WRITE_ACTIONS = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
DELETE_ACTIONS = ["s3:DeleteObject"]

#: AWS's limit on a bucket policy's size, in bytes.
BUCKET_POLICY_LIMIT = 20 * 1024


def _client(client: Any, endpoint_url: str | None, region: str | None) -> Any:
    if client is not None:
        return client
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region)


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def bucket_exists(bucket: str, *, endpoint_url: str | None = None, region: str | None = None,
                  client: Any = None) -> bool:
    """Whether ``bucket`` exists and these credentials may use it (a read only).

    A bucket that exists but answers 403 belongs to someone else (bucket names
    are global on AWS) or the credentials lack rights on it: PermissionError,
    with the name.
    """
    s3 = _client(client, endpoint_url, region)
    try:
        s3.head_bucket(Bucket=bucket)
        return True
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if _error_code(exc) in ("404", "NoSuchBucket", "NotFound") or status == 404:
            return False
        raise PermissionError(
            f"bucket {bucket!r} exists but is not accessible with these credentials "
            f"({_error_code(exc) or status}); choose another name or fix the credentials"
        ) from exc


def ensure_bucket(
    bucket: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> bool:
    """Create ``bucket`` if it does not exist; True if this call created it.

    Idempotent and safe to race: a bucket created meanwhile by someone else on
    this account counts as existing. A bucket owned by another account is an error
    (PermissionError, with the name).
    """
    s3 = _client(client, endpoint_url, region)
    if bucket_exists(bucket, client=s3):
        return False
    kwargs: dict[str, Any] = {"Bucket": bucket}
    region = region or s3.meta.region_name
    if region and region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        s3.create_bucket(**kwargs)
    except ClientError as exc:
        if _error_code(exc) == "BucketAlreadyOwnedByYou":
            return False
        if _error_code(exc) == "BucketAlreadyExists":
            raise PermissionError(f"bucket {bucket!r} belongs to another account; "
                                  f"choose another name") from exc
        raise
    return True


def clean_prefix(prefix: str) -> str:
    """``/runs/`` -> ``runs``; a prefix with an empty, '.' or '..' segment is refused."""
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    return prefix


def lifecycle_rule(
    prefix: str,
    *,
    abort_multipart_days: int = 1,
    expire_days: int | None = None,
    rule_id: str | None = None,
) -> dict[str, Any]:
    """The lifecycle rule `apply_lifecycle` installs, as S3 reads it back.

    Aborting incomplete multipart uploads matters because a worker killed mid-upload
    leaves parts that are billed but never visible; nothing in the protocol ever
    reads them. Expiry is optional: use it for scratch or benchmark prefixes, not
    for runs you want to resume.
    """
    prefix = clean_prefix(prefix)
    if abort_multipart_days < 1:
        raise ValueError(f"abort_multipart_days must be >= 1, got {abort_multipart_days}")
    rule: dict[str, Any] = {
        "ID": rule_id or f"diloco:{prefix or '*'}"[:255],
        "Filter": {"Prefix": f"{prefix}/" if prefix else ""},
        "Status": "Enabled",
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": abort_multipart_days},
    }
    if expire_days is not None:
        if expire_days < 1:
            raise ValueError(f"expire_days must be >= 1 or None, got {expire_days}")
        rule["Expiration"] = {"Days": expire_days}
    return rule


def lifecycle_rules(bucket: str, *, client: Any) -> list[dict[str, Any]]:
    """The bucket's lifecycle rules now ([] when it has none)."""
    try:
        return list(client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
    except ClientError as exc:
        if _error_code(exc) != "NoSuchLifecycleConfiguration":
            raise
        return []


def apply_lifecycle(
    bucket: str,
    prefix: str,
    *,
    abort_multipart_days: int = 1,
    expire_days: int | None = None,
    rule_id: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> dict[str, Any]:
    """Install (or replace) our lifecycle rule for ``prefix``; returns the rule.

    S3 replaces a bucket's whole lifecycle configuration at once, so the rules
    already there are read first and kept, except one with the same ID.
    """
    s3 = _client(client, endpoint_url, region)
    rule = lifecycle_rule(
        prefix, abort_multipart_days=abort_multipart_days, expire_days=expire_days, rule_id=rule_id
    )
    rules = [r for r in lifecycle_rules(bucket, client=s3) if r.get("ID") != rule["ID"]]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket,
                                          LifecycleConfiguration={"Rules": [*rules, rule]})
    return rule


# -- policies, from storage.layout.KEYS ------------------------------------------------


def _arn(bucket: str, *parts: str) -> str:
    path = "/".join(p for p in parts if p)
    return f"arn:aws:s3:::{bucket}/{path}" if path else f"arn:aws:s3:::{bucket}"


def _read_statements(bucket: str, prefix: str) -> list[dict[str, Any]]:
    listing: dict[str, Any] = {
        "Sid": "ListRuns",
        "Effect": "Allow",
        "Action": LIST_ACTIONS,
        "Resource": _arn(bucket),
    }
    if prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
    return [
        listing,
        {"Sid": "ReadRuns", "Effect": "Allow", "Action": READ_ACTIONS,
         "Resource": _arn(bucket, prefix, "*")},
    ]


def _document(statements: list[dict[str, Any]]) -> dict[str, Any]:
    return {"Version": POLICY_VERSION, "Statement": statements}


def write_patterns(owner: str, worker: str | None = None, *, prunes: bool = False) -> list[str]:
    """Key patterns, relative to a run's root, that ``owner`` (a role of
    `storage.layout.ROLES`; ``worker`` with the worker's name) writes, or with
    ``prunes`` deletes, as they appear in its policy."""
    return [p.resource(worker) for p in layout.KEYS
            if p.owner == owner and (p.prunes or not prunes)]


def check_workers(workers: Iterable[str]) -> list[str]:
    """The worker names, validated as the run's config validates them (they become
    keys and policy resources)."""
    names = [w.strip() for w in workers if w.strip()]
    for name in names:
        layout.check_name("worker", name)
    if len(set(names)) != len(names):
        raise ValueError(f"worker names must be unique, got {names}")
    return names


def role_policies(bucket: str, prefix: str, workers: Iterable[str] = ()) -> dict[str, dict]:
    """IAM policy documents per role for the runs under ``s3://bucket/prefix``.

    Returns ``{"viewer": ..., "launcher": ..., "aggregator": ..., "worker:<name>":
    ...}`` with one worker entry per name in ``workers``. Attach each to the IAM
    user/role (or MinIO user) of that role; `bucket_policy` turns them into one
    bucket policy.
    """
    prefix = clean_prefix(prefix)
    read = _read_statements(bucket, prefix)
    runs = f"{prefix}/*" if prefix else "*"  # a run's root: one level below the prefix

    def grants(owner: str, worker: str | None = None) -> dict[str, Any]:
        statements = [*read, {
            "Sid": "WriteOwnKeys", "Effect": "Allow", "Action": WRITE_ACTIONS,
            "Resource": [_arn(bucket, runs, p) for p in write_patterns(owner, worker)],
        }]
        pruned = write_patterns(owner, worker, prunes=True)
        if pruned:
            statements.append({
                "Sid": "PruneOwnKeys", "Effect": "Allow", "Action": DELETE_ACTIONS,
                "Resource": [_arn(bucket, runs, p) for p in pruned],
            })
        return _document(statements)

    policies: dict[str, dict] = {
        layout.VIEWER: _document(read),
        layout.LAUNCHER: grants(layout.LAUNCHER),
        layout.AGGREGATOR: grants(layout.AGGREGATOR),
    }
    for worker in check_workers(workers):
        policies[f"{layout.WORKER}:{worker}"] = grants(layout.WORKER, worker)
    return policies


def _tag(text: str) -> str:
    return "".join(c for c in text.title() if c.isalnum())


def statement_prefix(bucket: str, prefix: str) -> str:
    """The Sid prefix of our statements for ``prefix`` in a bucket policy, so that
    setting up one prefix again replaces its statements and keeps everything else."""
    digest = hashlib.sha256(f"{bucket}/{clean_prefix(prefix)}".encode()).hexdigest()[:8]
    return f"Diloco{digest}"


def bucket_policy(
    bucket: str,
    prefix: str,
    principals: Mapping[str, str | list[str]],
    *,
    existing: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One bucket policy granting each principal the statements of its role.

    ``principals`` maps a role name from `role_policies` (``"viewer"``,
    ``"launcher"``, ``"aggregator"``, ``"worker:<name>"``) to an AWS principal ARN
    (or a list). The reading statements, the same for every role, appear once with
    every principal (AWS limits the whole policy to 20 KB). The statements of
    ``existing`` (the bucket's policy now) are kept, except ours for this prefix,
    which are replaced.
    """
    workers = [role.split(":", 1)[1] for role in principals if role.startswith("worker:")]
    roles = role_policies(bucket, prefix, workers)
    ours = statement_prefix(bucket, prefix)
    kept = [s for s in (existing or {}).get("Statement", [])
            if not str(s.get("Sid", "")).startswith(ours)]
    readers: list[str] = []
    writes = []
    for role, arns in principals.items():
        if role not in roles:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(sorted(roles))}")
        readers += [arns] if isinstance(arns, str) else arns
        writes += [{**statement, "Sid": f"{ours}{_tag(role)}{statement['Sid']}",
                    "Principal": {"AWS": arns}}
                   for statement in roles[role]["Statement"][len(roles[layout.VIEWER]["Statement"]):]]
    reads = [{**statement, "Sid": f"{ours}All{statement['Sid']}", "Principal": {"AWS": readers}}
             for statement in roles[layout.VIEWER]["Statement"]] if readers else []
    return {"Version": POLICY_VERSION, "Statement": [*kept, *reads, *writes]}


def current_bucket_policy(bucket: str, *, client: Any) -> dict[str, Any] | None:
    """The bucket's policy now, or None."""
    try:
        return json.loads(client.get_bucket_policy(Bucket=bucket)["Policy"])
    except ClientError as exc:
        if _error_code(exc) != "NoSuchBucketPolicy":
            raise
        return None


def apply_bucket_policy(
    bucket: str,
    policy: dict[str, Any],
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> None:
    """Install ``policy`` (e.g. from `bucket_policy`) as the bucket's policy."""
    text = json.dumps(policy, separators=(",", ":"))
    if len(text.encode()) > BUCKET_POLICY_LIMIT:
        raise ValueError(
            f"the bucket policy would be {len(text.encode())} bytes, over AWS's "
            f"{BUCKET_POLICY_LIMIT}: attach the per-role documents to IAM roles instead")
    s3 = _client(client, endpoint_url, region)
    s3.put_bucket_policy(Bucket=bucket, Policy=text)


def access(policies: Mapping[str, Mapping[str, Any]], bucket: str, prefix: str,
           worker: str = "region-a") -> list[tuple[str, dict[str, str]]]:
    """What each role's document allows on each kind of key, judged by `infra.iam`
    (not by the table the documents came from): ``[(key pattern, {role: "write,
    delete" | "write" | "read" | "-"})]``, for a run ``<run>`` and the keys of
    ``worker`` where a pattern names a worker."""
    prefix = clean_prefix(prefix)
    rows = []
    for pattern in layout.KEYS:
        key = "/".join(p for p in (prefix, "<run>", pattern.example(worker)) if p)
        cells = {}
        for role, policy in policies.items():
            can = [word for action, word in (("s3:PutObject", "write"),
                                             ("s3:DeleteObject", "delete"))
                   if allowed(policy, action, bucket, key)]
            cells[role] = (", ".join(can) if can
                           else "read" if allowed(policy, "s3:GetObject", bucket, key) else "-")
        rows.append((pattern.template.replace("{worker}", worker), cells))
    return rows


def access_table(policies: Mapping[str, Mapping[str, Any]], bucket: str,
                 prefix: str) -> list[str]:
    """`access` as aligned lines: the roles, then one row per kind of key (a worker's
    keys shown as the first worker's)."""
    workers = [role.split(":", 1)[1] for role in policies if role.startswith("worker:")]
    rows = access(policies, bucket, prefix, *workers[:1])
    width = max(len(key) for key, _ in rows)
    lines = [" " * width + "  " + "  ".join(f"{role:<15}" for role in policies)]
    lines += [f"{key:<{width}}  " + "  ".join(f"{cells[role]:<15}" for role in policies)
              for key, cells in rows]
    return [line.rstrip() for line in lines]


# -- command line ----------------------------------------------------------------------


def policy_file_name(role: str) -> str:
    """``worker:region-a`` -> ``worker-region-a.json`` (a name ``mc`` and shells take)."""
    return role.replace(":", "-") + ".json"


def write_policies(documents: Mapping[str, Mapping[str, Any]], out: Path) -> list[Path]:
    """One ``<role>.json`` per role in ``out`` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for role, document in documents.items():
        path = out / policy_file_name(role)
        path.write_text(json.dumps(document, indent=2) + "\n")
        paths.append(path)
    return paths


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infra.bucket",
        description="Bucket administration for diloco-flows runs (diloco bucket setup does "
                    "all of it at once; see docs/bucket.md).",
    )
    parser.add_argument("--endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 etc.)")
    parser.add_argument("--region", help="region of the bucket (default: the AWS configuration)")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, help_text: str, prefix: bool = True) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--bucket", required=True)
        if prefix:
            sub.add_argument("--prefix", default="", help="where the runs live in the bucket")
        return sub

    verb("create", "create the bucket if it does not exist", prefix=False)
    lifecycle = verb("lifecycle", "abort stale multipart uploads (and expire) under a prefix")
    lifecycle.add_argument("--abort-multipart-days", type=int, default=1)
    lifecycle.add_argument("--expire-days", type=int, default=None)
    policies = verb("policies", "IAM/MinIO policy documents per role (viewer, launcher, "
                                "aggregator, workers)")
    policies.add_argument("--workers", default="", help="comma-separated worker names")
    policies.add_argument("--out", type=Path, help="write one <role>.json per role into this folder")
    bucket = verb("bucket-policy", "one bucket policy granting principals their roles")
    bucket.add_argument(
        "--principal", action="append", default=[], metavar="ROLE=ARN", required=True,
        help="e.g. worker:region-a=arn:aws:iam::1:role/w (repeat for each principal)",
    )
    bucket.add_argument("--apply", action="store_true", help="install it on the bucket")
    return parser


def parse_principals(items: Iterable[str]) -> dict[str, list[str]]:
    """``["worker:a=arn:...", ...]`` -> ``{"worker:a": ["arn:...", ...]}``."""
    principals: dict[str, list[str]] = {}
    for item in items:
        role, sep, arn = item.partition("=")
        if not sep or not role or not arn:
            raise ValueError(f"--principal {item!r}: expected ROLE=ARN")
        principals.setdefault(role.strip(), []).append(arn.strip())
    return principals


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; JSON goes to stdout, one-line results to stderr."""
    args = _parser().parse_args(argv)
    where = {"endpoint_url": args.endpoint, "region": args.region}
    if args.verb == "create":
        created = ensure_bucket(args.bucket, **where)
        print(f"bucket {args.bucket}: {'created' if created else 'exists'}", file=sys.stderr)
    elif args.verb == "lifecycle":
        rule = apply_lifecycle(
            args.bucket, args.prefix, abort_multipart_days=args.abort_multipart_days,
            expire_days=args.expire_days, **where,
        )
        print(json.dumps(rule, indent=2))
    elif args.verb == "policies":
        documents = role_policies(args.bucket, args.prefix, args.workers.split(","))
        if args.out is None:
            print(json.dumps(documents, indent=2))
        else:
            for role, path in zip(documents, write_policies(documents, args.out), strict=True):
                print(f"{role}: {path}", file=sys.stderr)
    else:
        try:
            principals = parse_principals(args.principal)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        s3 = _client(None, **where) if args.apply else None
        existing = current_bucket_policy(args.bucket, client=s3) if s3 is not None else None
        policy = bucket_policy(args.bucket, args.prefix, principals, existing=existing)
        print(json.dumps(policy, indent=2))
        if s3 is not None:
            apply_bucket_policy(args.bucket, policy, client=s3)
            print(f"bucket {args.bucket}: policy installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
