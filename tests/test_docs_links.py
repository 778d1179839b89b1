"""Every relative link of the repository's Markdown reaches a file that exists, and its `#anchor` a heading there:
the documentation is split over README.md, docs/ and bench/RESULTS.md, and a moved section must not leave a
link behind."""

import re
from pathlib import Path

from tests.deploy.files import REPO, github_slug

DOCUMENTS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*.md")])
DOCUMENTS += sorted((REPO / "deploy").rglob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The text outside fenced code blocks and code spans (neither holds links)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The anchor of every heading of a Markdown file; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for title in re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE):
        slug, n = github_slug(title), 0
        while (slug if n == 0 else f"{slug}-{n}") in found:
            n += 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_relative_link_and_anchor_of_the_docs_exists() -> None:
    assert len(DOCUMENTS) >= 7
    broken = []
    for document in DOCUMENTS:
        for target in LINK.findall(_prose(document)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (document.parent / file).resolve() if file else document
            where = f"{document.relative_to(REPO)} -> {target}"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{where}: no heading #{anchor}")
    assert broken == []
