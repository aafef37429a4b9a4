"""Vocabularies: the committed embedded model, the gin choice, the byte fallback, errors."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import gin
import pytest
import sentencepiece
import seqio

from moe_jax.data import sources, vocab
from moe_jax.errors import InputFileError

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_embedded_vocabulary_has_sentinels_and_covers_every_language():
    v = vocab.selected_vocabulary()
    assert v.vocab_size == 8100 and v.extra_ids == 100
    assert v.decode([v.vocab_size - 1]) == "<extra_id_0>"
    assert v.decode([v.vocab_size - 100]) == "<extra_id_99>"
    assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
    for lang in sources.embedded_languages():
        line = (sources.EMBEDDED_DIR / f"{lang}-validation.txt").read_text().splitlines()[0]
        ids = v.encode(line)
        assert v.unk_id not in ids, lang
        assert max(ids) < 8000, lang  # text never produces sentinel ids
        assert len(ids) < len(line.encode()), lang  # better than bytes


def test_committed_vocabulary_is_what_the_script_trains(tmp_path):
    spec = importlib.util.spec_from_file_location("bv", REPO / "scripts/build_embedded_vocab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.train(8000, out_prefix=tmp_path / "spm")
    trained, committed = (
        sentencepiece.SentencePieceProcessor(model_file=str(f)) for f in (model, vocab.EMBEDDED_SPM)
    )
    assert trained.vocab_size() == committed.vocab_size() == 8000
    assert all(
        trained.id_to_piece(i) == committed.id_to_piece(i)
        and trained.get_score(i) == committed.get_score(i)
        for i in range(8000)
    )


def test_gin_selects_the_vocabulary_seen_by_the_tasks():
    import moe_jax.data.tasks  # noqa: F401  # pylint: disable=unused-import

    features = seqio.get_mixture_or_task("mc4_en_span_corruption").output_features
    assert features["targets"].vocabulary.vocab_size == 8100
    gin.parse_config_files_and_bindings([str(REPO / "gin/data/vocab_byte.gin")], [])
    assert features["targets"].vocabulary.vocab_size == 359
    assert features["targets"].vocabulary.encode("ab") == [100, 101]


def test_missing_vocabulary_file_names_the_path_and_option(tmp_path):
    missing = str(tmp_path / "nowhere" / "sentencepiece.model")
    with pytest.raises(InputFileError, match=re.escape("get_vocabulary.path")) as e:
        vocab.get_vocabulary(kind="sentencepiece", path=missing)
    assert missing in str(e.value)
    with pytest.raises(ValueError, match=re.escape("get_vocabulary.path")):
        vocab.get_vocabulary(kind="sentencepiece")
    with pytest.raises(ValueError, match=re.escape("get_vocabulary.kind")):
        vocab.get_vocabulary(kind="wordpiece")


def test_an_unreadable_vocabulary_location_is_one_line_naming_it():
    """A location the file system refuses (here a scheme TensorFlow lacks; on a machine
    without Google Cloud access, the mT5 vocabulary's ``gs://`` host) names the option and
    the cause instead of TensorFlow's traceback."""
    where = "hdfs://nowhere/sentencepiece.model"
    with pytest.raises(InputFileError) as e:
        vocab.get_vocabulary(kind="sentencepiece", path=where)
    assert str(e.value).startswith(
        f"cannot read the SentencePiece model get_vocabulary.path={where!r} ("
    )
    assert vocab.CLOUD_HINT not in str(e.value)  # said only of gs:// locations


def test_mt5_gin_file_points_at_the_real_vocabulary_without_loading_it():
    gin.parse_config_files_and_bindings([str(REPO / "gin/data/vocab_mt5.gin")], [])
    assert gin.query_parameter("MT5_VOCABULARY_PATH/macro.value") == vocab.MT5_SPM
    assert gin.query_parameter("get_vocabulary.kind") == "sentencepiece"
    assert gin.query_parameter("get_vocabulary.extra_ids") == 0
