"""The house's layout holds: one room per outside system, layers pointing one way,
no import circles, nothing in the product importing benchmarks or tests.

Read from the source (every ``import`` statement, at module level or inside a
function), so a new import that breaks a rule fails here with the file and line,
before a reader meets it.

    cli -> flows -> tracking -> workers -> diloco -> storage

And no module reaches into another object's private members (see `PRIVATE_RULE`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Each product package and the first-party packages it may import (itself included).
LAYERS = {
    "storage": {"storage"},
    "diloco": {"diloco", "storage"},
    "workers": {"workers", "diloco", "storage"},
    "tracking": {"tracking", "workers", "diloco", "storage"},
    "flows": {"flows", "tracking", "workers", "diloco", "storage"},
    "cli": {"cli", "flows", "tracking", "workers", "diloco", "storage", "infra"},
    # bucket and work-pool administration: beside the training path, never under it
    "infra": {"infra", "storage"},
}
FIRST_PARTY = {*LAYERS, "benchmarks", "tests", "examples", "scripts"}

#: An outside system and the only packages that may import it.
ROOMS = {
    "prefect": {"flows"},
    "mlflow": {"tracking"},
    "matplotlib": {"tracking"},
    "typer": {"cli"},
    "rich": {"cli"},
    "zarr": {"storage"},
    "s3fs": {"storage"},
    "boto3": {"storage", "infra"},
    "botocore": {"storage", "infra"},
    "aiobotocore": {"storage"},
    # fsspec is the store's; workers reads the user's text sources through it too
    # (any fsspec URL is a corpus), which is reading files, not the exchange.
    "fsspec": {"storage", "workers"},
    "torch": {"diloco", "workers", "flows", "tracking", "cli"},
}


PRIVATE_RULE = """\
In diloco/, storage/, workers/, flows/, cli/ and tracking/, an attribute access
``X.name`` where ``name`` starts with one underscore (``_x``, and ``__x`` without the
trailing pair; dunders like ``__dict__`` are public protocol) is allowed only when
``X`` is ``self``, ``cls`` or ``super()``. Reading or writing any other object's
``_name`` (another module's ``_helper``, another class's ``_field``, an outside
library's internals) fails here, unless listed in PRIVATE_EXCEPTIONS with its reason.
A module's own private functions and names, called bare (``_helper()``), are not
attribute accesses and stay free. Make the member public, with a docstring, or pass a
narrow part instead."""

#: (file, the access as written) -> why it may stay.
PRIVATE_EXCEPTIONS = {
    ("storage/tied.py", "os._exit"): "the standard library's exit without cleanup",
    ("workers/group_exit.py", "os._exit"): "the standard library's exit without cleanup",
    ("flows/__init__.py", "os._exit"): "the standard library's exit without cleanup",
    ("flows/worker_job.py", "os._exit"): "the standard library's exit without cleanup",
    ("storage/backends.py", "type(fs)._strip_protocol"):
        "fsspec's classmethod for a path without its protocol (its documented API)",
    ("storage/backends.py", "fs._call_s3"):
        "s3fs's one way to call an S3 operation it wraps no method for",
    ("storage/multipart.py", "fs._call_s3"):
        "s3fs's one way to call an S3 operation it wraps no method for (multipart, "
        "conditional writes)",
    ("storage/multipart.py", "fs._cat_file"):
        "fsspec's async API: its coroutines are the underscored names",
    ("storage/objectstore.py", "self._fs._pipe_file"):
        "fsspec's async API: its coroutines are the underscored names",
    **{("storage/objectstore.py", f"view.{name}"):
       "ObjectStore.child builds another ObjectStore: the class's own fields"
       for name in ("_kind", "_traffic_prefix", "_fs", "_root")},
    ("flows/server.py", "base._instances"):
        "Prefect's registry of its server subprocesses; it has no public one, and "
        "tying the server to this process must replace its default entry",
    ("tracking/exit_threads.py", "sys._current_frames"):
        "the standard library's one way to read another thread's stack (documented)",
    ("tracking/parent_run.py", "meta.source._get_source_type"):
        "MLflow's Dataset entity needs the source type and DatasetSource offers it "
        "only so",
}


def _private_accesses(path: Path) -> list[tuple[str, int]]:
    """(the access as written, line) of every access in ``path`` against
    `PRIVATE_RULE`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # a dunder: public protocol
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"):
            continue
        out.append((ast.unparse(node), node.lineno))
    return out


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
            # `from pkg import module` imports the module too
            out += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _product_files() -> dict[str, list[Path]]:
    return {pkg: sorted((ROOT / pkg).rglob("*.py")) for pkg in LAYERS}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_every_package_imports_only_the_layers_below_it() -> None:
    wrong = []
    for pkg, files in _product_files().items():
        for path in files:
            for module, line in _imports(path):
                top = module.split(".")[0]
                if top in FIRST_PARTY and top not in LAYERS[pkg]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(set(wrong)))


def test_each_outside_system_stays_in_its_room() -> None:
    wrong = []
    for pkg, files in _product_files().items():
        for path in files:
            for module, line in _imports(path):
                allowed = ROOMS.get(module.split(".")[0])
                if allowed is not None and pkg not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "outside systems out of their room:\n" + "\n".join(sorted(set(wrong)))


def test_no_import_circles() -> None:
    """Between the product's modules and the benchmarks', counting imports inside
    functions too: a circle hidden in a function is still two modules that need each
    other."""
    files = [p for ps in _product_files().values() for p in ps]
    files += sorted((ROOT / "benchmarks").rglob("*.py"))
    known = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in files:
        here = _module_name(path)
        for module, _line in _imports(path):
            if module in known and module != here and not here.startswith(f"{module}."):
                graph[here].add(module)
    # Tarjan's strongly connected components: any with two or more modules is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(known):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("pkg", sorted(LAYERS))
def test_no_product_file_is_over_500_lines_without_saying_why(pkg: str) -> None:
    long = []
    for path in _product_files()[pkg]:
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 500 and "over 500 lines" not in doc:
            long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, f"split these by job, or say in the docstring why not: {long}"


def test_no_module_reaches_into_another_objects_private_members() -> None:
    wrong, used = [], set()
    for files in _product_files().values():
        for path in files:
            rel = path.relative_to(ROOT).as_posix()
            for access, line in _private_accesses(path):
                if (rel, access) in PRIVATE_EXCEPTIONS:
                    used.add((rel, access))
                else:
                    wrong.append(f"{rel}:{line} {access}")
    assert not wrong, PRIVATE_RULE + "\n\nagainst it:\n" + "\n".join(sorted(wrong))
    stale = sorted(f"{f}: {a}" for f, a in set(PRIVATE_EXCEPTIONS) - used)
    assert not stale, f"exceptions no longer needed (remove them): {stale}"


def test_the_rules_catch_what_they_should(tmp_path: Path) -> None:
    """The checks above would see a violation (they are not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from benchmarks import run_all\n"
                   "    import mlflow.entities\n")
    found = {m for m, _ in _imports(bad)}
    assert {"benchmarks", "benchmarks.run_all", "mlflow.entities"} <= found
    nosy = tmp_path / "nosy.py"
    nosy.write_text("class A(B):\n    def f(self, loop):\n        self._x = cls._y\n"
                    "        super()._z()\n        loop.__dict__, loop.__x\n"
                    "        loop._status('running')\n        return self.a._b, _helper()\n")
    assert sorted(a for a, _ in _private_accesses(nosy)) == [
        "loop.__x", "loop._status", "self.a._b"]


def test_reading_a_run_imports_no_torch() -> None:
    """`diloco status`, `cancel` and `gc` read a run's manifest and objects only: they
    start in about 1 s of CPU instead of 2.6 s while torch stays out of them
    (workers/model_config.py holds the model's shape apart from the model)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import sys, cli.app, cli.status, cli.gc, diloco.run, workers.config, "
            "workers.locate\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_the_local_jobs_import_no_prefect() -> None:
    """The local launcher's jobs (``python -m flows.worker_job`` and ``-m
    flows.aggregator_job``) are not flow runs: each would spend a second of CPU
    importing Prefect for nothing, and a line they log goes to their own log."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import logging, sys, flows.worker_job, flows.aggregator_job\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "from flows.jobs import flow_log\n"
            "went = flow_log('a line %s', 1, fallback=logging.getLogger('job'))\n"
            "print(went, sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False []", out.stdout[:500]
    assert "a line 1" in out.stderr
