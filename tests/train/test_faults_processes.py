"""Faults of trainer processes made to happen for real: a full disk (the
trainer's file-size limit lowered with RLIMIT_FSIZE) failing a checkpoint save or
``metrics.jsonl``, Ctrl-C during training, twice during saves, and during eval, two
trainers on one MODEL_DIR, a lock holder killed with -9, and the chaos test: SIGKILL at 10
random moments of a 200-step run, which must end with exactly the losses and parameters of
an uninterrupted run.

Slow (each process imports TensorFlow and compiles):
    pytest -m slow tests/train/test_faults_processes.py
    pytest -m slow tests/train/test_faults_processes.py -k chaos -s     # prints the seed
    for i in $(seq 20); do
        pytest -m slow tests/train/test_faults_processes.py -k full_disk_stops -q || break
    done
(``CHAOS_SEED=N`` repeats a chaos run).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from moe_jax import cli, errors
from moe_jax.runtime import checkpoints
from moe_jax.runtime.metrics import read_metrics
from moe_jax.runtime.run_dir import RunDir
from tests.train.test_processes import FLAGS, env, finish, wait_for_step

pytestmark = pytest.mark.slow


PERIOD = "--gin.train_script.train.checkpoint_period=3"
# Reports of a failed or interrupted command that must not reach the user.
NOISE = ("Traceback", "exception was never retrieved", "Exception ignored", "Event loop is closed")


def start(model_dir, *flags: str, file_size_limit: int | None = None) -> subprocess.Popen:
    def limit():
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    process_env = env(1)
    if file_size_limit is not None:  # JAX's compilation cache writes would meet the limit first
        process_env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
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
        env=process_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit,  # noqa: PLW1509 -- sets RLIMIT_FSIZE only, before exec
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run, checkpoints every 3 steps (all within the warm-up, so
    the learning rates do not depend on TRAIN_STEPS)."""
    path = tmp_path_factory.mktemp("reference") / "run"
    code, out = finish(start(path, "--gin.TRAIN_STEPS=12", PERIOD))
    assert code == 0, out[-2000:]
    return path


def assert_quiet(out: str) -> None:
    found = [noise for noise in NOISE if noise in out]
    assert not found, f"{found} in:\n{out[-3000:]}"


def assert_resumes_exactly(run, reference, restored_step: int) -> None:
    """The next normal run resumes from ``restored_step`` and ends as ``reference`` did:
    each step logged once with the same loss, the same final parameters."""
    code, out = finish(start(run, "--gin.TRAIN_STEPS=12", PERIOD))
    assert code == 0, out[-2000:]
    assert f"restored {run}/checkpoints/{restored_step}" in out
    assert losses(run) == losses(reference)
    for a, b in zip(params_at(run, 12), params_at(reference, 12), strict=True):
        np.testing.assert_array_equal(a, b)


def losses(model_dir) -> dict[int, float]:
    """``{step: loss}`` of metrics.jsonl (local or gs://), asserting each step is logged once."""
    records = read_metrics(RunDir(model_dir))
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert len(steps) == len(set(steps)), f"steps logged twice: {sorted(steps)}"
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def params_at(model_dir, step: int) -> list[np.ndarray]:
    ckpt = checkpoints.Checkpointer(RunDir(model_dir), read_only=True)
    out = ckpt._manager.restore(
        step,
        args=checkpoints.ocp.args.Composite(params=checkpoints.ocp.args.StandardRestore()),
    )["params"]
    ckpt.close()
    return [np.asarray(x) for x in jax.tree.leaves(out)]


def error_lines(out: str, command: str = "train") -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"moe-jax {command}: error:")]


def stop_lines(out: str, command: str = "train") -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"moe-jax {command}: stopped by ")]


def test_full_disk_stops_with_one_line_then_resume_continues(tmp_path, reference):
    run = tmp_path / "run"
    code, out = finish(start(run, "--gin.TRAIN_STEPS=3", PERIOD))
    assert code == 0, out[-2000:]
    # each checkpoint file is > 1 MB: the save at step 6 fails with EFBIG ("File too large")
    code, out = finish(start(run, "--gin.TRAIN_STEPS=12", PERIOD, file_size_limit=1 << 20))
    assert code == errors.EXIT_WRITE_FAILED, out[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith(
        f"moe-jax train: error: cannot write checkpoint step 6 to "
        f"MODEL_DIR={run}: File too large ({run}/checkpoints/6."
    ), lines
    assert lines[0].endswith(f"; last good checkpoint: {run}/checkpoints/3")
    assert_quiet(out)
    assert sorted(os.listdir(run / "checkpoints")) == ["3"]  # partial step 6 removed
    assert not (run / "LOCK").exists()
    assert_resumes_exactly(run, reference, 3)


def test_full_disk_at_metrics_keeps_whole_lines_then_resume_continues(tmp_path, reference):
    run = tmp_path / "run"
    code, out = finish(start(run, "--gin.TRAIN_STEPS=9", PERIOD))
    assert code == 0, out[-2000:]
    # 9 lines of about 2.3 kB: the lines of steps 10 and 11 fit under the limit, the line
    # of step 12 crosses it, before its checkpoint
    size = (run / "metrics.jsonl").stat().st_size
    limit = int(size + 2.5 * size / 9)
    code, out = finish(start(run, "--gin.TRAIN_STEPS=12", PERIOD, file_size_limit=limit))
    assert code == errors.EXIT_WRITE_FAILED, out[-3000:]
    assert error_lines(out) == [
        f"moe-jax train: error: cannot write {run}/metrics.jsonl: File too "
        f"large; last good checkpoint: {run}/checkpoints/9"
    ], out[-3000:]
    assert_quiet(out)
    text = (run / "metrics.jsonl").read_text()  # whole lines, steps 1-11
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == list(range(1, 12))
    assert_resumes_exactly(run, reference, 9)


def test_ctrl_c_saves_at_the_end_of_the_step_then_resume_continues(tmp_path):
    proc = start(
        tmp_path, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=1000"
    )
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc)
    assert code == errors.EXIT_INTERRUPTED, out[-2000:]
    saved = RunDir(tmp_path).reached_step()
    assert stop_lines(out) == [
        f"moe-jax train: stopped by Ctrl-C (SIGINT): at step {saved}: saved "
        f"{tmp_path}/checkpoints/{saved}; the same command resumes from it"
    ], out[-2000:]
    assert_quiet(out)
    code, out = finish(start(tmp_path, f"--gin.TRAIN_STEPS={saved + 2}"))
    assert code == 0, out[-2000:]
    assert f"restored {tmp_path}/checkpoints/{saved}" in out
    assert list(losses(tmp_path)) == list(range(1, saved + 3))  # each step once


def test_ctrl_c_twice_during_saves_stops_at_once_then_resume_continues(tmp_path):
    """A save every step, so the signals meet saves in progress."""
    proc = start(tmp_path, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=1")
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc)
    assert code == errors.EXIT_INTERRUPTED, out[-2000:]
    latest = RunDir(tmp_path).reached_step()
    stopped = "moe-jax train: stopped by Ctrl-C (SIGINT)"
    then = f"{tmp_path}/checkpoints/{latest}; the same command resumes from it"
    assert stop_lines(out) in (  # stopped at once, or the first stop's save finished first
        [f"{stopped}: nothing saved at this stop; last checkpoint: {then}"],
        [f"{stopped}: at step {latest}: saved {then}"],
    ), out[-2000:]
    assert_quiet(out)
    code, out = finish(start(tmp_path, f"--gin.TRAIN_STEPS={latest + 2}"))
    assert code == 0, out[-2000:]
    assert f"restored {tmp_path}/checkpoints/{latest}" in out
    assert list(losses(tmp_path)) == list(range(1, latest + 3))  # each step once
    assert not [name for name in os.listdir(tmp_path / "checkpoints") if not name.isdigit()]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_eval_ends_with_one_line(tmp_path, reference, signum):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_jax.cli",
            "eval",
            f"--checkpoint={reference}",
            "--eval_steps=100000",
            f"--output_dir={tmp_path}",
        ],
        env=env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = ""
    while "eval settings:" not in seen and proc.poll() is None:  # printed before evaluating
        seen += proc.stdout.readline()
    time.sleep(5)  # restoring, compiling or evaluating
    proc.send_signal(signum)
    code, out = finish(proc)
    out = seen + out
    assert code == 128 + signum, out[-2000:]
    what = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
    line = f"moe-jax eval: stopped by {what}: {cli.INTERRUPTED_DETAIL}"
    assert stop_lines(out, "eval") == [line], out[-2000:]
    assert_quiet(out)


def test_second_trainer_is_refused_and_a_killed_holder_does_not_block(tmp_path):
    first = start(tmp_path, "--gin.TRAIN_STEPS=500", "--gin.train_script.train.checkpoint_period=2")
    wait_for_step(first, tmp_path, 3)
    code, out = finish(start(tmp_path, "--gin.TRAIN_STEPS=500"))
    assert code == 1, out[-2000:]
    lines = error_lines(out)
    assert (
        len(lines) == 1
        and f"is being written by another trainer: host {os.uname().nodename}, "
        f"PID {first.pid}, since "
        in lines[0]
    ), out[-2000:]
    first.send_signal(signal.SIGKILL)
    finish(first)
    reached = RunDir(tmp_path).reached_step()
    code, out = finish(start(tmp_path, f"--gin.TRAIN_STEPS={reached + 1}"))
    assert code == 0, out[-2000:]
    assert (
        f"took over the lock of {tmp_path} from host {os.uname().nodename} PID {first.pid}" in out
    )
    assert f"PID {first.pid} no longer runs on this host" in out


@pytest.mark.parametrize("store", ["local", "gcs"])
def test_chaos_sigkill_at_random_moments_then_exact_result(tmp_path, store, request):
    """``gcs``: the chaos run's MODEL_DIR is on the test GCS server; the clean run is local."""
    steps, kills = 200, 10
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 2**31))
    print(f"chaos seed {seed} (CHAOS_SEED={seed} repeats it)", flush=True)
    rng = random.Random(seed)
    flags = [f"--gin.TRAIN_STEPS={steps}", "--gin.train_script.train.checkpoint_period=10"]
    code, out = finish(start(tmp_path / "clean", *flags), timeout=900)
    assert code == 0, out[-2000:]
    run = f"{request.getfixturevalue('gcs_dir')}/chaos" if store == "gcs" else tmp_path / "chaos"
    survived = 0
    for kill in range(kills):
        # a random step beyond any logged so far (so only fresh progress reaches it), then a
        # random moment within the next steps (saves every 10 steps included)
        reached = max(losses(run), default=0)
        if reached + 1 > steps - 1:
            break
        target = rng.randint(
            reached + 1, min(steps - 1, reached + max(1, (steps - 1 - reached) // (kills - kill)))
        )
        proc = start(run, *flags)
        wait_for_step(proc, run, target, timeout=600)
        time.sleep(rng.uniform(0, 0.5))
        proc.send_signal(signal.SIGKILL)
        finish(proc)
        survived += 1
        print(
            f"kill {kill + 1}: SIGKILL after step >= {target}; checkpoints "
            f"{checkpoints.Checkpointer(RunDir(run), read_only=True).all_steps()}",
            flush=True,
        )
    assert survived == kills
    code, out = finish(start(run, *flags), timeout=900)
    assert code == 0, out[-2000:]
    assert losses(run) == losses(tmp_path / "clean")  # every step once, bit-identical
    for a, b in zip(params_at(run, steps), params_at(tmp_path / "clean", steps), strict=True):
        np.testing.assert_array_equal(a, b)
    print(f"chaos: survived {survived} SIGKILLs (seed {seed}); losses and final parameters exact")


def test_ctrl_c_during_import_is_never_a_silent_success(tmp_path, reference):
    """SIGINT at several moments of `moe-jax import` (the export of ``reference``): each ends
    with exit 130 and its one line, or, landing after the import finished, with the
    `imported` line; never exit 0 without it. The retry with ``--overwrite`` then imports."""
    export = tmp_path / "export"
    code, out = finish(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moe_jax.cli",
                "export",
                f"--checkpoint={reference}",
                f"--out={export}",
            ],
            env=env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    )
    assert code == 0, out[-2000:]
    stopped = 0
    for index, delay in enumerate((0.5, 2.0, 4.0, 6.0)):
        target = tmp_path / f"back{index}"
        command = [
            sys.executable,
            "-m",
            "moe_jax.cli",
            "import",
            f"--export={export}",
            f"--model_dir={target}",
        ]
        proc = subprocess.Popen(
            command, env=env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        code, out = finish(proc)
        imported = f"imported {export} as step" in out
        assert code != 0 or imported, f"exit 0 without the import:\n{out[-2000:]}"
        if code == 128 + signal.SIGINT and not imported:
            stopped += 1
            line = f"moe-jax import: stopped by Ctrl-C (SIGINT): {cli.INTERRUPTED_DETAIL}"
            assert stop_lines(out, "import") == [line], out[-2000:]
            assert_quiet(out)
            retry = subprocess.Popen(
                [*command, "--overwrite"],
                env=env(1),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            code, out = finish(retry)
            assert code == 0 and f"imported {export} as step" in out, out[-2000:]
    assert stopped, "no SIGINT landed before the import finished: lengthen the delays"
