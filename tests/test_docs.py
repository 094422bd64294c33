"""The repository documents itself: no reference to documents outside it, every
relative link of the README and docs/ reaches a file of the repository, the key
table of docs/design.md says what `storage.layout.KEYS` says, the README stays a
front door that leads into docs/, and docs/ builds as a MkDocs site with no broken
link, anchor or page left out of the navigation (``mkdocs build --strict``)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
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


def test_the_readme_is_a_front_door_into_the_docs():
    """At most 300 lines: the pitch, the two commands, the command table, one
    picture, one results table, and links into docs/ for everything else."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "README.md is a front door: move details to docs/"
    for needed in ("make run", "make test", "## The `diloco` command", "## Architecture",
                   "(docs/results.md)", "(docs/design.md)", "(docs/cli.md)"):
        assert needed in text, f"README.md lost {needed!r}"
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    separators = [line for line in results.splitlines() if line.startswith("|---")]
    assert len(separators) == 1, "the README keeps one headline results table"
    rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
    assert all("`" in row.rsplit("|", 2)[-2] for row in rows[1:]), (
        "every headline figure names the command that printed it")
    linked = set(re.findall(r"\(docs/([a-z0-9-]+\.md)", text))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= linked, f"README.md links to no {sorted(pages - linked)}"


def test_the_guarantees_are_stated_on_the_design_page():
    headings = _anchors(ROOT / "docs" / "design.md")
    for anchor in ("guarantees", "what-a-malicious-or-broken-worker-can-and-cannot-do",
                   "elastic-membership-join-leave-die-straggle"):
        assert anchor in headings, f"docs/design.md has no section #{anchor}"


#: What Python-Markdown leaves unparsed when a page is written for GitHub only (a list
#: nested by 2 spaces, a list or table right under a paragraph): the markers stay text.
_UNPARSED = re.compile(r"\n\s*(?:[-*+]|\d+\.) |\|---|\n\s*\||```")


def test_the_docs_build_as_a_site_with_no_broken_link(tmp_path):
    """mkdocs.yml turns every link to a missing page or anchor, and every page left
    out of the nav, into a warning, and --strict fails on warnings; every list and
    table of every page is rendered as one."""
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    pages = sorted((ROOT / "docs").glob("*.md"))
    unparsed = []
    for page in pages:
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.exists(), f"{page.name} was not built"
        body = built.read_text(encoding="utf-8")
        body = body[body.find("<article"):body.find("</article>")]
        body = re.sub(r"<pre.*?</pre>|<code>.*?</code>", "", body, flags=re.S)
        for block in re.findall(r"<(?:p|li)>(.*?)</(?:p|li)>", body, flags=re.S):
            if _UNPARSED.search(block):
                unparsed.append(f"{page.name}: {html.unescape(block[:120])!r}")
    assert not unparsed, ("left as text by MkDocs (nest lists by 4 spaces; a blank line "
                          "before a list or table):\n" + "\n".join(unparsed))


def test_the_configuration_reference_is_generated_from_the_config_classes():
    """docs/configuration.md is what scripts/config_reference.py writes from RunConfig
    and SyncConfig now: a field added, renamed or described anew shows there."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"),
                          "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
