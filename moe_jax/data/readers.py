"""The seqio data sources behind ``moe_jax.data.sources.make_source`` (TensorFlow-bound).

:func:`build` makes the source of one corpus and group: ``seqio.FileDataSource`` over the
embedded UDHR files, :class:`_CheckedTfdsSource` over TFDS (never generating data),
:class:`TextFilesSource` over the user's text files. :class:`CorpusSource` is what the
registered tasks hold: it resolves ``make_source`` when data is requested, so gin bindings
parsed after the tasks were registered take effect. ``sources`` (the gin configurable and
the corpus' groups) imports this module only when a source is built, so parsing a run's
gin files does not import TensorFlow or seqio.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence

import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from moe_jax.data import sources

_HASH_BUCKETS = 10_000  # held-out validation resolution: fractions in steps of 1e-4


def _read_text_lines(path: tf.Tensor) -> tf.data.Dataset:
    return tf.data.TextLineDataset(path).map(lambda line: {"text": line})


def _count_lines(paths: Sequence[str]) -> int:
    return sum(pathlib.Path(p).read_bytes().count(b"\n") for p in paths)


def _embedded_source(language: str | None) -> seqio.DataSource:
    available = sources.embedded_languages()
    if language is not None and language not in available:
        raise ValueError(
            f"language {language!r} is not in the embedded corpus "
            f"({sources.EMBEDDED_DIR}); available: {available}. Bind "
            "make_source.corpus='tfds' for the other mC4 languages."
        )
    languages = available if language is None else (language,)
    files = {
        "train": [str(sources.EMBEDDED_DIR / f"{lang}.txt") for lang in languages],
        "validation": [str(sources.EMBEDDED_DIR / f"{lang}-validation.txt") for lang in languages],
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
    languages = sources.mc4_languages() if language is None else (language,)
    if language is not None and language not in sources.mc4_languages():
        raise ValueError(f"language {language!r} is not an mC4 language: {sources.mc4_languages()}")
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
    language: str | None,
    train: sources.Groups,
    validation: sources.Groups,
    validation_fraction: float | None,
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

    def files(groups: sources.Groups, option: str) -> list[str]:
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
def build(
    language: str | None,
    corpus: str,
    tfds_name: str,
    data_dir: str | None,
    train: sources.Groups,
    validation: sources.Groups,
    validation_fraction: float | None,
) -> seqio.DataSource:
    if corpus == "embedded":
        return _embedded_source(language)
    if corpus == "tfds":
        return _CheckedTfdsSource(tfds_name, data_dir, _tfds_split_map(tfds_name, language))
    if corpus == "text":
        return _text_source(language, train, validation, validation_fraction)
    raise ValueError(f"make_source.corpus={corpus!r} is not one of {sources.CORPORA}")


class CorpusSource(seqio.DataSource):
    """A ``seqio.DataSource`` delegating to ``make_source(language)`` at use time."""

    def __init__(self, language: str | None):
        self._language = language
        super().__init__(splits=sources.SPLITS)

    @property
    def resolved(self) -> seqio.DataSource:
        return sources.make_source(self._language)

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
