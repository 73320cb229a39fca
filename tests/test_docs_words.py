"""The docs are written for a user with none of the project's history: no internal issue numbers, no words for
the machines the project borrowed; commands a user pastes are the ones that work."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *(ROOT / "docs").glob("*.md")])
# "issue 19", "issue-19", "issues 14", "issue #12954": a number a reader cannot look up. An upstream reference names
# its repository (ggml-org/llama.cpp#123) or is a URL (…/issues/123), which this does not match.
INTERNAL_ISSUE = re.compile(r"\bissues?[ -]#?\d+", re.IGNORECASE)
# The project's own words for the GPU machines it rented for a while.
HISTORY = re.compile(r"\blent\b|\bdevice machine\b|\bdevice time\b", re.IGNORECASE)


def _hits(pattern: re.Pattern[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in PAGES
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) for m in pattern.finditer(line)]


def test_no_internal_issue_numbers():
    assert _hits(INTERNAL_ISSUE) == []


def test_no_words_from_the_projects_history():
    assert _hits(HISTORY) == []


def test_mps_is_explained_where_patches_md_first_uses_it():
    text = (ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    first = text.index("MPS")
    assert "Multi-Process Service" in text[first:first + 200]


def test_readme_installs_from_inside_the_checkout():
    """`pipx install ./arcsplit` read as a path and left a folder named arcsplit in people's working directory."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^pipx install \.$", text, re.MULTILINE), "the install line is `pipx install .`"
    assert "pipx install ./" not in text and "pipx install ./" not in (ROOT / "docs" / "usage.md").read_text()
    assert len(text.splitlines()) < 220


def test_the_matcher_tells_internal_from_upstream():
    assert INTERNAL_ISSUE.search("met (issue 19)") and INTERNAL_ISSUE.search("the issue-19 figures")
    assert INTERNAL_ISSUE.search("issue #12954 tracks")
    assert not INTERNAL_ISSUE.search("ggml-org/llama.cpp#12954 and https://github.com/x/y/issues/12954")
