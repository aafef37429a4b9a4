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
    assert "MoeLayer." not in config and "MoeConfig.router = @TopKRouterConfig()" in config
    out = tmp_path / "eval"
    assert cli.main(["eval", f"--checkpoint={back}", f"--output_dir={out}", "--eval_steps=2"]) == 0
    metrics = json.loads((out / "imported.json").read_text())["metrics"]
    assert abs(metrics["loss"] - LOSS) < 1e-5, metrics["loss"]
