"""Load every page of the documentation site in headless Chromium: each must render
(its title and a body of text) with no console error, no uncaught exception and no
failed load; then screenshot the home page and the results page.

    .venv/bin/python scripts/docs_screenshots.py                  # builds the site first
    .venv/bin/python scripts/docs_screenshots.py --site /tmp/site --out /tmp/shots

Chromium is not a project dependency (on Debian: ``apt-get install chromium``); the
script finds ``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH, or takes
``--chromium``. It talks to the browser over the DevTools protocol with ``websockets``
(installed with Prefect). The site is built with ``mkdocs build --strict`` into a
temporary directory unless ``--site`` names one, and served on a free loopback port.
Exit status 0 when every page passed, 1 otherwise (each failure is printed).
docs/testing.md describes it.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parent.parent
#: page -> (screenshot, height in pixels from the top of the page)
SHOTS = {"index.md": ("home.png", 900), "results.md": ("results.png", 1700)}


def build_site(dest: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "-f", str(ROOT / "mkdocs.yml"), "-d", str(dest)], check=True, env=env)


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # the pages' requests are not news
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def find_chromium(given: str | None) -> str:
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome"]):
        if name and (path := shutil.which(name)):
            return path
    sys.exit("no Chromium found: install it (apt-get install chromium) or pass --chromium")


class Browser:
    """One headless Chromium, one tab, driven over the DevTools protocol."""

    def __init__(self, chromium: str, width: int, height: int) -> None:
        self.profile = tempfile.mkdtemp(prefix="docs-chromium-")
        args = [chromium, "--headless=new", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "--no-first-run", "--disable-gpu",
                "--hide-scrollbars", f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root otherwise
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                sys.exit("Chromium did not start (no DevToolsActivePort)")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version") as reply:
            url = json.load(reply)["webSocketDebuggerUrl"]
        self.ws = connect(url, max_size=None)
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, session: bool = False, **params) -> dict:
        ident = next(self.ids)
        message = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(method)
            try:
                self.events.append(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                raise TimeoutError(method) from None

    def drain(self, seconds: float) -> None:
        """Collect what the page logs in its first moments after the load."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                return

    def load(self, url: str) -> list[str]:
        """Open url; return its console errors, exceptions and failed loads."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("Page.loadEventFired")
        self.drain(1.0)
        problems = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                problems.append("exception: " + details.get("exception", {}).get(
                    "description", details.get("text", "")))
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                problems.append("console.error: " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                entry = params["entry"]
                problems.append(f"log: {entry['text']} {entry.get('url', '')}".strip())
        return problems

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int, height: int) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png",
                         captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": height,
                               "scale": 1})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def page_url(base: str, page: Path) -> str:
    return f"{base}/" if page.stem == "index" else f"{base}/{page.stem}/"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img",
                        help="where the screenshots go (default: docs/img)")
    parser.add_argument("--chromium", help="the browser's executable")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)

    chromium = find_chromium(args.chromium)
    with tempfile.TemporaryDirectory(prefix="docs-site-") as tmp:
        site = args.site
        if site is None:
            site = Path(tmp) / "site"
            build_site(site)
        server, base = serve(site)
        browser = Browser(chromium, args.width, args.height)
        failed = 0
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            for page in sorted((ROOT / "docs").glob("*.md")):
                url = page_url(base, page)
                problems = browser.load(url)
                title = browser.evaluate(
                    "(document.querySelector('article h1') || {}).textContent || ''")
                title = title.strip().rstrip("\N{PILCROW SIGN}")  # the heading's permalink
                words = browser.evaluate(
                    "(document.querySelector('article') || {innerText: ''}).innerText"
                    ".split(/\\s+/).length")
                if not title:
                    problems.append("no heading in the article")
                if (words or 0) < 50:
                    problems.append(f"the article has {words} words")
                status = "ok" if not problems else "FAILED"
                print(f"{status:6} {page.name:20} {title[:60]!r} ({words} words)")
                for problem in problems:
                    print(f"       {problem}")
                failed += bool(problems)
                if page.name in SHOTS:
                    name, height = SHOTS[page.name]
                    shot = args.out / name
                    browser.screenshot(shot, args.width, height)
                    print(f"       screenshot {shot}")
        finally:
            browser.close()
            server.shutdown()
    print(f"{failed} page(s) failed" if failed else "every page rendered with no console error")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
