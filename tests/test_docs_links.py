"""Every relative link in README.md, CHANGELOG.md and docs/ resolves: the file exists, and an
#anchor names a heading of that file (GitHub's heading ids). Links inside code are not links.

Mutation checked: renaming the heading "## Adding a scheme" in docs/schemes.md (docs/README.md
links to #adding-a-scheme) fails test_every_relative_link_resolves; the slug test pins GitHub's
rule for the headings these docs use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images
FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line with inline code removed) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield n, re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def broken_links(path: Path) -> list[str]:
    problems = []
    for n, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{n}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with id #{anchor} in {dest.relative_to(REPO)})")
            elif anchor and dest.is_dir():
                problems.append(f"{where} (an anchor into a directory)")
    return problems


def test_every_relative_link_resolves():
    files = doc_files()
    assert len(files) > 10 and all(f.exists() for f in files)
    problems = [p for f in files for p in broken_links(f)]
    assert not problems, "\n".join(problems)


def test_the_docs_are_linked_from_the_index():
    """Every manual page is reachable from docs/README.md (a page nobody links to is lost)."""
    index = (REPO / "docs" / "README.md").read_text()
    pages = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md"]
    assert pages and [p for p in pages if f"]({p})" not in index] == []


@pytest.mark.parametrize("heading, expected", [
    ("Adding a scheme", "adding-a-scheme"),
    ("PoSE: `train.position_skip`", "pose-trainposition_skip"),
    ("The 2024–2025 schemes: long evaluation at 16k", "the-20242025-schemes-long-evaluation-at-16k"),
    ("The quick preset's compare.md", "the-quick-presets-comparemd"),
    ("Comparing runs: `relpos compare`", "comparing-runs-relpos-compare"),
])
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n[ok](#title) [bad](#nope) [gone](b.md) `[code](c.md)`\n\n```\n[fenced](d.md)\n```\n")
    assert broken_links(page) == ["a.md:3: #nope (no heading with id #nope in a.md)", "a.md:3: b.md (no such file)"]
