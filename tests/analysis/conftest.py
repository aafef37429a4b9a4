"""A tiny trained checkpoint shared by the analysis tests (the tests/train smoke pattern):
the size_tiny MoE T5 (1 sparse layer per stack, 4 experts, top-2) trained for 1 step on the
embedded corpus, 32 encoder / 8 decoder positions."""

from __future__ import annotations

import pathlib

import gin
import pytest

from moe_jax.commands import train
from moe_jax.runtime import builders, gin_flags, gin_utils

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.train_script.train.checkpoint_period=1",
    "--gin.train_script.train.log_period=1",
    "--gin.train_script.train.eval_period=0",
]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> pathlib.Path:
    """``MODEL_DIR`` of a 1-step run: ``checkpoints/1`` and the run's ``config.gin``."""
    model_dir = tmp_path_factory.mktemp("tiny_run")
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        [*TINY, f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=1"],
    )
    gin_utils.parse_gin(args)
    try:
        train.train()
    finally:
        gin.clear_config()
    assert (model_dir / "checkpoints" / "1").is_dir() and (model_dir / "config.gin").exists()
    return model_dir


@pytest.fixture(autouse=True)
def _fresh_gin():
    """The analysis CLI parses gin; leave no bindings to the tests that run next."""
    yield
    gin.clear_config()
