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

Tasks hold a ``CorpusSource``, which resolves ``make_source`` when data is requested, so
gin bindings parsed after ``moe_jax.data.tasks`` was imported take effect.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence

import gin
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

EMBEDDED_DIR = pathlib.Path(__file__).resolve().parent / "embedded" / "udhr"
CORPORA = ("embedded", "tfds")
SPLITS = ("train", "validation")


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
        raise ValueError(f"language {language!r} is not in the embedded corpus "
                         f"({EMBEDDED_DIR}); available: {available}. Bind "
                         "make_source.corpus='tfds' for the other mC4 languages.")
    languages = available if language is None else (language,)
    files = {"train": [str(EMBEDDED_DIR / f"{lang}.txt") for lang in languages],
             "validation": [str(EMBEDDED_DIR / f"{lang}-validation.txt") for lang in languages]}
    return seqio.FileDataSource(
        read_file_fn=_read_text_lines, split_to_filepattern=files,
        num_input_examples={split: _count_lines(paths) for split, paths in files.items()})


def _tfds_split_map(tfds_name: str, language: str | None) -> Mapping[str, str]:
    if not tfds_name.startswith("c4/multilingual"):
        if language not in (None, "en"):
            raise ValueError(f"make_source.tfds_name={tfds_name!r} has no per-language splits; "
                             f"language {language!r} needs c4/multilingual")
        return {"train": "train", "validation": "validation"}
    languages = mc4_languages() if language is None else (language,)
    if language is not None and language not in mc4_languages():
        raise ValueError(f"language {language!r} is not an mC4 language: {mc4_languages()}")
    return {"train": "+".join(languages),
            "validation": "+".join(f"{lang}-validation" for lang in languages)}


class _CheckedTfdsSource(seqio.TfdsDataSource):
    """``TfdsDataSource`` that never generates data and names ``data_dir`` when it is absent."""

    def __init__(self, tfds_name: str, data_dir: str | None, splits: Mapping[str, str]):
        super().__init__(tfds_name=tfds_name, tfds_data_dir=data_dir, splits=dict(splits),
                         read_only=True)
        self._data_dir = data_dir

    def get_dataset(self, split: str = "train", shuffle: bool = True, seed: int | None = None,
                    shard_info: seqio.ShardInfo | None = None, **unused) -> tf.data.Dataset:
        try:
            return super().get_dataset(split=split, shuffle=shuffle, seed=seed,
                                       shard_info=shard_info)
        except (AssertionError, FileNotFoundError, tfds.core.DatasetNotFoundError) as e:
            where = self._data_dir or "the default TFDS data_dir (~/tensorflow_datasets)"
            raise FileNotFoundError(
                f"TFDS dataset {self.tfds_dataset.name!r} is not prepared in {where}: set "
                "make_source.data_dir (gin TFDS_DATA_DIR) to the directory holding it") from e

    def num_input_examples(self, split: str) -> int | None:
        """The split's size, or ``None`` where TFDS records none (seqio then skips its
        in-memory caching; ``tfds.testing.mock_data`` builders have empty split info)."""
        try:
            return super().num_input_examples(split)
        except KeyError:
            return None


@functools.lru_cache(maxsize=256)
def _build(language: str | None, corpus: str, tfds_name: str,
           data_dir: str | None) -> seqio.DataSource:
    if corpus == "embedded":
        return _embedded_source(language)
    if corpus == "tfds":
        return _CheckedTfdsSource(tfds_name, data_dir, _tfds_split_map(tfds_name, language))
    raise ValueError(f"make_source.corpus={corpus!r} is not one of {CORPORA}")


@gin.configurable
def make_source(language: str | None, corpus: str = "embedded",
                tfds_name: str = "c4/multilingual:3.1.0",
                data_dir: str | None = None) -> seqio.DataSource:
    """The raw-text source of ``language`` (``None``: all languages of the corpus).

    Raises:
      ValueError: naming ``make_source.corpus`` / the language when they are unknown.
    """
    return _build(language, corpus, tfds_name, data_dir)


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

    def get_dataset(self, split: str = "train", shuffle: bool = True, seed: int | None = None,
                    shard_info: seqio.ShardInfo | None = None, *,
                    sequence_length: Mapping[str, int] | None = None, use_cached: bool = False,
                    num_epochs: int | None = 1) -> tf.data.Dataset:
        return self.resolved.get_dataset(split=split, shuffle=shuffle, seed=seed,
                                         shard_info=shard_info)

    def __repr__(self) -> str:
        return f"CorpusSource(language={self._language!r})"
