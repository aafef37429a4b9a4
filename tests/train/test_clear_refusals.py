"""Refusals a new user meets first: one line naming the cause, nothing left behind."""

from __future__ import annotations

import os
import time

import gin
import pytest

from moe_jax import cli, errors
from moe_jax.train import run_lock

TINY = ["--gin_file=runs/smoke_cpu.gin", "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", "--gin.TRAIN_STEPS=1"]


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


def _last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flags, line", [
    (["--gin.vocab.get_vocabulary.kind=sentencepiece", "--gin.vocab.get_vocabulary.path=/nope/x.model"],
     "SentencePiece model not found: get_vocabulary.path='/nope/x.model' (kind='sentencepiece')"),
    (["--gin.MoeLayer.num_selected_experts=5"],
     "MoeLayer.num_selected_experts=5 must be between 1 and num_experts=4"),
    (["--gin.NUM_EXPERTS=3", "--gin.partitioning.make_mesh.mesh_shape=(4, 2, 1)"],
     "params/decoder/layers_1/ffn/moe/expert/wi_0 [3, 32, 64]: dimension 0 (3) is split over "
     "mesh axis expert of size 2, which does not divide it; make the number of experts "
     "(NUM_EXPERTS) a multiple of the expert axis, or change the mesh "
     "(partitioning.make_mesh.mesh_shape)"),
], ids=["vocabulary", "k_above_experts", "experts_vs_mesh"])
def test_a_refused_train_leaves_no_model_dir(tmp_path, capsys, flags, line):
    model_dir = tmp_path / "new_run"
    assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={model_dir}", *flags]) == 1
    assert _last_line(capsys) == f"moe-jax train: error: {line}"
    assert not model_dir.exists()


def test_a_broken_command_line_binding_is_named_as_given(tmp_path, capsys):
    model_dir = f"--gin.MODEL_DIR={tmp_path / 'run'}"
    assert cli.main(["train", *TINY, "--gin_bindings=TRAIN_STEPS = (", model_dir]) == 1
    assert _last_line(capsys) == ("moe-jax train: error: gin: --gin_bindings='TRAIN_STEPS = (': "
                                  "cannot parse it (a bracket or quote is not closed)")
    assert cli.main(["train", *TINY, "--gin_bindings=BATCH_SIZE = 8\nTRAIN_STEPS = two", model_dir]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-jax train: error: gin: --gin_bindings='BATCH_SIZE = 8\\nTRAIN_STEPS = "
                          "two': cannot parse it: not a value (strings need quotes)")
    assert "Failed to parse token 'two' (line 2)" in err and "<ast." not in err
    assert cli.main(["train", *TINY, "--gin.TASK_FEATURE_LENGTHS={'inputs': 32", model_dir]) == 1
    assert _last_line(capsys) == ("moe-jax train: error: gin: --gin.TASK_FEATURE_LENGTHS={'inputs': "
                                  "32: cannot parse it (a bracket or quote is not closed)")
    assert not (tmp_path / "run").exists()
