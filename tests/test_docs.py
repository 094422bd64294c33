"""The repository documents itself: no reference to documents outside it, every
relative link of the README and docs/ reaches a file of the repository, and the key
table of docs/design.md says what `storage.layout.KEYS` says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from storage import layout

ROOT = Path(__file__).resolve().parent.parent

#: Documents that live outside the repository; a user has only the repository.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|ALGORITHMS\.md|STYLE\.md")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # pragma: no cover - not a checkout
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.split("\0")
            if name and not name.startswith(".venv/") and (ROOT / name).is_file()]


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_tracked_file_cites_a_document_outside_the_repository():
    me = Path(__file__).resolve()
    found = []
    for path in _tracked():
        if path.resolve() == me:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "cites a document outside the repository (use docs/):\n" + "\n".join(found)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if heading := re.match(r"^#{1,6}\s+(.*)$", line):
            text = heading[1].strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_of_the_repository(doc):
    broken = []
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve()
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {path}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_key_table_of_the_design_page_is_layout_keys():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    table = text.split("<!-- keys:begin -->", 1)[1].split("<!-- keys:end -->", 1)[0]
    rows = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    documented = []
    for row in rows:
        key, writer, what = (cell.strip() for cell in row.strip("|").split("|"))
        owner, _, flags = writer.partition(" (")
        flags = set(flags.rstrip(")").split(", ")) if flags else set()
        documented.append((key.strip("`"), owner, what, "prunes" in flags, "gc" in flags))
    declared = [(p.template, p.owner, p.what, p.prunes, p.collected) for p in layout.KEYS]
    assert documented == declared, (
        "docs/design.md's key table differs from storage/layout.py KEYS; update the table")
