"""What an S3 policy document allows: the part of IAM's evaluation our documents use.

`infra.policies` writes the documents; this module reads them back the way AWS
does, so that the tests and ``diloco bucket setup --dry-run`` can say what each
role may do without asking a server (moto's server enforces identity policies
too, with gaps: see tests/iam_server.py). Supported, as IAM defines them:

- ``Effect`` Allow and Deny (an explicit Deny wins; nothing allowed is denied);
- ``Action`` and ``Resource`` as a string or a list, with ``*`` (any characters,
  ``/`` included) and ``?`` (one character); actions compare case-insensitively;
- ``Condition`` ``StringLike`` / ``StringEquals`` on ``s3:prefix`` (what
  ``ListBucket`` is asked for; a request without the key does not match);
- ``Principal`` (``"*"`` or ``{"AWS": arn or [arns]}``) in bucket policies: such a
  statement applies only to the ``principal`` the caller names.

Anything else (``NotAction``, ``NotResource``, other condition operators) raises
ValueError rather than being judged wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

#: Actions on the bucket itself: their resource is the bucket's ARN, and the key
#: argument of `allowed` is the prefix a listing asks for (``s3:prefix``).
BUCKET_ACTIONS = frozenset({
    "s3:listbucket", "s3:listbucketversions", "s3:listbucketmultipartuploads",
    "s3:createbucket", "s3:deletebucket", "s3:getbucketlocation",
    "s3:getlifecycleconfiguration", "s3:putlifecycleconfiguration",
    "s3:getbucketpolicy", "s3:putbucketpolicy", "s3:deletebucketpolicy",
})
_KNOWN = {"Sid", "Effect", "Action", "Resource", "Condition", "Principal"}
_OPERATORS = {"StringLike": True, "StringEquals": False}  # operator -> wildcards?


@lru_cache(maxsize=4096)
def _glob(pattern: str, ignore_case: bool) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile(f"^{body}$", re.DOTALL | (re.IGNORECASE if ignore_case else 0))


def matches(pattern: str, value: str, *, ignore_case: bool = False) -> bool:
    """IAM's wildcard match: ``*`` any characters (across ``/``), ``?`` one."""
    return _glob(pattern, ignore_case).match(value) is not None


def _listed(value: str | Iterable[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _applies_to(statement: Mapping[str, Any], principal: str | None) -> bool:
    if "Principal" not in statement:
        return True
    named = statement["Principal"]
    arns = ["*"] if named == "*" else _listed(named.get("AWS", []))
    return "*" in arns or (principal is not None and principal in arns)


def _conditions_hold(statement: Mapping[str, Any], context: Mapping[str, str]) -> bool:
    for operator, tests in statement.get("Condition", {}).items():
        if operator not in _OPERATORS:
            raise ValueError(f"condition operator {operator!r} is not supported here "
                             f"(known: {', '.join(_OPERATORS)})")
        for name, expected in tests.items():
            value = context.get(name)
            if value is None:
                return False
            if _OPERATORS[operator]:
                hit = any(matches(p, value) for p in _listed(expected))
            else:
                hit = value in _listed(expected)
            if not hit:
                return False
    return True


def _resource(action: str, bucket: str, key: str) -> tuple[str, dict[str, str]]:
    if action.lower() in BUCKET_ACTIONS:
        return f"arn:aws:s3:::{bucket}", {"s3:prefix": key}
    if not key:
        raise ValueError(f"{action} acts on an object: give its key")
    return f"arn:aws:s3:::{bucket}/{key}", {}


def allowed(policy: Mapping[str, Any], action: str, bucket: str, key: str = "", *,
            principal: str | None = None) -> bool:
    """Whether ``policy`` lets ``principal`` do ``action`` on ``key`` of ``bucket``.

    For an object action ``key`` is the object's key; for a bucket action (see
    `BUCKET_ACTIONS`) it is the ``s3:prefix`` of the request ("" for none).
    """
    resource, context = _resource(action, bucket, key)
    verdict = False
    for statement in _listed_statements(policy):
        unknown = set(statement) - _KNOWN
        if unknown:
            raise ValueError(f"statement {statement.get('Sid', '')!r}: "
                             f"{', '.join(sorted(unknown))} not supported here")
        if not _applies_to(statement, principal):
            continue
        if not any(matches(a, action, ignore_case=True) for a in _listed(statement["Action"])):
            continue
        if not any(matches(r, resource) for r in _listed(statement["Resource"])):
            continue
        if not _conditions_hold(statement, context):
            continue
        if statement["Effect"] == "Deny":
            return False
        verdict = verdict or statement["Effect"] == "Allow"
    return verdict


def _listed_statements(policy: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    statements = policy["Statement"]
    return [statements] if isinstance(statements, Mapping) else list(statements)
