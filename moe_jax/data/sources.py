"""Data sources with the features and split names of TFDS ``c4/multilingual``.

``make_source(language, **settings)`` returns the raw-text source of one language
(``None``: all languages) with canonical splits ``train`` and ``validation``; each example
is ``{"text": tf.string scalar}``. The settings choose the corpus:

* ``corpus="embedded"`` (default, every local run): the UDHR corpus committed under
  ``moe_jax/data/embedded/udhr`` (20 languages; ``SOURCE.md`` there), read with
  ``seqio.FileDataSource``.
* ``corpus="tfds"``: ``seqio.TfdsDataSource`` over ``tfds_name`` (``c4/multilingual:3.1.0``
  by default, per-language splits ``<lang>`` / ``<lang>-validation``; or a single-language
  config such as ``c4/en:3.1.0`` with splits ``train`` / ``validation``) read from
  ``data_dir`` (local or ``gs://``; the ``--tfds_data_dir`` of T5X). Never downloads or
  generates data: a ``data_dir`` without the prepared dataset is refused with its path.
* ``corpus="text"``: the user's own plain-text files, one document per line, read with
  ``seqio.TextLineDataSource`` from ``train_patterns`` (glob patterns, local or ``gs://``;
  a ``{label: pattern(s)}`` mapping gives one group per language or domain, so routing
  analyses can group by label). The validation split is ``validation_patterns`` (same
  form) when given, else a held-out ``validation_fraction`` of the training lines, chosen
  by a hash of each line (the same line always lands in the same split). A pattern matching no file
  is refused naming the pattern.

The settings every task reads with are those :func:`select_settings` was given (the front
door, :mod:`moe_jax.runtime.configured`, selects gin's ``make_source.*`` bindings, or a
recorded run's ``data.source``); :func:`make_source_settings` returns them with defaults
filled in. ``corpus_groups()`` lists the group labels of the selected corpus (embedded and
mC4: language codes; text: the labels of ``train_patterns``); :func:`selected_source`
reads one group of it.

Tasks hold a ``tasks.CorpusSource``, which resolves :func:`selected_source` when data is
requested, so a selection made after ``moe_jax.data.tasks`` was imported takes effect. This
module reads no gin and imports neither TensorFlow nor seqio (``moe_jax.data.readers``
builds the sources), so gin files that configure the data can be parsed where only the
model is needed.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import seqio

EMBEDDED_DIR = pathlib.Path(__file__).resolve().parent / "embedded" / "udhr"
CORPORA = ("embedded", "tfds", "text")
SPLITS = ("train", "validation")
TEXT_GROUP = "text"  # the one group's label when train_patterns is a pattern or a list
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

# Patterns as gin binds them: one glob, a list of globs, or {label: glob or list of globs}.
Patterns = str | Sequence[str] | Mapping[str, str | Sequence[str]]


def embedded_languages() -> tuple[str, ...]:
    """mC4 codes of the languages in the embedded corpus (one ``<lang>.txt`` file each)."""
    return tuple(sorted(p.stem for p in EMBEDDED_DIR.glob("*.txt") if "-" not in p.stem))


def mc4_languages() -> tuple[str, ...]:
    """The 107 language splits of TFDS ``c4/multilingual`` (without ``und``)."""
    from tensorflow_datasets.text import c4  # pylint: disable=g-import-not-at-top

    return tuple(c4.MC4_LANGUAGES)


def _embedded_files(language: str | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((split, (file, ...)), ...) of ``language`` (``None``: all) in the embedded corpus."""
    available = embedded_languages()
    if language is not None and language not in available:
        raise ValueError(
            f"language {language!r} is not in the embedded corpus "
            f"({EMBEDDED_DIR}); available: {available}. Bind "
            "make_source.corpus='tfds' for the other mC4 languages."
        )
    languages = available if language is None else (language,)
    return (
        ("train", tuple(str(EMBEDDED_DIR / f"{lang}.txt") for lang in languages)),
        ("validation", tuple(str(EMBEDDED_DIR / f"{lang}-validation.txt") for lang in languages)),
    )


def _tfds_split_map(tfds_name: str, language: str | None) -> Mapping[str, str]:
    if not tfds_name.startswith("c4/multilingual"):
        if language not in (None, "en"):
            raise ValueError(
                f"make_source.tfds_name={tfds_name!r} has no per-language splits; "
                f"language {language!r} needs c4/multilingual"
            )
        return {"train": "train", "validation": "validation"}
    languages = mc4_languages() if language is None else (language,)
    if language is not None and language not in mc4_languages():
        raise ValueError(f"language {language!r} is not an mC4 language: {mc4_languages()}")
    return {
        "train": "+".join(languages),
        "validation": "+".join(f"{lang}-validation" for lang in languages),
    }


Groups = tuple[tuple[str, tuple[str, ...]], ...]  # ((label, (pattern, ...)), ...), hashable


def _groups(patterns: Patterns | None, option: str) -> Groups:
    """``patterns`` as ``((label, (pattern, ...)), ...)``; a bare pattern or list is the one
    group :data:`TEXT_GROUP`. Refuses labels that could not name a task."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = {TEXT_GROUP: patterns}
    elif not isinstance(patterns, Mapping):
        patterns = {TEXT_GROUP: tuple(patterns)}
    groups = []
    for label, given in patterns.items():
        if not isinstance(label, str) or not _LABEL.fullmatch(label):
            raise ValueError(
                f"{option}: label {label!r} must be letters, digits, '_' or '-' "
                "(it names the group's task, text_<label>_<objective>)"
            )
        group = (given,) if isinstance(given, str) else tuple(given)
        if not group or not all(isinstance(p, str) and p for p in group):
            raise ValueError(
                f"{option}[{label!r}]: expected a file pattern or a list of them, got {group!r}"
            )
        groups.append((label, group))
    if not groups:
        raise ValueError(f"{option} is empty: give a file pattern or {{label: pattern}}")
    return tuple(groups)


def source_settings(
    corpus: str = "embedded",
    tfds_name: str = "c4/multilingual:3.1.0",
    data_dir: str | None = None,
    train_patterns: Patterns | None = None,
    validation_patterns: Patterns | None = None,
    validation_fraction: float | None = None,
) -> dict[str, Any]:
    """:func:`make_source`'s settings as a dict, defaults filled in (gin: ``make_source.*``).

    ``train_patterns`` / ``validation_patterns`` / ``validation_fraction`` configure
    ``corpus='text'`` (module docstring; ``validation_fraction`` applies only without
    ``validation_patterns``) and are ignored otherwise.
    """
    return {
        "corpus": corpus,
        "tfds_name": tfds_name,
        "data_dir": data_dir,
        "train_patterns": train_patterns,
        "validation_patterns": validation_patterns,
        "validation_fraction": validation_fraction,
    }


def make_source(language: str | None, **settings: Any) -> seqio.DataSource:
    """The raw-text source of ``language`` (a group label; ``None``: all groups) under
    ``settings`` (:func:`source_settings`' keyword arguments).

    Raises:
      ValueError: naming ``make_source.corpus`` / the language when they are unknown.
      FileNotFoundError: naming a text pattern that matches no file.
    """
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import readers

    options = source_settings(**settings)
    corpus = options["corpus"]
    train = _groups(options["train_patterns"], "make_source.train_patterns")
    validation = _groups(options["validation_patterns"], "make_source.validation_patterns")
    if corpus == "embedded":
        return readers.embedded_source(_embedded_files(language))
    if corpus == "tfds":
        splits = _tfds_split_map(options["tfds_name"], language)
        return readers.tfds_source(options["tfds_name"], options["data_dir"], tuple(splits.items()))
    if corpus == "text":
        return readers.text_source(language, train, validation, options["validation_fraction"])
    raise ValueError(f"make_source.corpus={corpus!r} is not one of {CORPORA}")


# The provider of the selected settings (select_settings); none selected: the defaults.
_SELECTED: list[Callable[[], Mapping[str, Any]]] = [dict]


def select_settings(provider: Callable[[], Mapping[str, Any]]) -> None:
    """Makes ``provider()`` (:func:`source_settings`' keyword arguments, read at each use)
    the settings every task's source is read with."""
    _SELECTED[0] = provider


def make_source_settings() -> dict[str, Any]:
    """The selected settings (:func:`select_settings`), defaults filled in."""
    return source_settings(**_SELECTED[0]())


def selected_source(language: str | None) -> seqio.DataSource:
    """``make_source(language)`` with the selected settings."""
    return make_source(language, **make_source_settings())


def describe_corpus() -> str:
    """The selected corpus, in words: ``the embedded UDHR corpus (20 languages)``,
    ``TFDS c4/multilingual:3.1.0``, ``the text files train_patterns=...``."""
    settings = make_source_settings()
    corpus = settings["corpus"]
    if corpus == "embedded":
        return f"the embedded UDHR corpus ({len(embedded_languages())} languages)"
    if corpus == "tfds":
        return f"TFDS {settings['tfds_name']}"
    return f"the text files train_patterns={settings['train_patterns']!r}"


def is_text_corpus() -> bool:
    """Whether the user's text files are selected (``make_source.corpus = 'text'``)."""
    return make_source_settings()["corpus"] == "text"


def corpus_groups() -> tuple[str, ...]:
    """The group labels of the selected corpus, each a valid ``selected_source(label)``:
    the embedded corpus' languages, mC4's languages (``('en',)``
    for a one-language TFDS config such as ``c4/en``) or the text corpus' labels in
    ``make_source.train_patterns`` order (``('text',)`` for a bare pattern)."""
    settings = make_source_settings()
    corpus = settings["corpus"]
    if corpus == "embedded":
        return embedded_languages()
    if corpus == "tfds":
        return mc4_languages() if settings["tfds_name"].startswith("c4/multilingual") else ("en",)
    if corpus == "text":
        return tuple(
            label for label, _ in _groups(settings["train_patterns"], "make_source.train_patterns")
        )
    raise ValueError(f"make_source.corpus={corpus!r} is not one of {CORPORA}")
