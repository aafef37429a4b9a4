"""`moe-jax train` as a cluster runs it: a fresh process whose stderr is not a terminal,
TRAIN_STEPS not a multiple of eval_period. It writes plain timestamped progress lines (no
progress bar), evaluates and saves the final step (and saves no other step off the
checkpoint period, such as step 1), and has left nothing in the temporary folder when
the command returns (not only once the interpreter's exit handlers have run)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.train.test_train import TINY

REPO = pathlib.Path(__file__).resolve().parents[2]
LINE = r"\[moe-jax\] \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "


# `moe-jax train FLAGS`, then what the temporary folder holds when the command has returned
CHILD = """
import json, os, sys, tempfile
from moe_jax import cli
rc = cli.main(sys.argv[1:])
print(json.dumps(os.listdir(os.environ["TMPDIR"])))
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory) -> tuple[pathlib.Path, list[str], str]:
    """(MODEL_DIR, what its TMPDIR held when the command returned, its stderr) of a 3-step
    run evaluating every 2 steps."""
    root = tmp_path_factory.mktemp("cluster_run")
    model_dir, tmp = root / "run", root / "tmp"
    tmp.mkdir()
    flags = [
        *TINY,
        f"--gin.MODEL_DIR={model_dir}",
        "--gin.TRAIN_STEPS=3",
        "--gin.train_script.train.log_period=1",
        "--gin.train_script.train.eval_period=2",
        "--gin.train_script.train.eval_steps=1",
    ]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "train", *flags],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return model_dir, json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_the_final_step_is_evaluated(cluster_run):
    model_dir, _, _ = cluster_run
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [2, 3]


def test_only_the_checkpoint_period_and_the_last_step_are_saved(cluster_run):
    model_dir, _, _ = cluster_run  # checkpoint_period=3 (TINY), TRAIN_STEPS=3
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["3"]


def test_progress_is_plain_timestamped_lines(cluster_run):
    _, _, stderr = cluster_run
    assert "\r" not in stderr  # no progress bar
    for step in (1, 2, 3):
        assert re.search(
            rf"^{LINE}step {step}/3: loss \d+\.\d{{4}}, [\d,]+ tokens/s$", stderr, re.M
        )
    assert re.search(rf"^{LINE}step 3: eval loss \d+\.\d{{4}} accuracy \d\.\d{{4}}$", stderr, re.M)


def test_nothing_is_left_in_the_temporary_folder(cluster_run):
    _, left, _ = cluster_run
    assert left == []  # TensorFlow's autograph files went with the command's scratch folder
