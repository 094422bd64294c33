"""The project as a user installs it: the wheel built from this checkout, installed
into a fresh virtualenv, runs `diloco run tiny` from a directory that has nothing to
do with the checkout. The shipped recipe must resolve from the installed package and
the run's products must land where the user stands (what the image and every cloud
work pool rely on: their working directory is not a checkout).

The fresh virtualenv borrows its dependencies (torch, Prefect, MLflow, ...) from this
test's environment through a plain path line in a ``.pth`` file. Such a line puts
that site-packages on ``sys.path`` without processing the ``.pth`` files inside it,
so the checkout's editable install (an import hook installed by a ``.pth`` there)
stays out: ``import workers`` finds the wheel, which the first test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from cli_runs import ROOT, SHORT
from prefect_home import prefect_home

pytestmark = pytest.mark.slow

#: What the wheel is built from, read from pyproject.toml so a new package is not missed.
PACKAGES = [name.rstrip("*") for name in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, text=True, capture_output=True, **kwargs)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _user_env(home: Path) -> dict[str, str]:
    """The caller's environment without the project's settings, and without
    PYTHONPATH (the checkout must not be reachable)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "DILOCO_", "AWS_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PREFECT_HOME=str(home / "prefect-home"), COLUMNS="120")
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel of this checkout installed (``--no-deps``);
    returns its directory."""
    work = tmp_path_factory.mktemp("wheel")
    # Build from a copy of what the wheel is made of: the checkout gets no build/.
    src = work / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--no-index", "--wheel-dir", str(work / "dist"), str(src)])
    wheel = next((work / "dist").glob("diloco_flows-*.whl"))

    env = work / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
          str(env)])
    purelib = Path(_run([str(env / "bin" / "python"), "-c",
                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "dependencies-from-the-test-environment.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
          "--quiet", "--no-deps", "--no-index", str(wheel)])
    return env


def test_the_installed_wheel_is_what_runs(venv, tmp_path):
    """The packages, the recipes and the `diloco` command come from the wheel in the
    fresh virtualenv; the checkout is on no path."""
    probe = _run([str(venv / "bin" / "python"), "-c", """
import json, sys
import cli, diloco, flows, infra, storage, tracking, workers
from workers.config import RECIPES, recipe_names
print(json.dumps({"modules": [p for m in (cli, diloco, flows, infra, storage, tracking, workers)
                              for p in m.__path__],
                  "recipes": str(RECIPES), "names": recipe_names(), "path": sys.path}))
"""], cwd=tmp_path, env=_user_env(tmp_path))
    found = json.loads(probe.stdout)
    site = str(venv / "lib")
    assert all(m.startswith(site) for m in found["modules"]), found["modules"]
    assert found["recipes"].startswith(site)
    assert found["names"] == ["gpu-150m", "gpu-1b", "small", "tiny"]
    assert not any(p.rstrip("/") == str(ROOT) for p in found["path"]), found["path"]
    assert (venv / "bin" / "diloco").read_text().startswith(f"#!{venv}/bin/python")


def test_diloco_run_tiny_from_an_unrelated_directory(venv, tmp_path):
    """The README's main command, shortened, as a user of the installed package runs
    it: the run finishes, its config is the shipped tiny recipe, and the store,
    the jobs' logs and MLflow's database are under the user's directory.

    Prefect's temporary server starts (from the wheel's flows/server.py) on a home
    whose database is made already (tests/prefect_home.py, once per test process,
    which most files' runs share): 4.5 s of CPU for the server instead of 11 s that
    create and migrate the database; a first run on an empty home is
    tests/test_cli.py's main command."""
    user = tmp_path / "somewhere" / "else"
    user.mkdir(parents=True)
    prefect_home(tmp_path / "prefect-home")  # the PREFECT_HOME of _user_env
    out = subprocess.run([str(venv / "bin" / "diloco"), "run", "tiny", *SHORT], cwd=user,
                         env=_user_env(tmp_path), text=True, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "Traceback" not in out.stderr

    (run,) = (user / "runs").iterdir()
    assert run.name.startswith("tiny-") and f"{run.name} finished in" in out.stdout
    config = json.loads((run / "run.json").read_text())["config"]
    # tiny.yaml's own values (the defaults differ: threads 0, codecs none), under SHORT's
    assert config["name"] == "tiny" and config["train"]["threads"] == 1
    assert (config["sync"]["codec"]["up"], config["sync"]["codec"]["down"]) == ("int4", "int8")
    assert config["train"]["steps"] == 24
    status = json.loads((run / "members" / "aggregator" / "status.json").read_text())
    assert status["state"] == "finished" and status["rounds"] == status["total_rounds"]
    # the jobs ran on the virtualenv's interpreter, from the user's directory
    jobs = json.loads((run / "members" / "launcher.json").read_text())["jobs"]
    assert set(jobs) == {"aggregator", "region-a", "region-b"}
    for job in jobs.values():
        assert job["exit"] == 0 and job["command"][0] == str(venv / "bin" / "python"), job
        assert Path(job["log"]).is_relative_to(user)
    assert (user / "mlflow.db").exists()


def test_diloco_deploy_finds_its_files_in_the_installed_wheel(venv, tmp_path):
    """`diloco deploy` reads infra/prefect.yaml and the work-pool templates from the
    installed package, as on a deploying machine without a checkout."""
    probe = _run([str(venv / "bin" / "python"), "-c", """
import json
from flows.deploy import read_deployments
from infra.deployments import PREFECT_FILE, pool_template
print(json.dumps({"file": str(PREFECT_FILE), "deployments": len(read_deployments(PREFECT_FILE)),
                  "templates": [bool(pool_template(k, "region-a")) for k in ("docker", "kubernetes")]}))
"""], cwd=tmp_path, env=_user_env(tmp_path))
    found = json.loads(probe.stdout)
    assert found["file"].startswith(str(venv / "lib")) and found["deployments"] == 4
    assert found["templates"] == [True, True]
