"""Invariants of the span-corruption preprocessor (moe_jax/data/span_corruption.py)."""

from __future__ import annotations

import numpy as np
import pytest
import seqio
import tensorflow as tf

from moe_jax.data import span_corruption as sc

VOCAB = seqio.ByteVocabulary(extra_ids=100)
SENTINEL0 = VOCAB.vocab_size - 1  # <extra_id_0>


def reconstruct(inputs: np.ndarray, targets: np.ndarray) -> list[int]:
    """Fills each sentinel of ``inputs`` with the tokens following it in ``targets``."""
    fills: dict[int, list[int]] = {}
    current = None
    for t in targets.tolist():
        if t > SENTINEL0 - 100:
            current = t
            fills[current] = []
        else:
            fills[current].append(t)
    out: list[int] = []
    for t in inputs.tolist():
        out.extend(fills[t] if t > SENTINEL0 - 100 else [t])
    return out


def test_tokens_length_matches_t5_and_every_shorter_segment_fits():
    assert sc.tokens_length_for(512, 114) == 568  # T5's random_spans_helper for 512/114
    for inputs_length, targets_length in [(128, 32), (64, 16), (512, 114), (40, 40)]:
        n = sc.tokens_length_for(inputs_length, targets_length)
        for m in range(1, n + 1):
            i, t = sc.corrupted_lengths(m)
            assert i <= inputs_length and t <= targets_length, (inputs_length, targets_length, m)
        i, t = sc.corrupted_lengths(n + 1)
        assert i > inputs_length or t > targets_length  # n is the longest that fits


def test_too_small_feature_lengths_are_refused():
    with pytest.raises(ValueError, match="too small"):
        sc.tokens_length_for(2, 2)


@pytest.mark.parametrize("length", [1, 2, 7, 20, 141, 568])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_fraction_span_count_and_reconstruction(length, seed):
    tokens = tf.constant(np.random.default_rng(seed).integers(3, 200, size=length), tf.int32)
    seeds = tf.constant([[seed, 1], [seed, 2]])
    mask = sc.random_spans_noise_mask(tf.constant(length), seeds).numpy()
    num_noise, num_spans = sc.noise_counts(length, sc.NOISE_DENSITY, sc.MEAN_NOISE_SPAN_LENGTH)
    if length >= 2:
        assert mask.sum() == num_noise
        runs = int(np.sum(mask & ~np.pad(mask[:-1], (1, 0))))
        assert runs == num_spans
        assert not mask[0] and mask[-1]  # non-noise first, noise last
    inputs = sc.replace_spans_with_sentinels(tokens, tf.constant(mask), SENTINEL0).numpy()
    targets = sc.replace_spans_with_sentinels(tokens, tf.constant(~mask), SENTINEL0).numpy()
    sentinels_in = inputs[inputs > SENTINEL0 - 100]
    assert list(sentinels_in) == [SENTINEL0 - k for k in range(len(sentinels_in))]
    assert reconstruct(inputs, targets) == tokens.numpy().tolist()
    assert len(inputs) + 1 == sc.corrupted_lengths(length)[0] or length < 2


def _corrupt(docs: list[list[int]], seed: int, lengths: dict[str, int]) -> list[dict]:
    ds = tf.data.Dataset.from_generator(
        lambda: ({"targets": np.asarray(d, np.int32)} for d in docs),
        output_signature={"targets": tf.TensorSpec([None], tf.int32)},
    )
    features = {"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)}
    with seqio.utils.map_seed_manager(seed):
        ds = sc.span_corruption(ds, lengths, features)
    return list(ds.as_numpy_iterator())


def test_preprocessor_splits_long_documents_and_fits_lengths():
    lengths = {"inputs": 64, "targets": 16}
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 250, size=n).tolist() for n in (5, 70, 1000)]
    examples = _corrupt(docs, seed=3, lengths=lengths)
    n = sc.tokens_length_for(64, 16)
    assert len(examples) == 1 + 1 + int(np.ceil(1000 / n))  # the long one: several examples
    for ex in examples:
        assert len(ex["inputs"]) + 1 <= 64 and len(ex["targets"]) + 1 <= 16
    rebuilt = [t for ex in examples for t in reconstruct(ex["inputs"], ex["targets"])]
    assert rebuilt == [t for d in docs for t in d]
    noise = sum(len(ex["targets"]) - np.sum(ex["targets"] > SENTINEL0 - 100) for ex in examples)
    assert abs(noise / sum(map(len, docs)) - sc.NOISE_DENSITY) < 0.02


def test_preprocessor_is_deterministic_given_the_seed():
    docs = [list(range(3, 203))]
    a, b, c = (_corrupt(docs, s, {"inputs": 64, "targets": 16}) for s in (5, 5, 6))
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c, strict=True))


def test_too_many_spans_for_the_sentinels_is_refused():
    features = {"inputs": seqio.Feature(VOCAB), "targets": seqio.Feature(VOCAB)}
    ds = tf.data.Dataset.from_tensors({"targets": tf.range(10)})
    with pytest.raises(ValueError, match="sentinels"):
        sc.span_corruption(ds, {"inputs": 4096, "targets": 1024}, features)
