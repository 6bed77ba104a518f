"""The project's Markdown links: every relative link of the README, the changelog and docs/ names a
file that exists, and a link's ``#anchor`` into a Markdown file names one of its headings (as
GitHub makes them), outside code blocks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped,
    each space a ``-``; a repeated heading's anchor gets ``-1``, ``-2``, ... after the first."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = 0
        while (f"{slug}-{n}" if n else slug) in found:
            n += 1
        found.add(f"{slug}-{n}" if n else slug)
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    broken = []
    for target, anchor in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}#{anchor}: no such heading")
    return broken


def test_every_link_of_the_docs_resolves():
    assert len(PAGES) > 10
    found = {str(page.relative_to(ROOT)): broken_links(page) for page in PAGES}
    assert not {page: links for page, links in found.items() if links}


def test_the_check_sees_a_broken_link(tmp_path):
    other = tmp_path / "other.md"
    other.write_text("# Title\n\n## A heading, with `code`\n\n## A heading, with `code`\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    links = [
        "[a](other.md#a-heading-with-code)",
        "[b](other.md#a-heading-with-code-1)",
        "[c](#top)",
        "[d](https://example.com/x#y)",
        "[e](missing.md)",
        "[f](other.md#no-such-heading)",
        "[g](other.md#not-a-heading)",
        "[h](other.md#a-heading-with-code-2)",
    ]
    page.write_text("# Top\n\n" + "\n".join(links) + "\n\n```\n[i](missing-in-code.md)\n```\n")
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#no-such-heading: no such heading",
        "other.md#not-a-heading: no such heading",
        "other.md#a-heading-with-code-2: no such heading",
    ]
