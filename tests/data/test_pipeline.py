"""Training input pipeline: determinism, restarts, per-host sharding, global batches, gin."""

from __future__ import annotations

import hashlib
import json
import pathlib
import unicodedata

import gin
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from moe_jax import partitioning
from moe_jax.data import pipeline, sources, vocab
from moe_jax.runtime import configured
from tests.data.span_lib import original_tokens

REPO = pathlib.Path(__file__).resolve().parents[2]
LENGTHS = {"inputs": 64, "targets": 16}


def _iterator(seed: int, **kwargs) -> pipeline.TrainIterator:
    return pipeline.TrainIterator(
        "mc4_span_corruption",
        LENGTHS,
        batch_size=4,
        seed=seed,
        shard_info=seqio.ShardInfo(0, 1),
        shuffle_buffer_size=128,
        **kwargs,
    )


def _take(it: pipeline.TrainIterator, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_same_seed_same_batches_other_seed_other_batches():
    with _iterator(7) as a, _iterator(7) as b, _iterator(8) as c:
        xs, ys, zs = _take(a, 3), _take(b, 3), _take(c, 3)
    assert all(_equal(x, y) for x, y in zip(xs, ys, strict=True))
    assert not any(_equal(x, z) for x, z in zip(xs, zs, strict=True))


def test_restart_sees_the_batches_of_an_uninterrupted_run():
    with _iterator(3) as it:
        uninterrupted = _take(it, 6)
    with _iterator(3) as it:
        _take(it, 4)
        state = json.loads(json.dumps(it.get_state()))  # as saved in a checkpoint
    assert state["step"] == 4 and state["seed"] == 3
    with pipeline.TrainIterator.restore(state) as resumed:
        assert resumed.step == 4
        after = _take(resumed, 2)
        assert resumed.get_state()["step"] == 6
    assert _equal(after[0], uninterrupted[4]) and _equal(after[1], uninterrupted[5])


def test_restore_refuses_an_incomplete_state():
    with pytest.raises(ValueError, match="lacks"):
        pipeline.TrainIterator.restore({"step": 3})


def test_close_stops_the_prefetch_thread():
    it = _iterator(0)
    next(it)
    it.close()
    assert not it._thread.is_alive()  # pylint: disable=protected-access


def _segments(shard: seqio.ShardInfo | None) -> set[tuple[int, ...]]:
    """Original token segments (span corruption undone) of one shard of the validation split."""
    ds = pipeline.get_dataset(
        "mc4_span_corruption",
        LENGTHS,
        "validation",
        batch_size=1,
        shuffle=False,
        seed=0,
        shard_info=shard,
        pack=False,
        num_epochs=1,
    )
    return {tuple(original_tokens(batch)) for batch in ds.as_numpy_iterator()}


def test_host_shards_are_disjoint_and_cover_the_split():
    everything = _segments(None)
    first, second = _segments(seqio.ShardInfo(0, 2)), _segments(seqio.ShardInfo(1, 2))
    assert first and second and not first & second
    assert first | second == everything


def test_host_shard_info_uses_the_process_index():
    assert pipeline.host_shard_info() == seqio.ShardInfo(jax.process_index(), jax.process_count())


def test_to_global_batch_shards_the_batch_over_data_and_expert():
    mesh = partitioning.make_mesh((2, 4, 1))
    with _iterator(0) as it:
        local = {k: np.concatenate([v, v]) for k, v in next(it).items()}  # 8 rows
    global_batch = pipeline.to_global_batch(local, mesh)
    for name, array in global_batch.items():
        assert array.shape == local[name].shape  # one process: global == local
        assert array.sharding.spec == jax.sharding.PartitionSpec(("data", "expert"))
        assert len(array.addressable_shards) == 8
        np.testing.assert_array_equal(np.asarray(array), local[name])
    with pytest.raises(ValueError, match="not divisible"):
        pipeline.to_global_batch({k: v[:3] for k, v in local.items()}, mesh)


def test_gin_files_drive_the_pipeline():
    gin.parse_config_files_and_bindings(
        [str(REPO / "gin/data/embedded.gin"), str(REPO / "gin/data/vocab_byte.gin")],
        [
            "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}",
            "MIXTURE_OR_TASK_NAME = 'mc4_el_prefix_lm'",
        ],
    )
    ds = configured.get_dataset(
        split="train", batch_size=2, shuffle=True, seed=0, shuffle_buffer_size=16
    )
    batch = next(ds.as_numpy_iterator())
    assert batch["encoder_input_tokens"].shape == (2, 32)
    assert batch["decoder_target_tokens"].shape == (2, 8)
    assert batch["encoder_input_tokens"].max() < 359  # byte vocabulary
    text = seqio.ByteVocabulary(extra_ids=100).decode(batch["decoder_target_tokens"][0].tolist())
    assert any("GREEK" in unicodedata.name(c, "") for c in text), text


def test_mc4_gin_file_selects_the_papers_data(monkeypatch):
    """With data/mc4.gin the default task reads TFDS c4/multilingual, every language, into
    the paper's 512/114 span-corruption examples (TFDS mocked: nothing is downloaded; the
    mT5 vocabulary on gs:// is swapped for bytes, data/vocab_mt5.gin is tested on its own)."""
    monkeypatch.chdir(REPO)  # gin `include` paths are relative to the repository root
    gin.parse_config_files_and_bindings(
        ["gin/data/mc4.gin", "gin/data/vocab_byte.gin"], ["vocab.get_vocabulary.path = None"]
    )
    source = sources.selected_source(None)
    assert isinstance(source, seqio.TfdsDataSource)
    assert source.tfds_dataset.name == "c4/multilingual:3.1.0"
    read = []

    def c4_text(builder, split, **kwargs):  # what TFDS would read; records which split
        del kwargs
        read.append((builder.name, str(split)))
        return tf.data.Dataset.from_tensor_slices({"text": [" ".join(["word"] * 2000)] * 2})

    with tfds.testing.mock_data(as_dataset_fn=c4_text):
        batch = next(
            configured.get_dataset(
                split="train", batch_size=2, shuffle=False, seed=0, pack=False
            ).as_numpy_iterator()
        )
    assert read[0][0] == "c4"
    languages = read[0][1].split("+")
    assert languages == list(sources.mc4_languages()) and len(languages) > 100
    assert batch["encoder_input_tokens"].shape == (2, 512)
    assert batch["decoder_target_tokens"].shape == (2, 114)
    # span corruption: targets open with <extra_id_0>
    sentinel = vocab.selected_vocabulary().vocab_size - 1
    np.testing.assert_array_equal(batch["decoder_target_tokens"][:, 0], sentinel)


@pytest.mark.parametrize(
    "task, expected",
    [("mc4_span_corruption", "9bf919bbbf6b21e1"), ("mc4_prefix_lm", "1f1373ddd707df66")],
)
def test_streams_are_the_batches_they_were_with_autograph(task, expected):
    """The project's tf.data functions are traced without autograph's conversion
    (``preprocessors.plain_tf``): the first batches of both objectives are byte for byte
    those of the pipeline whose functions autograph converted (digests taken from it)."""
    it = pipeline.TrainIterator(
        task,
        LENGTHS,
        batch_size=4,
        seed=0,
        shard_info=seqio.ShardInfo(0, 1),
        shuffle_buffer_size=128,
    )
    digest = hashlib.sha256()
    with it:
        for batch in _take(it, 3):
            for name in sorted(batch):
                digest.update(name.encode() + np.ascontiguousarray(batch[name]).tobytes())
    assert digest.hexdigest()[:16] == expected
