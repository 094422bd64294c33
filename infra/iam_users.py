"""One IAM user per role on an S3 service with an IAM API (SeaweedFS, AWS), each with
its role's policy document only, and its keys written to a credentials file of its
own: what ``infra/minio/setup.sh`` does with ``mc`` on MinIO, for a service whose
IAM API makes the keys (CreateAccessKey) instead of taking a chosen password.

    python -m infra.iam_users --endpoint http://127.0.0.1:8333 --policies /policies \\
        --workers region-a,region-b --bucket diloco --mlflow-bucket mlflow --out /credentials

Run with an administrator's ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``. It
creates the buckets, then for each user (viewer, launcher, aggregator, a worker per
region, mlflow) the user and its policy (created or replaced), and, when
``OUT/<user>/env`` does not hold that user's key yet, a fresh access key written
there (mode 0644 in a directory only that user's service mounts): ``AWS_*`` lines
a shell sources (``set -a; . env``), the endpoint included. Safe to run again: a key
already written is kept. No key is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

#: The region every client is told (SeaweedFS ignores it; botocore wants one).
REGION = "us-east-1"


def mlflow_policy(bucket: str) -> dict[str, Any]:
    """The tracking server's document: its artifacts bucket, nothing else."""
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
         "Resource": [f"arn:aws:s3:::{bucket}"]},
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
         "Resource": [f"arn:aws:s3:::{bucket}/*"]}]}


def users(policies: Path, workers: list[str], mlflow_bucket: str) -> dict[str, dict[str, Any]]:
    """Every user's policy document, by user name (the role's, a worker's for a region):
    the files of ``python -m infra.bucket policies --out POLICIES``, and mlflow's."""
    files = {role: policies / f"{role}.json" for role in ("viewer", "launcher", "aggregator")}
    files |= {w: policies / f"worker-{w}.json" for w in workers}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise SystemExit(f"iam_users: no policy document {missing[0]} (python -m infra.bucket "
                         f"policies writes one per role and per worker)")
    out = {name: json.loads(f.read_text()) for name, f in files.items()}
    out["mlflow"] = mlflow_policy(mlflow_bucket)
    return out


def credentials_file(key_id: str, secret: str, endpoint: str) -> str:
    """The ``env`` file of a user: what its service sources before it starts."""
    return "".join(f"{k}='{v}'\n" for k, v in (
        ("AWS_ACCESS_KEY_ID", key_id), ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_ENDPOINT_URL_S3", endpoint), ("MLFLOW_S3_ENDPOINT_URL", endpoint),
        ("AWS_DEFAULT_REGION", REGION)))


def written_key(path: Path) -> str | None:
    """The access key id in an ``env`` file written earlier, if any."""
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("AWS_ACCESS_KEY_ID="):
            return line.split("=", 1)[1].strip("'")
    return None


def main(argv: list[str] | None = None) -> int:
    import boto3  # noqa: PLC0415 - only this command needs it
    from botocore.exceptions import ClientError  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m infra.iam_users", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True, help="the S3 (and IAM) endpoint URL")
    p.add_argument("--policies", required=True, type=Path, help="the policy documents' folder")
    p.add_argument("--workers", required=True, help="the regions' workers, comma-separated")
    p.add_argument("--bucket", required=True, help="the runs' bucket")
    p.add_argument("--mlflow-bucket", required=True, help="MLflow's artifacts bucket")
    p.add_argument("--out", required=True, type=Path, help="OUT/<user>/env per user")
    args = p.parse_args(argv)
    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        raise SystemExit("iam_users: set the administrator's AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY")
    documents = users(args.policies, args.workers.split(","), args.mlflow_bucket)
    s3 = boto3.client("s3", endpoint_url=args.endpoint, region_name=REGION)
    iam = boto3.client("iam", endpoint_url=args.endpoint, region_name=REGION)
    for bucket in (args.bucket, args.mlflow_bucket):
        try:
            s3.create_bucket(Bucket=bucket)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou",
                                                     "BucketAlreadyExists"):
                raise
    print(f"buckets: {args.bucket}, {args.mlflow_bucket}")
    for name, document in documents.items():
        try:
            iam.create_user(UserName=name)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "EntityAlreadyExists":
                raise
        iam.put_user_policy(UserName=name, PolicyName=f"diloco-{name}",
                            PolicyDocument=json.dumps(document))
        env = args.out / name / "env"
        keys = {k["AccessKeyId"] for k in iam.list_access_keys(UserName=name)["AccessKeyMetadata"]}
        if written_key(env) not in keys:
            key = iam.create_access_key(UserName=name)["AccessKey"]
            env.parent.mkdir(parents=True, exist_ok=True)
            env.write_text(credentials_file(key["AccessKeyId"], key["SecretAccessKey"],
                                            args.endpoint))
            env.chmod(0o644)
        print(f"user {name}: policy diloco-{name}, keys in {env}")
    print(f"ready: s3://{args.bucket}, one user per role")
    return 0


if __name__ == "__main__":
    sys.exit(main())
