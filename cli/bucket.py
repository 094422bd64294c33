"""``diloco bucket``: a bucket ready for runs, and the least-privilege documents of
each role (infra/setup.py and infra/policies.py do the work; this module prints).

    diloco bucket setup s3://my-bucket/runs --workers region-a,region-b --dry-run
    diloco bucket setup s3://my-bucket/runs --workers region-a,region-b \\
        --principal launcher=arn:aws:iam::123456789012:role/ops ...
    diloco bucket policies s3://my-bucket/runs --workers region-a,region-b --out DIR
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli.console import console, fail

bucket_app = typer.Typer(
    name="bucket", no_args_is_help=True, rich_markup_mode=None,
    help="Set up a bucket for runs: create it, its lifecycle rule, one policy per role "
         "(viewer, launcher, aggregator, one per worker). Credentials from AWS_* variables.",
)

URL = Annotated[str, typer.Argument(
    help="s3://BUCKET/PREFIX: where the runs will live (a run config's store)")]
WORKERS = Annotated[str, typer.Option(
    "--workers", help="comma-separated worker names, as in the run config's workers")]


def _names(workers: str) -> list[str]:
    """``--workers`` as a list of valid worker names, or the one-line error."""
    from storage.layout import check_name  # noqa: PLC0415

    names = [w.strip() for w in workers.split(",")]
    if not workers.strip() or "" in names:
        raise fail(f"--workers: {workers!r} has an empty worker name; give comma-separated "
                   "names, e.g. --workers region-a,region-b")
    for name in names:
        try:
            check_name("worker", name)
        except ValueError as exc:
            raise fail(f"--workers: {exc}") from None
    return names


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


@bucket_app.command("setup")
def setup_command(
    url: URL,
    workers: WORKERS,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="say what it would do; change nothing, write no file")] = False,
    expire_days: Annotated[int | None, typer.Option(
        help="expire the prefix's objects after N days (scratch prefixes only)")] = None,
    abort_multipart_days: Annotated[int, typer.Option(
        help="abort incomplete multipart uploads after N days")] = 1,
    policies_out: Annotated[Path, typer.Option(
        help="folder for the policy documents, one <role>.json each")] = Path("diloco-policies"),
    principal: Annotated[list[str] | None, typer.Option(
        "--principal", metavar="ROLE=ARN",
        help="AWS: install a bucket policy granting ARN the role (viewer, launcher, "
             "aggregator, worker:NAME); repeatable")] = None,
    endpoint: Annotated[str | None, typer.Option(
        help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3, else AWS)")] = None,
    region: Annotated[str | None, typer.Option(help="the bucket's region (AWS)")] = None,
) -> None:
    """Create the bucket if missing, install the lifecycle rule, write the per-role
    policy documents and, with --principal, install them as the bucket policy."""
    from infra.policies import parse_principals  # noqa: PLC0415
    from infra.setup import setup  # noqa: PLC0415 - boto3, for this command only

    names = _names(workers)
    try:
        setup(url, names, say=_say, dry_run=dry_run, expire_days=expire_days,
              abort_multipart_days=abort_multipart_days, policies_out=policies_out,
              principals=parse_principals(principal or []), endpoint_url=endpoint,
              region=region)
    except ValueError as exc:  # SetupError, CredentialsInURL, a bad --principal
        raise fail(str(exc)) from None


@bucket_app.command("policies")
def policies_command(
    url: URL,
    workers: WORKERS,
    out: Annotated[Path | None, typer.Option(
        help="write one <role>.json per role into this folder (default: print them)")] = None,
) -> None:
    """The policy document of each role, and what each allows; nothing is sent."""
    from infra.policies import access_table, role_policies, write_policies  # noqa: PLC0415
    from infra.setup import parse_url  # noqa: PLC0415

    names = _names(workers)
    try:
        bucket, prefix = parse_url(url)
        documents = role_policies(bucket, prefix, names)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if out is None:
        _say(json.dumps(documents, indent=2))
    else:
        for path in write_policies(documents, out):
            _say(f"wrote {path}")
    for line in access_table(documents, bucket, prefix):
        _say(line)
