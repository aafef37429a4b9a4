"""Resumption faults: a configuration change accepted on resume is the one the run trains
on, and a damaged checkpoint without an integrity record (non-finite parameters) is set
aside like a CRC mismatch. In-process on the tiny smoke config of tests/train/test_train.py."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_jax import cli, errors
from moe_jax.commands import train
from moe_jax.runtime import checkpoint_checks, checkpoints
from moe_jax.runtime.run_dir import RunDir
from tests.train.test_train import parse, run


def _train_records(model_dir: pathlib.Path) -> dict[int, dict]:
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == "train"}


def _saved_stream(model_dir: pathlib.Path, step: int) -> dict:
    ckpt = checkpoints.Checkpointer(RunDir(model_dir), read_only=True)
    try:
        return ckpt.read_meta(step)["data_iterators"][0]
    finally:
        ckpt.close()


def test_an_accepted_data_change_is_applied_from_the_resumed_step(tmp_path, capsys):
    run(tmp_path, 6)
    parse(f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=9", "--gin.BATCH_SIZE=16")
    train.train(allow_config_change=True)
    assert (
        "the training data changed at step 6 (batch_size: 8 -> 16): reading the new stream "
        "from its batch 6"
    ) in capsys.readouterr().err
    assert _saved_stream(tmp_path, 9)["batch_size"] == 16  # what the run recorded...
    records = _train_records(tmp_path)
    assert records[8]["num_tokens"] > 1.5 * records[6]["num_tokens"]  # ...is what it trained on
    # the next resume continues the changed stream where it stopped, without a word
    run(tmp_path, 12, "--gin.BATCH_SIZE=16")
    assert "training data changed" not in capsys.readouterr().err
    assert _saved_stream(tmp_path, 12) == {**_saved_stream(tmp_path, 9), "step": 12}


def test_a_change_a_resumed_run_cannot_apply_is_refused_by_name(tmp_path):
    run(tmp_path, 3)
    parse(f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=6", "--gin.RANDOM_SEED=7")
    with pytest.raises(
        errors.ConfigError,
        match=r"^RANDOM_SEED \(train_script.train.random_seed\) = 7, but \S+/checkpoints/3 was "
        r"trained with 0: a resumed run keeps its checkpoint's RNG state",
    ):
        train.train(allow_config_change=True)
    assert RunDir(tmp_path).reached_step() == 3
    assert not list(tmp_path.glob("config.step-*.gin"))


def _poison_parameters(step_dir: pathlib.Path) -> None:
    """Damage no integrity record can tell: the record removed, then the parameters saved
    again by Orbax with the largest one NaN. (Flipping bytes of the saved files is no such
    damage: Orbax compresses them, and flipped bytes decode as other finite values or as a
    read error, depending on where they land.)"""
    (step_dir / checkpoint_checks.INTEGRITY_FILE).unlink()
    saver = ocp.StandardCheckpointer()
    params = jax.tree.map(np.array, saver.restore(step_dir / "params"))
    largest = max(jax.tree.leaves(params), key=lambda a: a.size)
    largest[...] = np.nan
    shutil.rmtree(step_dir / "params")
    saver.save(step_dir / "params", params)
    saver.wait_until_finished()
    saver.close()


def test_non_finite_parameters_without_a_record_are_set_aside(tmp_path, capsys):
    run(tmp_path, 6)  # checkpoints 3 and 6
    _poison_parameters(tmp_path / "checkpoints/6")
    assert cli.main(["eval", f"--checkpoint={tmp_path}", "--eval_steps=1"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("moe-jax eval: error: checkpoint step 6 is unreadable: "), line
    assert line.endswith("holds NaN or Inf"), line
    assert (tmp_path / "checkpoints/6").is_dir()  # eval moves nothing
    resumed = run(tmp_path, 9)
    assert "step 6 is unreadable" in capsys.readouterr().err
    assert (pathlib.Path(RunDir(tmp_path).unreadable_dir) / "6").is_dir()
    assert sorted(resumed["losses"]) == list(range(4, 10))
    assert all(jnp.isfinite(loss) for loss in resumed["losses"].values())


def test_parameters_broken_by_a_step_are_never_saved(tmp_path):
    with pytest.raises(
        train.NonFiniteLossError,
        match=r"^parameters hold NaN or Inf after step 1 \(\S+, \d+ in all\); not saved; "
        r"last good checkpoint: none yet",
    ):
        run(
            tmp_path,
            3,
            "--gin.train_script.train.checkpoint_period=1",
            "--gin.learning_rate_schedule.base_learning_rate=1e39",
        )
    assert RunDir(tmp_path).reached_step() is None


def test_orbax_waiting_for_a_save_is_not_printed(tmp_path, caplog):
    """On slow storage (gs://) orbax warns at each save that waited for the previous one;
    the loop waits on purpose, so the run's output stays clean."""
    checkpoints.Checkpointer(RunDir(tmp_path), read_only=True).close()  # installs the filters
    with caplog.at_level(logging.WARNING):
        logging.getLogger("absl").warning(
            "Waiting for previous save to complete took %f seconds. If this number is high, "
            "consider checkpointing less frequently.",
            2.5,
        )
        logging.getLogger("absl").warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


def test_the_shuffle_buffer_is_part_of_the_stream_a_resumed_run_continues():
    """A saved position continues the stream it was saved from: another shuffle buffer
    (``SHUFFLE_BUFFER_SIZE``) orders the examples differently, so it is a data change."""
    from moe_jax.runtime.builders import DatasetConfig

    cfg = DatasetConfig("mc4_span_corruption", {"inputs": 32, "targets": 8}, batch_size=8)
    saved = {
        "mixture_or_task_name": "mc4_span_corruption",
        "task_feature_lengths": {"inputs": 32, "targets": 8},
        "split": "train",
        "batch_size": 8,
        "seed": 0,
        "pack": True,
        "use_cached": False,
        "shuffle_buffer_size": None,
    }
    assert train.stream_changes(saved, cfg) == []
    smaller = DatasetConfig(**{**cfg.__dict__, "shuffle_buffer_size": 1000})
    assert train.stream_changes(saved, smaller) == ["shuffle_buffer_size: None -> 1000"]
