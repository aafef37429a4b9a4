"""The `text` corpus: the user's own files through seqio's TextLineDataSource."""

from __future__ import annotations

import pathlib
import unicodedata

import gin
import pytest
import seqio

from moe_jax.data import pipeline, sources, tasks, vocab
from tests.data.span_lib import original_tokens

REPO = pathlib.Path(__file__).resolve().parents[2]
LENGTHS = {"inputs": 64, "targets": 16}


@pytest.fixture
def corpus(tmp_path) -> pathlib.Path:
    """en/ and de/ folders of real text (the embedded UDHR files), two files each."""
    for lang in ("en", "de"):
        lines = (sources.EMBEDDED_DIR / f"{lang}.txt").read_text().splitlines()
        (tmp_path / lang).mkdir()
        (tmp_path / lang / "a.txt").write_text("\n".join(lines[:14]) + "\n")
        (tmp_path / lang / "b.txt").write_text("\n".join(lines[14:]) + "\n")
        (tmp_path / f"{lang}-validation.txt").write_text(
            (sources.EMBEDDED_DIR / f"{lang}-validation.txt").read_text()
        )
    return tmp_path


def _lines(source, split: str) -> list[str]:
    return sorted(
        x["text"].decode() for x in source.get_dataset(split, shuffle=False).as_numpy_iterator()
    )


def _file_lines(*paths: pathlib.Path) -> list[str]:
    return sorted(line for p in paths for line in p.read_text().splitlines())


def _normalized(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).split())


def _parse_text_gin(bindings: list[str]) -> None:
    gin.parse_config_files_and_bindings(
        [str(REPO / "gin/data/text.gin")], bindings, finalize_config=False
    )


def test_held_out_fraction_splits_every_line_into_exactly_one_split(corpus):
    _parse_text_gin([f"TEXT_TRAIN_FILES = '{corpus}/*/*.txt'", "TEXT_VALIDATION_FRACTION = 0.2"])
    assert sources.corpus_groups() == ("text",)
    assert sources.describe_corpus().startswith("the text files train_patterns=")
    source = sources.selected_source(None)
    train, validation = _lines(source, "train"), _lines(source, "validation")
    everything = _file_lines(*corpus.glob("*/*.txt"))
    assert sorted(train + validation) == everything  # nothing lost, nothing in both
    assert 0.05 < len(validation) / len(everything) < 0.4


def test_labelled_groups_read_their_own_files_and_validation_patterns(corpus):
    _parse_text_gin(
        [
            f"TEXT_TRAIN_FILES = {{'en': '{corpus}/en/*.txt', 'de': '{corpus}/de/*.txt'}}",
            f"TEXT_VALIDATION_FILES = {{'en': '{corpus}/en-validation.txt', "
            f"'de': '{corpus}/de-validation.txt'}}",
        ]
    )
    assert sources.corpus_groups() == ("en", "de")
    de = sources.selected_source("de")
    assert _lines(de, "train") == _file_lines(*(corpus / "de").glob("*.txt"))
    assert _lines(de, "validation") == _file_lines(corpus / "de-validation.txt")
    assert _lines(sources.selected_source(None), "validation") == _file_lines(
        corpus / "en-validation.txt", corpus / "de-validation.txt"
    )
    # The group's task tokenizes only German text: its targets + inputs give back German lines.
    name = tasks.group_task("de")
    assert name == "text_de_span_corruption"
    batches = pipeline.get_dataset(
        name, LENGTHS, "validation", 1, shuffle=False, seed=0, pack=False, num_epochs=1
    ).as_numpy_iterator()
    german = _normalized((corpus / "de-validation.txt").read_text())
    texts = [_normalized(vocab.selected_vocabulary().decode(original_tokens(b))) for b in batches]
    assert len(texts) > 3 and all(text in german for text in texts)


def test_group_task_names_resolve_by_name_in_a_fresh_registry(corpus):
    _parse_text_gin([f"TEXT_TRAIN_FILES = {{'en-GB': '{corpus}/en/*.txt'}}"])
    batch = next(
        pipeline.get_dataset(
            "text_en_gb_prefix_lm", LENGTHS, "train", 2, shuffle=True, seed=0, shuffle_buffer_size=8
        ).as_numpy_iterator()
    )
    assert batch["encoder_input_tokens"].shape == (2, 64)
    with pytest.raises(ValueError, match="text_<label>_<objective>"):
        pipeline.get_provider("text_fr_prefix_lm")


def test_a_pattern_matching_no_file_is_named(corpus):
    missing = f"{corpus}/fr/*.txt"
    _parse_text_gin([f"TEXT_TRAIN_FILES = {{'en': '{corpus}/en/*.txt', 'fr': '{missing}'}}"])
    with pytest.raises(FileNotFoundError, match="train_patterns\\['fr'\\]") as err:
        next(
            pipeline.get_dataset(
                "text_span_corruption", LENGTHS, "train", 1, False, 0
            ).as_numpy_iterator()
        )
    assert missing in str(err.value)


def test_no_validation_split_and_bad_labels_are_refused(corpus):
    _parse_text_gin([f"TEXT_TRAIN_FILES = '{corpus}/en/*.txt'", "TEXT_VALIDATION_FRACTION = 0.0"])
    for shard_info in (None, seqio.ShardInfo(0, 2)):  # as one host, as one of two hosts
        with pytest.raises(ValueError, match="validation_fraction"):
            pipeline.get_dataset(
                "text_span_corruption", LENGTHS, "validation", 1, False, 0, shard_info=shard_info
            )
    gin.clear_config()
    _parse_text_gin([f"TEXT_TRAIN_FILES = {{'en us': '{corpus}/en/*.txt'}}"])
    with pytest.raises(ValueError, match="label 'en us'"):
        sources.corpus_groups()
