"""A run directory written before the MoE settings became a typed config (its config.gin
binds ``MoeLayer.*``) still evaluates, to the loss it had."""

from __future__ import annotations

import json
import pathlib
import shutil

from moe_jax import cli

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "run_before_moe_config"
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
