# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every relative link in README.md and docs/ leads somewhere.

A link to a file must name one in this tree; a link with ``#anchor`` must
name a heading of its target, as GitHub makes anchors from headings. Links
to other sites are not followed.
"""

import re
from pathlib import Path

import pytest
import tree_imports

_FENCE = re.compile(r"^ *```.*?^ *```$", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and reference definitions: [name]: target
_INLINE = re.compile(r"\]\(([^)\s]+)\)")
_DEFINITION = re.compile(r"^\[[^\]]+\]: (\S+)", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6} (.+?) *#*$", re.MULTILINE)


def doc_files() -> list[Path]:
    root = tree_imports.REPO_ROOT
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose(path: Path) -> str:
    """The file's text without code blocks, whose lines are not links."""
    return _FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of ``path``.

    Lowercased, with punctuation other than ``-`` and ``_`` dropped and each
    space made a ``-``; a repeated heading gets ``-1``, ``-2``, ...
    """
    found: set[str] = set()
    for heading in _HEADING.findall(prose(path)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def links(path: Path) -> list[str]:
    text = _CODE.sub("", prose(path))
    return _INLINE.findall(text) + _DEFINITION.findall(text)


def test_anchors_follow_github() -> None:
    readme = tree_imports.REPO_ROOT / "README.md"
    assert "what-breaks-on-flashinfer-python-074" in anchors(readme)
    assert "install-and-test-any-machine-no-gpu-needed" in anchors(readme)


@pytest.mark.parametrize(
    "path", doc_files(), ids=lambda p: str(p.relative_to(tree_imports.REPO_ROOT))
)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for link in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        where = (path.parent / target).resolve() if target else path
        if not where.exists():
            broken.append(f"{link}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, f"{path.name}: " + "; ".join(broken)
