"""``diloco bucket setup``: a bucket ready for runs, in one idempotent command.

For ``s3://BUCKET/PREFIX`` (where the runs will live: a run config's ``store``),
in this order, saying one line per action through ``say``:

1. create the bucket if it is missing (on this account; one owned by someone else
   is an error);
2. install the lifecycle rule of the prefix (abort incomplete multipart uploads,
   optionally expire objects), keeping the bucket's other rules;
3. write one policy document per role (`infra.policies.role_policies`: viewer,
   launcher, aggregator, one per worker) into a folder;
4. with principals (``ROLE=ARN``, AWS): install them as the bucket's policy,
   keeping the statements of others. Without: print how to attach the documents,
   with ``mc`` for an S3-compatible server such as MinIO (it has no IAM API), with
   the AWS CLI for AWS.

Why a bucket policy rather than attaching the documents to IAM users or roles:
it needs only S3 rights on the bucket (no IAM rights), it is one document to
review, and it also grants principals of other AWS accounts (a region's workers
may run under another account). What it cannot do is take rights away: a
principal whose own IAM policies allow more keeps that, so give the role
principals no other S3 rights, or attach the documents to them instead.

``dry_run`` reads (is there a bucket, which rules and policy it has) but changes
nothing, writes no file, and shows what each role's document allows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from infra.bucket import (
    apply_bucket_policy,
    apply_lifecycle,
    bucket_exists,
    current_bucket_policy,
    ensure_bucket,
    lifecycle_rule,
    lifecycle_rules,
    policy_text,
)
from infra.policies import (
    access_table,
    bucket_policy,
    check_workers,
    clean_prefix,
    policy_file_name,
    role_policies,
    statement_prefix,
    write_policies,
)
from storage import layout
from storage.backends import refuse_credentials

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class SetupError(ValueError):
    """Something the user must fix; the message is one line."""


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``("bucket", "prefix")``; SetupError otherwise."""
    refuse_credentials(url, what="the bucket URL")
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise SetupError(f"{url!r} is not an s3://BUCKET[/PREFIX] URL")
    if not _BUCKET.match(parsed.netloc) or ".." in parsed.netloc:
        raise SetupError(f"bucket name {parsed.netloc!r} is not valid: 3-63 lower-case "
                         f"letters, digits, '.' and '-', starting and ending with a letter "
                         f"or digit")
    if parsed.query or parsed.fragment:
        raise SetupError(f"{url!r}: a bucket URL has no query or fragment")
    try:
        return parsed.netloc, clean_prefix(parsed.path)
    except ValueError as exc:
        raise SetupError(f"{url!r}: {exc}") from None


def check_principals(principals: Mapping[str, list[str]], workers: list[str]) -> None:
    """Every role named is one of the run's roles, every principal an ARN."""
    known = [layout.VIEWER, layout.LAUNCHER, layout.AGGREGATOR, *(f"worker:{w}" for w in workers)]
    for role, arns in principals.items():
        if role not in known:
            raise SetupError(f"--principal {role}=...: unknown role; known: {', '.join(known)} "
                             f"(a worker must be in --workers)")
        for arn in arns:
            if not arn.startswith("arn:"):
                raise SetupError(f"--principal {role}={arn}: not an ARN "
                                 f"(arn:aws:iam::ACCOUNT:role/NAME or :user/NAME)")


def _is_aws(endpoint: str | None) -> bool:
    host = urlparse(endpoint).hostname if endpoint else None
    return host is None or host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _days(n: int) -> str:
    return f"{n} day" if n == 1 else f"{n} days"


def _describe(rule: dict[str, Any]) -> str:
    text = (f"abort incomplete multipart uploads after "
            f"{_days(rule['AbortIncompleteMultipartUpload']['DaysAfterInitiation'])}")
    if "Expiration" in rule:
        text += f", expire objects after {_days(rule['Expiration']['Days'])}"
    return f"lifecycle rule {rule['ID']} on prefix {rule['Filter']['Prefix'] or '(all)'}: {text}"


def attach_commands(documents: Iterable[str], folder: Path, *, endpoint: str | None) -> list[str]:
    """How to give each role's document to its user, where boto3 cannot: ``mc`` for
    an S3-compatible server (MinIO), the AWS CLI for AWS."""
    lines = []
    if not _is_aws(endpoint):
        lines.append(f'mc alias set diloco {endpoint} "$ADMIN_USER" "$ADMIN_PASSWORD"')
        for role in documents:
            name = policy_file_name(role)[: -len(".json")]
            lines += [
                f"mc admin policy create diloco diloco-{name} {folder / policy_file_name(role)}",
                f'mc admin user add diloco {name} "$PASSWORD_OF_{name.upper().replace("-", "_")}"',
                f"mc admin policy attach diloco diloco-{name} --user {name}",
            ]
        return lines
    for role in documents:
        name = policy_file_name(role)[: -len(".json")]
        lines.append(f"aws iam put-role-policy --role-name ROLE_OF_{name.upper().replace('-', '_')} "
                     f"--policy-name diloco-{name} "
                     f"--policy-document file://{folder / policy_file_name(role)}")
    return lines


def _client(endpoint: str | None, region: str | None) -> Any:
    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise SetupError("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                         "(or AWS_PROFILE) in the environment")
    # a few quick retries: an endpoint that refuses connections is said in seconds
    return session.client("s3", endpoint_url=endpoint, region_name=region,
                          config=Config(connect_timeout=10, retries={"max_attempts": 3,
                                                                     "mode": "standard"}))


def setup(
    url: str,
    workers: Iterable[str],
    *,
    say: Callable[[str], None],
    dry_run: bool = False,
    expire_days: int | None = None,
    abort_multipart_days: int = 1,
    policies_out: Path = Path("diloco-policies"),
    principals: Mapping[str, list[str]] | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    client: Any = None,
) -> dict[str, Any]:
    """Set up the bucket of ``url`` for runs (see the module docstring); returns what
    it did (or would do). Everything the user gave is checked before the first
    request, and `SetupError` (one line) is all it raises for what the user can fix."""
    bucket, prefix = parse_url(url)
    for option, days in (("--abort-multipart-days", abort_multipart_days),
                         ("--expire-days", expire_days)):
        if days is not None and days < 1:
            raise SetupError(f"{option} must be a number of days >= 1, got {days}")
    try:
        names = check_workers(workers)
        rule = lifecycle_rule(prefix, abort_multipart_days=abort_multipart_days,
                              expire_days=expire_days)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    principals = dict(principals or {})
    check_principals(principals, names)
    documents = role_policies(bucket, prefix, names)
    try:
        if principals:  # ours alone already too large: say so before any request
            policy_text(bucket_policy(bucket, prefix, principals))
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    s3 = client if client is not None else _client(endpoint_url, region)
    endpoint = endpoint_url or s3.meta.endpoint_url
    try:
        return _setup(s3, bucket, prefix, rule, documents, principals, say=say,
                      dry_run=dry_run, folder=policies_out, endpoint=endpoint)
    except PermissionError as exc:
        raise SetupError(str(exc)) from None
    except EndpointConnectionError as exc:
        raise SetupError(f"cannot reach the S3 endpoint: {exc}") from None
    except ClientError as exc:
        error = exc.response.get("Error", {})
        raise SetupError(f"s3://{bucket}: {exc.operation_name} refused: "
                         f"{error.get('Code')}: {error.get('Message')}") from None
    except BotoCoreError as exc:
        raise SetupError(f"s3://{bucket}: {exc}") from None


def _setup(s3: Any, bucket: str, prefix: str, rule: dict[str, Any],
           documents: dict[str, dict], principals: dict[str, list[str]], *,
           say: Callable[[str], None], dry_run: bool, folder: Path,
           endpoint: str | None) -> dict[str, Any]:
    done: dict[str, Any] = {"bucket": bucket, "prefix": prefix, "lifecycle": rule}
    exists = bucket_exists(bucket, client=s3)
    if exists:
        say(f"bucket {bucket}: exists")
    elif dry_run:
        say(f"would create bucket {bucket}")
    else:
        ensure_bucket(bucket, client=s3)
        say(f"created bucket {bucket}")
    done["created"] = not exists

    current = [r for r in lifecycle_rules(bucket, client=s3) if r.get("ID") == rule["ID"]] \
        if exists else []
    if current == [rule]:
        say(f"{_describe(rule)}: already in place")
    else:
        if not dry_run:
            apply_lifecycle(bucket, prefix, client=s3, rule_id=rule["ID"],
                            abort_multipart_days=rule["AbortIncompleteMultipartUpload"][
                                "DaysAfterInitiation"],
                            expire_days=rule.get("Expiration", {}).get("Days"))
        if dry_run:
            say(f"would {'replace' if current else 'install'} {_describe(rule)}")
        else:
            say(f"{'replaced' if current else 'installed'} {_describe(rule)}")

    files = ", ".join(policy_file_name(role) for role in documents)
    if not dry_run:
        write_policies(documents, folder)
    say(f"{'would write' if dry_run else 'wrote'} {len(documents)} policy documents to "
        f"{folder}: {files}")
    done["documents"] = documents

    if principals:
        existing = current_bucket_policy(bucket, client=s3) if exists else None
        policy = bucket_policy(bucket, prefix, principals, existing=existing)
        mine = statement_prefix(bucket, prefix)
        ours = sum(1 for st in policy["Statement"] if str(st.get("Sid", "")).startswith(mine))
        kept = len(policy["Statement"]) - ours
        what = (f"the bucket policy: {ours} statements for {', '.join(principals)}"
                + (f"; {kept} statements of others kept" if kept else ""))
        try:
            policy_text(policy)  # with the statements of others, perhaps too large now
        except ValueError as exc:
            raise SetupError(str(exc)) from None
        if policy == existing:
            say(f"{what}: already in place")
        elif dry_run:
            say(f"would install {what}")
        else:
            apply_bucket_policy(bucket, policy, client=s3)
            say(f"installed {what}")
        done["bucket_policy"] = policy
    else:
        if _is_aws(endpoint):
            say("AWS: attach each document to its role's IAM role (or rerun with "
                "--principal ROLE=ARN to install them as the bucket policy):")
        else:
            say(f"{endpoint} is not AWS; if it is MinIO, give each role a user with its "
                f"document (boto3 has no MinIO admin API):")
        for line in attach_commands(documents, folder, endpoint=endpoint):
            say(f"  {line}")
    if dry_run:
        say("what each role may do under s3://" + "/".join(p for p in (bucket, prefix) if p)
            + "/<run>/ (judged from the documents):")
        for line in access_table(documents, bucket, prefix):
            say(f"  {line}")
    return done
