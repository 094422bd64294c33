"""The ``local-s3`` store: a folder of this machine served over S3 by SeaweedFS.

Why: to run the S3 path end to end (create-only commits, listings, credentials from
the environment) before a cloud bucket costs anything, as one would with MinIO.
``diloco run --store local-s3`` serves the folder (``runs/.seaweedfs``) for as
long as the command runs; ``diloco store serve`` serves it until Ctrl-C, to read a
run back (``diloco status``), resume it, or share one server between commands.

Runs live at ``s3://diloco/runs/<name>``. The endpoint and keys reach every job
through the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...),
never through a URL or a flow parameter. The keys are made once per folder and
kept in ``<folder>/credentials.json`` (mode 0600); the server listens on
127.0.0.1 only.

One server per folder: the process that serves it holds an exclusive lock on
``<folder>/lock`` and writes ``<folder>/server.json`` (endpoint, pid, purpose) and
``<folder>/env`` (the shell ``export`` lines of the endpoint and keys, mode 0600,
for ``source``). A second command finds the server there and uses it when it was
started by ``diloco store serve``; a server started by a ``diloco run`` stops with
that run, so another command is refused rather than left without its store.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from storage.seaweed import Identity, SeaweedError, SeaweedFS, new_identity

#: What ``--store`` says to ask for this store.
LOCAL_S3 = "local-s3"
#: The folder served, beside the default local store (``runs/``).
DEFAULT_FOLDER = "runs/.seaweedfs"
BUCKET = "diloco"
#: Where runs are created in it.
STORE_URL = f"s3://{BUCKET}/runs"
#: weed's log is moved aside (one old copy kept) when it grows beyond this.
LOG_LIMIT = 20 * 2**20


class LocalS3Busy(SeaweedError):
    """Another process serves the folder in a way this command cannot share."""


class LocalS3:
    """The local-s3 store in ``folder``: `open` serves it (or finds the process that
    already does), `close` stops what `open` started.

    ``purpose``: ``"run"`` (the server ends with this command) or ``"serve"``
    (``diloco store serve``: others may use it). ``port``: the S3 port when this
    process serves it (default: a free one).
    """

    def __init__(self, folder: str | os.PathLike[str] = DEFAULT_FOLDER, *,
                 purpose: str = "run", port: int | None = None) -> None:
        if purpose not in ("run", "serve"):
            raise ValueError(f"purpose must be 'run' or 'serve', got {purpose!r}")
        self.folder = Path(folder).resolve()
        self.purpose = purpose
        self.port = port
        self.server: SeaweedFS | None = None
        #: who serves it: this process's own server, or another process's record
        self.served_by: dict[str, Any] = {}
        self._lock: int | None = None
        self._identity: Identity | None = None

    @property
    def url(self) -> str:
        """Where runs are created: ``s3://diloco/runs``."""
        return STORE_URL

    @property
    def endpoint(self) -> str:
        """The S3 endpoint serving the folder (after `open`)."""
        return self.served_by["endpoint"]

    @property
    def env_file(self) -> Path:
        """The shell file to ``source`` while the folder is served."""
        return self.folder / "env"

    def env(self) -> dict[str, str]:
        """The variables that point botocore, s3fs and every job at the store."""
        assert self._identity is not None, "open() first"
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                **self._identity.env()}

    def runs(self) -> list[str]:
        """The URLs of the runs in the store (its folders holding a run.json), by name."""
        from storage.objectstore import ObjectStore, RetryPolicy  # noqa: PLC0415

        assert self._identity is not None, "open() first"
        root = ObjectStore(self.url, retry=RetryPolicy(attempts=2, base_delay=0.2),
                           storage_options={"endpoint_url": self.endpoint,
                                            "key": self._identity.access_key,
                                            "secret": self._identity.secret_key})
        try:
            found = root.fs.ls(STORE_URL.removeprefix("s3://"), detail=False)
        except FileNotFoundError:
            return []
        names = sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in found)
        return [f"{self.url}/{n}" for n in names if root.exists(f"{n}/run.json")]

    def open(self) -> LocalS3:
        """Serve the folder, or use the ``diloco store serve`` that already does.

        `LocalS3Busy` if a ``diloco run`` serves it, or if this is a ``serve`` and
        anything already serves it; `SeaweedError` if SeaweedFS is missing or does
        not start.
        """
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # its data: this user's
        self._identity = self._credentials()
        self._lock = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            return self._attach()
        try:
            self._serve()
        except BaseException:
            self.close()
            raise
        return self

    def _attach(self) -> LocalS3:
        record = self._record()
        who = f"pid {record.get('pid', '?')}"
        if self.purpose == "serve":
            raise LocalS3Busy(f"{self.folder} is already served at "
                              f"{record.get('endpoint', '?')} ({who}); use that one")
        if record.get("purpose") != "serve" or not record.get("endpoint"):
            raise LocalS3Busy(
                f"{self.folder} is served by a diloco run ({who}) until it ends; wait for "
                f"it, or serve the store with `diloco store serve` in another terminal: "
                f"then every command uses that one")
        self.served_by = record
        return self

    def _record(self, patience: float = 60.0) -> dict[str, Any]:
        """What the process holding the lock wrote about its server; it may still be
        starting it (about a second), so this waits for the record while the lock
        is held, up to ``patience`` seconds."""
        deadline = time.monotonic() + patience
        while True:
            try:
                return json.loads((self.folder / "server.json").read_text())
            except (OSError, ValueError):
                pass
            if not _locked(self.folder / "lock") or time.monotonic() > deadline:
                return {}
            time.sleep(0.2)

    def _serve(self) -> None:
        log = self.folder / "weed.log"
        with contextlib.suppress(OSError):
            if log.stat().st_size > LOG_LIMIT:
                log.replace(log.with_suffix(".log.1"))
        self.server = SeaweedFS(self.folder / "data", admin=self._identity, s3_port=self.port,
                                log_path=log)
        self.server.start()
        self.server.create_bucket(BUCKET)
        self.served_by = {"endpoint": self.server.endpoint, "pid": os.getpid(),
                          "purpose": self.purpose, "started_in": self.server.started_in}
        (self.folder / "server.json").write_text(json.dumps(self.served_by) + "\n")
        lines = [f"# the local-s3 store {self.folder}, served by pid {os.getpid()}",
                 *(f"export {k}={v}" for k, v in self.env().items())]
        _write_private(self.env_file, "\n".join(lines) + "\n")

    def _credentials(self) -> Identity:
        """This folder's keys, made on first use."""
        path = self.folder / "credentials.json"
        try:
            saved = json.loads(path.read_text())
            return Identity("admin", saved["access_key"], saved["secret_key"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError) as exc:
            raise SeaweedError(f"{path} is not what diloco wrote ({exc}); remove it and "
                               f"the store gets new keys") from None
        made = new_identity("admin")
        _write_private(path, json.dumps({"access_key": made.access_key,
                                         "secret_key": made.secret_key}) + "\n")
        return made

    def close(self) -> None:
        """Stop the server if this process started it; forget the other's."""
        if self.server is not None:
            for name in ("env", "server.json"):
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / name).unlink()
            self.server.stop()
            self.server = None
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None

    def __enter__(self) -> LocalS3:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _locked(path: Path) -> bool:
    """Whether another open file holds the lock on ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (from the first byte)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)
