"""S3 servers for tests and benchmarks: moto's, in a child process, and SeaweedFS.

`MotoS3Server` is a mock that answers like S3 (kept for fault injection and the
tests that need a behaviour only moto and AWS have); `SeaweedS3Server` is a real
object store (storage/seaweed.py) with the same small interface. Both take the
dummy credentials below.

Why a child process rather than `moto.server.ThreadedMotoServer` in the test
process: the tests race 8 threads against the server and s3fs runs its own IO
thread, so a server sharing the GIL with them slows everything and blurs the
timing; and a `moto.mock_aws()` used by any test in the same process patches
botocore globally, which would silently divert our requests away from the server.

The child runs `ThreadedMotoServer(ip_address=host, port=0)` (moto 5.2 binds
port 0 and reports the bound port through `get_host_and_port()`), prints
``PORT <n>`` on stdout, and exits when its stdin closes, so it dies with the test
run even if pytest is killed.

``host`` is 127.0.0.1 for the tests; the benchmarks (which sit on top and may
import this helper; the product never does) bind it to a bridge's address so that
workers in network namespaces reach it over capped links.

Usage::

    with MotoS3Server() as server:
        endpoint = server.endpoint_url        # http://127.0.0.1:<port>
        bucket = server.new_bucket()          # a fresh bucket, for one run
        opts = server.options()               # fsspec/s3fs storage_options

Credentials are dummies (`DUMMY_KEY`, `DUMMY_SECRET`); moto accepts any, and
SeaweedFS is started with them as its admin identity.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from types import TracebackType
from typing import Any, Self

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
REGION = "us-east-1"


class Served:
    """A server that starts on entering a ``with`` block and stops on leaving it."""

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class MotoS3Server(Served):
    """moto's S3 server in a child process on ``host`` (any local address) and a free
    port."""

    #: The child's script: it serves as `_serve` does (a subclass may run its own).
    child_script = __file__

    def __init__(self, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> None:
        self.host = host
        self.startup_timeout = startup_timeout
        self.endpoint_url = ""
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> str:
        """Start the server and return its endpoint URL once it answers."""
        env = dict(os.environ)
        env.update(
            AWS_ACCESS_KEY_ID=DUMMY_KEY,
            AWS_SECRET_ACCESS_KEY=DUMMY_SECRET,
            AWS_DEFAULT_REGION=REGION,
        )
        self._proc = subprocess.Popen(
            [sys.executable, self.child_script, self.host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"moto server on {self.host} did not start (said {line!r})")
        self.endpoint_url = f"http://{self.host}:{int(line.split()[1])}"
        self._wait_until_answering()
        return self.endpoint_url

    def _wait_until_answering(self) -> None:
        # No proxy: the server is local, and a proxy from the environment would not
        # reach a bridge's address.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                with opener.open(f"{self.endpoint_url}/moto-api/", timeout=2):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"moto server at {self.endpoint_url} never answered"
                    ) from exc
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (closing its stdin) and wait for it to exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """fsspec/s3fs storage options for this server, or for ``endpoint_url`` (e.g. a
        counting proxy in front of it) with the same credentials."""
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "key": DUMMY_KEY,
            "secret": DUMMY_SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (default: a fresh ``bench-<hex>`` name) and return its name."""
        import boto3

        name = name or f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=DUMMY_KEY,
            aws_secret_access_key=DUMMY_SECRET,
            region_name=REGION,
        ).create_bucket(Bucket=name)
        return name


class SeaweedS3Server(Served):
    """SeaweedFS (`storage.seaweed.SeaweedFS`) on ``host`` and free ports, with the
    interface of `MotoS3Server`; its data lives in ``data_dir`` (default: a temp
    directory removed at `stop`). ``identities``: more identities, for per-role
    credentials (see storage/seaweed.py for what SeaweedFS enforces)."""

    def __init__(self, host: str = "127.0.0.1", data_dir: str | os.PathLike[str] | None = None,
                 identities: tuple[Any, ...] = (), iam_writable: bool = False) -> None:
        from storage.seaweed import Identity  # noqa: PLC0415 - only this class needs it

        self.host = host
        self._own_dir = data_dir is None
        self.data_dir = str(data_dir) if data_dir else ""
        self.admin = Identity("admin", DUMMY_KEY, DUMMY_SECRET)
        self.identities = identities
        self.iam_writable = iam_writable
        self.endpoint_url = ""
        self.server: Any = None

    def start(self) -> str:
        """Start SeaweedFS and return its endpoint URL once it serves S3."""
        from storage.seaweed import SeaweedFS  # noqa: PLC0415

        if self._own_dir:
            self.data_dir = tempfile.mkdtemp(prefix="seaweedfs-test-")
        self.server = SeaweedFS(self.data_dir, host=self.host, admin=self.admin,
                                identities=self.identities, iam_writable=self.iam_writable)
        try:
            self.endpoint_url = self.server.start()
        except BaseException:
            self.stop()
            raise
        return self.endpoint_url

    def stop(self) -> None:
        """Stop SeaweedFS (and remove its data if the directory was ours)."""
        if self.server is not None:
            self.server.stop()
        if self._own_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """fsspec/s3fs storage options, as `MotoS3Server.options`."""
        return {**self.server.storage_options(),
                "endpoint_url": endpoint_url or self.endpoint_url}

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (default: a fresh ``bench-<hex>`` name) and return its name."""
        return self.server.create_bucket(name or f"bench-{uuid.uuid4().hex[:8]}")


def _serve(host: str) -> None:
    """Child-process entry point: serve on ``host`` until stdin closes."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()  # returns at EOF: the parent closed the pipe or died
    server.stop()


if __name__ == "__main__":
    _serve(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1")
