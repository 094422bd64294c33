"""Setting up a bucket for runs: create it, clean up after failed uploads, and
install what gives each role only the access it needs.

This is the one-off administration a user does before the first run
(``diloco bucket setup``, infra/setup.py; the local stack in `infra/minio/` uses
the documents for its per-role users); the training path never calls it and never
needs more than `ObjectStore`. It uses boto3 directly because bucket
configuration (lifecycle, policies) is outside what fsspec offers. Credentials and
the endpoint come from the usual ``AWS_*`` variables (``AWS_ENDPOINT_URL_S3`` for
MinIO). The documents themselves, one per role, come from infra/policies.py
(re-exported here: ``from infra.bucket import role_policies``).

From anywhere the package is installed::

    python -m infra.bucket create --bucket diloco
    python -m infra.bucket lifecycle --bucket diloco --prefix runs --abort-multipart-days 1
    python -m infra.bucket policies --bucket diloco --prefix runs --workers region-a,region-b \
        --out policies/   # viewer.json, launcher.json, aggregator.json, worker-region-a.json, ...
    python -m infra.bucket bucket-policy --bucket diloco --prefix runs \
        --principal aggregator=arn:aws:iam::123456789012:role/agg [--apply]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from infra.policies import (
    bucket_policy,
    clean_prefix,
    parse_principals,
    role_policies,
    write_policies,
)

__all__ = ["BUCKET_POLICY_LIMIT", "apply_bucket_policy", "apply_lifecycle", "bucket_exists",
           "bucket_policy", "current_bucket_policy", "ensure_bucket", "lifecycle_rule",
           "lifecycle_rules", "main", "policy_text", "role_policies"]

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


def current_bucket_policy(bucket: str, *, client: Any) -> dict[str, Any] | None:
    """The bucket's policy now, or None."""
    try:
        return json.loads(client.get_bucket_policy(Bucket=bucket)["Policy"])
    except ClientError as exc:
        if _error_code(exc) != "NoSuchBucketPolicy":
            raise
        return None


def policy_text(policy: dict[str, Any]) -> str:
    """``policy`` as sent (compact JSON); ValueError if it is over AWS's size limit."""
    text = json.dumps(policy, separators=(",", ":"))
    if len(text.encode()) > BUCKET_POLICY_LIMIT:
        raise ValueError(
            f"the bucket policy would be {len(text.encode())} bytes, over AWS's "
            f"{BUCKET_POLICY_LIMIT}: attach the per-role documents to IAM roles instead "
            f"(without --principal)")
    return text


def apply_bucket_policy(
    bucket: str,
    policy: dict[str, Any],
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> None:
    """Install ``policy`` (e.g. from `bucket_policy`) as the bucket's policy."""
    text = policy_text(policy)
    s3 = _client(client, endpoint_url, region)
    s3.put_bucket_policy(Bucket=bucket, Policy=text)


# -- command line ----------------------------------------------------------------------


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
