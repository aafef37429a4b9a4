"""Data sources with the features and split names of TFDS ``c4/multilingual``, chosen from gin.

``make_source(language)`` returns the raw-text source of one language (``None``: all
languages) with canonical splits ``train`` and ``validation``; each example is
``{"text": tf.string scalar}``. The corpus is a gin binding:

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

``corpus_groups()`` lists the group labels of the corpus gin selects (embedded and mC4:
language codes; text: the labels of ``train_patterns``); ``make_source(label)`` reads one.

Tasks hold a ``CorpusSource``, which resolves ``make_source`` when data is requested, so
gin bindings parsed after ``moe_jax.data.tasks`` was imported take effect.
"""

from __future__ import annotations

import functools
import inspect
import pathlib
import re
from collections.abc import Mapping, Sequence

import gin
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

EMBEDDED_DIR = pathlib.Path(__file__).resolve().parent / "embedded" / "udhr"
CORPORA = ("embedded", "tfds", "text")
SPLITS = ("train", "validation")
TEXT_GROUP = "text"  # the one group's label when train_patterns is a pattern or a list
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_HASH_BUCKETS = 10_000  # held-out validation resolution: fractions in steps of 1e-4

# Patterns as gin binds them: one glob, a list of globs, or {label: glob or list of globs}.
Patterns = str | Sequence[str] | Mapping[str, str | Sequence[str]]


def embedded_languages() -> tuple[str, ...]:
    """mC4 codes of the languages in the embedded corpus (one ``<lang>.txt`` file each)."""
    return tuple(sorted(p.stem for p in EMBEDDED_DIR.glob("*.txt") if "-" not in p.stem))


def mc4_languages() -> tuple[str, ...]:
    """The 107 language splits of TFDS ``c4/multilingual`` (without ``und``)."""
    from tensorflow_datasets.text import c4  # pylint: disable=g-import-not-at-top

    return tuple(c4.MC4_LANGUAGES)


def _read_text_lines(path: tf.Tensor) -> tf.data.Dataset:
    return tf.data.TextLineDataset(path).map(lambda line: {"text": line})


def _count_lines(paths: Sequence[str]) -> int:
    return sum(pathlib.Path(p).read_bytes().count(b"\n") for p in paths)


def _embedded_source(language: str | None) -> seqio.DataSource:
    available = embedded_languages()
    if language is not None and language not in available:
        raise ValueError(
            f"language {language!r} is not in the embedded corpus "
            f"({EMBEDDED_DIR}); available: {available}. Bind "
            "make_source.corpus='tfds' for the other mC4 languages."
        )
    languages = available if language is None else (language,)
    files = {
        "train": [str(EMBEDDED_DIR / f"{lang}.txt") for lang in languages],
        "validation": [str(EMBEDDED_DIR / f"{lang}-validation.txt") for lang in languages],
    }
    return seqio.FileDataSource(
        read_file_fn=_read_text_lines,
        split_to_filepattern=files,
        num_input_examples={split: _count_lines(paths) for split, paths in files.items()},
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


class _CheckedTfdsSource(seqio.TfdsDataSource):
    """``TfdsDataSource`` that never generates data and names ``data_dir`` when it is absent."""

    def __init__(self, tfds_name: str, data_dir: str | None, splits: Mapping[str, str]):
        super().__init__(
            tfds_name=tfds_name, tfds_data_dir=data_dir, splits=dict(splits), read_only=True
        )
        self._data_dir = data_dir

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        **unused,
    ) -> tf.data.Dataset:
        try:
            return super().get_dataset(
                split=split, shuffle=shuffle, seed=seed, shard_info=shard_info
            )
        except (AssertionError, FileNotFoundError, tfds.core.DatasetNotFoundError) as e:
            where = self._data_dir or "the default TFDS data_dir (~/tensorflow_datasets)"
            raise FileNotFoundError(
                f"TFDS dataset {self.tfds_dataset.name!r} is not prepared in {where}: set "
                "make_source.data_dir (gin TFDS_DATA_DIR) to the directory holding it"
            ) from e

    def num_input_examples(self, split: str) -> int | None:
        """The split's size, or ``None`` where TFDS records none (seqio then skips its
        in-memory caching; ``tfds.testing.mock_data`` builders have empty split info)."""
        try:
            return super().num_input_examples(split)
        except KeyError:
            return None


_Groups = tuple[tuple[str, tuple[str, ...]], ...]  # ((label, (pattern, ...)), ...), hashable


def _groups(patterns: Patterns | None, option: str) -> _Groups:
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


def _files(pattern: str, option: str) -> list[str]:
    """The files ``pattern`` matches (``tf.io.gfile.glob``: local or ``gs://``), or a
    ``FileNotFoundError`` naming the pattern and the option that set it."""
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise FileNotFoundError(f"{option}: the pattern {pattern!r} matches no file")
    return files


class TextFilesSource(seqio.TextLineDataSource):
    """The user's text files, one document per line, as ``{"text": tf.string}`` examples.

    With ``validation_fraction`` the ``train`` and ``validation`` splits read the same files
    and keep the lines whose hash bucket (``tf.strings.to_hash_bucket_fast`` over
    10 000 buckets) is at/above or below ``validation_fraction * 10 000``.
    """

    def __init__(
        self, split_to_files: Mapping[str, Sequence[str]], validation_fraction: float | None
    ):
        super().__init__(split_to_filepattern={k: list(v) for k, v in split_to_files.items()})
        self._validation_fraction = validation_fraction

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(
                f"the text corpus has no {split!r} split: bind "
                "make_source.validation_patterns or make_source.validation_fraction"
            )

    def list_shards(self, split: str) -> Sequence[str]:
        self._check_split(split)
        return super().list_shards(split)

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        **kwargs,
    ) -> tf.data.Dataset:
        self._check_split(split)
        ds = super().get_dataset(
            split=split, shuffle=shuffle, seed=seed, shard_info=shard_info, **kwargs
        )
        if self._validation_fraction:
            cut = round(self._validation_fraction * _HASH_BUCKETS)
            held_out = split == "validation"
            ds = ds.filter(
                lambda line: tf.equal(
                    tf.strings.to_hash_bucket_fast(line, _HASH_BUCKETS) < cut, held_out
                )
            )
        return ds.map(lambda line: {"text": line}, num_parallel_calls=tf.data.AUTOTUNE)


def _text_source(
    language: str | None, train: _Groups, validation: _Groups, validation_fraction: float | None
) -> seqio.DataSource:
    if not train:
        raise ValueError(
            "make_source.corpus='text' needs make_source.train_patterns "
            "(gin TEXT_TRAIN_FILES): a file pattern or {label: pattern}"
        )
    if validation_fraction is not None and not 0 <= validation_fraction < 1:
        raise ValueError(f"make_source.validation_fraction={validation_fraction} is not in [0, 1)")
    labels = [label for label, _ in train]
    if language is not None and language not in labels:
        raise ValueError(
            f"group {language!r} is not in the text corpus; make_source.train_patterns has {labels}"
        )
    unknown = [label for label, _ in validation if label not in labels]
    if unknown:
        raise ValueError(
            f"make_source.validation_patterns labels {unknown} are not in "
            f"make_source.train_patterns ({labels})"
        )

    def files(groups: _Groups, option: str) -> list[str]:
        return [
            f
            for label, patterns in groups
            if language in (None, label)
            for p in patterns
            for f in _files(p, f"make_source.{option}[{label!r}]")
        ]

    split_files = {"train": files(train, "train_patterns")}
    if validation:
        split_files["validation"] = files(validation, "validation_patterns")
        if not split_files["validation"]:  # this group has no validation pattern
            del split_files["validation"]
    elif validation_fraction:
        split_files["validation"] = split_files["train"]
    return TextFilesSource(split_files, validation_fraction if not validation else None)


@functools.lru_cache(maxsize=256)
def _build(
    language: str | None,
    corpus: str,
    tfds_name: str,
    data_dir: str | None,
    train: _Groups,
    validation: _Groups,
    validation_fraction: float | None,
) -> seqio.DataSource:
    if corpus == "embedded":
        return _embedded_source(language)
    if corpus == "tfds":
        return _CheckedTfdsSource(tfds_name, data_dir, _tfds_split_map(tfds_name, language))
    if corpus == "text":
        return _text_source(language, train, validation, validation_fraction)
    raise ValueError(f"make_source.corpus={corpus!r} is not one of {CORPORA}")


@gin.configurable
def make_source(
    language: str | None,
    corpus: str = "embedded",
    tfds_name: str = "c4/multilingual:3.1.0",
    data_dir: str | None = None,
    train_patterns: Patterns | None = None,
    validation_patterns: Patterns | None = None,
    validation_fraction: float | None = None,
) -> seqio.DataSource:
    """The raw-text source of ``language`` (a group label; ``None``: all groups).

    ``train_patterns`` / ``validation_patterns`` / ``validation_fraction`` configure
    ``corpus='text'`` (module docstring; ``validation_fraction`` applies only without
    ``validation_patterns``) and are ignored otherwise.

    Raises:
      ValueError: naming ``make_source.corpus`` / the language when they are unknown.
      FileNotFoundError: naming a text pattern that matches no file.
    """
    return _build(
        language,
        corpus,
        tfds_name,
        data_dir,
        _groups(train_patterns, "make_source.train_patterns"),
        _groups(validation_patterns, "make_source.validation_patterns"),
        validation_fraction,
    )


def make_source_settings() -> dict:
    """``make_source``'s keyword arguments as gin binds them (defaults filled in)."""
    settings = {
        name: p.default
        for name, p in inspect.signature(make_source).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    settings.update(gin.get_bindings(make_source))
    return settings


def describe_corpus() -> str:
    """The corpus gin selects, in words: ``the embedded UDHR corpus (20 languages)``,
    ``TFDS c4/multilingual:3.1.0``, ``the text files train_patterns=...``."""
    settings = make_source_settings()
    corpus = settings["corpus"]
    if corpus == "embedded":
        return f"the embedded UDHR corpus ({len(embedded_languages())} languages)"
    if corpus == "tfds":
        return f"TFDS {settings['tfds_name']}"
    return f"the text files train_patterns={settings['train_patterns']!r}"


def is_text_corpus() -> bool:
    """Whether gin selects the user's text files (``make_source.corpus = 'text'``)."""
    return make_source_settings()["corpus"] == "text"


def corpus_groups() -> tuple[str, ...]:
    """The group labels of the corpus gin selects (``make_source``'s bindings), each a valid
    ``make_source(label)``: the embedded corpus' languages, mC4's languages (``('en',)``
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


class CorpusSource(seqio.DataSource):
    """A ``seqio.DataSource`` delegating to ``make_source(language)`` at use time."""

    def __init__(self, language: str | None):
        self._language = language
        super().__init__(splits=SPLITS)

    @property
    def resolved(self) -> seqio.DataSource:
        return make_source(self._language)

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return self.resolved.supports_arbitrary_sharding

    def list_shards(self, split: str) -> Sequence[str]:
        return self.resolved.list_shards(split)

    def num_input_examples(self, split: str) -> int | None:
        return self.resolved.num_input_examples(split)

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        *,
        sequence_length: Mapping[str, int] | None = None,
        use_cached: bool = False,
        num_epochs: int | None = 1,
    ) -> tf.data.Dataset:
        return self.resolved.get_dataset(
            split=split, shuffle=shuffle, seed=seed, shard_info=shard_info
        )

    def __repr__(self) -> str:
        return f"CorpusSource(language={self._language!r})"
