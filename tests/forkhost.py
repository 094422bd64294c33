"""Processes forked from one that imported their modules once, for tests whose
subject is what a benchmark's child processes measure, not the start of a fresh
interpreter (which costs every such child ~1 s of CPU for numpy and the store, ~3 s
with torch, before it does anything).

``ForkHost(*modules)`` starts ``python`` in the checkout with tests/ on its path,
imports ``modules`` and waits. ``host.call(fn, *args, **kwargs)`` runs ``fn`` (a
module-level function, pickled by name, as multiprocessing's spawn would) in a
process forked from the host, and returns what it returned (pickled back) or raises
`ForkedError` with its traceback. Calls may run at once, one connection each.
``fork_call(fn, *args, **kwargs)`` does the same one level down, from inside a
forked process (or any single-threaded one).

The host is a plain, single-threaded interpreter: nothing but the imports has run
in it when it forks (no torch thread pool, no pytest, no servers), so a forked
process starts where a fresh one would be after its imports. Every forked process is
waited for by its parent and the host by `ForkHost.close`, so their CPU time counts
in the test process's children's (``/usr/bin/time``, ``getrusage``) as a
subprocess's does. What forked processes print goes to the host's log
(``host.log``), shown by a `ForkedError`.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

_SERVER = r"""
import importlib, os, pickle, select, socket, struct, sys, traceback
path, *modules = sys.argv[1:]
for name in modules:
    importlib.import_module(name)
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen(64)
sys.stdout.write("ready\n")
sys.stdout.flush()
os.dup2(2, 1)  # what forked functions print goes to the log, not to the client's pipe


def recv(conn, n):
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise EOFError("the client went away")
        data += got
    return data


def serve(conn):
    status = 1
    try:
        fn, args, kwargs = pickle.loads(recv(conn, struct.unpack("!Q", recv(conn, 8))[0]))
        try:
            reply = (True, fn(*args, **kwargs))
        except BaseException as exc:
            reply = (False, "".join(traceback.format_exception(exc)))
        data = pickle.dumps(reply)
        conn.sendall(struct.pack("!Q", len(data)) + data)
        status = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


children = set()
while True:
    ready, _, _ = select.select([listener, 0], [], [], 0.5)
    for pid in list(children):
        if os.waitpid(pid, os.WNOHANG)[0]:
            children.discard(pid)
    if 0 in ready and not os.read(0, 1024):  # the client closed our stdin: stop
        break
    if listener in ready:
        conn, _ = listener.accept()
        pid = os.fork()
        if pid == 0:
            listener.close()
            serve(conn)
        conn.close()
        children.add(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


class ForkedError(RuntimeError):
    """A forked call raised (its traceback is the message) or died without a reply."""


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise EOFError
        data += got
    return data


class ForkHost:
    """See the module docstring."""

    def __init__(self, *modules: str, env: dict[str, str] | None = None,
                 timeout: float = 900.0):
        self.dir = Path(tempfile.mkdtemp(prefix="forkhost-"))
        self.path = str(self.dir / "socket")
        self.log = self.dir / "host.log"
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), str(TESTS), env.get("PYTHONPATH")) if p)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, self.path, *modules],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, cwd=ROOT, env=env)
        assert self.proc.stdout is not None
        try:
            line = self.proc.stdout.readline()  # after the imports
        finally:
            self.proc.stdout.close()
        if line != b"ready\n":
            self.close()
            raise ForkedError(f"the fork host did not start: {self.tail()}")
        self.timeout = timeout

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a process forked from the host; its result."""
        data = pickle.dumps((fn, args, kwargs))
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(self.timeout)
            conn.connect(self.path)
            conn.sendall(struct.pack("!Q", len(data)) + data)
            try:
                size = struct.unpack("!Q", _recv_exactly(conn, 8))[0]
                ok, value = pickle.loads(_recv_exactly(conn, size))
            except EOFError:
                raise ForkedError(f"{fn.__qualname__}: the forked process ended without a "
                                  f"reply; the host's log:\n{self.tail()}") from None
        if not ok:
            raise ForkedError(f"{fn.__qualname__} raised in a forked process:\n{value}\n"
                              f"the host's log:\n{self.tail()}")
        return value

    def close(self) -> None:
        """Stop the host once its forked processes have ended, and wait for it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ForkHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fork_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a child forked from this process (which should be
    single-threaded: a forked process, say); its result, or `ForkedError`."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        status = 1
        try:
            try:
                reply = (True, fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - sent to the parent
                reply = (False, "".join(traceback.format_exception(exc)))
            with os.fdopen(write, "wb") as out:
                out.write(pickle.dumps(reply))
            status = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        data = got.read()
    os.waitpid(pid, 0)
    if not data:
        raise ForkedError(f"{fn.__qualname__}: the forked process ended without a reply")
    ok, value = pickle.loads(data)
    if not ok:
        raise ForkedError(f"{fn.__qualname__} raised in a forked process:\n{value}")
    return value
