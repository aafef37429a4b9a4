"""The registered seqio tasks on the embedded corpus, through the real seqio path."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
import seqio

from moe_jax.data import pipeline, sources, tasks, vocab

LENGTHS = {"inputs": 64, "targets": 16}


def _corpus_text(language: str) -> str:
    text = "".join(
        (sources.EMBEDDED_DIR / f"{language}{suffix}.txt").read_text()
        for suffix in ("", "-validation")
    )
    return " ".join(unicodedata.normalize("NFKC", text).split())


def _reconstruct(inputs: np.ndarray, targets: np.ndarray, vocab_size: int) -> list[int]:
    first = vocab_size - 100  # sentinels are the last 100 ids
    fills: dict[int, list[int]] = {}
    for t in targets.tolist():
        if t >= first:
            key = t
            fills[key] = []
        elif t != 1:  # EOS
            fills[key].append(t)
    return [x for t in inputs.tolist() if t != 1 for x in (fills[t] if t >= first else [t])]


def test_registration_is_idempotent_and_names_follow_mc4_splits():
    assert tasks.register_tasks() == tasks.TASK_NAMES
    for name in (
        "mc4_span_corruption",
        "mc4_en_span_corruption",
        "mc4_zh_latn_prefix_lm",
        "mc4_prefix_lm",
        "mc4_iw_span_corruption",
    ):
        assert name in tasks.TASK_NAMES and name in seqio.TaskRegistry.names()
    assert len(tasks.TASK_NAMES) == 2 * (2 + len(sources.mc4_languages()))  # + text_<objective>
    assert {"text_span_corruption", "text_prefix_lm"} <= set(seqio.TaskRegistry.names())
    assert set(sources.embedded_languages()) <= set(sources.mc4_languages())
    assert tasks.DEFAULT_TASK == "mc4_span_corruption"


@pytest.mark.parametrize("language", ["en", "ru", "hi"])
def test_span_corruption_task_reconstructs_corpus_text(language):
    task = seqio.get_mixture_or_task(tasks.task_name("span_corruption", language))
    v = vocab.selected_vocabulary()
    corpus = _corpus_text(language)
    examples = list(
        task.get_dataset(LENGTHS, split="train", shuffle=True, seed=0).take(20).as_numpy_iterator()
    )
    assert len(examples) == 20
    for ex in examples:
        assert ex["inputs"][-1] == 1 and ex["targets"][-1] == 1  # EOS
        assert len(ex["inputs"]) <= 64 and len(ex["targets"]) <= 16
        assert ex["targets"][0] == v.vocab_size - 1  # starts with <extra_id_0>
        text = v.decode(_reconstruct(ex["inputs"], ex["targets"], v.vocab_size))
        assert " ".join(text.split()) in corpus


def test_prefix_lm_task_splits_a_corpus_segment():
    task = seqio.get_mixture_or_task("mc4_ja_prefix_lm")
    v = vocab.selected_vocabulary()
    corpus = _corpus_text("ja")
    for ex in task.get_dataset(LENGTHS, split="validation", shuffle=False).as_numpy_iterator():
        assert 1 <= len(ex["inputs"]) <= 64 and 2 <= len(ex["targets"]) <= 16
        tokens = ex["inputs"][:-1].tolist() + ex["targets"][:-1].tolist()
        assert " ".join(v.decode(tokens).split()) in corpus


def test_all_language_task_mixes_scripts():
    task = seqio.get_mixture_or_task("mc4_prefix_lm")
    v = vocab.selected_vocabulary()
    texts = [
        v.decode(ex["targets"].tolist())
        for ex in task.get_dataset(LENGTHS, split="validation", shuffle=True, seed=1)
        .take(60)
        .as_numpy_iterator()
    ]
    scripts = {unicodedata.name(c).split()[0] for t in texts for c in t if c.isalpha()}
    assert len(scripts) >= 5, scripts


@pytest.mark.parametrize("task", ["mc4_span_corruption", "mc4_prefix_lm"])
def test_packed_batches_have_the_encdec_features(task):
    ds = pipeline.get_dataset(
        task, LENGTHS, "train", batch_size=4, shuffle=True, seed=0, shuffle_buffer_size=64
    )
    batch = next(ds.as_numpy_iterator())
    expected = {
        "encoder_input_tokens": 64,
        "encoder_segment_ids": 64,
        "encoder_positions": 64,
        "decoder_input_tokens": 16,
        "decoder_target_tokens": 16,
        "decoder_loss_weights": 16,
        "decoder_segment_ids": 16,
        "decoder_positions": 16,
    }
    assert {k: v.shape for k, v in batch.items()} == {k: (4, n) for k, n in expected.items()}
    assert all(v.dtype == np.int32 for v in batch.values())
    np.testing.assert_array_equal(
        batch["encoder_segment_ids"] > 0, batch["encoder_input_tokens"] > 0
    )
    # The short last segment of each document gets packed with others.
    more = [b["encoder_segment_ids"].max() for b in ds.take(6).as_numpy_iterator()]
    assert max(more) >= 2
    np.testing.assert_array_equal(batch["decoder_loss_weights"], batch["decoder_target_tokens"] > 0)
    assert batch["encoder_input_tokens"].max() < vocab.selected_vocabulary().vocab_size
    starts = batch["decoder_positions"] == 0
    np.testing.assert_array_equal(batch["decoder_input_tokens"][starts], 0)  # BOS = pad
