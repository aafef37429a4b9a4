"""`moe-jax upcycle` (sparse upcycling) on the tiny smoke config: the upcycled MoE model
computes the dense model's outputs at step 0, the dense run is only read, bad input is one
line naming the option, and `moe-jax train` continues the upcycled run."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.train import checkpoints, gin_utils, setup, train, upcycle

TINY = ["--gin_file=runs/smoke_cpu.gin", "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.TRAIN_STEPS=4",
        "--gin.train_script.train.checkpoint_period=2", "--gin.train_script.train.eval_period=0"]
# Gates summing to 1 and no token dropped: the upcycled layer is its dense MLP.
EXACT = ["--gin.MoeLayer.renormalize_gates=True", "--gin.MoeLayer.dropless=True"]
SHAPES = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}


def _parse(*flags: str):
    gin_utils.parse_gin(gin_utils.parse_flags(setup.build_parser("test", "test"), [*TINY, *flags]))


def _dense_run(model_dir: pathlib.Path, step: int = 7):
    """A dense run's checkpoint at ``step`` (initialised weights; no training needed)."""
    _parse("--gin.NUM_SPARSE_LAYERS=0", f"--gin.MODEL_DIR={model_dir}")
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    state = setup.build_train_setup(model, SHAPES, setup.run_context(), seed=3).init_state()
    state = state.replace(step=jnp.asarray(step, jnp.int32))
    ckpt = checkpoints.Checkpointer(str(model_dir), async_save=False)
    ckpt.save(state, {"data_iterators": [], "random_seed": 3}, force=True)
    ckpt.close()
    return model, jax.device_get(state.params)


def _batch():
    rng = np.random.default_rng(0)
    tokens = lambda n: jnp.asarray(rng.integers(2, 300, (8, n)), jnp.int32)  # noqa: E731
    return {"encoder_input_tokens": tokens(32), "decoder_input_tokens": tokens(8),
            "decoder_target_tokens": tokens(8)}


def _logits(model, params, batch):
    return model.module.apply({"params": params}, batch["encoder_input_tokens"], batch["decoder_input_tokens"],
                              batch["decoder_target_tokens"], enable_dropout=False, mutable=["aux_loss", "moe_metrics"])[0]


def _files(path: pathlib.Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")}


def test_upcycled_model_equals_the_dense_model_at_step_zero(tmp_path):
    dense_model, dense_params = _dense_run(tmp_path / "dense")
    before = _files(tmp_path / "dense")
    out = tmp_path / "moe"
    assert upcycle.main([*TINY, *EXACT, f"--checkpoint={tmp_path / 'dense'}", f"--out={out}"]) == 0
    assert _files(tmp_path / "dense") == before  # the dense run is only read
    assert (out / "config.gin").exists()
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    target = setup.build_train_setup(model, SHAPES, setup.run_context()).abstract_state
    ckpt = checkpoints.Checkpointer(str(out), read_only=True)
    state, meta = ckpt.restore(ckpt.latest_step(), target)
    ckpt.close()
    assert int(state.step) == 7 and "upcycled_from" in meta
    experts = state.params["encoder"]["layers_1"]["ffn"]["moe"]["expert"]["wi_0"]
    np.testing.assert_array_equal(experts[2], dense_params["encoder"]["layers_1"]["ffn"]["mlp"]["wi_0"])
    batch = _batch()
    np.testing.assert_allclose(_logits(model, state.params, batch), _logits(dense_model, dense_params, batch),
                               rtol=1e-5, atol=1e-5)


def test_bad_upcycle_input_is_one_line_naming_the_option(tmp_path, capsys):
    _dense_run(tmp_path / "dense")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        ([f"--out={tmp_path / 'full'}"], "--out="),
        ([f"--out={tmp_path / 'a'}", "--gin.MLP_DIM=32"], "wi_0: dense"),
        ([f"--out={tmp_path / 'b'}", "--gin.MoeLayer.expert_granularity=2"], "expert_granularity|each expert"),
    ]
    for flags, message in cases:
        assert upcycle.main([*TINY, f"--checkpoint={tmp_path / 'dense'}", *flags]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert upcycle.main([*TINY, f"--checkpoint={tmp_path / 'none'}", f"--out={tmp_path / 'c'}"]) == 1
    assert "--checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_train_continues_an_upcycled_run(tmp_path):
    _dense_run(tmp_path / "dense", step=2)
    out = tmp_path / "moe"
    assert upcycle.main([*TINY, f"--checkpoint={tmp_path / 'dense'}", f"--out={out}"]) == 0
    _parse(f"--gin.MODEL_DIR={out}")
    result = train.train()
    assert sorted(result["losses"]) == [3, 4] and np.isfinite(list(result["losses"].values())).all()
