"""The README's contents list names every section, in order, with GitHub's anchors."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _anchor(title: str) -> str:
    # GitHub's rule: lower case, drop what is not a word character, space or hyphen,
    # spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_contents_list_matches_the_headings():
    text = README.read_text()
    head, sep, body = text.partition("\nContents:\n")
    assert sep, "README has no 'Contents:' list"
    listed = re.findall(r"^( *)- \[(.+)\]\(#([^)]+)\)$", body.split("\n\n## ", 1)[0], flags=re.M)
    headings = re.findall(r"^(##+) (.+)$", body, flags=re.M)
    assert [(len(indent) // 2 + 2, title) for indent, title, _ in listed] == [(len(h), t) for h, t in headings]
    assert [a for _, _, a in listed] == [_anchor(t) for _, t in headings]
