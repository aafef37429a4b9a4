"""Refusals a new user meets first: one line naming the cause, nothing left behind."""

from __future__ import annotations

import json
import time

import gin
import pytest

from moe_jax import cli, storage
from moe_jax.runtime import run_lock
from moe_jax.runtime.run_dir import RunDir

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.TRAIN_STEPS=1",
]


@pytest.fixture(autouse=True)
def _fresh_gin():
    yield
    gin.clear_config()


def _last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            [
                "--gin.vocab.get_vocabulary.kind=sentencepiece",
                "--gin.vocab.get_vocabulary.path=/nope/x.model",
            ],
            "SentencePiece model not found: get_vocabulary.path='/nope/x.model' "
            "(kind='sentencepiece')",
        ),
        (
            ["--gin.NUM_SELECTED_EXPERTS=5"],
            "TopKRouterConfig.num_selected_experts=5 must be between 1 and MoeConfig.num_experts=4",
        ),
        (
            ["--gin.NUM_EXPERTS=3", "--gin.partitioning.make_mesh.mesh_shape=(4, 2, 1)"],
            "params/decoder/layers_1/ffn/moe/expert/wi_0 [3, 32, 64]: dimension 0 (3) is split "
            "over mesh axis expert of size 2, which does not divide it; make the number of experts "
            "(NUM_EXPERTS) a multiple of the expert axis, or change the mesh "
            "(partitioning.make_mesh.mesh_shape)",
        ),
    ],
    ids=["vocabulary", "k_above_experts", "experts_vs_mesh"],
)
def test_a_refused_train_leaves_no_model_dir(tmp_path, capsys, flags, line):
    model_dir = tmp_path / "new_run"
    assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={model_dir}", *flags]) == 1
    assert _last_line(capsys) == f"moe-jax train: error: {line}"
    assert not model_dir.exists()


def test_a_broken_command_line_binding_is_named_as_given(tmp_path, capsys):
    model_dir = f"--gin.MODEL_DIR={tmp_path / 'run'}"
    assert cli.main(["train", *TINY, "--gin_bindings=TRAIN_STEPS = (", model_dir]) == 1
    assert _last_line(capsys) == (
        "moe-jax train: error: gin: --gin_bindings='TRAIN_STEPS = (': "
        "cannot parse it (a bracket or quote is not closed)"
    )
    two_lines = "--gin_bindings=BATCH_SIZE = 8\nTRAIN_STEPS = two"
    assert cli.main(["train", *TINY, two_lines, model_dir]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "moe-jax train: error: gin: --gin_bindings='BATCH_SIZE = 8\\nTRAIN_STEPS "
        "= two': cannot parse it: not a value (strings need quotes)"
    )
    assert "Failed to parse token 'two' (line 2)" in err and "<ast." not in err
    unclosed = "--gin.TASK_FEATURE_LENGTHS={'inputs': 32"
    assert cli.main(["train", *TINY, unclosed, model_dir]) == 1
    assert _last_line(capsys) == (
        f"moe-jax train: error: gin: {unclosed}: cannot parse it (a bracket or quote is not closed)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_an_empty_lock_is_taken_over_at_once(tmp_path, request, where):
    """A writer stopped between creating LOCK and writing it leaves an empty file: no holder
    to wait for (the project's own locks are created whole)."""
    model_dir = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_dir")
    lock_path = RunDir(model_dir).lock_file
    storage.write_bytes(lock_path, b"")
    start = time.monotonic()
    lock = run_lock.RunLock(RunDir(model_dir)).acquire()
    try:
        assert time.monotonic() - start < 10
        assert lock.took_over["reason"] == (
            "the lock file is empty (its writer stopped before writing it)"
        )
        assert json.loads(storage.read_text(lock_path)) == lock.record
    finally:
        lock.release()
    assert not storage.exists(lock_path)


_LENGTHS = "TASK_FEATURE_LENGTHS (DatasetConfig.task_feature_lengths) = "


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--gin.TASK_FEATURE_LENGTHS={'inputs': '32', 'targets': 8}"],
            _LENGTHS + "{'inputs': '32', 'targets': 8}: 'inputs': expected a positive integer; "
            "e.g. {'inputs': 512, 'targets': 114}",
        ),
        (
            ["--gin.TASK_FEATURE_LENGTHS=32"],
            _LENGTHS + "32: expected a dict; e.g. {'inputs': 512, 'targets': 114}",
        ),
        (
            ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32}"],
            _LENGTHS + "{'inputs': 32}: no 'targets'; e.g. {'inputs': 512, 'targets': 114}",
        ),
        (
            ["--gin.NoisyTopKRouterConfig.init_stddev=0.5"],
            "NoisyTopKRouterConfig.init_stddev = 0.5: no part of the model reads this binding "
            "(a config of a router or layer the model does not use?)",
        ),
    ],
    ids=["length_as_text", "lengths_not_a_dict", "no_targets", "unused_router_config"],
)
def test_bad_lengths_and_unread_bindings_are_one_line(tmp_path, capsys, flags, line):
    model_dir = tmp_path / "new_run"
    assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={model_dir}", *flags]) == 1
    assert _last_line(capsys) == f"moe-jax train: error: {line}"
    assert not model_dir.exists()


def test_data_that_yields_nothing_is_one_line_and_leaves_no_run(tmp_path, capsys):
    model_dir = tmp_path / "new_run"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    text = ["--gin_file=data/text.gin", f"--gin.MODEL_DIR={model_dir}"]
    for flags in (
        ["--gin.MIXTURE_OR_TASK_NAME=no_such_task"],
        ["--gin_file=data/text.gin", f"--gin.TEXT_TRAIN_FILES={tmp_path}/nothing/*.txt"],
        [*text, f"--gin.TEXT_TRAIN_FILES={empty}"],
    ):
        assert cli.main(["train", *TINY, f"--gin.MODEL_DIR={model_dir}", *flags]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("moe-jax train: error: ") and "Traceback" not in err, err
        assert not model_dir.exists(), flags
    # nothing of the refused run is left to refuse a good one as a config change
    good = tmp_path / "good.txt"
    good.write_text("".join(f"line {i} of some text to train on.\n" for i in range(200)))
    assert cli.main(["train", *TINY, *text, f"--gin.TEXT_TRAIN_FILES={good}"]) == 0
