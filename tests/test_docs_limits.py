"""The limits a newcomer and a maintainer rely on, kept by a test rather than by memory:
a one-screen README, a design doc short enough to keep true, comments that say why
(no issue numbers in src/), and a changelog that names every deprecated spelling."""

from __future__ import annotations

import pathlib
import re

from lazyckpt.options import DEPRECATED

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _lines(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def test_the_readme_is_one_screen():
    assert _lines("README.md") <= 150


def test_the_design_doc_stays_short():
    assert _lines("docs/ARCHITECTURE.md") <= 600


def test_no_issue_number_in_src():
    pattern = re.compile(r"\b[Ii]ssues? ?#?\d+|\(#\d+\)")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in sorted((ROOT / "src" / "lazyckpt").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_changelog_names_every_deprecated_spelling():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    missing = [name for name in DEPRECATED if f"`{name}" not in changelog]
    assert not missing, f"CHANGELOG.md does not name the deprecated keywords {missing}"
