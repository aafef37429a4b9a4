"""The real TFDS c4 path (under tfds.testing.mock_data, no download) and bad input."""

from __future__ import annotations

import re

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from moe_jax.data import pipeline, vocab
from moe_jax.errors import InputFileError
from tests.data.span_lib import original_tokens

LENGTHS = {"inputs": 64, "targets": 16}
REPLACEMENT = "\ufffd"


def _examples(task: str, **kwargs) -> list[dict[str, np.ndarray]]:
    ds = pipeline.get_dataset(
        task,
        LENGTHS,
        "train",
        batch_size=1,
        shuffle=False,
        seed=0,
        pack=False,
        num_epochs=1,
        **kwargs,
    )
    return list(ds.as_numpy_iterator())


@pytest.mark.parametrize(
    "tfds_name,task",
    [("c4/multilingual:3.1.0", "mc4_de_span_corruption"), ("c4/en:3.1.0", "mc4_span_corruption")],
)
def test_tfds_c4_path_under_mock_data(tfds_name, task, tmp_path):
    gin.bind_parameter("make_source.corpus", "tfds")
    gin.bind_parameter("make_source.tfds_name", tfds_name)
    with tfds.testing.mock_data(num_examples=12):
        batches = _examples(task)
        packed = next(
            pipeline.get_dataset(
                task, LENGTHS, "train", batch_size=2, shuffle=True, seed=0, shuffle_buffer_size=8
            ).as_numpy_iterator()
        )
    assert batches and all(b["encoder_input_tokens"].shape == (1, 64) for b in batches)
    assert packed["encoder_segment_ids"].shape == (2, 64)


BAD_DOCS = [
    b"",  # empty document
    b"   \n\t  ",  # whitespace only (ASCII)
    "\u3000\u00a0 ".encode(),  # whitespace only (Unicode separators)
    b"caf\xc3\xa9 abc\xff\xfedef",  # invalid UTF-8 inside
    " ".join(["freedom"] * 3000).encode(),  # far longer than the feature length
    b"Everyone has the right to life.",
]


def _feed_bad_docs(builder, split, **kwargs):
    del builder, split, kwargs
    return tf.data.Dataset.from_tensor_slices({"text": tf.constant(BAD_DOCS)})


def test_bad_documents_are_skipped_replaced_or_split():
    gin.bind_parameter("make_source.corpus", "tfds")
    with tfds.testing.mock_data(as_dataset_fn=_feed_bad_docs):
        batches = _examples("mc4_en_span_corruption")
    v = vocab.selected_vocabulary()
    for b in batches:
        assert (b["encoder_input_tokens"] > 0).sum() <= 64
        assert (b["decoder_target_tokens"] > 0).sum() <= 16
    tokens = [t for b in batches for t in original_tokens(b)]
    # The empty and whitespace-only documents produce nothing; the rest comes back whole.
    expected = (
        v.encode(f"café abc{REPLACEMENT}{REPLACEMENT}def")
        + v.encode(" ".join(["freedom"] * 3000))
        + v.encode("Everyone has the right to life.")
    )
    assert tokens == expected
    assert len(batches) > 3000 // 70  # the long document became many examples


def test_unknown_task_name_is_refused_with_the_option():
    with pytest.raises(ValueError, match="MIXTURE_OR_TASK_NAME='mc4_xx_span_corruption'"):
        pipeline.get_dataset("mc4_xx_span_corruption", LENGTHS, "train", 1, False, 0)


def test_data_dir_without_the_dataset_is_refused_with_its_path(tmp_path):
    gin.bind_parameter("make_source.corpus", "tfds")
    gin.bind_parameter("make_source.data_dir", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape("make_source.data_dir")) as e:
        pipeline.get_dataset("mc4_en_span_corruption", LENGTHS, "train", 1, False, 0)
    assert str(tmp_path) in str(e.value)


def test_a_host_shard_of_an_unprepared_dataset_names_the_env_data_dir(tmp_path, monkeypatch):
    """A sharded read (seqio lists the split's files first: TFDS's KeyError of an empty
    split table) names the dataset and the data dir ``--tfds_data_dir`` set, in one line."""
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    gin.bind_parameter("make_source.corpus", "tfds")
    with pytest.raises(FileNotFoundError, match=re.escape("c4/multilingual")) as e:
        pipeline.get_dataset(
            "mc4_en_span_corruption", LENGTHS, "train", 1, False, 0, seqio.ShardInfo(0, 2)
        )
    assert f"is not prepared in {tmp_path}" in str(e.value)
    assert "--tfds_data_dir" in str(e.value)


def test_unknown_corpus_or_language_is_refused():
    gin.bind_parameter("make_source.corpus", "wiki")
    with pytest.raises(ValueError, match=re.escape("make_source.corpus='wiki'")):
        pipeline.get_dataset("mc4_en_span_corruption", LENGTHS, "train", 1, False, 0)
    gin.bind_parameter("make_source.corpus", "embedded")
    with pytest.raises(ValueError, match="not in the embedded corpus"):
        pipeline.get_dataset("mc4_fy_span_corruption", LENGTHS, "train", 1, False, 0)


def test_missing_vocabulary_file_is_refused_by_the_pipeline(tmp_path):
    missing = str(tmp_path / "spm.model")
    gin.bind_parameter("get_vocabulary.kind", "sentencepiece")
    gin.bind_parameter("get_vocabulary.path", missing)
    with pytest.raises(InputFileError, match=re.escape("get_vocabulary.path")):
        next(
            pipeline.get_dataset(
                "mc4_en_span_corruption", LENGTHS, "train", 1, False, 0
            ).as_numpy_iterator()
        )
