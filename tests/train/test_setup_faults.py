"""Settings and leftovers a `train` start must not take at face value: a setting that keeps
no checkpoint, an empty or unset MODEL_DIR, sizes and rates that cannot work, a macro of
the user's own gin file that nothing uses, a lock whose heartbeat lies in the future, a
plain file among the checkpoints, an optimizer state holding NaN, a signal during the
final evaluation, a finished run started again. In-process on the tiny smoke config of
tests/train/test_train.py."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from moe_jax import cli, errors
from moe_jax.commands import train
from moe_jax.runtime import (
    builders,
    checkpoint_checks,
    evaluation,
    gin_flags,
    gin_text,
    gin_utils,
    run_lock,
)
from moe_jax.runtime.run_dir import RunDir
from tests.train.test_train import run

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.TRAIN_STEPS=2",
    "--gin.train_script.train.eval_period=0",
]


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "flag, line",
    [
        (
            "--gin.train_script.train.keep_checkpoints=0",
            "train_script.train.keep_checkpoints = 0; expected a positive integer, "
            "or None to keep every checkpoint",
        ),
        (
            "--gin.train_script.train.checkpoint_period=-1",
            "train_script.train.checkpoint_period = -1; expected a positive integer",
        ),
        (
            "--gin.train_script.train.log_period=0",
            "train_script.train.log_period = 0; expected a positive integer",
        ),
        (
            "--gin.train_script.train.eval_period=-2",
            "train_script.train.eval_period = -2; expected 0 (never) or a positive integer",
        ),
        (
            "--gin.MODEL_DIR=''",
            "MODEL_DIR (train_script.train.model_dir) = '': expected a directory "
            "(an empty path would put the run into the working directory)",
        ),
        (
            "--gin.BATCH_SIZE=1000000000000",
            "DatasetConfig.batch_size (BATCH_SIZE) = 1000000000000: 32000000000000 input "
            "tokens per batch; at most 2147483647 (token positions are int32)",
        ),
        (
            "--gin.learning_rate_schedule.base_learning_rate='fast'",
            "learning_rate_schedule.base_learning_rate = 'fast'; expected a number",
        ),
    ],
    ids=["keep_0", "period_negative", "log_0", "eval_negative", "empty_dir", "huge_batch", "lr"],
)
def test_settings_that_cannot_work_are_one_line_and_write_nothing(
    tmp_path, monkeypatch, capsys, flag, line
):
    """``keep_checkpoints=0`` used to finish with an empty ``checkpoints/`` (the next run
    started again at step 0); ``MODEL_DIR=''`` wrote the run into the working directory."""
    monkeypatch.chdir(tmp_path)
    model_dir = tmp_path / "run"
    flags = [f"--gin.MODEL_DIR={model_dir}", flag] if "MODEL_DIR" not in flag else [flag]
    assert cli.main(["train", *TINY, *flags]) == 1
    err = _err_lines(capsys)
    assert err[-1] == f"moe-jax train: error: {line}", err[-3:]
    assert "Traceback" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []


def test_the_smoke_config_names_no_shared_model_dir(tmp_path, monkeypatch, capsys):
    """``runs/smoke_cpu.gin`` sets no MODEL_DIR (once a fixed ``/tmp/moe_jax_smoke`` that every
    user's second call resumed without a word): train asks for one; `moe-jax smoke` makes
    a fresh one."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *TINY]) == 1
    assert _err_lines(capsys)[-1] == (
        "moe-jax train: error: MODEL_DIR (train_script.train.model_dir) = None: expected a "
        "directory; pass --gin.MODEL_DIR=DIR (a new directory, or a run's to resume it)"
    )
    assert list(tmp_path.iterdir()) == []


def _parse(*flags: str) -> None:
    args = gin_flags.parse_flags(builders.build_parser("test", "test"), list(flags))
    gin_utils.parse_gin(args)


def test_a_macro_of_the_users_gin_file_that_nothing_uses_is_refused(tmp_path):
    mine = tmp_path / "mine.gin"
    mine.write_text("include 'runs/smoke_cpu.gin'\n\n# more experts\nNUM_EXPERT = 8\n")
    with pytest.raises(
        gin_text.GinConfigError,
        match=rf"^gin: macro NUM_EXPERT set by file '{mine}', line 4 is not used by any gin "
        r"file; did you mean NUM_EXPERTS or NUM_SELECTED_EXPERTS\?",
    ):
        _parse(f"--gin_file={mine}")
    # used by a binding of the same file, or by another file: accepted
    mine.write_text("include 'runs/smoke_cpu.gin'\nMY_STEPS = 7\nTRAIN_STEPS = %MY_STEPS\n")
    _parse(f"--gin_file={mine}")
    assert str(gin_utils.bound_value("TRAIN_STEPS/macro.value", None)) == "%MY_STEPS"


def _write_lock(path: pathlib.Path, lease_sec: float, mtime: float) -> dict:
    record = {"host": "elsewhere", "pid": 1, "since": "x", "lease_sec": lease_sec}
    path.write_text(json.dumps(record))
    os.utime(path, (mtime, mtime))
    return record


def test_a_lock_with_a_heartbeat_in_the_future_is_watched_not_waited_for(tmp_path):
    """Another host's clock far ahead (or a touched file) put the heartbeat beyond any lease:
    a lock that does not beat within two of its holder's heartbeat periods is taken over;
    one that beats is refused, the skew named."""
    lock_file = pathlib.Path(RunDir(tmp_path).lock_file)
    future = time.time() + 10**8 + 100
    _write_lock(lock_file, 1.0, future)
    start = time.monotonic()
    taken = run_lock.RunLock(RunDir(tmp_path)).acquire()
    waited = time.monotonic() - start
    try:
        assert 0.4 < waited < 10, waited
        assert re.match(r"its heartbeat is 100000\d\d\d s in the future", taken.took_over["reason"])
        assert taken.took_over["reason"].endswith("and did not change in 0.5 s")
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    finally:
        taken.release()
    # a holder that still beats (on its own clock, far ahead) is alive
    _write_lock(lock_file, 1.0, future)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            stamp = time.time() + 10**8 + 100
            os.utime(lock_file, (stamp, stamp))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        with pytest.raises(
            errors.RunLockedError, match=r"heartbeat 100000\d\d\d s in the future \(clocks differ"
        ):
            run_lock.RunLock(RunDir(tmp_path)).acquire()
    finally:
        stop.set()
        beater.join()


def test_a_plain_file_named_as_a_step_is_no_checkpoint(tmp_path):
    checkpoints = pathlib.Path(RunDir(tmp_path).checkpoints_dir)
    (checkpoints / "3").mkdir(parents=True)
    (checkpoints / "9").write_text("not a checkpoint")
    assert RunDir(tmp_path).reached_step() == 3
    (checkpoints / "3").rmdir()
    assert RunDir(tmp_path).reached_step() is None


def _poison_optimizer_state(step_dir: pathlib.Path) -> None:
    """The optimizer state of a step NaN where no integrity record tells: the record removed,
    then the ``train`` item saved again by Orbax with its largest float array NaN."""
    (step_dir / checkpoint_checks.INTEGRITY_FILE).unlink()
    saver = ocp.StandardCheckpointer()
    item = jax.tree.map(np.array, saver.restore(step_dir / "train"))
    floats = [a for a in jax.tree.leaves(item["opt_state"]) if a.dtype.kind == "f"]
    max(floats, key=lambda a: a.size)[...] = np.nan
    shutil.rmtree(step_dir / "train")
    saver.save(step_dir / "train", item)
    saver.wait_until_finished()
    saver.close()


def test_an_optimizer_state_holding_nan_is_set_aside_not_resumed_forever(tmp_path, capsys):
    """Only the parameters used to be checked: every restart resumed the NaN optimizer state,
    and stopped again at its first step with a NaN loss."""
    every_2 = "--gin.train_script.train.checkpoint_period=2"
    run(tmp_path, 4, every_2)  # checkpoints 2 and 4
    _poison_optimizer_state(tmp_path / "checkpoints/4")
    resumed = run(tmp_path, 5, every_2)
    err = capsys.readouterr().err
    assert "warning: checkpoint step 4 is unreadable: " in err
    assert "optimizer state opt_state/" in err and "holds NaN or Inf" in err
    assert "resuming from step 2 instead" in err
    assert (pathlib.Path(RunDir(tmp_path).unreadable_dir) / "4").is_dir()
    assert sorted(resumed["losses"]) == [3, 4, 5]
    assert np.isfinite(list(resumed["losses"].values())).all()


def test_a_state_holding_nan_in_its_optimizer_state_is_never_saved():
    params = {"w": np.ones(3, np.float32)}
    opt_state = ({"mu": {"w": np.array([1.0, np.inf, 0.0], np.float32)}, "count": np.int32(2)},)
    with pytest.raises(
        train.NonFiniteLossError,
        match=r"^the optimizer state holds NaN or Inf after step 5 \(0/mu/w, 1 in all\); not "
        r"saved; last good checkpoint: none yet$",
    ):
        train._check_state(params, opt_state, 5, "none yet")
    train._check_state(params, ({"mu": params, "count": np.int32(2)},), 5, "none yet")


def test_sigterm_in_the_final_eval_is_named_and_a_finished_run_says_so(
    tmp_path, monkeypatch, capsys
):
    """SIGTERM during the last step's evaluation used to exit 0 without a word; a finished
    run started again used to compile and restore, then exit 0 without a word."""
    real_eval = evaluation.run_eval

    def signalled_eval(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the process is asked to stop mid-evaluation
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(evaluation, "run_eval", signalled_eval)
    flags = [*TINY, f"--gin.MODEL_DIR={tmp_path}", "--gin.train_script.train.eval_period=2"]
    flags.append("--gin.EVAL_STEPS=1")
    assert cli.main(["train", *flags]) == 143
    step_dir = RunDir(tmp_path).step_dir(2)
    assert _err_lines(capsys)[-1] == (
        f"moe-jax train: stopped by SIGTERM: at step 2, the run's last: saved {step_dir}; "
        "the run is complete"
    )
    monkeypatch.setattr(evaluation, "run_eval", real_eval)
    metrics_before = (tmp_path / "metrics.jsonl").read_text()
    # a plain file among the checkpoints changes nothing
    (tmp_path / "checkpoints" / "9").write_text("stray")
    start = time.monotonic()
    assert cli.main(["train", *flags]) == 0
    err = _err_lines(capsys)
    assert err[-1] == (
        f"[moe-jax] MODEL_DIR={tmp_path} already reached TRAIN_STEPS=2 ({step_dir}): nothing to "
        "train; pass a larger TRAIN_STEPS to continue it"
    )
    assert not any("compiling" in line for line in err), err
    assert time.monotonic() - start < 30
    assert (tmp_path / "metrics.jsonl").read_text() == metrics_before
    assert not (tmp_path / "LOCK").exists()
