"""The trainer as separate processes: SIGTERM, kill -9 during saves, two-process runs.

Slow (each process imports TensorFlow and compiles): `pytest -m slow tests/train`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from moe_jax import param_paths
from moe_jax.runtime import checkpoints, router_init
from moe_jax.runtime.metrics import read_metrics
from moe_jax.runtime.run_dir import RunDir

pytestmark = pytest.mark.slow

FLAGS = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.train_script.train.log_period=1",
    "--gin.train_script.train.eval_period=0",
]


def env(devices: int) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    return e


def start(model_dir, *flags: str, devices: int = 1) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_jax.cli",
            "train",
            *FLAGS,
            f"--gin.MODEL_DIR={model_dir}",
            *flags,
        ],
        env=env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def logged_steps(model_dir) -> list[int]:
    """The steps of ``MODEL_DIR/metrics.jsonl`` (local or gs://; [] before the first)."""
    return [r["step"] for r in read_metrics(RunDir(model_dir))]


def wait_for_step(proc, model_dir, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if logged_steps(model_dir) and max(logged_steps(model_dir)) >= step:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"step {step} not reached:\n{proc.communicate()[0][-3000:]}")


def finish(proc, timeout: float = 300) -> tuple[int, str]:
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"process hung:\n{out[-3000:]}") from None
    return proc.returncode, out


def test_sigterm_saves_then_resume_continues(tmp_path):
    proc = start(
        tmp_path, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=1000"
    )
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 143, out[-2000:]
    saved = checkpoints.Checkpointer(RunDir(tmp_path), read_only=True).all_steps()
    assert saved and saved[-1] >= 3, saved
    assert [line for line in out.splitlines() if line.startswith("moe-jax train:")] == [
        f"moe-jax train: stopped by SIGTERM: at step {saved[-1]}: saved {tmp_path}/checkpoints/"
        f"{saved[-1]}; the same command resumes from it"
    ], out[-2000:]
    assert "Traceback" not in out
    code, out = finish(start(tmp_path, f"--gin.TRAIN_STEPS={saved[-1] + 2}"))
    assert code == 0, out[-2000:]
    assert f"restored {tmp_path}/checkpoints/{saved[-1]}" in out
    assert logged_steps(tmp_path)[-2:] == [saved[-1] + 1, saved[-1] + 2]


def test_kill_during_saves_then_resume(tmp_path):
    proc = start(tmp_path, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=1")
    wait_for_step(proc, tmp_path, 4)
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    complete = checkpoints.Checkpointer(RunDir(tmp_path), read_only=True).all_steps()
    assert complete
    code, out = finish(start(tmp_path, f"--gin.TRAIN_STEPS={complete[-1] + 1}"))
    assert code == 0, out[-2000:]
    assert f"restored {tmp_path}/checkpoints/{complete[-1]}" in out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(model_dir, steps: int, heartbeat: int = 10) -> list[subprocess.Popen]:
    port = free_port()
    return [
        start(
            model_dir,
            f"--gin.TRAIN_STEPS={steps}",
            "--gin.train_script.train.checkpoint_period=2",
            f"--coordinator_address=127.0.0.1:{port}",
            "--process_count=2",
            f"--process_index={i}",
            f"--heartbeat_timeout={heartbeat}",
            "--initialization_timeout=120",
            devices=4,
        )
        for i in range(2)
    ]


def test_two_processes_write_one_checkpoint_restorable_in_one(tmp_path):
    procs = two_processes(tmp_path, 3)
    results = [finish(p) for p in procs]
    for code, out in results:
        assert code == 0, out[-3000:]
    ckpt = checkpoints.Checkpointer(RunDir(tmp_path), read_only=True)
    assert ckpt.all_steps()[-1] == 3
    meta = ckpt.read_meta(3)
    assert [s["shard_index"] for s in meta["data_iterators"]] == [0, 1]
    # restore in this single process, on 8 devices and on 1: the same parameters
    from moe_jax import partitioning
    from moe_jax.runtime import builders, gin_flags, gin_utils, train_state

    gin_utils.parse_gin(
        gin_flags.parse_flags(
            builders.build_parser("t", "t"),
            [*FLAGS, f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=3"],
        )
    )
    from moe_jax.models.model import EncoderDecoderModel
    from moe_jax.models.t5 import EncoderDecoder

    model = EncoderDecoderModel(EncoderDecoder())
    shapes = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}
    rules = partitioning.standard_logical_axis_rules()
    restored = []
    for shape in [(2, 4, 1), (1, 1, 1)]:
        mesh = partitioning.make_mesh(
            mesh_shape=shape, devices=jax.devices()[: int(np.prod(shape))]
        )
        target = train_state.abstract_with_shardings(
            builders.abstract_params(model, shapes),
            train_state.param_shardings(model, shapes, mesh, rules),
        )
        restored.append(jax.tree.map(np.asarray, ckpt.restore_params(3, target)[0]))
    jax.tree.map(np.testing.assert_array_equal, *restored)
    init = router_init.load(RunDir(tmp_path))
    trained = param_paths.router_params(restored[0])
    assert init and any(not np.array_equal(init[k], trained[k]) for k in init)


def test_one_process_dying_makes_the_other_exit(tmp_path):
    procs = two_processes(tmp_path, 10_000, heartbeat=10)
    wait_for_step(procs[0], tmp_path, 2)
    procs[1].send_signal(signal.SIGKILL)
    start_time = time.time()
    code, out = finish(procs[0], timeout=120)
    finish(procs[1])
    assert code != 0, out[-2000:]
    assert time.time() - start_time < 120


def _export(model_dir, out, *flags: str, devices: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_jax.cli",
            "export",
            f"--checkpoint={model_dir}",
            f"--out={out}",
            *flags,
        ],
        env=env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_processes_export_what_one_process_exports(tmp_path):
    """Experts sharded over both processes (mesh (1, 8, 1), 8 experts): each process holds
    half of every expert kernel, the export gathers them, and process 0 alone writes."""
    from safetensors.numpy import load_file

    from moe_jax.interop import export_format

    run = tmp_path / "run"
    code, out = finish(start(run, "--gin.TRAIN_STEPS=1", "--gin.NUM_EXPERTS=8"))
    assert code == 0, out[-3000:]
    port = free_port()
    procs = [
        _export(
            run,
            tmp_path / f"two_{i}",
            "--gin.partitioning.make_mesh.mesh_shape=(1, 8, 1)",
            f"--coordinator_address=127.0.0.1:{port}",
            "--process_count=2",
            f"--process_index={i}",
            "--initialization_timeout=120",
            devices=4,
        )
        for i in range(2)
    ]
    for proc in procs:
        code, out = finish(proc)
        assert code == 0, out[-3000:]
    code, out = finish(_export(run, tmp_path / "one", devices=1))
    assert code == 0, out[-3000:]
    assert not (tmp_path / "two_1").exists()  # only process 0 writes
    one, two = tmp_path / "one", tmp_path / "two_0"
    for name in (export_format.WEIGHTS_FILE, export_format.ROUTER_INIT_FILE):
        a, b = load_file(one / name), load_file(two / name)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(b[key], a[key], err_msg=key)
    assert (
        load_file(one / export_format.WEIGHTS_FILE)[
            "encoder/layers_1/mlp/expert/wi_0/kernel"
        ].shape[0]
        == 8
    )
    assert json.loads((one / export_format.CONFIG_JSON).read_text()) == json.loads(
        (two / export_format.CONFIG_JSON).read_text()
    )
