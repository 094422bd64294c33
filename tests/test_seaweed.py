"""SeaweedFS as the tests and ``diloco run --store local-s3`` use it.

The launcher (storage/seaweed.py): every port on loopback and free, a clean stop
that leaves nothing behind, no server outliving a killed parent, data kept across
restarts, one-line errors. What SeaweedFS 4.48 enforces, as the module docstring
reports it: create-only writes, static identities with scoped actions, bucket
policies, IAM users with AWS policy documents. And the local-s3 store as a user
meets it: a short `diloco run --store local-s3`, then the run read back while
`diloco store serve` serves the folder.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import botocore
import psutil
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError
from cli_runs import SHORT, alive, clean_env
from typer.testing import CliRunner

from cli.app import app
from storage.local_s3 import LocalS3, LocalS3Busy
from storage.objectstore import ObjectStore, RetryPolicy
from storage.seaweed import INSTALL_HINT, Identity, SeaweedError, SeaweedFS, new_identity

DILOCO = str(Path(sys.executable).parent / "diloco")
ROOT = Path(__file__).resolve().parent.parent
#: weed's own defaults: none of them may be bound by a server of ours
DEFAULT_PORTS = {8333, 9333, 9340, 8888, 7333, 23646, 8181, 9101, 18333, 19333, 18888, 33646}
FAST = RetryPolicy(attempts=2, base_delay=0.01)


def code(exc: ClientError) -> str:
    return exc.response["Error"]["Code"]


def denied(call, *args, **kwargs) -> str:
    """The error code of a call that must fail."""
    with pytest.raises(ClientError) as info:
        call(*args, **kwargs)
    return code(info.value)


# -- the launcher ------------------------------------------------------------------------


def test_serves_on_free_loopback_ports_and_leaves_nothing_behind(tmp_path):
    server = SeaweedFS(tmp_path / "s3", admin=new_identity("admin"))
    with server:
        assert server.started_in is not None and server.started_in < 30
        listening = {(c.laddr.ip, c.laddr.port)
                     for c in psutil.Process(server.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        assert {port for _, port in listening} <= set(server.ports.values()), listening
        assert server.ports["s3.port"] in {port for _, port in listening}
        assert not DEFAULT_PORTS & set(server.ports.values())
        store = ObjectStore(f"s3://{server.create_bucket('round-trip')}/r",
                            storage_options=server.storage_options(), retry=FAST)
        store.put("a/b", b"payload")
        assert store.get("a/b") == b"payload"
        # create-only: the server itself answers 412 to the second create
        assert store.put_if_absent("commit", b"first") is True
        assert store.put_if_absent("commit", b"second") is False
        assert store.get("commit") == b"first"
        pid, ports = server.pid, server.ports
    assert not alive(pid)
    for port in ports.values():  # every port free again (for a server: TIME_WAIT is no use)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    left = [p for p in Path("/tmp").glob("seaweedfs-*-grpc-*.sock")
            if int(p.stem.rsplit("-", 1)[1]) in ports.values()]
    assert left == []


def test_multipart_uploads_work(tmp_path):
    with SeaweedFS(tmp_path / "s3", admin=new_identity("admin")) as server:
        client = server.client()
        server.create_bucket("multi")
        body = os.urandom(11 * 2**20)
        client.upload_fileobj(io.BytesIO(body), "multi", "big",
                              Config=TransferConfig(multipart_threshold=5 * 2**20,
                                                    multipart_chunksize=5 * 2**20))
        head = client.head_object(Bucket="multi", Key="big")
        assert head["ContentLength"] == len(body) and head["ETag"].endswith('-3"')
        assert client.get_object(Bucket="multi", Key="big")["Body"].read() == body


def test_data_is_kept_across_restarts_on_other_ports(tmp_path):
    admin = new_identity("admin")
    with SeaweedFS(tmp_path / "s3", admin=admin) as first:
        first.create_bucket("kept")
        first.client().put_object(Bucket="kept", Key="k", Body=b"still here")
        old = first.ports
    with SeaweedFS(tmp_path / "s3", admin=admin) as second:
        # every port given anew, none of the first start's flags kept (weed mini keeps
        # them); a port may come back by chance under another flag, not as the same one
        assert [flag for flag, port in second.ports.items() if old[flag] == port] == []
        assert second.client().get_object(Bucket="kept", Key="k")["Body"].read() == b"still here"


def test_a_server_never_outlives_a_killed_parent(tmp_path):
    """The parent is SIGKILLed (no cleanup of ours runs): the kernel's parent-death
    signal stops weed all the same."""
    script = ("import sys, time\n"
              "from storage.seaweed import SeaweedFS, new_identity\n"
              f"s = SeaweedFS({str(tmp_path / 's3')!r}, admin=new_identity('admin'))\n"
              "s.start()\n"
              "print(s.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    leftovers: list[Path] = []
    try:
        weed = int(parent.stdout.readline())
        assert alive(weed)
        for arg in psutil.Process(weed).cmdline():  # what stop() would have removed
            flag, _, value = arg.lstrip("-").partition("=")
            if flag == "s3.localSocket":
                leftovers.append(Path(value).parent)
            elif flag.endswith(".grpc"):
                leftovers.append(Path(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{value}.sock"))
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 40
        while alive(weed) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(weed), "weed outlived its parent"
    finally:
        parent.kill()
        parent.stdout.close()
        for path in leftovers:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def test_missing_weed_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SeaweedError) as info:
        SeaweedFS(tmp_path / "s3", admin=new_identity("admin")).start()
    assert "\n" not in str(info.value) and INSTALL_HINT in str(info.value)
    assert not (tmp_path / "s3").exists()


def test_a_server_that_cannot_start_says_why(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = SeaweedFS(tmp_path / "s3", admin=new_identity("admin"), s3_port=port)
        with pytest.raises(SeaweedError) as info:
            server.start()
    message = str(info.value)
    assert message.startswith("SeaweedFS exited with status"), message
    assert str(tmp_path / "s3" / "weed.log") in message
    assert f"port {port}" in message and "not available" in message  # the log's tail
    assert not server.running()


def test_the_admin_credential_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(SeaweedError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        SeaweedFS(tmp_path / "s3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    server = SeaweedFS(tmp_path / "s3")
    assert (server.admin.access_key, server.admin.secret_key) == ("from-env", "env-secret")


# -- what SeaweedFS enforces ----------------------------------------------------------------

WORKER = new_identity("worker-w1", ["Read:diloco", "List:diloco", "Write:diloco/runs/r1/w1/*"])
VIEWER = new_identity("viewer", ["Read:diloco", "List:diloco"])
EXACT = new_identity("exact", ["Write:diloco/runs/r1/k.json"])


@pytest.fixture(scope="module")
def policed(tmp_path_factory):
    """One server with per-role identities and a writable IAM API."""
    server = SeaweedFS(tmp_path_factory.mktemp("policed"), admin=new_identity("admin"),
                       identities=[WORKER, VIEWER, EXACT], iam_writable=True)
    with server:
        server.create_bucket("diloco")
        server.create_bucket("other")
        server.client().put_object(Bucket="diloco", Key="runs/r1/run.json", Body=b"{}")
        yield server


def test_identities_have_their_scoped_actions(policed):
    worker, viewer = policed.client(WORKER), policed.client(VIEWER)
    worker.put_object(Bucket="diloco", Key="runs/r1/w1/delta", Body=b"1")
    worker.put_object(Bucket="diloco", Key="runs/r1/w1/deeper/ckpt", Body=b"1")
    assert worker.get_object(Bucket="diloco", Key="runs/r1/run.json")["Body"].read() == b"{}"
    assert worker.list_objects_v2(Bucket="diloco", Prefix="runs/r1/")["KeyCount"] >= 3
    assert denied(worker.put_object, Bucket="diloco", Key="runs/r1/w2/delta", Body=b"1") \
        == "AccessDenied"
    assert denied(worker.delete_object, Bucket="diloco", Key="runs/r1/run.json") \
        == "AccessDenied"
    assert denied(worker.get_object, Bucket="other", Key="x") == "AccessDenied"
    assert denied(worker.create_bucket, Bucket="made-by-worker") == "AccessDenied"
    # create-only holds for a scoped identity too
    worker.put_object(Bucket="diloco", Key="runs/r1/w1/commit", Body=b"a", IfNoneMatch="*")
    assert denied(worker.put_object, Bucket="diloco", Key="runs/r1/w1/commit", Body=b"b",
                  IfNoneMatch="*") == "PreconditionFailed"
    assert viewer.get_object(Bucket="diloco", Key="runs/r1/w1/commit")["Body"].read() == b"a"
    assert denied(viewer.put_object, Bucket="diloco", Key="runs/r1/v", Body=b"1") \
        == "AccessDenied"
    # a scope without a trailing * matches no key, not even the one it names
    assert denied(policed.client(EXACT).put_object, Bucket="diloco", Key="runs/r1/k.json",
                  Body=b"1") == "AccessDenied"
    stranger = Identity("stranger", "AKIASTRANGER", "no-secret")
    assert denied(policed.client(stranger).list_objects_v2, Bucket="diloco") \
        == "InvalidAccessKeyId"
    anonymous = boto3.client("s3", endpoint_url=policed.endpoint, region_name="us-east-1",
                             config=Config(signature_version=botocore.UNSIGNED))
    assert denied(anonymous.get_object, Bucket="diloco", Key="runs/r1/run.json") \
        == "AccessDenied"


def test_iam_users_get_aws_policy_documents(policed):
    """The policy documents a cloud bucket would get, enforced: a wildcard inside the
    key, and ListBucket limited to the run's prefix by an s3:prefix condition."""
    iam = policed.client(service="iam")
    name = f"worker-{uuid.uuid4().hex[:6]}"
    iam.create_user(UserName=name)
    key = iam.create_access_key(UserName=name)["AccessKey"]
    run = "arn:aws:s3:::diloco/runs/r1"
    document = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::diloco",
         "Condition": {"StringLike": {"s3:prefix": ["runs/r1", "runs/r1/*"]}}},
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"{run}/*"},
        {"Effect": "Allow", "Action": "s3:PutObject",
         "Resource": [f"{run}/frag/*/delta/w1/*", f"{run}/members/w1.json"]}]}
    iam.put_user_policy(UserName=name, PolicyName="diloco", PolicyDocument=json.dumps(document))
    user = policed.client(Identity(name, key["AccessKeyId"], key["SecretAccessKey"], ()))
    user.put_object(Bucket="diloco", Key="runs/r1/frag/0/delta/w1/c0", Body=b"1")
    user.put_object(Bucket="diloco", Key="runs/r1/members/w1.json", Body=b"1")
    assert denied(user.put_object, Bucket="diloco", Key="runs/r1/frag/0/delta/w2/c0",
                  Body=b"1") == "AccessDenied"
    assert denied(user.put_object, Bucket="diloco", Key="runs/r1/frag/0/mean/c0",
                  Body=b"1") == "AccessDenied"
    assert user.get_object(Bucket="diloco", Key="runs/r1/run.json")["Body"].read() == b"{}"
    user.list_objects_v2(Bucket="diloco", Prefix="runs/r1/")
    assert denied(user.list_objects_v2, Bucket="diloco", Prefix="runs/") == "AccessDenied"
    # an action SeaweedFS does not know is refused, by name
    unknown = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:ListMultipartUploadParts", "Resource": f"{run}/*"}]}
    with pytest.raises(ClientError, match="ListMultipartUploadParts") as info:
        iam.put_user_policy(UserName=name, PolicyName="more", PolicyDocument=json.dumps(unknown))
    assert code(info.value) == "MalformedPolicyDocument"


def test_bucket_policies_are_enforced(policed):
    admin, viewer = policed.client(), policed.client(VIEWER)
    policed.create_bucket("policed")
    deny = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
         "Resource": "arn:aws:s3:::policed/frozen/*"},
        {"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::000000000000:user/viewer"},
         "Action": "s3:PutObject", "Resource": "arn:aws:s3:::policed/drop/*"}]}
    admin.put_bucket_policy(Bucket="policed", Policy=json.dumps(deny))
    assert denied(admin.put_object, Bucket="policed", Key="frozen/k", Body=b"1") \
        == "AccessDenied"
    admin.put_object(Bucket="policed", Key="open/k", Body=b"1")
    viewer.put_object(Bucket="policed", Key="drop/k", Body=b"1")  # beyond its own actions


# -- the local-s3 store ----------------------------------------------------------------------


def test_one_server_per_folder(tmp_path):
    """A `serve` is shared; a run's server is not (it ends with that run); a second
    `serve` is refused."""
    with LocalS3(tmp_path / "store", purpose="serve") as served:
        assert served.server is not None
        with LocalS3(tmp_path / "store") as user:
            assert user.server is None and user.endpoint == served.endpoint
            assert user.env() == served.env()
        with pytest.raises(LocalS3Busy, match="already served at"):
            LocalS3(tmp_path / "store", purpose="serve").open()
        assert served.server.running()
        assert (tmp_path / "store" / "env").stat().st_mode & 0o077 == 0
        assert (tmp_path / "store" / "credentials.json").stat().st_mode & 0o077 == 0
    assert not (tmp_path / "store" / "env").exists()
    with LocalS3(tmp_path / "store") as run, pytest.raises(LocalS3Busy) as info:
        LocalS3(tmp_path / "store").open()
    assert "diloco store serve" in str(info.value) and "\n" not in str(info.value)
    assert run.server is None  # closed


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The command in this process, as a user in an empty folder."""
    for key in list(os.environ):
        if key.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return CliRunner()


@pytest.mark.parametrize("args, says", [
    (["--backend", "deployments"], "--backend local"),
    (["--set", "store=local-s3", "--backend", "deployments"], "--backend local"),
    (["--run-url", "s3://elsewhere/runs/r1"], "not in the local-s3 store"),
    (["--run-url", "s3://AKIAX:verysecret@diloco/runs/r1"], "credentials in a URL"),
    (["--set", "train.steps=-3"], "train.steps"),
])
def test_local_s3_refuses_what_cannot_work_before_serving(user, tmp_path, args, says):
    chosen = [] if "store=local-s3" in args else ["--store", "local-s3"]
    result = user.invoke(app, ["run", *chosen, *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "verysecret" not in result.output, lines
    assert not (tmp_path / "runs").exists(), "something was served or written"


@pytest.mark.slow
def test_a_run_on_local_s3_then_read_back_while_served(tmp_path, monkeypatch):
    """As a user does it: `diloco run --store local-s3`, then `diloco store serve` in
    one shell and `source runs/.seaweedfs/env; diloco status RUN` in another (the
    status in this process: it only reads the store)."""
    env = clean_env(tmp_path, shared_prefect=True, DILOCO_TRACKING="off")
    # one worker: what is checked is the store, not the run's size (a job less)
    done = subprocess.run([DILOCO, "run", "--store", "local-s3", *SHORT, "--set",
                           "workers=[region-a]"], cwd=tmp_path, env=env,
                          text=True, capture_output=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "local-s3: SeaweedFS serves runs/.seaweedfs at http://127.0.0.1:" in done.stdout
    url = next(w for w in done.stdout.split() if w.startswith("s3://diloco/runs/tiny-"))
    folder = tmp_path / "runs" / ".seaweedfs"
    assert sorted(p.name for p in folder.iterdir()) == ["credentials.json", "data", "lock",
                                                        "weed.log"]
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(folder) in " ".join(p.info["cmdline"] or [])], "weed still runs"

    serve = subprocess.Popen([DILOCO, "store", "serve"], cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "env").exists():
            assert serve.poll() is None and time.monotonic() < deadline, serve.stdout.read()
            time.sleep(0.2)
        exported = dict(line.removeprefix("export ").split("=", 1)
                        for line in (folder / "env").read_text().splitlines()
                        if line.startswith("export "))
        assert exported["AWS_ENDPOINT_URL_S3"].startswith("http://127.0.0.1:")
        for key in list(os.environ):  # the other shell: the user's, and the env sourced
            if key.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_")):
                monkeypatch.delenv(key)
        for key, value in {**env, **exported}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(tmp_path)
        status = CliRunner().invoke(app, ["status", url, "--json"])
        assert status.exit_code == 0, status.output
        snap = json.loads(status.stdout)
        assert snap["run_url"] == url
        assert {w["state"] for w in snap["workers"].values()} == {"finished"}
        assert snap["aggregator"]["state"] == "finished"
        # the run is in the object store: its manifest, commits and canonical state;
        # the workers' checkpoints went with the gc that ends a finished run
        store = ObjectStore(url, storage_options={
            "endpoint_url": exported["AWS_ENDPOINT_URL_S3"],
            "key": exported["AWS_ACCESS_KEY_ID"], "secret": exported["AWS_SECRET_ACCESS_KEY"]})
        keys = store.list()
        assert "run.json" in keys
        assert any(k.startswith("frag/") for k in keys)
        assert any(k.startswith("global/frag/") for k in keys)
        assert not any("/ckpt/" in k for k in keys)
    finally:
        serve.send_signal(signal.SIGINT)
        # a hang guard: SeaweedFS gets 30 s for a clean stop, then SIGKILL (10 s); under a
        # whole suite's load the stop outlasted a 60 s guard once
        out, _ = serve.communicate(timeout=120)
    assert serve.returncode == 0, out
    assert url in out and "source runs/.seaweedfs/env" in out
    assert not (folder / "env").exists() and not (folder / "server.json").exists()
    assert exported["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr + out
