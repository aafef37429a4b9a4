"""The seqio data sources behind ``moe_jax.data.sources.make_source`` (TensorFlow-bound).

One constructor per corpus, each cached per arguments: :func:`embedded_source`
(``seqio.FileDataSource`` over the embedded UDHR files), :func:`tfds_source` (TFDS, never
generating data), :func:`text_source` (the user's text files). ``sources`` (the gin
configurable, its checks and the corpus' groups) imports this module only when a source is
built, so parsing a run's gin files imports neither TensorFlow nor seqio.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence

import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from moe_jax.data.preprocessors import plain_tf

_HASH_BUCKETS = 10_000  # held-out validation resolution: fractions in steps of 1e-4
Groups = tuple[tuple[str, tuple[str, ...]], ...]  # sources.Groups: ((label, (pattern, ...)), ...)
SplitFiles = tuple[tuple[str, tuple[str, ...]], ...]  # ((split, (file, ...)), ...)


@plain_tf
def _read_text_lines(path: tf.Tensor) -> tf.data.Dataset:
    return tf.data.TextLineDataset(path).map(plain_tf(lambda line: {"text": line}))


def _count_lines(paths: Sequence[str]) -> int:
    return sum(pathlib.Path(p).read_bytes().count(b"\n") for p in paths)


@functools.lru_cache(maxsize=256)
def embedded_source(split_files: SplitFiles) -> seqio.DataSource:
    """The embedded corpus' files of each split, one document per line."""
    files = {split: list(paths) for split, paths in split_files}
    return seqio.FileDataSource(
        read_file_fn=_read_text_lines,
        split_to_filepattern=files,
        num_input_examples={split: _count_lines(paths) for split, paths in files.items()},
    )


@functools.lru_cache(maxsize=256)
def tfds_source(
    tfds_name: str, data_dir: str | None, splits: tuple[tuple[str, str], ...]
) -> seqio.DataSource:
    """TFDS ``tfds_name`` in ``data_dir``, canonical splits mapped to TFDS splits."""
    return _CheckedTfdsSource(tfds_name, data_dir, dict(splits))


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
        with self._naming_data_dir():
            return super().get_dataset(
                split=split, shuffle=shuffle, seed=seed, shard_info=shard_info
            )

    def list_shards(self, split: str) -> Sequence[str]:
        """The split's files (seqio asks for them before sharding a dataset by host)."""
        with self._naming_data_dir():
            return super().list_shards(split)

    @contextlib.contextmanager
    def _naming_data_dir(self) -> Iterator[None]:
        """TFDS's failures to find the prepared dataset (an assertion, a missing file, a
        builder whose split info is empty) as one ``FileNotFoundError`` naming the dataset,
        the data dir and the option that sets it."""
        try:
            yield
        except (AssertionError, KeyError, FileNotFoundError, tfds.core.DatasetNotFoundError) as e:
            where = (
                self._data_dir
                or os.environ.get("TFDS_DATA_DIR")
                or "the default TFDS data_dir (~/tensorflow_datasets)"
            )
            raise FileNotFoundError(
                f"TFDS dataset {self.tfds_dataset.name!r} is not prepared in {where}: set "
                "make_source.data_dir (gin TFDS_DATA_DIR, or --tfds_data_dir) to the directory "
                "or bucket holding it (a laptop run: experiments/cpu_scale.gin reads the "
                "embedded corpus instead)"
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
                plain_tf(
                    lambda line: tf.equal(
                        tf.strings.to_hash_bucket_fast(line, _HASH_BUCKETS) < cut, held_out
                    )
                )
            )
        return ds.map(plain_tf(lambda line: {"text": line}), num_parallel_calls=tf.data.AUTOTUNE)


@functools.lru_cache(maxsize=256)
def text_source(
    language: str | None,
    train: Groups,
    validation: Groups,
    validation_fraction: float | None,
) -> seqio.DataSource:
    """The user's text files of group ``language`` (``None``: all groups), as
    ``make_source``'s ``train_patterns`` / ``validation_patterns`` / ``validation_fraction``
    describe them; a ``ValueError`` or ``FileNotFoundError`` names the option at fault."""
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

    def files(groups: Groups, option: str) -> list[str]:
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
