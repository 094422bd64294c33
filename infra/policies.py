"""The policy documents of each role, derived from the key layout.

The roles and the keys each writes are declared once, in `storage.layout.KEYS`;
`role_policies` derives every document from that table, so a key added there is
granted to its owner and to no one else:

- ``worker:<name>``: reads everything, writes only its own keys (deltas and their
  commits, its registration and status, its checkpoints, which it prunes). A
  compromised or buggy worker cannot overwrite another's delta, the mean, or the
  canonical model.
- ``aggregator``: reads everything, writes the means, their commits, the rejection
  notes, the canonical state (which it prunes), its registration and status.
- ``launcher``: the operator (the train job, ``diloco run``/``resume``/``cancel``/``gc``,
  ``python -m workers --create``): creates the run (manifest, initial parameters,
  prepared data), writes tracking.json, the launcher record, the train job's status
  and cancel requests (and deletes a request on resume). It also deletes what
  ``diloco gc`` collects (checkpoints and payloads: the ``collected`` keys), and
  nothing else: no commit record, status or manifest.
- ``viewer``: read-only (dashboards, ``diloco status``, evaluation, comparisons).

A document covers every run under ``s3://bucket/prefix``: the runs one level below
the prefix (``prefix/<run>/...``), which is how ``store: s3://bucket/prefix``
places them. The documents name each worker's keys explicitly rather than using
``${aws:username}``, so they work for IAM roles, MinIO users and any worker naming.
IAM's ``*`` also matches ``/``, so a grant reaches keys deeper than the layout's
(``.../members/x/members/region-a.json``): places no party reads, never another
role's keys (tests/test_roles.py checks that against every key of a real run).

Nothing here sends a request: infra/bucket.py installs what this module writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infra.iam import allowed
from storage import layout

POLICY_VERSION = "2012-10-17"

READ_ACTIONS = ["s3:GetObject"]
LIST_ACTIONS = ["s3:ListBucket"]
#: A multipart upload is PutObject for S3's authorization (create, parts, complete);
#: AbortMultipartUpload lets a retried upload clean up. Nothing here lists the parts
#: of an upload (s3fs never resumes one), so ListMultipartUploadParts is not granted,
#: which also keeps the documents acceptable to SeaweedFS's IAM (it refuses that action).
WRITE_ACTIONS = ["s3:PutObject", "s3:AbortMultipartUpload"]
DELETE_ACTIONS = ["s3:DeleteObject"]

#: AWS's limit on a bucket policy's size, in bytes.
def clean_prefix(prefix: str) -> str:
    """``/runs/`` -> ``runs``; a prefix with an empty, '.' or '..' segment is refused."""
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    return prefix



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
        if owner == layout.LAUNCHER:
            statements.append({
                "Sid": "CollectGarbage", "Effect": "Allow", "Action": DELETE_ACTIONS,
                "Resource": [_arn(bucket, runs, p.resource()) for p in layout.KEYS
                             if p.collected],
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


def parse_principals(items: Iterable[str]) -> dict[str, list[str]]:
    """``["worker:a=arn:...", ...]`` -> ``{"worker:a": ["arn:...", ...]}``."""
    principals: dict[str, list[str]] = {}
    for item in items:
        role, sep, arn = item.partition("=")
        if not sep or not role or not arn:
            raise ValueError(f"--principal {item!r}: expected ROLE=ARN")
        principals.setdefault(role.strip(), []).append(arn.strip())
    return principals
