"""SeaweedFS on loopback: a real S3 server started and stopped by a test or a command.

Why: moto is a mock and MinIO cannot be installed everywhere. SeaweedFS (``pip
install 'diloco-flows[local]'`` installs its ``weed`` program) is a real object
store with an S3 gateway that runs as one process, ``weed mini``. It serves the S3
tests and ``diloco run --store local-s3``: test on a local object store before
paying for the cloud.

`SeaweedFS` gives every port ``weed mini`` opens (master, volume, filer, S3,
admin, and their gRPC ports) a free port of ``host``, and turns off WebDAV, the
Iceberg and Lance catalogs and the admin UI, so that two servers (two test
sessions; a test beside a ``diloco run --store local-s3``) never meet. The server
is ready when it answers a signed ListBuckets (how long that takes, and a stop:
docs/local-s3.md, Figures).
It runs in a session of its own, so a Ctrl-C in the terminal reaches the jobs
(which then checkpoint into this store) and not the store under them; and it
asks the kernel for a parent-death signal (``PR_SET_PDEATHSIG``, as
storage/tied.py arranges), so it never outlives a killed test or
command. `stop` sends SIGTERM to its process group and waits for a clean exit.

What SeaweedFS does, and this module relies on (tests/test_seaweed.py checks each
point; docs/local-s3.md names the version they were found with):

- ``PutObject`` with ``If-None-Match: *`` on an existing key answers 412
  PreconditionFailed, also for a scoped identity: create-only commits work as on
  AWS and MinIO. Multipart uploads work.
- Credentials: without ``-s3.config``, ``weed mini`` takes one admin identity
  from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its environment.
  Unknown keys get 403 InvalidAccessKeyId, anonymous requests 403 AccessDenied.
- Static identities (``-s3.config``, see `Identity`): each has an action list,
  ``Admin``, ``Read``, ``Write``, ``List``, ``Tagging``, global or scoped to a
  bucket (``Write:diloco``) or to a key prefix (``Write:diloco/runs/r1/members/*``).
  Only a trailing ``*`` is a wildcard, and a scope without one matches nothing
  (``Write:diloco/a/k.json`` does not allow writing ``a/k.json``; ``...k.json*``
  does, and ``k.jsonx`` too). Without ``Admin`` an identity cannot create buckets.
- Bucket policies (``PutBucketPolicy``) are stored and enforced: a Deny
  statement stops even the admin; an Allow for ``Principal: *`` opens reads to
  anonymous clients; an Allow naming ``arn:aws:iam::000000000000:user/<name>``
  grants that identity more than its action list.
- IAM: the IAM API answers on the S3 port. It is read-only unless
  ``iam_writable=True`` (``-s3.iam.readOnly=false``); then CreateUser,
  CreateAccessKey and PutUserPolicy take AWS policy documents and enforce them,
  mid-key wildcards (``frag/*/delta/w1/*``) and ``s3:prefix`` conditions on
  ListBucket included; users persist in the data directory. PutUserPolicy refuses
  actions it does not know: ``s3:ListMultipartUploadParts``,
  ``s3:ListBucketMultipartUploads``, ``s3:PutLifecycleConfiguration``,
  ``s3:CreateBucket`` (``s3:GetObject``, ``s3:PutObject``, ``s3:DeleteObject``,
  ``s3:ListBucket``, ``s3:AbortMultipartUpload``, ``s3:GetBucketLocation``,
  ``s3:PutBucketPolicy``, ``s3:*`` and ``s3:Get*`` pass).
- ``weed mini`` writes the unix sockets of its gRPC ports to
  ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` whatever ``TMPDIR`` says, and
  leaves some behind; `stop` removes those of its ports. It keeps the flags of
  its last start in ``<data>/mini.options`` and reads them back at the next start
  for every flag not given; `start` deletes that file, since its flags name the
  old ports and temp files.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from storage.tied import tied

#: Where ``weed`` comes from (the optional dependency that provides it).
INSTALL_HINT = "pip install 'diloco-flows[local]'"
#: The region every client is told (SeaweedFS ignores it; botocore wants one).
REGION = "us-east-1"
#: Every action of SeaweedFS's static identities: an admin's list.
ADMIN_ACTIONS = ("Admin", "Read", "Write", "List", "Tagging")

#: The ports ``weed mini`` opens, each given a free port of its own.
PORT_FLAGS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
    "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc",
)
#: Where weed puts the unix sockets of its gRPC ports (fixed in weed/command/mini.go).
_GRPC_SOCKET = "/tmp/seaweedfs-{service}-grpc-{port}.sock"


class SeaweedError(RuntimeError):
    """SeaweedFS is not installed or did not start; one line (plus the tail of its
    log when it ran)."""


def weed_binary() -> str:
    """The ``weed`` program: beside this Python (a virtualenv's bin/, where pip put
    it) first, then on PATH; `SeaweedError` naming the install command if neither
    has it."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError(f"SeaweedFS is not installed (no 'weed' beside {sys.executable} "
                       f"or on PATH); install it with: {INSTALL_HINT}")


@dataclass(frozen=True)
class Identity:
    """One S3 identity of SeaweedFS: its keys and what it may do.

    ``actions`` are SeaweedFS's (see the module docstring): ``Admin``, ``Read``,
    ``Write``, ``List``, ``Tagging``, global or scoped to a bucket
    (``Write:diloco``) or a key prefix (``Write:diloco/runs/r1/members/*``).
    """

    name: str
    access_key: str
    secret_key: str = field(repr=False)
    actions: tuple[str, ...] = ADMIN_ACTIONS

    def config(self) -> dict[str, Any]:
        """This identity as an entry of SeaweedFS's ``-s3.config`` JSON."""
        return {"name": self.name,
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": list(self.actions)}

    def env(self) -> dict[str, str]:
        """``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` of this identity."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


def new_identity(name: str, actions: Sequence[str] = ADMIN_ACTIONS) -> Identity:
    """An identity with fresh random keys (a local server needs nothing remembered)."""
    tag = "".join(c if c.isalnum() else "-" for c in name)[:16]
    return Identity(name, f"{tag}-{secrets.token_hex(6)}", secrets.token_urlsafe(24),
                    tuple(actions))


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (held open together, so they
    differ). Another process may take one before the server binds it; `SeaweedFS`
    then tries again."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    private: str  # a short temp directory: the filer's and S3's unix sockets, -s3.config
    log: Any = field(repr=False)


class SeaweedFS:
    """``weed mini`` on ``host`` with its data in ``data_dir``, as a context manager.

    ``admin``: the identity that `env`, `storage_options` and `client` use by
    default; without one, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` of this
    process. ``identities``: more identities (per-role credentials); with them the
    server runs with an ``-s3.config`` listing the admin and them, kept in a private
    temp directory while it runs. ``iam_writable``: let the IAM API create users
    and attach AWS policy documents. ``s3_port``: the S3 port (default: a free
    one). ``log_path``: where weed's output is appended (default
    ``data_dir/weed.log``).

    Example::

        with SeaweedFS(tmp / "s3", admin=new_identity("admin")) as s3:
            s3.create_bucket("diloco")
            job_env = {**os.environ, **s3.env()}   # endpoint and keys for a job
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        s3_port: int | None = None,
        admin: Identity | None = None,
        identities: Iterable[Identity] = (),
        iam_writable: bool = False,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.s3_port = s3_port
        self.admin = admin or _admin_from_environment()
        self.identities = tuple(identities)
        names = [i.name for i in (self.admin, *self.identities)]
        if len(set(names)) != len(names):
            raise ValueError(f"identity names must differ, got {names}")
        self.iam_writable = iam_writable
        self.log_path = Path(log_path).resolve() if log_path else self.data_dir / "weed.log"
        self.startup_timeout = startup_timeout
        #: seconds from the first launch to the first served request, once started
        self.started_in: float | None = None
        self._running: _Running | None = None

    # -- what clients need --------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://host:port`` of the S3 API (while running)."""
        if self._running is None:
            raise SeaweedError("SeaweedFS is not running")
        return f"http://{self.host}:{self._running.ports['s3.port']}"

    @property
    def ports(self) -> dict[str, int]:
        """The port of each of weed's flags (``s3.port``, ``master.port``, ...)."""
        if self._running is None:
            raise SeaweedError("SeaweedFS is not running")
        return dict(self._running.ports)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._running.proc.pid if self._running else None

    def env(self, identity: Identity | None = None) -> dict[str, str]:
        """The environment that points botocore, s3fs, and so every job, at this
        server as ``identity`` (default: the admin): ``AWS_ENDPOINT_URL_S3``, the keys,
        the region."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": REGION,
                **(identity or self.admin).env()}

    def storage_options(self, identity: Identity | None = None) -> dict[str, Any]:
        """fsspec/s3fs options for this server as ``identity`` (default: the admin)."""
        who = identity or self.admin
        return {"endpoint_url": self.endpoint, "key": who.access_key, "secret": who.secret_key,
                "client_kwargs": {"region_name": REGION}}

    def client(self, identity: Identity | None = None, service: str = "s3",
               **timeouts: float) -> Any:
        """A boto3 client (``s3``, or ``iam`` for the IAM API) of this server as
        ``identity`` (default: the admin), making one attempt per call;
        ``timeouts``: botocore's ``connect_timeout`` and ``read_timeout``."""
        import boto3  # noqa: PLC0415 - for those who ask
        from botocore.config import Config  # noqa: PLC0415

        who = identity or self.admin
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=who.access_key,
                            aws_secret_access_key=who.secret_key,
                            config=Config(retries={"total_max_attempts": 1}, **timeouts))

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` unless it exists; its name."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                 client.exceptions.BucketAlreadyExists):
            client.create_bucket(Bucket=name)
        return name

    # -- life -----------------------------------------------------------------------

    def start(self) -> str:
        """Start the server; its S3 endpoint once it serves a signed request.

        `SeaweedError` if it exits or does not serve within ``startup_timeout``
        (with the tail of its log). A free port taken by another process between
        its choice and weed's check (weed then exits saying it "is not available")
        is met with new ports, up to 3 launches.
        """
        if self._running is not None:
            return self.endpoint
        binary = weed_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        for attempt in range(3):
            self._running = self._launch(binary)
            try:
                self._wait_until_serving()
                break
            except SeaweedError:
                tail = self._log_tail(40).lower()
                self.stop()
                raced = "is not available" in tail or "address already in use" in tail
                if attempt == 2 or not raced or self.s3_port:
                    raise
        self.started_in = time.monotonic() - began
        return self.endpoint

    def _launch(self, binary: str) -> _Running:
        ports = dict(zip(PORT_FLAGS, free_ports(self.host, len(PORT_FLAGS)), strict=True))
        if self.s3_port:
            ports["s3.port"] = self.s3_port
        # Unix socket paths are limited to 107 bytes: a short private directory.
        private = tempfile.mkdtemp(prefix="weed-")
        # The previous start's flags, read back for every flag not given: stale ports
        # and temp files (see the module docstring).
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / "mini.options").unlink()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        args = [
            binary, "-logtostderr", "mini",
            f"-dir={self.data_dir}", f"-ip={self.host}", f"-ip.bind={self.host}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
            "-admin.ui=false", "-master.telemetry=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={private}/filer.sock", f"-s3.localSocket={private}/s3.sock",
        ]
        if self.iam_writable:
            args.append("-s3.iam.readOnly=false")
        if self.identities:
            config = Path(private) / "s3.json"
            config.touch(mode=0o600)
            config.write_text(json.dumps({"identities": [
                i.config() for i in (self.admin, *self.identities)]}))
            args.append(f"-s3.config={config}")
        else:
            env.update(self.admin.env())
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
        log.write(f"\n--- weed mini on {self.host}: {ports}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            tied(args),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=self.data_dir, env=env, start_new_session=True,
        )
        return _Running(proc, ports, private, log)

    def _wait_until_serving(self) -> None:
        """Until a signed ListBuckets succeeds: the S3 gateway, the filer behind it
        and the admin's credentials all work."""
        assert self._running is not None
        # short timeouts: a port that accepts but never answers must not hide an exit
        client = self.client(connect_timeout=2, read_timeout=5)
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while True:
            code = self._running.proc.poll()
            if code is not None:
                raise SeaweedError(f"SeaweedFS exited with status {code} while starting "
                                   f"(log: {self.log_path}):\n{self._log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet, whatever it says
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise SeaweedError(
                    f"SeaweedFS did not serve S3 at {self.endpoint} within "
                    f"{self.startup_timeout:.0f} s (last answer: {last}; log: "
                    f"{self.log_path}):\n{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._running is not None and self._running.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout`` seconds;
        then its sockets and temp files are removed. The default ``timeout`` leaves
        room for a slow clean stop: a busy maintenance worker makes weed wait 10 s
        for its admin server first (the times seen: docs/local-s3.md, Figures)."""
        running, self._running = self._running, None
        if running is None:
            return
        proc = running.proc
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        finally:
            running.log.close()
            shutil.rmtree(running.private, ignore_errors=True)
            for flag, port in running.ports.items():
                if flag.endswith(".grpc"):
                    _remove_socket(_GRPC_SOCKET.format(service=flag.split(".")[0], port=port))

    def __enter__(self) -> SeaweedFS:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _remove_socket(path: str) -> None:
    """Remove ``path`` if it is a unix socket (never anything else)."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _admin_from_environment() -> Identity:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise SeaweedError("SeaweedFS needs an admin credential: set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY, or pass admin=Identity(...)")
    return Identity("admin", key, secret)
