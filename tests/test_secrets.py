"""Credentials stay in the environment, the way a user runs things.

A real run (`diloco run` on the S3 test server, the tiny recipe shortened) with a
marker secret in the environment: the marker is in none of the run's objects in
the bucket, the command lines of its jobs and of Prefect's server (read from
/proc while they run), the logs, the MLflow store (SQLite file and artifacts), the
Prefect database, or what the command prints. And credentials where they do not
belong are refused before anything is written, with one line naming the variables
to use: in a run URL (userinfo or a query parameter) given to any command, job
entry point, flow or ObjectStore, and in storage options bound for Prefect's
database or a command line.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest
from cli_runs import SHORT, clean_env, descendants

from cli.app import app
from storage.backends import CredentialsInURL

BIN = Path(sys.executable).parent
DILOCO = str(BIN / "diloco")
ROOT = Path(__file__).resolve().parent.parent
SECRET = f"marker-{uuid.uuid4().hex}"
KEY_ID = "AKIAMARKER" + uuid.uuid4().hex[:10].upper()

# The tiny recipe, shortened as in test_cli.py: a micro model, 24 steps.

def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def objects(s3_endpoint, bucket: str, prefix: str) -> dict[str, bytes]:
    endpoint, options = s3_endpoint
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=options.get("key"),
                          aws_secret_access_key=options.get("secret"),
                          region_name=options["client_kwargs"]["region_name"])
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=f"{prefix}/"):
        for item in page.get("Contents", []):
            out[item["Key"]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out


def refused(text: str) -> str:
    """The one error line of a refusal: names the variables to use, no secret."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, text
    assert text.rstrip().endswith(lines[0]), text
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert name in lines[0], lines[0]
    assert SECRET not in text and KEY_ID not in text, text
    return lines[0]


@pytest.fixture
def in_process(in_process, monkeypatch, s3_env):
    """conftest's command in this process, with the S3 test server's endpoint."""
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    return in_process


# -- credentials where they do not belong: refused before anything is written ---------------

MISSING = f"diloco-nowhere-{uuid.uuid4().hex[:8]}"
COMMANDS = {
    "run --run-url": ["run", "--run-url", "s3://{key}:{secret}@{missing}/runs/r1"],
    "run store": ["run", "--set", "store=s3://{key}:{secret}@{missing}/runs"],
    "run store ?secret=": ["run", "--set", "store=s3://{missing}/runs?secret={secret}"],
    "run data.dataset": ["run", "--set", "data.dataset=s3://{key}:{secret}@{missing}/data"],
    "run --continue-from": ["run", "--continue-from", "s3://{key}:{secret}@{bucket}/{prefix}"],
    "resume": ["resume", "s3://{key}:{secret}@{bucket}/{prefix}"],
    "status": ["status", "s3://{key}:{secret}@{bucket}/{prefix}"],
    "cancel": ["cancel", "s3://{key}:{secret}@{bucket}/{prefix}"],
}


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # refused before any request: one server is enough (time)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_url_with_credentials_is_refused_by_the_command(in_process, tmp_path, s3_endpoint,
                                                          s3_bucket, command):
    prefix = f"refused-{uuid.uuid4().hex[:12]}"
    args = [a.format(key=KEY_ID, secret=SECRET, missing=MISSING, bucket=s3_bucket,
                     prefix=prefix) for a in COMMANDS[command]]
    result = in_process.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = refused(result.stderr)
    assert "credentials in a URL" in line
    assert SECRET not in result.output
    assert tree(tmp_path) == [], "something was written"
    assert objects(s3_endpoint, s3_bucket, prefix) == {}


@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # refused before any request: one server is enough (time)
@pytest.mark.parametrize("entry", [
    ["-m", "workers", "--aggregate"],
    ["-m", "workers", "--worker", "region-a"],
    ["-m", "flows.aggregator"],
    ["-m", "flows.worker", "--worker", "region-a"],
], ids=["workers-aggregate", "workers-worker", "flows-aggregator", "flows-worker"])
def test_the_job_entry_points_refuse_a_url_with_credentials(s3_env, s3_endpoint, s3_bucket,
                                                            tmp_path, entry):
    prefix = f"refused-{uuid.uuid4().hex[:12]}"
    url = f"s3://{KEY_ID}:{SECRET}@{s3_bucket}/{prefix}"
    out = subprocess.run([sys.executable, entry[0], entry[1], "--run", url, *entry[2:]],
                         env=clean_env(tmp_path, DILOCO_TRACKING="off", **s3_env), cwd=ROOT,
                         text=True, capture_output=True, timeout=120)
    assert objects(s3_endpoint, s3_bucket, prefix) == {}, "something was written"
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    refused(out.stderr)
    assert SECRET not in out.stdout


def test_a_credential_on_the_command_line_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "workers", "--run", str(tmp_path / "r"),
                          "--create", "--storage-option", f"secret={SECRET}"],
                         env=clean_env(tmp_path), cwd=ROOT, text=True, capture_output=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--storage-option secret" in refused(out.stderr)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("url", [  # ids fixed: the markers are random per process
    f"s3://{KEY_ID}:{SECRET}@bucket/runs/r1",
    f"s3://{KEY_ID}:{SECRET[:8]}/{SECRET[8:]}@bucket/runs/r1",  # a secret with a '/'
    f"s3://bucket/runs/r1?token={SECRET}",
    f"s3://bucket/runs/r1?password={SECRET}",
], ids=["userinfo", "userinfo-with-slash", "token", "password"])
def test_object_store_and_jobs_refuse_a_url_with_credentials(url, monkeypatch):
    from flows.aggregator import run_aggregator_job
    from flows.worker import run_worker_job
    from storage.objectstore import ObjectStore

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # never AWS
    for call in (lambda: ObjectStore(url), lambda: run_worker_job(url, "region-a"),
                 lambda: run_aggregator_job(url)):
        with pytest.raises(CredentialsInURL) as info:
            call()
        refused(f"error: {info.value}")


def test_the_flows_refuse_credentials_in_their_parameters(tmp_path, monkeypatch):
    """Refused first thing, before a store, MLflow or a job sees them. (Prefect has
    stored the parameters of a flow run by then: `diloco run` checks before it
    calls the flow, the deployment launcher before it creates flow runs.)"""
    from flows.aggregator import aggregator
    from flows.train import train
    from flows.worker import worker

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # never AWS
    monkeypatch.setenv("DILOCO_TRACKING", "off")
    with pytest.raises(CredentialsInURL) as info:
        train.fn(config="no-such-recipe", run_url=f"s3://{KEY_ID}:{SECRET}@bucket/runs/r1")
    assert "run_url" in refused(f"error: {info.value}")
    with pytest.raises(CredentialsInURL) as info:
        train.fn(config="no-such-recipe", resume_run=f"s3://bucket/r0?secret={SECRET}")
    assert "resume_run" in refused(f"error: {info.value}")
    secret = {"endpoint_url": "http://127.0.0.1:9", "secret": SECRET}
    for call in (lambda: train.fn(config="no-such-recipe", storage_options=secret),
                 lambda: worker.fn(str(tmp_path / "r"), "region-a", storage_options=secret),
                 lambda: aggregator.fn(str(tmp_path / "r"), storage_options=secret)):
        with pytest.raises(ValueError, match="storage_options.secret") as info:
            call()
        assert "Prefect's database" in refused(f"error: {info.value}")
    assert tree(tmp_path) == []


@pytest.mark.parametrize("options, name", [
    ({"key": KEY_ID, "secret": SECRET}, "storage_options.key"),
    ({"token": SECRET}, "storage_options.token"),
    ({"password": SECRET}, "storage_options.password"),
    ({"client_kwargs": {"region_name": "eu", "aws_secret_access_key": SECRET}},
     "storage_options.client_kwargs.aws_secret_access_key"),
    ({"client_kwargs": {"aws_session_token": SECRET}},
     "storage_options.client_kwargs.aws_session_token"),
])
def test_the_deployment_launcher_refuses_credentials_in_storage_options(options, name):
    """Its flow runs' parameters land in Prefect's database: refused, one line,
    before anything is launched; the other options are passed on."""
    from flows.launchers import DeploymentLauncher, LaunchError

    with pytest.raises(LaunchError) as info:
        DeploymentLauncher(key="k", storage_options=options)
    line = refused(f"error: {info.value}")
    assert line.startswith(f"error: {name}:") and "Prefect's database" in line
    harmless = {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu"}}
    params = DeploymentLauncher(key="k", storage_options=harmless).parameters(
        "s3://bucket/runs/r1", "region-a")
    assert params["storage_options"] == harmless


# -- a real run with its credentials in the environment: the marker is nowhere ---------------


def watch_command_lines(pid: int, seen: dict[int, set[str]], done: threading.Event) -> None:
    """Every process under ``pid`` and its command line, polled from /proc."""
    while not done.is_set():
        for child, command in descendants(pid).items():
            seen.setdefault(child, set()).add(command)
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.s3_backends("moto")  # moto takes any secret, so the marker secret can be the key
def test_no_secret_from_the_environment_leaks(s3_endpoint, s3_env, s3_bucket, tmp_path):
    token = f"marker-{uuid.uuid4().hex}"
    markers = (SECRET.encode(), token.encode())
    prefix = f"secrets-{uuid.uuid4().hex[:12]}"
    (tmp_path / "tmp").mkdir()
    env = clean_env(tmp_path, **{**s3_env, "AWS_SECRET_ACCESS_KEY": SECRET,
                                 "AWS_SESSION_TOKEN": token, "TMPDIR": str(tmp_path / "tmp")})
    # one worker: a job of each kind is enough to find the marker (a job process less)
    proc = subprocess.Popen([DILOCO, "run", *SHORT, "--set", f"store=s3://{s3_bucket}/{prefix}",
                             "--set", "workers=[region-a]"],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen: dict[int, set[str]] = {}
    done = threading.Event()
    watcher = threading.Thread(target=watch_command_lines, args=(proc.pid, seen, done),
                               daemon=True)
    watcher.start()
    try:
        stdout, stderr = proc.communicate(timeout=540)
    finally:
        done.set()
        proc.kill()
    watcher.join(5)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    # what it printed, and the command lines of its jobs and of Prefect's server
    assert not any(m.decode() in stdout + stderr for m in markers)
    lines = [c for commands in seen.values() for c in commands]
    for job in ("flows.worker", "flows.aggregator", "uvicorn"):
        assert any(job in c for c in lines), (job, lines)
    assert not [c for c in lines if any(m.decode() in c for m in markers)]

    # every object of the run in the bucket (launcher.json, statuses, tracking.json,
    # the dataset, deltas, means, checkpoints)
    stored = objects(s3_endpoint, s3_bucket, prefix)
    assert any(k.endswith("members/launcher.json") for k in stored), sorted(stored)[:20]
    leaked = [k for k, body in stored.items() if any(m in body or m.decode() in k
                                                     for m in markers)]
    assert not leaked, leaked

    # every file it left here: the logs, MLflow (SQLite and artifacts), Prefect's
    # database and its temporary server's log (its home), temporary files
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = [str(p.relative_to(tmp_path)) for p in files]
    assert "mlflow.db" in names, names
    assert any(n.startswith("prefect-home/") and ".db" in n for n in names), names
    assert "prefect-home/temporary-server.log" in names, names
    assert any(n.endswith("summary.json") for n in names), names
    assert any(n.endswith("aggregator.log") for n in names), names
    leaked = [n for p, n in zip(files, names, strict=True)
              if any(m in p.read_bytes() for m in markers)]
    assert not leaked, leaked
