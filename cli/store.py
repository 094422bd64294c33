"""``diloco store serve`` and ``--store local-s3``: the local-s3 store as commands
meet it (`storage.local_s3` serves it; this module prints, and sets the environment
the jobs inherit).

    diloco run --store local-s3          # serve runs/.seaweedfs for this run only
    diloco store serve                   # serve it until Ctrl-C; in another shell:
    source runs/.seaweedfs/env
    diloco status s3://diloco/runs/tiny-20260101-120000
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from cli.console import EXIT_FAILED, console, fail, shown
from storage.local_s3 import DEFAULT_FOLDER, LocalS3, LocalS3Busy
from storage.seaweed import INSTALL_HINT, SeaweedError

store_app = typer.Typer(
    name="store", help="The local-s3 store: SeaweedFS serving runs/.seaweedfs on 127.0.0.1.",
    no_args_is_help=True, add_completion=False, rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@contextmanager
def local_s3(folder: str = DEFAULT_FOLDER, *, purpose: str = "run",
             port: int | None = None) -> Iterator[LocalS3]:
    """The local-s3 store served (or found served) for the duration of a command,
    with its endpoint and keys in this process's environment, which the jobs
    inherit; the environment is restored and the server stopped afterwards."""
    store = LocalS3(folder, purpose=purpose, port=port)
    try:
        store.open()
    except LocalS3Busy as exc:
        raise fail(str(exc)) from None
    except SeaweedError as exc:
        missing = INSTALL_HINT in str(exc)
        first = str(exc).splitlines()[0]
        log = f" (log: {shown(str(store.folder / 'weed.log'))})" if not missing else ""
        raise fail(f"the local-s3 store did not start: {first}{log}",
                   2 if missing else EXIT_FAILED) from None
    saved = {name: os.environ.get(name) for name in store.env()}
    os.environ.update(store.env())
    try:
        yield store
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        store.close()


def describe(store: LocalS3) -> str:
    """One line: what serves the store, and for how long."""
    where = shown(str(store.folder))
    if store.server is None:
        return (f"local-s3: {where} as served by diloco store serve (pid "
                f"{store.served_by.get('pid')}) at {store.endpoint}")
    until = "until this command ends" if store.purpose == "run" else "until Ctrl-C"
    return (f"local-s3: SeaweedFS serves {where} at {store.endpoint} "
            f"(started in {store.served_by['started_in']:.1f} s), {until}")


def read_back_hint(store: LocalS3) -> str:
    """How to read the store after this command: serve it, source its variables."""
    source = f"source {shown(str(store.env_file))}"
    if store.server is None:
        return f"while diloco store serve runs (pid {store.served_by.get('pid')}): {source}"
    return f"diloco store serve, then in another shell: {source}"


@store_app.command()
def serve(
    folder: Annotated[str, typer.Option(help="the folder served")] = DEFAULT_FOLDER,
    port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="the S3 port on 127.0.0.1 (default: a free one)")] = None,
) -> None:
    """Serve the local-s3 store until Ctrl-C: read runs back, resume them, or let
    several commands share one server."""
    stopped = threading.Event()
    # first, and both explicitly: a Ctrl-C while the server starts (or the store is
    # listed) was lost once, and the command served on; a shell that starts a command
    # in the background hands it SIGINT ignored, and Python then never raises
    # KeyboardInterrupt for it
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    with local_s3(folder, purpose="serve", port=port) as store:
        console.print(describe(store), highlight=False)
        runs = store.runs()
        console.print(f"runs: {', '.join(runs[-5:]) if runs else 'none yet'}", highlight=False)
        console.print(f"in another shell:  source {shown(str(store.env_file))}", highlight=False)
        example = runs[-1] if runs else f"{store.url}/<run>"
        console.print(f"then, e.g.:        diloco status {example}", highlight=False)
        while not stopped.wait(1.0):
            if store.server is not None and not store.server.running():
                raise fail(f"SeaweedFS stopped on its own; see "
                           f"{shown(str(store.folder / 'weed.log'))}", EXIT_FAILED)
        console.print("stopping the local-s3 store")
