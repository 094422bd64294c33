"""The image for real: built by `docker build` on a Docker engine of the project's own
(tests/docker_engine.py, scripts/docker-engine) and run with `docker run`.

Slow (the first build takes minutes; the engine's cache keeps it for the next
session), and needs root (dockerd): skipped unless asked for, with ``-m containers``
or ``DILOCO_TEST_CONTAINERS=1``, so ``make test`` skips them::

    .venv/bin/python -m pytest -m containers -q tests/test_containers.py

The engine is installed (``scripts/docker-engine install``: Debian's docker.io) when
dockerd is missing, started on its own socket under ``$DILOCO_DOCKER_ROOT`` (default
/var/tmp/diloco-docker) for the session and stopped at its end; where it cannot start,
the tests are skipped with one line saying why. The image is built by
``scripts/docker-image`` (docs/image.md), so the tests check what a user runs. The
engine and the image are session fixtures of tests/docker_engine.py: every container
test file of a session shares one engine and one build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

try:  # tests/ is on sys.path under pytest's default import mode
    from docker_engine import REPO, DockerEngine, build, say
except ImportError:  # tests imported as a package
    from tests.docker_engine import REPO, DockerEngine, build, say

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

#: what the build is given and no image may keep: pip's settings, a secret's place
PIP_BUILD_KEYS = ("PIP_CERT", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
                  "PIP_TRUSTED_HOST", "PIP_CONFIG_FILE", "PIP_CLIENT_CERT")


def image_lib(expression: str) -> str:
    """The output of bash EXPRESSION with scripts/image-lib.sh sourced (the short run's
    arguments and pip's settings, as scripts/docker-image and check-image have them)."""
    return subprocess.run(["bash", "-c", f'PROG=test; . scripts/image-lib.sh; {expression}'],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_a_second_build_is_all_cached(docker_engine: DockerEngine, image: str,
                                      request: pytest.FixtureRequest) -> None:
    again = build(docker_engine)
    say(request.config, f"the same build again: {again.seconds:.1f} s")
    assert re.search(r"\b\d+ steps cached, 0 run\b", again.output), again.output
    assert again.seconds < 60, again.output


def test_diloco_run_tiny_in_a_container(docker_engine: DockerEngine, image: str,
                                        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`docker run IMAGE diloco run tiny` (short), as the user diloco, finishes every round;
    the time from `docker run` to the container running and to the first step."""
    t0 = time.monotonic()
    who = docker_engine.docker(*docker_engine.run_args(), "--rm", "--network", "host", image,
                               "id", "-un").stdout.strip()
    start_stop = time.monotonic() - t0
    assert who == "diloco"
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)  # the container's user writes its run here
    short = image_lib('printf "%s\\0" "${SHORT[@]}"').split("\0")[:-1]
    t0 = time.monotonic()
    cid = docker_engine.docker(*docker_engine.run_args(), "--detach", "--network", "host",
                               "--user", "diloco", "--volume", f"{work}:/work", "--workdir",
                               "/work", image, "diloco", "run", "tiny", *short).stdout.strip()
    running = time.monotonic() - t0
    first_step = None
    while docker_engine.docker("inspect", "--format", "{{.State.Running}}", cid,
                               timeout=60).stdout.strip() == "true":
        if first_step is None and stepped(work):
            first_step = time.monotonic() - t0
        if time.monotonic() - t0 > 900:
            pytest.fail("diloco run tiny in the container ran over 15 minutes")
        time.sleep(0.5)
    finished = time.monotonic() - t0
    code = docker_engine.docker("wait", cid, timeout=60).stdout.strip()
    logs = docker_engine.docker("logs", cid, timeout=60)
    docker_engine.docker("rm", cid, timeout=60)
    output = logs.stdout + logs.stderr
    assert code == "0", output[-4000:]
    assert "finished in" in output, output[-4000:]
    (run,) = (work / "runs").iterdir()
    status = json.loads((run / "members/aggregator/status.json").read_text())
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["config"]["name"] == "tiny" and manifest["total_steps"] == 20, manifest
    assert status["state"] == "finished" and status["rounds"] == status["total_rounds"], status
    assert (work / "mlflow.db").exists()
    assert run.stat().st_uid != 0  # written by the container's user, not root
    say(request.config, f"docker run --rm {image} id -un: {start_stop:.2f} s (start to exit)")
    say(request.config, f"diloco run tiny (20 steps): container running {running:.2f} s, "
                        f"first step {first_step:.1f} s, finished {finished:.1f} s after docker run"
                        if first_step else "no first step seen while it ran")
    say(request.config, "; ".join(line.strip() for line in output.splitlines()
                                  if "finished in" in line or "canonical model" in line))


def stepped(work: Path) -> bool:
    """A worker of the run under WORK has reported a step (its status, every second)."""
    for path in work.glob("runs/*/members/region-*/status.json"):
        try:
            if json.loads(path.read_text()).get("step", 0) >= 1:
                return True
        except (OSError, ValueError):  # being written
            pass
    return False


def certificates(pem: str) -> set[str]:
    """The base64 bodies of the certificates in a PEM bundle, one line each."""
    return {"".join(body.split()) for body in re.findall(
        r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", pem, re.S)}


def test_the_image_keeps_no_secret(docker_engine: DockerEngine, image: str,
                                   request: pytest.FixtureRequest) -> None:
    """No credential, CA bundle or pip setting of the build in the image: not in its
    environment, labels or history, and not in any file of any layer."""
    (info,) = json.loads(docker_engine.docker("image", "inspect", image).stdout)
    config = info["Config"]
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    labels = config.get("Labels") or {}
    assert not [k for k in env if k in PIP_BUILD_KEYS or k.startswith("AWS_")], env
    assert config.get("User") == "diloco", config
    history = docker_engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}",
                                   image).stdout
    conf = Path(os.environ.get("DILOCO_IMAGE_CACHE", "/var/tmp/diloco-image"),
                "pip-docker-image.conf")
    given = re.findall(r"=\s*(\S+)", conf.read_text()) if conf.exists() else []
    for where, text in (("env", json.dumps(env)), ("labels", json.dumps(labels)),
                        ("history", history)):
        assert "BEGIN CERTIFICATE" not in text, where
        assert not [v for v in given if v in text], (where, given, text)
    # a RUN step of the history names the build arguments in force: `RUN |3 A=x B= ...`
    arguments = [a for line in re.findall(r"^RUN \|\d+ (.*?) /bin/sh -c ", history, re.M)
                 for a in line.split()]
    assert arguments, history
    assert not [a for a in arguments if a.split("=")[0] in PIP_BUILD_KEYS
                and a.split("=", 1)[1]], arguments

    # the bundle the build trusted, less the certificates the base image ships
    # (ca-certificates): the machine's own CAs (a TLS-inspecting proxy's) must be nowhere
    cert = image_lib("pip_setting cert").strip()
    bundle = Path(cert).read_text() if cert and Path(cert).is_file() else ""
    shipped = docker_engine.docker("run", "--rm", "--network", "host", "--entrypoint", "cat",
                                   image, "/etc/ssl/certs/ca-certificates.crt").stdout
    own = sorted(certificates(bundle) - certificates(shipped))
    needles = [c[:64].encode() for c in own] + [b"/run/secrets/pip-ca", b"[global]\ncert = "]
    needles += [v.encode() for v in given]
    found, files, size = scan_layers(docker_engine, image, needles)
    say(request.config, f"{files} files ({size / 1e9:.2f} GB) in the layers searched for "
                        f"{len(own)} CA certificate(s) of this machine not in the base image "
                        f"and the build's pip settings: {len(found)} found")
    assert not found, found


def test_the_layer_scan_finds_what_a_layer_keeps(docker_engine: DockerEngine, image: str,
                                                 tmp_path: Path) -> None:
    """The scan above is not blind: in an image whose one layer holds a CA bundle and a
    .netrc that the next layer deletes, it finds both."""
    pem = Path("/etc/ssl/certs/ca-certificates.crt")
    if not pem.is_file():
        pytest.skip("no CA bundle on this machine")
    shutil.copy(pem, tmp_path / "bundle.pem")
    (tmp_path / "netrc").write_text("machine example.org login me password secret\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM localhost/diloco-base:bookworm\n"
        "COPY bundle.pem /etc/leaked.pem\nCOPY netrc /root/.netrc\n"
        "RUN rm /etc/leaked.pem /root/.netrc\n")
    leaky = "localhost/diloco-leak-check:latest"
    docker_engine.docker("build", "--network", "host", "--quiet", "-t", leaky, str(tmp_path))
    try:
        (needle,) = [c[:64].encode() for c in sorted(certificates(pem.read_text()))[:1]]
        found, _, _ = scan_layers(docker_engine, leaky, [needle])
    finally:
        docker_engine.docker("image", "rm", leaky, check=False)
    assert any(f.endswith(f"etc/leaked.pem holds {needle[:40]!r}") for f in found), found
    assert any(f.endswith("root/.netrc (a credentials file)") for f in found), found


def scan_layers(engine: DockerEngine, image: str,
                needles: list[bytes]) -> tuple[list[str], int, int]:
    """Every file of every layer of `docker save IMAGE`: those holding a needle, or a
    secret's mount point with content, or a credentials file; files and bytes read."""
    found, files, size = [], 0, 0
    credentials = re.compile(r"(^|/)(\.aws/credentials|\.netrc|\.pypirc|\.docker/config\.json"
                             r"|etc/pip\.conf|\.config/pip/pip\.conf|\.pip/pip\.conf)$")
    save = subprocess.Popen([engine.client, "save", image], env={**os.environ, **engine.env()},
                            stdout=subprocess.PIPE)
    assert save.stdout is not None
    with tarfile.open(fileobj=save.stdout, mode="r|") as archive:
        for member in archive:
            if not member.name.endswith("layer.tar"):
                continue
            with tarfile.open(fileobj=archive.extractfile(member), mode="r|") as layer:
                for entry in layer:
                    if not entry.isfile():
                        continue
                    files, size = files + 1, size + entry.size
                    name = f"{member.name}:{entry.name}"
                    if entry.name.startswith(("run/secrets/", "./run/secrets/")) and entry.size:
                        found.append(f"{name} (a secret's mount point)")
                    if credentials.search(entry.name):
                        found.append(f"{name} (a credentials file)")
                    data = layer.extractfile(entry).read()  # type: ignore[union-attr]
                    found += [f"{name} holds {n[:40]!r}" for n in needles if n in data]
    assert save.wait() == 0
    return found, files, size


#: Run in a container: a shell that leaves an orphan (its background `sleep`) and
#: exits; the orphan is re-parented to pid 1, which must reap it when it ends. Prints
#: the zombies left and pid 1's command.
ZOMBIES = r"""
import pathlib, subprocess, time
subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True)
time.sleep(1.5)
zombies = [p.name for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
           and (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"]
print(len(zombies), (pathlib.Path("/proc/1/cmdline").read_bytes().split(b"\0")[0]).decode())
"""


def test_tini_is_pid_1_and_reaps_orphans(docker_engine: DockerEngine, image: str) -> None:
    """The image's entrypoint is tini: pid 1 reaps an orphaned grandchild. Not blind:
    with python as pid 1 (--entrypoint) the same orphan stays a zombie."""
    run = [*docker_engine.run_args(), "--rm", "--network", "host"]
    with_tini = docker_engine.docker(*run, image, "python3", "-c", ZOMBIES).stdout.split()
    assert with_tini == ["0", "/usr/bin/tini"], with_tini
    without = docker_engine.docker(*run, "--entrypoint", "python3", image, "-c",
                                   ZOMBIES).stdout.split()
    assert without == ["1", "python3"], without


def test_docker_stop_reaches_the_command(docker_engine: DockerEngine, image: str,
                                         request: pytest.FixtureRequest) -> None:
    """`docker stop` (SIGTERM) ends a command that sets no handler at once, with the
    status of SIGTERM (143), where pid 1 without an init ignores it and is SIGKILLed
    after the grace period (137)."""
    cid = docker_engine.docker(*docker_engine.run_args(), "--detach", "--network", "host",
                               image, "sleep", "600").stdout.strip()
    t0 = time.monotonic()
    docker_engine.docker("stop", "--time", "30", cid, timeout=60)
    took = time.monotonic() - t0
    code = docker_engine.docker("inspect", "--format", "{{.State.ExitCode}}", cid).stdout.strip()
    docker_engine.docker("rm", cid, check=False)
    assert code == "143" and took < 10, (code, took)
    say(request.config, f"docker stop of `sleep 600` under tini: exit {code} in {took:.1f} s")
