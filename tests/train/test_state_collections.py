"""Non-parameter state collections in training: the auxiliary-loss-free balancing bias
(routers/aux_free_bias.gin) is updated by the train step, never by the optimizer, survives a
checkpoint round trip, stays put under ``freeze.bias_mode.mode = 'frozen'``, and is read
by `moe-jax eval`."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moe_jax.commands import evaluate, train
from moe_jax.moe.collections import BIAS_COLLECTION
from moe_jax.runtime import builders, checkpoints, configured, gin_flags, gin_utils, train_state
from moe_jax.runtime.run_dir import RunDir

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin_file=routers/aux_free_bias.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.BIAS_UPDATE_RATE=0.01",
    "--gin.train_script.train.checkpoint_period=2",
    "--gin.train_script.train.log_period=1",
    "--gin.train_script.train.eval_period=2",
    "--gin.train_script.train.eval_steps=1",
]
SHAPES = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}


def _run(model_dir, steps: int, *flags: str) -> dict:
    gin_utils.parse_gin(
        gin_flags.parse_flags(
            builders.build_parser("t", "t"),
            [*TINY, f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_STEPS={steps}", *flags],
        )
    )
    return train.train()


def _restore(model_dir) -> train_state.TrainState:
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    target = configured.train_setup(model, SHAPES, configured.run_context()).abstract_state
    ckpt = checkpoints.Checkpointer(RunDir(model_dir), read_only=True)
    try:
        return ckpt.restore(ckpt.latest_step(), target)[0]
    finally:
        ckpt.close()


def _biases(state) -> list[np.ndarray]:
    return [np.asarray(b) for b in jax.tree.leaves(state.collections[BIAS_COLLECTION])]


def test_bias_is_trained_by_the_step_and_survives_a_checkpoint_round_trip(tmp_path):
    result = _run(tmp_path, 2)
    assert np.isfinite(list(result["losses"].values())).all()
    state = _restore(tmp_path)
    biases = _biases(state)
    assert len(biases) == 2 and all(b.shape == (4,) for b in biases)  # encoder + decoder layer
    # Two sign updates of 0.01 from zero (0 where an expert's load was exactly the mean):
    # every entry is a multiple of 0.01 of at most 0.02, some nonzero.
    flat = np.concatenate(biases)
    _assert_steps_of(flat, 0.01, at_most=2)
    assert np.any(flat != 0)
    assert BIAS_COLLECTION not in str(jax.tree_util.tree_structure(state.params))
    # Resuming keeps the restored bias: one more step moves each entry by 0.01 at most.
    _run(tmp_path, 3)
    moved = np.concatenate(_biases(_restore(tmp_path))) - flat
    _assert_steps_of(moved, 0.01, at_most=1)
    assert np.any(moved != 0)


def _assert_steps_of(values: np.ndarray, step: float, at_most: int) -> None:
    """Every value is a whole number of ``step``s, at most ``at_most`` of them."""
    steps = values / step
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert np.all(np.abs(np.round(steps)) <= at_most), values


@pytest.mark.slow
def test_frozen_bias_mode_keeps_the_bias_and_eval_reads_it(tmp_path):
    _run(tmp_path, 2, "--gin_file=routers/frozen.gin", "--gin_file=routers/frozen_bias.gin")
    np.testing.assert_array_equal(np.concatenate(_biases(_restore(tmp_path))), 0.0)
    results = evaluate.evaluate(
        [str(tmp_path)], str(tmp_path / "eval")
    )  # `moe-jax eval` restores the bias
    assert np.isfinite(next(iter(results.values()))["metrics"]["loss"])
