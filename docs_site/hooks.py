"""MkDocs hooks: the site is built from the repository's own Markdown, unchanged on disk.

* ``README.md`` is the site's home page (``index.md``); ``CHANGELOG.md`` and
  ``benchmarks/RESULTS.md`` are pages at the same paths as in the repository.
* A relative link is resolved as it resolves on disk (from the file's place in the
  repository) and rewritten to the page or file of the site that holds the target; a link to
  a repository file the site does not hold (a gin file, a script) becomes its path in code
  font. So README.md and docs/*.md keep links that work when read on disk or on a forge,
  and the site builds with ``--strict``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
# repository path -> the page's path in the site (src_uri)
EXTRA_PAGES = {
    "README.md": "index.md",
    "CHANGELOG.md": "CHANGELOG.md",
    "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
}
# [text](target) and ![alt](target); targets without spaces, optionally "title"
LINK = re.compile(r"(!?\[[^\]\n]*\])\(([^)\s]+)(\s+\"[^\"]*\")?\)")
DOCS = "docs"


def on_files(files: Files, config) -> Files:
    """Adds README.md (as the home page), CHANGELOG.md and benchmarks/RESULTS.md."""
    for repo_path, src_uri in EXTRA_PAGES.items():
        content = (REPO / repo_path).read_text(encoding="utf-8")
        files.append(File.generated(config, src_uri, content=content))
    return files


def _repo_path_of(src_uri: str) -> str:
    """The repository path of a page given by its site path."""
    for repo_path, uri in EXTRA_PAGES.items():
        if uri == src_uri:
            return repo_path
    return f"{DOCS}/{src_uri}"


def _site_path_of(repo_path: str) -> str | None:
    """The site path (src_uri) holding a repository file, or None when the site has none."""
    if repo_path in EXTRA_PAGES:
        return EXTRA_PAGES[repo_path]
    if repo_path.startswith(f"{DOCS}/") and (REPO / repo_path).exists():
        return repo_path[len(DOCS) + 1 :]
    return None


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrites each relative link from the page's repository place to its site place."""
    src_uri = page.file.src_uri
    page_repo = _repo_path_of(src_uri)

    def rewrite(match: re.Match) -> str:
        label, target, title = match.group(1), match.group(2), match.group(3) or ""
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)  # URL, in-page anchor or absolute path
        path, _, anchor = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), path))
        site_target = _site_path_of(repo_target)
        if site_target is None:
            return f"`{repo_target}`" if label.startswith("[") else match.group(0)
        if (REPO / repo_target).is_dir():
            site_target = posixpath.join(site_target, "index.md")
        relative = posixpath.relpath(site_target, posixpath.dirname(src_uri) or ".")
        return f"{label}({relative}{'#' + anchor if anchor else ''}{title})"

    return LINK.sub(rewrite, markdown)
