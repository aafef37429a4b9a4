"""Every command that reads a checkpoint restores its state collections through one path
(``builders.restore_model``): on a tiny run of the auxiliary-loss-free bias router
(routers/aux_free_bias.gin), `moe-jax infer` and `moe-jax analyze` run, the restored bias is
the trained one, and the routing-churn probe measures churn and reads the bias."""

from __future__ import annotations

import json
import pathlib

import gin
import jax
import numpy as np
import pytest

from moe_jax import cli
from moe_jax.commands import train
from moe_jax.moe.collections import BIAS_COLLECTION
from moe_jax.runtime import builders, checkpoints, configured, gin_flags, gin_utils
from moe_jax.runtime.routing_telemetry import ChurnProbe
from moe_jax.runtime.run_dir import RunDir

# A bias-router run trained once for the module (minutes on 2 cores); the round trip of the
# bias itself is in test_state_collections.py, which runs with `make test`.
pytestmark = pytest.mark.slow

STEPS = 4
TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin_file=routers/aux_free_bias.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.BIAS_UPDATE_RATE=0.01",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.train_script.train.checkpoint_period=2",
    "--gin.train_script.train.log_period=2",
    "--gin.train_script.train.eval_period=2",
    "--gin.train_script.train.eval_steps=1",
]
SHAPES = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}
LAYERS = ("encoder/layers_1", "decoder/layers_1")


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def bias_run(tmp_path_factory) -> pathlib.Path:
    model_dir = tmp_path_factory.mktemp("bias_run")
    gin_utils.parse_gin(
        gin_flags.parse_flags(
            builders.build_parser("t", "t"), [*TINY, f"--gin.MODEL_DIR={model_dir}"]
        )
    )
    try:
        train.train()
    finally:
        gin.clear_config()
    return model_dir


def _model():
    return gin.query_parameter("train_script.train.model").scoped_configurable_fn()


def _parse_run(model_dir: pathlib.Path) -> None:
    gin_utils.parse_gin(
        gin_flags.parse_flags(
            builders.build_parser("t", "t"), [*TINY, f"--gin.MODEL_DIR={model_dir}"]
        )
    )


def _biases(collections) -> np.ndarray:
    return np.concatenate([np.asarray(b) for b in jax.tree.leaves(collections[BIAS_COLLECTION])])


def test_restore_model_gives_the_trained_bias(bias_run):
    _parse_run(bias_run)
    model, ctx = _model(), configured.run_context()
    restored = builders.restore_model(str(bias_run), model, SHAPES, ctx)
    full = configured.train_setup(model, SHAPES, ctx).abstract_state
    ckpt = checkpoints.Checkpointer(RunDir(bias_run), read_only=True)
    try:
        state = ckpt.restore(STEPS, full)[0]
    finally:
        ckpt.close()
    assert restored.step == STEPS
    np.testing.assert_array_equal(_biases(restored.collections), _biases(state.collections))
    assert np.any(_biases(restored.collections) != 0)  # four updates of 0.01 moved it
    for got, want in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_training_measures_churn_for_a_bias_router(bias_run):
    records = [json.loads(line) for line in (bias_run / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((r for r in records if r["split"] == "eval"), key=lambda r: r["step"])
    assert [r["step"] for r in evals] == [2, 4]
    for layer in LAYERS:
        assert f"moe/{layer}/routing_churn" not in evals[0]
        assert 0.0 <= evals[1][f"moe/{layer}/routing_churn"] <= 1.0


def test_churn_probe_routes_with_the_bias(bias_run, tmp_path):
    """The same parameters with a bias of +100 on expert 3: every token's first choice
    becomes expert 3, so the churn is exactly the share of tokens whose choice was not 3."""
    _parse_run(bias_run)
    model, ctx = _model(), configured.run_context()
    restored = builders.restore_model(str(bias_run), model, SHAPES, ctx)
    probe_batch = next(
        builders.eval_batches(
            gin.query_parameter(
                "train_script.train.train_eval_dataset_cfg"
            ).scoped_configurable_fn(),
            1,
        )
    )
    probe = ChurnProbe(
        model,
        restored.params_shardings,
        ctx,
        probe_batch,
        RunDir(tmp_path),
        restored.collections_shardings,
    )
    assert probe(restored.params, restored.collections) == {}
    before = dict(probe._previous)
    assert probe(restored.params, restored.collections) == {
        f"moe/{layer}/routing_churn": 0.0 for layer in LAYERS
    }
    pushed = jax.tree.map(lambda b: b.at[3].add(100.0), restored.collections)
    churn = probe(restored.params, pushed)
    for layer in LAYERS:
        valid = probe._previous[layer] < 4
        np.testing.assert_array_equal(probe._previous[layer][valid], 3)
        expected = float(np.mean(before[layer][valid] != 3))
        assert churn[f"moe/{layer}/routing_churn"] == pytest.approx(expected)
        assert expected > 0


def test_infer_and_analyze_run_on_a_bias_router_checkpoint(bias_run, tmp_path, capsys):
    assert (
        cli.main(
            [
                "infer",
                f"--checkpoint={bias_run}",
                "--input=Everyone has the right to <extra_id_0>.",
                f"--output_file={tmp_path / 'out.jsonl'}",
            ]
        )
        == 0
    ), capsys.readouterr().err
    (line,) = (tmp_path / "out.jsonl").read_text().splitlines()
    assert json.loads(line)["input"] == "Everyone has the right to <extra_id_0>."
    gin.clear_config()
    assert (
        cli.main(
            [
                "analyze",
                "positions",
                f"--checkpoint={bias_run}",
                f"--out={tmp_path / 'pos'}",
                "--gin.positions_script.analyze.num_batches=1",
                "--gin.positions_script.analyze.block_sizes=(4, 16)",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert set(json.loads((tmp_path / "pos" / "positions.json").read_text())["layers"]) == set(
        LAYERS
    )
    gin.clear_config()
    assert (
        cli.main(
            [
                "analyze",
                "languages",
                f"--checkpoint={bias_run}",
                f"--out={tmp_path / 'lang'}",
                "--gin.languages_script.analyze.max_examples_per_label=2",
                "--gin.languages_script.analyze.batch_size=8",
            ]
        )
        == 0
    ), capsys.readouterr().err
    report = json.loads((tmp_path / "lang" / "languages.json").read_text())
    assert report["checkpoints"][0]["step"] == STEPS and set(
        report["checkpoints"][0]["layers"]
    ) == set(LAYERS)
