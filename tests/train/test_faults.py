"""Faults made to happen for real: unreadable checkpoints, changed configs on
resume, foreign imports in a run's config, a second writer, duplicated metrics after a
resume, bad input; each checks the message, what is on disk, and that the next normal run
continues exactly. In-process on the tiny smoke config (as tests/train/test_train.py);
the subprocess ones (file-size limit, two trainers, exit codes) are slow-marked in
tests/train/test_faults_processes.py."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from moe_jax import cli, errors
from moe_jax.commands import train
from moe_jax.runtime import (
    builders,
    checkpoint_checks,
    checkpoints,
    gin_flags,
    gin_text,
    run_config,
    run_lock,
)
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import RunSpec
from tests.train.test_train import parse, run


def truncate_arrays(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """Cuts every array data file of a checkpoint step to 10 bytes (a bad disk or copy)."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(10)
    return files


def metrics(model_dir: pathlib.Path, split: str = "train") -> list[dict]:
    return [
        r
        for r in map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"] == split
    ]


@pytest.mark.slow
def test_unreadable_latest_checkpoint_falls_back_and_continues_exactly(tmp_path, capsys):
    full = run(tmp_path / "full", 9)
    run(tmp_path / "run", 6)  # checkpoints 3 and 6
    files = truncate_arrays(tmp_path / "run/checkpoints/6")
    assert files
    # eval/analyze/infer: one line naming step, file and cause
    with pytest.raises(
        checkpoint_checks.UnreadableCheckpointError,
        match=r"^checkpoint step 6 is unreadable: \S+/checkpoints/6/\S+: 10 bytes, \d+ when saved",
    ) as err:
        checkpoints.restore_from(str(tmp_path / "run"), None)
    assert "\n" not in str(err.value)
    resumed = run(tmp_path / "run", 9)
    warning = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("[moe-jax] warning")
    ]
    assert (
        len(warning) == 1
        and "step 6" in warning[0]
        and "resuming from step 3 instead" in warning[0]
    )
    assert (tmp_path / "run/unreadable_checkpoints/6").is_dir()  # moved aside, not deleted
    assert sorted(resumed["losses"]) == list(range(4, 10))
    assert resumed["losses"] == {s: full["losses"][s] for s in range(4, 10)}
    logged = [r["step"] for r in metrics(tmp_path / "run")]
    assert (
        logged == sorted(set(logged)) and logged[-1] == 9 and 6 in logged
    )  # each logged step once
    assert tensorboard_steps(tmp_path / "run/train", "loss") == logged  # there too


def tensorboard_steps(folder: pathlib.Path, tag: str) -> list[int]:
    import tensorflow as tf

    steps = []
    for path in folder.iterdir():
        for raw in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(raw.numpy())
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(steps)


def test_changed_config_on_resume_is_refused_unless_allowed(tmp_path):
    run(tmp_path, 3)
    saved = (tmp_path / "config.gin").read_text()
    with pytest.raises(
        run_config.ConfigChangedError,
        match=r"(?s)resuming at step 3 would change 1 field.*--allow_config_change.*"
        r"optimizer.learning_rate.base_learning_rate: 0.003 -> 0.5",
    ):
        run(tmp_path, 6, "--gin.learning_rate_schedule.base_learning_rate=0.5")
    assert RunDir(tmp_path).reached_step() == 3  # nothing trained
    # length, periods and paths may change: only the learning rate is listed
    parse(
        f"--gin.MODEL_DIR={tmp_path}",
        "--gin.TRAIN_STEPS=5",
        "--gin.train_script.train.log_period=2",
        "--gin.learning_rate_schedule.base_learning_rate=0.5",
    )
    result = train.train(allow_config_change=True)
    assert result["step"] == 5
    assert (tmp_path / "config.gin").read_text() == saved  # never overwritten
    spec = RunSpec.from_json((tmp_path / "run.step-3.json").read_text())
    assert spec.optimizer.learning_rate.base_learning_rate == 0.5
    kept = (tmp_path / "config.step-3.gin").read_text()
    assert kept.splitlines()[:3] == [
        "# resumed at step 3 with --allow_config_change; changed from run.json:",
        "#   optimizer.learning_rate.base_learning_rate: 0.003 -> 0.5",
        saved.splitlines()[0],
    ], kept[:500]
    # the accepted change is the run's config now: repeating it needs no flag...
    assert run(tmp_path, 6, "--gin.learning_rate_schedule.base_learning_rate=0.5")["step"] == 6
    assert sorted(p.name for p in tmp_path.glob("config*.gin")) == [
        "config.gin",
        "config.step-3.gin",
    ]
    assert sorted(p.name for p in tmp_path.glob("run*.json")) == ["run.json", "run.step-3.json"]
    # ...and a plain resume that would silently go back to 0.003 is refused like any change
    with pytest.raises(
        run_config.ConfigChangedError,
        match=r"(?s)another config \(.*run.step-3.json\); resuming at step 6 "
        r"would change 1 field.*base_learning_rate: 0.5 -> 0.003",
    ):
        run(tmp_path, 7)
    assert RunDir(tmp_path).reached_step() == 6


def _flags(*argv: str):
    return gin_flags.parse_flags(builders.build_parser("t", "t"), list(argv))


def test_run_config_with_a_foreign_import_is_refused(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    marker = tmp_path / "ran"
    (package / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(package))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.gin").write_text(
        "from moe_jax.data import vocab\n# c\nimport evilmod\nA = 1\n"
    )
    with pytest.raises(
        gin_text.GinConfigError, match=r"config.gin, line 3: refusing `import evilmod`"
    ):
        run_config.run_gin_files(_flags(), str(run_dir), [], extend_run_config=True)
    assert cli.main(["analyze", "positions", f"--checkpoint={run_dir}"]) == 1
    assert not marker.exists()  # the module never ran
    (run_dir / "config.gin").write_text("import moe_jax.models.t5 as moe_jax2\nA = 1\n")
    assert run_config.run_config_file(RunDir(run_dir), _flags()) == str(run_dir / "config.gin")


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    with run_lock.RunLock(RunDir(tmp_path)) as first:
        with pytest.raises(
            errors.RunLockedError, match=rf"host {first.record['host']}, PID {os.getpid()}, since"
        ):
            run_lock.RunLock(RunDir(tmp_path)).acquire()
        with pytest.raises(errors.RunLockedError, match="being written by another trainer"):
            run(tmp_path, 1)
    assert not (tmp_path / "LOCK").exists()  # released on exit
    lock_file = tmp_path / "LOCK"
    # killed with -9 on this host: a PID that no longer runs is taken over at once
    lock_file.write_text(
        json.dumps(
            {
                "host": run_lock.socket.gethostname(),
                "pid": 2**22 + 12345,
                "since": "x",
                "lease_sec": 120,
            }
        )
    )
    taken = run_lock.RunLock(RunDir(tmp_path)).acquire()
    assert "no longer runs" in taken.took_over["reason"]
    taken.release()
    # another host: refused while its heartbeat is fresh, taken over after the lease
    lock_file.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "x", "lease_sec": 60}))
    with pytest.raises(errors.RunLockedError, match="host elsewhere, PID 1"):
        run_lock.RunLock(RunDir(tmp_path)).acquire()
    old = time.time() - 61
    os.utime(lock_file, (old, old))
    taken = run_lock.RunLock(RunDir(tmp_path)).acquire()
    assert "no heartbeat for 6" in taken.took_over["reason"]
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    taken.release()


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            "--gin.TRAIN_STEPS=-5",
            r"TRAIN_STEPS \(train_script.train.total_steps\) = -5; expected a positive",
        ),
        (
            "--gin.TRAIN_STEPS=0",
            r"TRAIN_STEPS \(train_script.train.total_steps\) = 0; expected a positive",
        ),
        ("--gin.BATCH_SIZE=0", r"BATCH_SIZE\) = 0; expected a positive integer"),
        ("--gin.BATCH_SIZE=-4", r"BATCH_SIZE\) = -4; expected a positive integer"),
        ("--gin_file=runs/nope.gin", r"--gin_file=runs/nope.gin: no such file"),
        ("--gin_bindings=get_vocabulary.kind='sentencepiece'", None),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, flag, message):
    model_dir = tmp_path / "run"
    argv = ["train", *TINY_CLI, f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=2", flag]
    if flag.startswith("--gin_bindings"):
        argv.append("--gin_bindings=get_vocabulary.path='/nonexistent/spm.model'")
        message = r"SentencePiece model not found: get_vocabulary.path='/nonexistent/spm.model'"
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-jax train: error: "), err
    assert __import__("re").search(message, err[0]), err
    if "vocab" not in flag:
        assert not model_dir.exists()


def test_train_steps_below_the_reached_step_is_refused(tmp_path, capsys):
    run(tmp_path, 3)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main(["train", *TINY_CLI, f"--gin.MODEL_DIR={tmp_path}", "--gin.TRAIN_STEPS=2"]) == 1
    assert "TRAIN_STEPS=2 is below step 3, which MODEL_DIR=" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_infer_input_file_missing_or_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe bad\n")
    for path, message in [
        (tmp_path / "nope.txt", "No such file or directory"),
        (bad, "not UTF-8 text (byte 3"),
    ]:
        assert (
            cli.main(
                [
                    "infer",
                    "--gin_file=runs/smoke_cpu.gin",
                    f"--checkpoint={tmp_path}",
                    f"--input_file={path}",
                ]
            )
            == 1
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"moe-jax infer: error: --input_file={path}: {message}" + err[0].split(message, 1)[1]
        ]


TINY_CLI = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.train_script.train.checkpoint_period=3",
    "--gin.train_script.train.log_period=1",
    "--gin.train_script.train.eval_period=0",
]
