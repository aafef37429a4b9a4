"""seqio preprocessors shared by the tasks: text cleaning, token splitting, prefix LM.

Shapes: ``targets`` below is a 1-D int32 token sequence ``[n]`` (no EOS yet: seqio's
``append_eos_after_trim`` adds it last), ``inputs`` likewise.

The functions the project hands to ``tf.data`` (here, in ``span_corruption``, ``readers``
and ``tasks.SelectedVocabulary.encode_tf``) are marked :data:`plain_tf`: TensorFlow ops only,
no Python ``if``/``for`` over tensors, so autograph has nothing to convert in them, and
``tf.data`` does not convert them (nor what they call) each time a pipeline is built: about
a CPU second of `moe-jax smoke`'s start, the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import seqio
import tensorflow as tf

# A function of TensorFlow ops only: tf.data traces it as it is, without autograph's conversion.
plain_tf = tf.autograph.experimental.do_not_convert

# Leading/trailing whitespace, ASCII and Unicode (\pZ: separators such as U+3000, U+00A0).
_EDGE_SPACE = r"^[\s\pZ]+|[\s\pZ]+$"


def clean_text(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``{"text": ...}`` -> ``{"targets": cleaned text}``; drops empty/whitespace-only documents.

    Invalid UTF-8 byte sequences are replaced by U+FFFD (never an error downstream).
    """

    @plain_tf
    def _clean(x: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        text = tf.strings.unicode_transcode(
            x["text"], "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
        )
        return {"targets": tf.strings.regex_replace(text, _EDGE_SPACE, "")}

    return dataset.map(_clean, num_parallel_calls=tf.data.AUTOTUNE).filter(
        plain_tf(lambda x: tf.strings.length(x["targets"]) > 0)
    )


def drop_empty_targets(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Drops examples whose tokenized ``targets`` is empty (text the vocabulary maps to nothing)."""
    return dataset.filter(plain_tf(lambda x: tf.size(x["targets"]) > 0))


def split_tokens(dataset: tf.data.Dataset, max_tokens_per_segment: int) -> tf.data.Dataset:
    """Cuts each ``targets`` ``[n]`` into consecutive segments of ``max_tokens_per_segment``
    tokens (the last one shorter): a long document becomes several examples, none lost."""
    if max_tokens_per_segment < 1:
        raise ValueError(f"max_tokens_per_segment must be >= 1, got {max_tokens_per_segment}")

    @plain_tf
    def _split(x: Mapping[str, tf.Tensor]) -> dict[str, tf.RaggedTensor]:
        tokens = x["targets"]
        n = tf.size(tokens)
        num_segments = (n + max_tokens_per_segment - 1) // max_tokens_per_segment
        lengths = tf.minimum(
            max_tokens_per_segment, n - tf.range(num_segments) * max_tokens_per_segment
        )
        return {"targets": tf.RaggedTensor.from_row_lengths(tokens, lengths)}

    return dataset.map(_split, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


def prefix_lm(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, seqio.Feature],
) -> tf.data.Dataset:
    """Prefix LM: each segment of a document is cut at a random point; the encoder reads the
    prefix (``inputs``), the decoder predicts the continuation token by token (``targets``).

    Segments have at most ``inputs + targets - 2`` tokens (one EOS each is added later) and
    the cut is drawn so that neither side exceeds its feature length; the prefix is non-empty
    whenever the segment has two tokens or more.
    """
    del output_features
    if (
        not sequence_length
        or not sequence_length.get("inputs")
        or not sequence_length.get("targets")
    ):
        raise ValueError(
            "prefix_lm needs task_feature_lengths with 'inputs' and 'targets', "
            f"got {sequence_length}"
        )
    max_inputs, max_targets = sequence_length["inputs"] - 1, sequence_length["targets"] - 1
    if max_inputs < 1 or max_targets < 1:
        raise ValueError(f"prefix_lm needs feature lengths >= 2, got {dict(sequence_length)}")
    dataset = split_tokens(dataset, max_inputs + max_targets)

    @seqio.map_over_dataset(num_seeds=1)
    @plain_tf
    def _cut(x: Mapping[str, tf.Tensor], seed: tf.Tensor) -> dict[str, tf.Tensor]:
        tokens = x["targets"]
        n = tf.size(tokens)
        low = tf.maximum(n - max_targets, 1)
        high = tf.maximum(tf.minimum(n - 1, max_inputs), low)
        cut = tf.random.stateless_uniform([], seed, minval=low, maxval=high + 1, dtype=tf.int32)
        cut = tf.where(n < 2, 0, cut)
        return {"inputs": tokens[:cut], "targets": tokens[cut:]}

    return _cut(dataset)
