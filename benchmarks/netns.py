"""Workers in their own network namespaces, each behind a link capped with tc.

    .venv/bin/python -m benchmarks.netns --cleanup      # remove leftovers of a killed run

Topology (needs root, ``ip`` and ``tc``; netem is not needed)::

    root namespace: bridge dlb-br 10.213.0.1/24  <- the S3 server binds here
      |-- veth dlb-w0h ==== dlb-w0n 10.213.0.10/24 in namespace dlb-w0
      |-- veth dlb-w1h ==== dlb-w1n 10.213.0.11/24 in namespace dlb-w1
      ...

Every byte a worker exchanges, with the store in the root namespace or with another
worker (gloo, for data-parallel), crosses its own veth pair: its upload leaves
through the namespace side (``dlb-wNn`` egress), its download through the root
side (``dlb-wNh`` egress, the bridge port). Each of the two egresses gets an HTB
class with ``rate = ceil = cap`` (``set_cap``), so a cap holds in both directions;
worker-to-worker traffic is capped twice, by the sender's upload and the receiver's
download, as on two real access links. There is no added latency (no netem).

Clean-up is by name: every link and namespace starts with ``dlb-``. ``Topology`` is a
context manager that removes what it created on exit, on SIGTERM/SIGINT (turned
into an exception so ``finally`` runs) and at interpreter exit; ``cleanup()``
removes whatever a killed run left.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PREFIX = "dlb-"
SUBNET = "10.213.0"


class NetnsUnavailable(RuntimeError):
    """Not root, or ``ip``/``tc`` missing: the bandwidth benchmark cannot run."""


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def _run(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {out.stderr.strip() or out.returncode}")
    return out


def namespaces(prefix: str = PREFIX) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def links(prefix: str = PREFIX) -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace and link named ``{prefix}*``; returns what was removed.
    Processes still running inside a namespace keep it alive until they exit (the
    caller stops its own processes first)."""
    removed = []
    for ns in namespaces(prefix):
        _run("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    for name in links(prefix):  # deleting one end of a veth removes both
        if _run("ip", "link", "del", name, check=False).returncode == 0:
            removed.append(f"link {name}")
    return removed


def _rate(bits_per_s: float) -> str:
    return f"{int(bits_per_s)}bit"


class Worker:
    """One worker's namespace and its veth pair."""

    def __init__(self, index: int, prefix: str = PREFIX, subnet: str = SUBNET):
        self.index = index
        self.ns = f"{prefix}w{index}"
        self.host_if = f"{prefix}w{index}h"  # root side, a bridge port
        self.ns_if = f"{prefix}w{index}n"
        self.addr = f"{subnet}.{10 + index}"

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside this worker's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def counters(self) -> dict[str, int]:
        """Bytes on the wire (Ethernet frames) the worker sent (up) and received
        (down), read on the root side of its veth."""
        base = Path("/sys/class/net") / self.host_if / "statistics"
        rx = int((base / "rx_bytes").read_text())
        tx = int((base / "tx_bytes").read_text())
        return {"up": rx, "down": tx}


class Topology:
    """``n`` worker namespaces on a bridge; ``set_cap`` limits every link. Names
    start with ``prefix`` and addresses are in ``subnet``.0/24 (tests use their own)."""

    def __init__(self, n: int, prefix: str = PREFIX, subnet: str = SUBNET):
        why = available()
        if why:
            raise NetnsUnavailable(why)
        if len(prefix) > 8:
            raise ValueError(f"prefix {prefix!r}: at most 8 characters (interface names)")
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        self.host_addr = f"{subnet}.1"
        self.workers = [Worker(i, prefix, subnet) for i in range(n)]
        self._active = False
        self._old_handlers: dict[int, object] = {}

    # -- life cycle --------------------------------------------------------------------
    def __enter__(self) -> Topology:
        leftovers = namespaces(self.prefix) + links(self.prefix)
        if leftovers:
            raise RuntimeError(
                f"network leftovers from an earlier run: {', '.join(leftovers)}; remove them "
                "with: .venv/bin/python -m benchmarks.netns --cleanup")
        self._install_signals()
        atexit.register(self.close)
        self._active = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._active:
            return
        self._active = False
        cleanup(self.prefix)
        self._restore_signals()
        with contextlib.suppress(Exception):  # the interpreter may be shutting down
            atexit.unregister(self.close)

    def _install_signals(self) -> None:
        def stop(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # outside the main thread signals cannot be caught: finally and atexit remain
            with contextlib.suppress(ValueError):
                self._old_handlers[sig] = signal.signal(sig, stop)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers.clear()

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for w in self.workers:
            _run("ip", "netns", "add", w.ns)
            _run("ip", "link", "add", w.host_if, "type", "veth", "peer", "name", w.ns_if)
            _run("ip", "link", "set", w.ns_if, "netns", w.ns)
            _run("ip", "link", "set", w.host_if, "master", self.bridge)
            _run("ip", "link", "set", w.host_if, "up")
            _run("ip", "addr", "add", f"{w.addr}/24", "dev", w.ns_if, ns=w.ns)
            _run("ip", "link", "set", w.ns_if, "up", ns=w.ns)
            _run("ip", "link", "set", "lo", "up", ns=w.ns)
            for dev, ns in ((w.host_if, None), (w.ns_if, w.ns)):
                _run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                     "default", "10", ns=ns)
        self.set_cap(None)

    # -- caps --------------------------------------------------------------------------
    def set_cap(self, bits_per_s: float | None) -> None:
        """Cap every worker's upload and download at ``bits_per_s`` (None: 10 Gbit/s,
        above what the veth carries on this machine, i.e. uncapped)."""
        rate = _rate(bits_per_s if bits_per_s else 10e9)
        for w in self.workers:
            for dev, ns in ((w.host_if, None), (w.ns_if, w.ns)):
                _run("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10",
                     "htb", "rate", rate, "ceil", rate, "quantum", "60000", ns=ns)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.netns", description=__doc__.splitlines()[0])
    p.add_argument("--cleanup", action="store_true",
                   help=f"remove namespaces and links named {PREFIX}* left by a killed run")
    args = p.parse_args(argv)
    if not args.cleanup:
        p.print_help()
        return 0
    why = available()
    if why:
        print(f"nothing to do: {why}", file=sys.stderr)
        return 1
    removed = cleanup()
    print("\n".join(removed) if removed else "no leftovers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
