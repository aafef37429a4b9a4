"""The documentation: the site builds with no warning, and every relative link resolves.

Links are checked on disk, as a reader of the repository follows them: a relative link or
image in README.md, CHANGELOG.md, benchmarks/RESULTS.md, docs/**/*.md or a folder's
README.md must name an existing file, and an anchor into a Markdown file must be one of its
headings (GitHub's slugs, which the site uses too: mkdocs.yml).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from pymdownx.slugs import slugify

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted(
    {
        REPO / "README.md",
        REPO / "CHANGELOG.md",
        REPO / "benchmarks" / "RESULTS.md",
        *(REPO / "docs").rglob("*.md"),
        *REPO.glob("*/README.md"),
        *REPO.glob("*/*/README.md"),
    }
)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_slug = slugify(case="lower")


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def anchors(path: pathlib.Path) -> set[str]:
    """The heading anchors of a Markdown file (duplicates get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    result = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2)).replace("`", "")
        slug = _slug(text, "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


def broken_links(page: pathlib.Path) -> list[str]:
    """Each relative link of ``page`` whose file or anchor does not exist."""
    broken = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                continue  # a URL or an absolute path: not checked here
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{target} (no heading '{anchor}' in {file.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_images_resolve(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-yes) [bad](other.md#nope) ![img](missing.png)\n"
        "```\n[in code](not_checked.md)\n```\n[url](https://example.com) [self](#top)\n# Top\n"
    )
    assert broken_links(page) == [
        "other.md#nope (no heading 'nope' in other.md)",
        "missing.png (no such file)",
    ]


def test_the_site_builds_without_warnings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    home = (tmp_path / "site" / "index.html").read_text()
    assert "What you can do" in home  # README.md is the home page
    assert (tmp_path / "site" / "api" / "moe.html").read_text().count(
        "MoeLayer"
    ) > 1  # API from docstrings
