"""The trainer end to end on the tiny smoke config (8 forced CPU devices, data parallel):
exact resumption, checkpoint refusal, bad gin input, NaN handling, restore onto another mesh."""

from __future__ import annotations

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_jax import param_paths
from moe_jax.commands import train
from moe_jax.compile import aot
from moe_jax.models.t5 import EncoderDecoder
from moe_jax.runtime import (
    builders,
    checkpoint_checks,
    checkpoints,
    gin_flags,
    gin_text,
    gin_utils,
    router_init,
    train_state,
)
from moe_jax.runtime.run_dir import RunDir

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.train_script.train.checkpoint_period=3",
    "--gin.train_script.train.log_period=2",
    "--gin.train_script.train.eval_period=0",
    "--gin.train_script.train.async_checkpointing=True",
]


def parse(*flags: str):
    args = gin_flags.parse_flags(builders.build_parser("test", "test"), [*TINY, *flags])
    gin_utils.parse_gin(args)


def run(model_dir, steps: int, *flags: str) -> dict:
    parse(f"--gin.MODEL_DIR={model_dir}", f"--gin.TRAIN_STEPS={steps}", *flags)
    return train.train()


def test_interrupted_run_continues_exactly(tmp_path, monkeypatch):
    """Steps 1 and 5 neither log (every 2nd) nor save (every 3rd): their loss is read one
    step late, and the run still matches step for step."""
    full = run(tmp_path / "full", 6)
    with monkeypatch.context() as stopped:  # this invocation ends (with a checkpoint) at 3
        stopped.setattr(train, "_STOP_AFTER_STEPS", 3)
        first = run(tmp_path / "resumed", 6)
    assert first["step"] == 3 and sorted(first["losses"]) == [1, 2, 3]
    second = run(tmp_path / "resumed", 6)
    assert sorted(second["losses"]) == [4, 5, 6]
    resumed = {**first["losses"], **second["losses"]}
    assert resumed == full["losses"]  # bit-identical, step for step
    assert np.isfinite(list(full["losses"].values())).all()
    # the run keeps its routers' initial weights for drift measurements
    assert router_init.load(RunDir(tmp_path / "full"))


# one scan of [dense, MoE] x 2 per stack
SCANNED = (
    "--gin.SCAN_LAYERS=True",
    "--gin.T5Config.scan_min_layers=2",
    "--gin.NUM_ENCODER_LAYERS=4",
    "--gin.NUM_DECODER_LAYERS=4",
    "--gin.NUM_SPARSE_LAYERS=2",
)


def _saved_names(step_dir: str) -> list[str]:
    """The leaf names of a checkpoint step's parameters and train state (orbax's metadata)."""
    return [
        f"{item}/{name}"
        for item in ("params", "train")
        for name in param_paths.named_leaves(
            ocp.PyTreeCheckpointer().metadata(f"{step_dir}/{item}").item_metadata.tree
        )
    ]


def test_a_scanned_run_checkpoints_per_layer_and_continues_exactly(tmp_path, monkeypatch):
    """A run with scanned layers saves its parameters and optimizer state per layer, as an
    unrolled run does, and an interrupted run matches the uninterrupted one step for step."""
    scans = []

    def record(next_fun, args, kwargs, context):
        scans.append(context.module.name)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        full = run(tmp_path / "full", 6, *SCANNED)
    assert "scan_0" in scans  # the layers did run scanned
    with monkeypatch.context() as stopped:
        stopped.setattr(train, "_STOP_AFTER_STEPS", 3)
        first = run(tmp_path / "resumed", 6, *SCANNED)
    names = _saved_names(RunDir(tmp_path / "resumed").step_dir(3))
    assert "params/encoder/layers_3/ffn/moe/expert/wi_0" in names
    assert "train/opt_state/0/mu/decoder/layers_2/ffn/mlp/wo" in names
    assert [n for n in names if "scan_" in n] == []
    second = run(tmp_path / "resumed", 6, *SCANNED)
    assert {**first["losses"], **second["losses"]} == full["losses"]  # bit-identical


def test_a_run_traces_the_network_once_to_initialise_and_once_for_its_step(tmp_path, monkeypatch):
    """The abstract state, the shardings, the initialisation and the step share traces:
    the network is traced once for its initialisation (``EncoderDecoderModel.init_program``)
    and once for the train step; a resumed run likewise."""
    traced = []

    def count(next_fun, args, kwargs, context):
        if isinstance(context.module, EncoderDecoder) and context.method_name == "__call__":
            traced.append(context.module)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(count), monkeypatch.context() as stopped:
        stopped.setattr(train, "_STOP_AFTER_STEPS", 1)
        assert run(tmp_path, 2)["step"] == 1
    assert len(traced) == 2
    with nn.intercept_methods(count):
        assert run(tmp_path, 2)["step"] == 2
    assert len(traced) == 4


@pytest.mark.slow
def test_checkpoint_from_another_model_is_refused(tmp_path):
    run(tmp_path, 1)
    with pytest.raises(
        checkpoint_checks.CheckpointMismatchError,
        match=r"other shapes \(\d+\): decoder/final_norm/scale: checkpoint \[32\] vs model \[16\]",
    ):
        run(tmp_path, 2, "--gin.EMBED_DIM=16")
    with pytest.raises(checkpoint_checks.CheckpointMismatchError, match="not the checkpoint"):
        run(tmp_path, 2, "--gin.NUM_ENCODER_LAYERS=3")


def test_restore_onto_another_mesh_gives_same_params(tmp_path):
    from moe_jax import partitioning
    from moe_jax.models.model import EncoderDecoderModel

    run(tmp_path, 1)  # saved from the (8, 1, 1) data-parallel mesh
    model = EncoderDecoderModel(EncoderDecoder())  # the gin-configured tiny model
    shapes = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}
    rules = partitioning.standard_logical_axis_rules()
    ckpt = checkpoints.Checkpointer(RunDir(tmp_path), read_only=True)
    restored = []
    for shape in [(8, 1, 1), (2, 4, 1), (1, 1, 1)]:
        mesh = partitioning.make_mesh(
            mesh_shape=shape, devices=jax.devices()[: int(np.prod(shape))]
        )
        sharding = train_state.param_shardings(model, shapes, mesh, rules)
        target = train_state.abstract_with_shardings(
            builders.abstract_params(model, shapes), sharding
        )
        params, _, meta = ckpt.restore_params(1, target)
        assert meta["step"] == 1
        assert jax.tree.leaves(params)[0].sharding.mesh.shape == mesh.shape
        restored.append(jax.tree.map(np.asarray, params))
    for other in restored[1:]:
        jax.tree.map(np.testing.assert_array_equal, restored[0], other)


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_step_and_checkpoint(tmp_path):
    huge_lr = "--gin.learning_rate_schedule.base_learning_rate=1e30"
    with pytest.raises(
        train.NonFiniteLossError, match=r"at step \d+; last good checkpoint: .*checkpoints/\d"
    ):
        run(
            tmp_path / "stop",
            8,
            huge_lr,
            "--gin.learning_rate_schedule.warmup_steps=0",
            "--gin.train_script.train.checkpoint_period=1",  # step 1 is saved before the NaN
        )
    # skip: a step whose loss is non-finite leaves parameters (and optimizer state) as they were
    skip_dir = tmp_path / "skip"
    result = run(
        skip_dir,
        4,
        huge_lr,
        "--gin.learning_rate_schedule.warmup_steps=0",
        "--gin.train_script.train.on_nonfinite='skip'",
        "--gin.train_script.train.checkpoint_period=1",
        "--gin.train_script.train.keep_checkpoints=None",
        "--gin.train_script.train.log_period=1",
    )
    records = [json.loads(line) for line in (skip_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in records}
    assert result["step"] == 4 and skipped == {1: 0, 2: 1, 3: 1, 4: 1}
    assert np.isfinite(result["losses"][1]) and not np.isfinite(result["losses"][2])
    ckpt = checkpoints.Checkpointer(RunDir(skip_dir), read_only=True)
    saved = {}
    for s in (1, 2, 3, 4):
        out = ckpt._manager.restore(
            s,
            args=checkpoints.ocp.args.Composite(
                params=checkpoints.ocp.args.StandardRestore(),
                train=checkpoints.ocp.args.StandardRestore(),
            ),
        )
        saved[s] = {item: jax.tree.map(np.asarray, out[item]) for item in ("params", "train")}
    ckpt.close()
    for s in (2, 3, 4):
        jax.tree.map(np.testing.assert_array_equal, saved[1]["params"], saved[s]["params"])
        jax.tree.map(
            np.testing.assert_array_equal,
            saved[1]["train"]["opt_state"],
            saved[s]["train"]["opt_state"],
        )


@pytest.mark.parametrize("sync_every_step", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_nan_at_a_known_step_stops_there_and_is_never_saved(tmp_path, monkeypatch, sync_every_step):
    """The loss turns NaN on the device at step 5 (no log, no save there): the lagged check
    reads it while step 6 runs and stops before step 6's save, naming step 5 and the
    checkpoint of step 3; the step-by-step loop (``sync_every_step``) says the same."""
    check_fits = aot.check_fits  # returns the compiled step that train runs

    def nan_at_step_5(*args):
        step_fn = check_fits(*args)

        def step(state, batch):
            state, metrics = step_fn(state, batch)
            return state, {**metrics, "loss": jnp.where(state.step == 5, jnp.nan, metrics["loss"])}

        return step

    monkeypatch.setattr(aot, "check_fits", nan_at_step_5)
    with pytest.raises(
        train.NonFiniteLossError,
        match=r"loss is nan at step 5; last good checkpoint: .*checkpoints/3\.",
    ):
        run(
            tmp_path,
            8,
            "--gin.train_script.train.log_period=100",
            f"--gin.train_script.train.sync_every_step={sync_every_step}",
        )
    assert checkpoints.Checkpointer(RunDir(tmp_path), read_only=True).latest_step() == 3


def test_unwritable_model_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="MODEL_DIR="):
        run(blocker / "run", 1)
    assert not (blocker.parent / "run").exists()


def test_gin_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'gin/runs/smoke_cpu.gin'\n\ntrain_script.train.chekpoint_period = 3\n")
    with pytest.raises(gin_text.GinConfigError, match=r"(?s)chekpoint_period.*bad.gin.*line 3"):
        gin_utils.parse_gin(
            gin_flags.parse_flags(builders.build_parser("t", "t"), [f"--gin_file={bad}"])
        )
    undefined = tmp_path / "macro.gin"
    undefined.write_text(
        "include 'gin/runs/smoke_cpu.gin'\ntrain_script.train.total_steps = %TRAIN_STEPZ\n"
    )
    with pytest.raises(gin_text.GinConfigError, match=r"(?s)%TRAIN_STEPZ.*macro.gin.*line 2"):
        gin_utils.parse_gin(
            gin_flags.parse_flags(builders.build_parser("t", "t"), [f"--gin_file={undefined}"])
        )
    with pytest.raises(
        gin_text.GinConfigError, match=r"TRAIN_STEP .*not used.*did you mean TRAIN_STEPS\b"
    ):
        parse("--gin.TRAIN_STEP=10")


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    from moe_jax import cli

    assert (
        cli.main(["train", *TINY, "--gin.MODEL_DIR=" + str(tmp_path), "--gin.TRAIN_STEPZ=3"]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("moe-jax train: error: gin: macro TRAIN_STEPZ") and "Traceback" not in err


def test_resolves_checkpoint_paths():
    assert RunDir.of_checkpoint("/r/run") == (RunDir("/r/run"), None)
    assert RunDir.of_checkpoint("/r/run/300") == (RunDir("/r/run"), 300)
    assert RunDir.of_checkpoint("/r/run/checkpoints/300") == (RunDir("/r/run"), 300)
    assert RunDir("/r/run/").step_dir(300) == "/r/run/checkpoints/300"
    assert pathlib.Path(gin_text.REPO_GIN_DIR, "runs", "smoke_cpu.gin").exists()
