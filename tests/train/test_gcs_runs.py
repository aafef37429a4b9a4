"""Runs whose MODEL_DIR is a ``gs://`` path, against the GCS protocol server on localhost
(tests/gcs_server.py): training killed mid-save and resumed, the fault rows (damaged
checkpoint, changed config, a second writer), and the reading commands giving the numbers
they give for the same run on local disk."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import fsspec
import jax
import numpy as np
import pytest

from moe_jax import cli, errors, storage
from moe_jax.interop import export_format
from moe_jax.runtime import checkpoint_checks, checkpoints, run_config, run_lock
from moe_jax.runtime.event_files import unpack_records
from moe_jax.runtime.metrics import read_metrics
from moe_jax.runtime.run_dir import RunDir
from tests.train.test_faults_processes import error_lines, losses, params_at
from tests.train.test_processes import finish, start, wait_for_step
from tests.train.test_train import run


def event_steps(model_dir: str, split: str = "train", tag: str = "loss") -> list[int]:
    """The steps of ``tag`` in the TensorBoard event files of ``MODEL_DIR/split``."""
    from tensorboard.compat.proto import event_pb2

    folder = storage.join(model_dir, split)
    steps = []
    for name in storage.listdir(folder):
        for record in unpack_records(storage.read_bytes(storage.join(folder, name))):
            event = event_pb2.Event.FromString(record)
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return sorted(steps)


@pytest.mark.slow
def test_gcs_run_killed_mid_save_resumes_bit_identical_to_a_local_run(tmp_path, gcs_dir):
    flags = ["--gin.TRAIN_STEPS=10", "--gin.train_script.train.checkpoint_period=1"]
    code, out = finish(start(tmp_path / "local", *flags))
    assert code == 0, out[-2000:]
    proc = start(gcs_dir, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=1")
    wait_for_step(proc, gcs_dir, 4)
    proc.send_signal(signal.SIGKILL)  # saves every step: this lands in or near a save
    finish(proc)
    complete = checkpoints.Checkpointer(RunDir(gcs_dir), read_only=True).all_steps()
    assert complete, "no complete checkpoint on gs://"
    code, out = finish(start(gcs_dir, *flags))
    assert code == 0, out[-2000:]
    assert f"restored {gcs_dir}/checkpoints/{complete[-1]}" in out
    assert losses(gcs_dir) == losses(tmp_path / "local")  # each step once, the same losses
    assert event_steps(gcs_dir) == list(range(1, 11))  # TensorBoard: each step once
    for a, b in zip(params_at(gcs_dir, 10), params_at(tmp_path / "local", 10), strict=True):
        np.testing.assert_array_equal(a, b)
    # the run's files on the bucket: config, integrity records with checksums, no lock left
    assert storage.exists(f"{gcs_dir}/config.gin") and not storage.exists(f"{gcs_dir}/LOCK")
    integrity = storage.join(RunDir(gcs_dir).step_dir(10), checkpoint_checks.INTEGRITY_FILE)
    record = json.loads(storage.read_text(integrity))
    assert all(len(entry["crc32c"]) == 8 for entry in record["files"].values())


def test_gcs_damaged_checkpoint_falls_back_and_changed_config_is_refused(gcs_dir, capsys):
    run(gcs_dir, 6)  # checkpoints 3 and 6
    step_dir = f"{gcs_dir}/checkpoints/6"
    fs = fsspec.filesystem("gs")
    data_files = [name for name in fs.find(step_dir) if "/params/" in name and "/d/" in name]
    assert data_files
    # the object's bytes, not the listing's size: the listing can be older than the last
    # write of an object the save rewrote
    size = len(fs.cat_file(data_files[0]))
    fs.pipe_file(data_files[0], os.urandom(size))  # same size, other bytes
    with pytest.raises(
        checkpoint_checks.UnreadableCheckpointError,
        match=r"^checkpoint step 6 is unreadable: "
        rf"{step_dir}/\S+: CRC32C differs",
    ):
        checkpoints.restore_from(gcs_dir, None)
    resumed = run(gcs_dir, 9)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "resuming from step 3 instead" in warnings[0]
    assert sorted(resumed["losses"]) == list(range(4, 10))
    assert RunDir(gcs_dir).set_aside_steps() == [6]
    steps = [r["step"] for r in read_metrics(RunDir(gcs_dir), "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 9
    # the next start names the step set aside
    run(gcs_dir, 9)
    assert "holds step(s) [6] set aside as damaged" in capsys.readouterr().err
    config = storage.read_text(f"{gcs_dir}/config.gin")
    with pytest.raises(run_config.ConfigChangedError, match=r"base_learning_rate: 0.003 -> 0.5"):
        run(gcs_dir, 12, "--gin.learning_rate_schedule.base_learning_rate=0.5")
    assert storage.read_text(f"{gcs_dir}/config.gin") == config  # never overwritten


def test_gcs_lock_refuses_a_second_writer_until_the_holder_dies_or_its_lease_expires(
    gcs_dir, monkeypatch
):
    first = run_lock.RunLock(RunDir(gcs_dir)).acquire()
    with pytest.raises(
        errors.RunLockedError, match=f"{gcs_dir} is being written by another trainer"
    ):
        run_lock.RunLock(RunDir(gcs_dir)).acquire()
    first.release()
    assert not storage.exists(f"{gcs_dir}/LOCK")
    # a holder on another host that stopped heartbeating: let in once its lease expired
    record = {"host": "other-host", "pid": 1, "since": "then", "lease_sec": 3.0}
    assert storage.create_exclusive(f"{gcs_dir}/LOCK", json.dumps(record).encode())
    with pytest.raises(errors.RunLockedError, match="host other-host, PID 1"):
        run_lock.RunLock(RunDir(gcs_dir)).acquire()
    time.sleep(3.5)
    second = run_lock.RunLock(RunDir(gcs_dir)).acquire()
    assert second.took_over["host"] == "other-host" and "no heartbeat" in second.took_over["reason"]
    second.release()


@pytest.mark.slow
def test_gcs_second_trainer_process_is_refused_and_a_killed_holder_does_not_block(gcs_dir):
    first = start(gcs_dir, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=2")
    wait_for_step(first, gcs_dir, 3)
    code, out = finish(start(gcs_dir, "--gin.TRAIN_STEPS=500"))
    assert code == errors.EXIT_USER_ERROR, out[-2000:]
    assert len(error_lines(out)) == 1 and f"PID {first.pid}" in error_lines(out)[0], out[-2000:]
    first.send_signal(signal.SIGKILL)
    finish(first)
    reached = RunDir(gcs_dir).reached_step()
    code, out = finish(start(gcs_dir, f"--gin.TRAIN_STEPS={reached + 1}"))
    assert code == 0, out[-2000:]
    assert (
        f"took over the lock of {gcs_dir} from host {socket.gethostname()} PID {first.pid}" in out
    )
    # TensorStore's C++ auth provider says which credentials it uses on its own: not here
    assert "google_auth_provider" not in out, out[-2000:]


def _cli(*argv: str) -> int:
    return cli.main(list(argv))


@pytest.mark.slow
def test_gcs_run_reads_like_its_local_copy(tmp_path, gcs_dir, capsys):
    """eval, infer, export/import and analyze positions of a gs:// run give what they give
    for the same run copied to local disk."""
    run(gcs_dir, 3)
    local = str(tmp_path / "copy")
    fsspec.filesystem("gs").get(gcs_dir, local, recursive=True)
    outputs = {}
    for name, root in (("gcs", gcs_dir), ("local", local)):
        out = f"{root}/read"
        assert (
            _cli("eval", f"--checkpoint={root}", f"--output_dir={out}/eval", "--gin.EVAL_STEPS=2")
            == 0
        )
        assert (
            _cli(
                "infer",
                f"--checkpoint={root}",
                f"--output_file={out}/infer.jsonl",
                "--input=Hello world",
                "--gin.infer_script.infer.max_decode_length=4",
            )
            == 0
        )
        assert _cli("export", f"--checkpoint={root}", f"--out={out}/export") == 0
        assert _cli("import", f"--export={out}/export", f"--model_dir={out}/imported") == 0
        assert (
            _cli(
                "analyze",
                "positions",
                f"--checkpoint={root}",
                f"--out={out}/positions",
                "--gin.EVAL_STEPS=1",
            )
            == 0
        )
        outputs[name] = {
            "eval": _eval_numbers(f"{out}/eval"),
            "infer": storage.read_text(f"{out}/infer.jsonl"),
            "export": export_format.safetensors_arrays(f"{out}/export/model.safetensors"),
            "imported": [np.asarray(x) for x in jax.tree.leaves(params_at(f"{out}/imported", 3))],
            "positions": sorted(storage.listdir(f"{out}/positions")),
        }
    capsys.readouterr()
    gcs, loc = outputs["gcs"], outputs["local"]
    assert gcs["eval"] == loc["eval"] and gcs["eval"]
    assert gcs["infer"] == loc["infer"]
    assert gcs["export"].keys() == loc["export"].keys() and gcs["export"]
    for name, array in gcs["export"].items():
        np.testing.assert_array_equal(array, loc["export"][name])
    for a, b in zip(gcs["imported"], loc["imported"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert gcs["positions"] == loc["positions"] and gcs["positions"]


def _eval_numbers(folder: str) -> list[dict]:
    """The metrics and routing statistics of each evaluated checkpoint (labels and paths
    name the run's location, so they differ between the copies)."""
    results = json.loads(storage.read_text(f"{folder}/comparison.json"))
    return [
        {"step": r["step"], "metrics": r["metrics"], "routing": r["routing"]}
        for r in results.values()
    ]


@pytest.mark.slow
def test_gcs_sweep_runs_marks_and_collects_a_family_on_a_bucket(tmp_path, gcs_dir, capsys):
    from moe_jax.experiments import sweep

    family = tmp_path / "tiny.toml"
    family.write_text("""
name = "tiny"
seeds = [0]
[bindings]
TRAIN_STEPS = 2
BATCH_SIZE = 8
TASK_FEATURE_LENGTHS = {inputs = 32, targets = 8}
"train_script.train.eval_period" = 2
"train_script.train.eval_steps" = 1
"train_script.train.checkpoint_period" = 2
[runs.learned]
gin_files = ["runs/smoke_cpu.gin"]
""")
    assert sweep.main(["run", str(family), "--root", gcs_dir]) == 0
    run_dir = f"{gcs_dir}/learned/seed0"
    assert storage.exists(f"{run_dir}/DONE") and storage.isdir(f"{run_dir}/checkpoints/2")
    # the trainer's output, uploaded: plain progress lines (its stderr is no terminal)
    assert "step 2/2: loss" in storage.read_text(f"{run_dir}/log.txt")
    capsys.readouterr()
    assert sweep.main(["run", str(family), "--root", gcs_dir]) == 0
    assert "0 to run" in capsys.readouterr().out
    assert sweep.main(["collect", str(family), "--root", gcs_dir]) == 0
    summary = json.loads(storage.read_text(f"{gcs_dir}/tiny.json"))
    assert summary["groups"]["learned"]["final_step"] == 2
    assert storage.exists(f"{gcs_dir}/tiny_curves.png")
