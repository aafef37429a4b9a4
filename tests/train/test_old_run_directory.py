"""A run directory and an export written before the MoE settings became a typed config
(their config.gin binds ``MoeLayer.*``) still evaluate, to the loss the run had."""

from __future__ import annotations

import json
import pathlib
import shutil

from moe_jax import cli

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "run_before_moe_config"
# `moe-jax export` of the fixture by the same code (export format 1).
EXPORT = pathlib.Path(__file__).parent / "fixtures" / "export_before_moe_config"
# `moe-jax eval --eval_steps=2` of the fixture (8 CPU devices, as in the tests) with the code
# that wrote it.
LOSS = 6.658900499343872


def test_old_run_directory_evaluates_to_its_loss(tmp_path, capsys):
    run = tmp_path / "run_before_moe_config"
    shutil.copytree(FIXTURE, run)
    out = tmp_path / "eval"
    assert cli.main(["eval", f"--checkpoint={run}", f"--output_dir={out}", "--eval_steps=2"]) in (
        0,
        None,
    )
    metrics = json.loads((out / "run_before_moe_config.json").read_text())["metrics"]
    assert abs(metrics["loss"] - LOSS) < 1e-5, metrics["loss"]


def test_old_export_imports_in_the_new_form_and_evaluates_to_the_runs_loss(tmp_path, capsys):
    """An export of the fixture written before ``MoeConfig`` (format 1) imports; the imported
    run's config.gin is in the new form and evaluates to the run's loss."""
    back = tmp_path / "imported"
    assert json.loads((EXPORT / "config.json").read_text())["version"] == 1
    assert cli.main(["import", f"--export={EXPORT}", f"--model_dir={back}"]) == 0
    assert "binds MoeLayer.*" in capsys.readouterr().err
    config = (back / "config.gin").read_text()
    assert "\nMoeLayer." not in config and "\nMoeConfig.router = @TopKRouterConfig()" in config
    out = tmp_path / "eval"
    assert cli.main(["eval", f"--checkpoint={back}", f"--output_dir={out}", "--eval_steps=2"]) == 0
    metrics = json.loads((out / "imported.json").read_text())["metrics"]
    assert abs(metrics["loss"] - LOSS) < 1e-5, metrics["loss"]


def test_old_run_directory_resumes_training_with_the_new_gin_files(tmp_path, capsys):
    """`train` resumes the fixture with the flags that made it, in the new form (the option
    its router ignored left out): the saved config.gin is compared after translation."""
    run = tmp_path / "run_before_moe_config"
    shutil.copytree(FIXTURE, run)
    flags = [
        "--gin_file=runs/smoke_cpu.gin",
        "--gin_file=data/vocab_byte.gin",
        "--gin.VOCAB_SIZE=384",
        "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        "--gin.TRAIN_STEPS=4",
        "--gin.train_script.train.checkpoint_period=3",
        "--gin.train_script.train.keep_checkpoints=1",
        "--gin.train_script.train.eval_period=0",
        "--gin.EVAL_STEPS=2",
        "--gin.TopKRouterConfig.renormalize_gates=True",
        "--gin.TopKRouterConfig.jitter_noise=0.01",
        f"--gin.MODEL_DIR={run}",
    ]
    assert cli.main(["train", *flags]) == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4
    assert not list(run.glob("config.step-*.gin"))  # nothing changed
