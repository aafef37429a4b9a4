"""The T5/mT5 span-corruption objective as a seqio preprocessor (seqio ships none).

A token segment ``[n]`` is partitioned into alternating non-noise / noise spans (about
``noise_density * n`` noise tokens in ``round(noise / mean_noise_span_length)`` spans, span
lengths drawn by a random segmentation, as in T5's ``random_spans_noise_mask``). Each noise
span is replaced in ``inputs`` by one sentinel; ``targets`` holds, for each span, its sentinel
followed by the dropped tokens. Sentinels are the vocabulary's last ids: span ``k`` uses
``vocab_size - 1 - k`` (``<extra_id_k>``).

    tokens   a b c d e f g h
    inputs   a b <X0> e f <X1> h
    targets  <X0> c d <X1> g

``tokens_length_for`` picks the segment length so that inputs and targets (EOS included)
fit the requested feature lengths, like T5's ``random_spans_helper``.
"""

from __future__ import annotations

from collections.abc import Mapping

import seqio
import tensorflow as tf

from moe_jax.data.preprocessors import plain_tf, split_tokens

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


def noise_counts(
    length: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
    """(noise tokens, noise spans) of a segment of ``length`` tokens, as the mask draws them."""
    length = max(length, 2)
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    return num_noise, max(round(num_noise / mean_noise_span_length), 1)


def corrupted_lengths(
    tokens_length: int,
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> tuple[int, int]:
    """(inputs, targets) lengths, one EOS each included, of a corrupted ``tokens_length``
    segment."""
    num_noise, num_spans = noise_counts(tokens_length, noise_density, mean_noise_span_length)
    return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def tokens_length_for(
    inputs_length: int,
    targets_length: int | None,
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> int:
    """The longest segment whose corrupted inputs/targets fit the feature lengths.

    Raises:
      ValueError: when even a 2-token segment does not fit (feature lengths too small).
    """
    targets_length = targets_length or 10**9

    def fits(n: int) -> bool:
        inputs, targets = corrupted_lengths(n, noise_density, mean_noise_span_length)
        return inputs <= inputs_length and targets <= targets_length

    if not fits(2):
        raise ValueError(
            f"feature lengths inputs={inputs_length}, targets={targets_length} are "
            "too small for span corruption (need at least 3 each)"
        )
    n = 2
    while fits(n + 1):
        n += 1
    return n


def _random_segmentation(
    num_items: tf.Tensor, num_segments: tf.Tensor, seed: tf.Tensor
) -> tf.Tensor:
    """Random lengths ``[num_segments]`` (each >= 1) summing to ``num_items``."""
    is_first = tf.cast(tf.range(num_items - 1) < num_segments - 1, tf.int32)
    order = tf.argsort(tf.random.stateless_uniform([num_items - 1], seed))
    is_first = tf.pad(tf.gather(is_first, order), [[1, 0]])
    segment_id = tf.cumsum(is_first)
    return tf.math.unsorted_segment_sum(tf.ones_like(segment_id), segment_id, num_segments)


def random_spans_noise_mask(
    length: tf.Tensor,
    seeds: tf.Tensor,
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> tf.Tensor:
    """Boolean noise mask ``[length]``: non-noise span first, spans alternating.

    Args:
      length: scalar int32, number of tokens.
      seeds: int ``[2, 2]``, two stateless seeds (noise and non-noise segmentations).
    """
    orig_length = length
    length = tf.maximum(length, 2)
    num_noise = tf.cast(tf.round(tf.cast(length, tf.float32) * noise_density), tf.int32)
    num_noise = tf.clip_by_value(num_noise, 1, length - 1)
    num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length), tf.int32)
    num_spans = tf.maximum(num_spans, 1)
    noise_lengths = _random_segmentation(num_noise, num_spans, seeds[0])
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, seeds[1])
    interleaved = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], axis=1), [-1])
    span_starts = tf.cumsum(interleaved)[:-1]
    span_start_indicator = tf.math.unsorted_segment_sum(
        tf.ones_like(span_starts), span_starts, length
    )
    is_noise = tf.equal(tf.cumsum(span_start_indicator) % 2, 1)
    return is_noise[:orig_length]


def replace_spans_with_sentinels(
    tokens: tf.Tensor, mask: tf.Tensor, first_sentinel: tf.Tensor | int
) -> tf.Tensor:
    """Replaces each run of ``mask``-ed tokens by one sentinel (``first_sentinel - k`` for run k).

    Args:
      tokens: int32 ``[n]``; mask: bool ``[n]``. Returns int32 ``[n - masked + runs]``.
    """
    previous = tf.pad(mask[:-1], [[1, 0]])
    first_in_run = tf.logical_and(mask, tf.logical_not(previous))
    later_in_run = tf.logical_and(mask, previous)
    sentinels = first_sentinel + 1 - tf.cumsum(tf.cast(first_in_run, tokens.dtype))
    tokens = tf.where(first_in_run, sentinels, tokens)
    return tf.boolean_mask(tokens, tf.logical_not(later_in_run))


def span_corruption(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, seqio.Feature],
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
    num_sentinels: int = 100,
) -> tf.data.Dataset:
    """seqio post-cache preprocessor: ``{"targets": tokens [n]}`` -> ``{"inputs", "targets"}``.

    Documents are first cut into segments of ``tokens_length_for(inputs, targets)`` tokens
    (a document far longer than the feature length becomes several examples), then each
    segment is corrupted. Randomness is stateless, from seqio's per-example seeds, so the
    output is a function of the task seed.

    Raises:
      ValueError: when ``sequence_length`` lacks ``inputs`` or a segment could need more
        sentinels than ``num_sentinels``.
    """
    if not sequence_length or not sequence_length.get("inputs"):
        raise ValueError(
            f"span_corruption needs task_feature_lengths with 'inputs', got {sequence_length}"
        )
    tokens_length = tokens_length_for(
        sequence_length["inputs"],
        sequence_length.get("targets"),
        noise_density,
        mean_noise_span_length,
    )
    max_spans = noise_counts(tokens_length, noise_density, mean_noise_span_length)[1]
    if max_spans > num_sentinels:
        raise ValueError(
            f"inputs length {sequence_length['inputs']} gives up to {max_spans} "
            f"noise spans but the vocabulary has {num_sentinels} sentinels"
        )
    vocabulary = output_features["targets"].vocabulary

    @seqio.map_over_dataset(num_seeds=2)
    @plain_tf
    def _corrupt(x: Mapping[str, tf.Tensor], seeds: tf.Tensor) -> dict[str, tf.Tensor]:
        tokens = x["targets"]
        mask = random_spans_noise_mask(
            tf.size(tokens), seeds, noise_density, mean_noise_span_length
        )
        first_sentinel = tf.constant(vocabulary.vocab_size - 1, tokens.dtype)
        return {
            "inputs": replace_spans_with_sentinels(tokens, mask, first_sentinel),
            "targets": replace_spans_with_sentinels(tokens, tf.logical_not(mask), first_sentinel),
        }

    return _corrupt(split_tokens(dataset, tokens_length))
