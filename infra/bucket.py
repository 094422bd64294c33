"""Setting up a bucket for runs: create it, clean up after failed uploads, and
give each role only the access it needs.

This is the one-off administration a user does before the first run (and what
the local stack in `infra/minio/` uses for its per-role users); the training path
never calls it and never needs more than `ObjectStore`. It uses boto3 directly
because bucket configuration (lifecycle, policies) is outside what fsspec offers.
Credentials and the endpoint come from the usual ``AWS_*`` variables
(``AWS_ENDPOINT_URL_S3`` for MinIO).

From the repository root::

    python -m infra.bucket create --bucket diloco
    python -m infra.bucket lifecycle --bucket diloco --prefix runs --abort-multipart-days 1
    python -m infra.bucket policies --bucket diloco --prefix runs --workers region-a,region-b \
        --out policies/     # reader.json, aggregator.json, worker-region-a.json, ...
    python -m infra.bucket bucket-policy --bucket diloco --prefix runs \
        --principal aggregator=arn:aws:iam::123456789012:role/agg [--apply]

Roles, as the exchange protocol uses the bucket (see `storage/layout.py`):

- ``worker:<name>``: reads everything of the run, writes only its own keys: its
  deltas and their commit records, its membership record and heartbeats, and its
  checkpoints. A compromised or buggy worker cannot overwrite another's delta, the
  mean, or the canonical model.
- ``aggregator``: reads everything, writes the means and their commits, the
  rejection notes, the canonical (global) state, the run manifest, and its own
  registration and status (``members/aggregator.json``, ``members/aggregator/*``).
- ``reader``: read-only (dashboards, evaluation, MLflow comparisons).

The documents use explicit per-worker prefixes rather than ``${aws:username}``, so
they work for IAM roles, MinIO users, and any worker naming scheme.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

POLICY_VERSION = "2012-10-17"

READ_ACTIONS = ["s3:GetObject"]
LIST_ACTIONS = ["s3:ListBucket"]
WRITE_ACTIONS = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
DELETE_ACTIONS = ["s3:DeleteObject"]


def _client(client: Any, endpoint_url: str | None, region: str | None) -> Any:
    if client is not None:
        return client
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region)


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


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
    (bucket names are global on AWS), reported with the name.
    """
    s3 = _client(client, endpoint_url, region)
    try:
        s3.head_bucket(Bucket=bucket)
        return False
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if _error_code(exc) not in ("404", "NoSuchBucket", "NotFound") and status != 404:
            raise PermissionError(
                f"bucket {bucket!r} exists but is not accessible with these credentials "
                f"({_error_code(exc) or status}); choose another name or fix the credentials"
            ) from exc
    kwargs: dict[str, Any] = {"Bucket": bucket}
    region = region or s3.meta.region_name
    if region and region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        s3.create_bucket(**kwargs)
    except ClientError as exc:
        if _error_code(exc) == "BucketAlreadyOwnedByYou":
            return False
        raise
    return True


def _clean_prefix(prefix: str) -> str:
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
    prefix = _clean_prefix(prefix)
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
    try:
        existing = s3.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
    except ClientError as exc:
        if _error_code(exc) != "NoSuchLifecycleConfiguration":
            raise
        existing = []
    rules = [r for r in existing if r.get("ID") != rule["ID"]] + [rule]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
    return rule


def _arn(bucket: str, prefix: str, pattern: str = "") -> str:
    path = "/".join(p for p in (prefix, pattern) if p)
    return f"arn:aws:s3:::{bucket}/{path}" if path else f"arn:aws:s3:::{bucket}"


def _read_statements(bucket: str, prefix: str) -> list[dict[str, Any]]:
    listing: dict[str, Any] = {
        "Sid": "ListRun",
        "Effect": "Allow",
        "Action": LIST_ACTIONS,
        "Resource": _arn(bucket, ""),
    }
    if prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
    return [
        listing,
        {
            "Sid": "ReadRun",
            "Effect": "Allow",
            "Action": READ_ACTIONS,
            "Resource": _arn(bucket, prefix, "*"),
        },
    ]


def _document(statements: list[dict[str, Any]]) -> dict[str, Any]:
    return {"Version": POLICY_VERSION, "Statement": statements}


def worker_write_patterns(worker: str) -> list[str]:
    """Key patterns (relative to the run prefix) that worker ``worker`` may write."""
    return [
        f"frag/*/delta/{worker}/*",
        f"frag/*/commits/{worker}.json",
        f"members/{worker}.json",
        f"members/{worker}/*",
        f"workers/{worker}/*",
    ]


AGGREGATOR_WRITE_PATTERNS = [
    "run.json",
    "frag/*/mean/*",
    "frag/*/mean.json",
    "frag/*/rejected/*",
    "global/*",
    "members/aggregator.json",  # its registration, written at start
    "members/aggregator/*",  # its status
]


def role_policies(bucket: str, prefix: str, workers: Iterable[str] = ()) -> dict[str, dict]:
    """IAM policy documents per role for the run(s) under ``s3://bucket/prefix``.

    Returns ``{"reader": ..., "aggregator": ..., "worker:<name>": ...}`` with one
    worker entry per name in ``workers``. Attach each to the IAM user/role (or
    MinIO user) of that role; `bucket_policy` turns them into one bucket policy.
    """
    prefix = _clean_prefix(prefix)
    read = _read_statements(bucket, prefix)
    policies: dict[str, dict] = {
        "reader": _document(read),
        "aggregator": _document(
            [
                *read,
                {
                    "Sid": "WriteMeansAndGlobal",
                    "Effect": "Allow",
                    "Action": WRITE_ACTIONS,
                    "Resource": [_arn(bucket, prefix, p) for p in AGGREGATOR_WRITE_PATTERNS],
                },
                {
                    "Sid": "PruneGlobalCheckpoints",
                    "Effect": "Allow",
                    "Action": DELETE_ACTIONS,
                    "Resource": _arn(bucket, prefix, "global/*"),
                },
            ]
        ),
    }
    for worker in workers:
        if not worker or any(c in worker for c in "/*?"):
            raise ValueError(f"worker name {worker!r} cannot appear in a policy resource")
        policies[f"worker:{worker}"] = _document(
            [
                *read,
                {
                    "Sid": "WriteOwnKeys",
                    "Effect": "Allow",
                    "Action": WRITE_ACTIONS,
                    "Resource": [_arn(bucket, prefix, p) for p in worker_write_patterns(worker)],
                },
                {
                    "Sid": "PruneOwnCheckpoints",
                    "Effect": "Allow",
                    "Action": DELETE_ACTIONS,
                    "Resource": _arn(bucket, prefix, f"workers/{worker}/*"),
                },
            ]
        )
    return policies


def bucket_policy(
    bucket: str,
    prefix: str,
    principals: Mapping[str, str | list[str]],
) -> dict[str, Any]:
    """One bucket policy granting each principal the statements of its role.

    ``principals`` maps a role name from `role_policies` (``"reader"``,
    ``"aggregator"``, ``"worker:<name>"``) to an AWS principal ARN (or a list).
    """
    workers = [role.split(":", 1)[1] for role in principals if role.startswith("worker:")]
    roles = role_policies(bucket, prefix, workers)
    statements = []
    for role, arns in principals.items():
        if role not in roles:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(sorted(roles))}")
        tag = "".join(c for c in role.title() if c.isalnum())
        for statement in roles[role]["Statement"]:
            statements.append(
                {**statement, "Sid": f"{tag}{statement['Sid']}", "Principal": {"AWS": arns}}
            )
    return _document(statements)


def apply_bucket_policy(
    bucket: str,
    policy: dict[str, Any],
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> None:
    """Install ``policy`` (e.g. from `bucket_policy`) as the bucket's policy."""
    s3 = _client(client, endpoint_url, region)
    s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))


# -- command line ----------------------------------------------------------------------


def policy_file_name(role: str) -> str:
    """``worker:region-a`` -> ``worker-region-a.json`` (a name ``mc`` and shells take)."""
    return role.replace(":", "-") + ".json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infra.bucket",
        description="Bucket administration for diloco-flows runs (see infra/minio/README.md).",
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
    policies = verb("policies", "IAM/MinIO policy documents per role (reader, aggregator, workers)")
    policies.add_argument("--workers", default="", help="comma-separated worker names")
    policies.add_argument("--out", type=Path, help="write one <role>.json per role into this folder")
    bucket = verb("bucket-policy", "one bucket policy granting principals their roles")
    bucket.add_argument(
        "--principal", action="append", default=[], metavar="ROLE=ARN", required=True,
        help="e.g. worker:region-a=arn:aws:iam::1:role/w (repeat for each principal)",
    )
    bucket.add_argument("--apply", action="store_true", help="install it on the bucket")
    return parser


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
        workers = [w.strip() for w in args.workers.split(",") if w.strip()]
        documents = role_policies(args.bucket, args.prefix, workers)
        if args.out is None:
            print(json.dumps(documents, indent=2))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            for role, document in documents.items():
                path = args.out / policy_file_name(role)
                path.write_text(json.dumps(document, indent=2) + "\n")
                print(f"{role}: {path}", file=sys.stderr)
    else:
        principals: dict[str, list[str]] = {}
        for item in args.principal:
            role, sep, arn = item.partition("=")
            if not sep or not arn:
                raise SystemExit(f"--principal {item!r}: expected ROLE=ARN")
            principals.setdefault(role, []).append(arn)
        policy = bucket_policy(args.bucket, args.prefix, principals)
        print(json.dumps(policy, indent=2))
        if args.apply:
            apply_bucket_policy(args.bucket, policy, **where)
            print(f"bucket {args.bucket}: policy installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
