"""The user docs: README length, words the docs must not use, links that resolve, and a
docs/performance.md that is exactly what benchmarks/report.py generates. No TVM here."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])

# The project speaks of itself: not of who worked when, no unpublished scripts, no
# times of day, no commit hashes, no issue numbers, no first person.
FORBIDDEN = {
    "a work period": re.compile(r"\bsess(?:ion|ions)\b", re.I),
    "uncommitted": re.compile(r"\buncommitted\b", re.I),
    "a time of day": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s*[–-]\s*\d{1,2}:\d{2}(?::\d{2})?)?\s*UTC\b"),
    "a clock time": re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b"),
    "a commit hash": re.compile(r"`[0-9a-f]{7,40}`|\bcommit\s+[0-9a-f]{7,40}\b"),
    "an issue number": re.compile(r"\bissues?\s*#?\d", re.I),
    "the first person": re.compile(r"(?<![\w`'])(?:I|I'm|I've|I'd)(?![\w`'])|\b[Mm]y\b"),
}
README_ONLY = {"seeds": re.compile(r"(?<!-)\bseeds?\b", re.I)}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, keep word characters, spaces and hyphens,
    spaces to hyphens; a repeated anchor gets -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        m = re.match(r"^(#{1,6})\s+(.+?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it at 250 or fewer and move detail to docs/"


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_no_forbidden_words(path):
    rules = dict(FORBIDDEN, **(README_ONLY if path == README else {}))
    found = [
        f"{rel(path)}:{n}: {what}: {m.group(0)!r}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for what, rx in rules.items()
        for m in rx.finditer(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_relative_links_resolve(path):
    broken = []
    for n, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{rel(path)}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(path)}:{n}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_readme_status_links_to_performance():
    text = README.read_text()
    status = text.split("## Status at a glance", 1)[1].split("\n## ", 1)[0]
    assert "docs/performance.md" in status


def test_performance_md_is_generated(tmp_path):
    out = tmp_path / "performance.md"
    subprocess.run([sys.executable, "-m", "benchmarks.report", "--out", str(out)], cwd=ROOT, check=True, timeout=60)
    committed = (ROOT / "docs" / "performance.md").read_text()
    assert out.read_text() == committed, (
        "docs/performance.md differs from what benchmarks/report.py writes: run `make report` "
        "(python -m benchmarks.report) and commit the result"
    )
