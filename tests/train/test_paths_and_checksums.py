"""Relative paths from any working directory, and the integrity record's checksums: a
checkpoint is set aside only when provably damaged, and never silently replaced by a run
from step 0."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from moe_jax import cli, errors, storage
from moe_jax.runtime import checkpoint_checks, checkpoints
from moe_jax.runtime.run_dir import RunDir
from tests.train.test_train import run


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d")


def flip_bytes(path: pathlib.Path) -> None:
    """Overwrites the middle of ``path`` with other bytes of the same length (size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def test_relative_model_dir_and_checkpoint_work_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = run("run1rel", 6)  # checkpoints 3 and 6, relative to the working directory
    assert first["model_dir"] == str(tmp_path / "run1rel")
    assert sorted(os.listdir(tmp_path / "run1rel/checkpoints")) == ["3", "6"]
    resumed = run("run1rel", 9)
    assert sorted(resumed["losses"]) == [7, 8, 9]  # continued, nothing set aside
    assert not storage.exists(RunDir(tmp_path / "run1rel").unreadable_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert (
        cli.main(["eval", "--checkpoint=../run1rel", "--output_dir=out", "--gin.EVAL_STEPS=1"]) == 0
    )
    result = json.loads((elsewhere / "out/run1rel.json").read_text())
    assert result["step"] == 9 and result["checkpoint"] == str(tmp_path / "run1rel/checkpoints/9")


@pytest.mark.slow  # its gs:// twin (test_gcs_runs) keeps the fallback in make test
def test_same_size_corruption_is_found_by_the_checksum(tmp_path, capsys):
    full = run(tmp_path / "full", 9)
    run(tmp_path / "run", 6)
    step_dir = pathlib.Path(RunDir(tmp_path / "run").step_dir(6))
    record = json.loads((step_dir / checkpoint_checks.INTEGRITY_FILE).read_text())
    assert all(len(entry["crc32c"]) == 8 for entry in record["files"].values())
    target = data_files(tmp_path / "run/checkpoints/6/params")[0]
    size = target.stat().st_size
    flip_bytes(target)
    assert target.stat().st_size == size
    # eval/infer/analyze/export: one line naming the step, file and cause
    code = cli.main(["eval", f"--checkpoint={tmp_path / 'run'}", "--gin.EVAL_STEPS=1"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == errors.EXIT_USER_ERROR
    assert line == (
        f"moe-jax eval: error: checkpoint step 6 is unreadable: {target}: CRC32C differs from "
        f"the one recorded when saved (content changed, {size} bytes)"
    )
    # train: falls back to step 3 and continues exactly
    resumed = run(tmp_path / "run", 9)
    assert resumed["losses"] == {s: full["losses"][s] for s in range(4, 10)}
    assert RunDir(tmp_path / "run").set_aside_steps() == [6]
    run(tmp_path / "run", 9)  # a later start names the step set aside
    assert "holds step(s) [6] set aside as damaged" in capsys.readouterr().err


@pytest.mark.slow
def test_a_read_failing_while_files_match_their_record_moves_nothing(tmp_path):
    """A checkpoint whose files match their checksums is not damaged: whatever fails while
    reading it (a library, a path, access) stops with one line and leaves it in place."""
    run(tmp_path, 6)
    step_dir = tmp_path / "checkpoints/6"
    meta = step_dir / "meta/metadata"
    meta.write_text("{not json")
    checkpoint_checks.write_integrity(str(step_dir))  # the record agrees with the files
    with pytest.raises(checkpoints.CheckpointReadError, match=r"^cannot read checkpoint step 6 \("):
        run(tmp_path, 9)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
    assert not storage.exists(RunDir(tmp_path).unreadable_dir)


@pytest.mark.slow
def test_no_silent_restart_from_step_zero_while_damaged_steps_are_set_aside(tmp_path):
    run(tmp_path, 6)
    for step in (3, 6):
        flip_bytes(data_files(tmp_path / f"checkpoints/{step}/params")[0])
    with pytest.raises(checkpoint_checks.UnreadableCheckpointError, match="no readable checkpoint"):
        run(tmp_path, 9)
    assert RunDir(tmp_path).set_aside_steps() == [3, 6]
    with pytest.raises(
        errors.CheckpointError,
        match=r"no readable checkpoint, but \S+ holds step\(s\) \[3, 6\] "
        "set aside as damaged: refusing to train again from step 0",
    ):
        run(tmp_path, 9)
    assert not storage.listdir(str(tmp_path / "checkpoints"))
