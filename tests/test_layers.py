"""The house's layout holds: one room per outside system, layers pointing one way,
no import circles, nothing in the product importing benchmarks or tests.

Read from the source (every ``import`` statement, at module level or inside a
function), so a new import that breaks a rule fails here with the file and line,
before a reader meets it.

    cli -> flows -> tracking -> workers -> diloco -> storage
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


def test_the_rules_catch_what_they_should(tmp_path: Path) -> None:
    """The checks above would see a violation (they are not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from benchmarks import run_all\n"
                   "    import mlflow.entities\n")
    found = {m for m, _ in _imports(bad)}
    assert {"benchmarks", "benchmarks.run_all", "mlflow.entities"} <= found
