"""The launch scripts in dry-run mode: every step echoed, nothing run, bad flags named; and
the TPU launcher's compile check stopping a run that does not fit before it books a slice."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        check=False,  # the tests read the exit code
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _steps(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def test_tpu_pod_dry_run_creates_installs_trains_on_all_workers_and_deletes():
    proc = _run(
        "tpu_pod.sh",
        "--dry-run",
        "--tpu",
        "moe1",
        "--zone",
        "us-central2-b",
        "--accelerator",
        "v4-32",
        "--model-dir",
        "gs://bucket/runs/fig5",
        "--",
        "--gin_file=models/t5_moe.gin",
        "--gin.TRAIN_STEPS=500000",
    )
    assert proc.returncode == 0, proc.stderr
    steps = _steps(proc.stdout)
    # first the run compiled here for the slice it is about to book, with the same flags
    assert steps[0].startswith(
        "moe-jax compile --target=tpu:v4-32 --no_eval --gin_file=models/t5_moe.gin"
    )
    assert steps[1].startswith("gcloud compute tpus tpu-vm create moe1")
    assert "--accelerator-type v4-32" in steps[1]
    train = [s for s in steps if "nohup" in s]
    assert len(train) == 1 and "--worker=all" in train[0]
    assert "gs://bucket/runs/fig5" in train[0] and "--gin.TRAIN_STEPS=500000" in train[0]
    assert any("pip\\ install" in s and "--worker=all" in s for s in steps)
    assert steps[-1].startswith("gcloud compute tpus tpu-vm delete moe1")
    assert "shipping the working tree of" in proc.stdout  # which code goes, said in a dry run


def test_pods_get_the_working_tree_and_a_dirty_one_is_said(tmp_path):
    """The archive the TPU launcher ships holds uncommitted edits and new untracked files
    (not ignored ones, nor files deleted since the commit), and the launcher says so."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "kept.gin").write_text("committed\n")
    (repo / "gone.gin").write_text("committed\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")

    def pack() -> str:
        archive = tmp_path / "checkout.tar.gz"
        out = subprocess.run(
            ["bash", "-c", f"source {LAUNCH / 'common.sh'}; pack_checkout {repo} {archive}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return out

    assert "no uncommitted changes" in pack()
    (repo / "kept.gin").write_text("edited\n")
    (repo / "gone.gin").unlink()
    (repo / "new_task.py").write_text("x = 1\n")
    (repo / "ignored.txt").write_text("secret\n")
    out = pack()
    assert "warning: shipping the working tree" in out and "3 uncommitted change(s)" in out
    kept = subprocess.run(
        ["tar", "-xzOf", str(tmp_path / "checkout.tar.gz"), "kept.gin"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert kept == "edited\n"
    names = subprocess.run(
        ["tar", "-tzf", str(tmp_path / "checkout.tar.gz")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(names) == [".gitignore", "kept.gin", "new_task.py"]
    assert (
        subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.count("\n")
        == 3
    )  # the repository's own index is untouched


def test_tpu_pod_reuse_and_keep_skip_create_and_delete():
    proc = _run(
        "tpu_pod.sh",
        "--dry-run",
        "--reuse",
        "--keep",
        "--tpu",
        "moe1",
        "--zone",
        "z",
        "--accelerator",
        "v5p-128",
        "--model-dir",
        "gs://b/r",
        "--",
        "--gin_file=x.gin",
    )
    steps = _steps(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert "describe moe1" in steps[1]
    assert not any(" create " in s or " delete " in s for s in steps)


def test_tpu_pod_stops_before_booking_a_run_that_does_not_fit(tmp_path):
    # a real compile for a v5e-4 slice (libtpu of `make compilers`) of a batch too big for
    # it; gcloud is a stub recording its calls: it must never be called
    calls = tmp_path / "gcloud_calls"
    (tmp_path / "gcloud").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (tmp_path / "gcloud").chmod(0o755)
    repo = LAUNCH.parent
    env = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "MOE_JAX": f"{sys.executable} -m moe_jax.cli",
        "PYTHONPATH": str(repo),
        "XLA_FLAGS": "",
    }  # not the test session's 8 CPU devices
    proc = _run(
        "tpu_pod.sh",
        "--tpu",
        "t",
        "--zone",
        "z",
        "--accelerator",
        "v5litepod-4",
        "--model-dir",
        "gs://b/r",
        "--",
        "--gin_file=runs/smoke_cpu.gin",
        "--gin.make_mesh.mesh_shape=(1,4,1)",
        "--gin.BATCH_SIZE=131072",
        env=env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "--no-check" in proc.stderr
    assert not calls.exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--zone", "z", "--accelerator", "v4-8", "--model-dir", "gs://b", "--", "--gin_file=x"],
            "--tpu",
        ),
        (
            [
                "--tpu",
                "t",
                "--zone",
                "z",
                "--accelerator",
                "v4-8",
                "--model-dir",
                "/local",
                "--",
                "--gin_file=x",
            ],
            "--model-dir",
        ),
        (
            ["--tpu", "t", "--zone", "z", "--accelerator", "v4-8", "--model-dir", "gs://b"],
            "train flags",
        ),
        (["--tpu", "t", "--bogus"], "--bogus"),
    ],
)
def test_tpu_pod_refuses_bad_flags_by_name(args, named):
    proc = _run("tpu_pod.sh", "--dry-run", *args)
    assert proc.returncode == 2
    assert named in proc.stderr
    assert _steps(proc.stdout) == []


def test_slurm_script_passes_coordinator_count_and_rank_to_every_task():
    proc = _run(
        "slurm_gpu.sbatch",
        "--gin_file=models/t5_moe.gin",
        env={"DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu-node7,gpu-node8", "SLURM_NTASKS": "16"},
    )
    assert proc.returncode == 0, proc.stderr
    (step,) = _steps(proc.stdout)
    assert step.startswith("srun --kill-on-bad-exit=1")
    for expected in (
        "--coordinator_address=gpu-node7:29500",
        "--process_count=16",
        "--process_index=\\$SLURM_PROCID",
        "--multiprocess_gpu",
    ):
        assert expected in step


def test_local_multiprocess_dry_run_starts_one_process_per_rank():
    proc = _run(
        "local_cpu_multiprocess.sh",
        "--dry-run",
        "--processes",
        "3",
        "--devices",
        "2",
        "--",
        "--gin_file=runs/smoke_cpu.gin",
        env={"MOE_JAX_COORDINATOR_PORT": "23456"},
    )
    assert proc.returncode == 0, proc.stderr
    steps = _steps(proc.stdout)
    assert len(steps) == 3
    for rank, step in enumerate(steps):
        assert "JAX_NUM_CPU_DEVICES=2" in step
        assert "--coordinator_address=127.0.0.1:23456" in step
        assert f"--process_index={rank}" in step and "--process_count=3" in step


@pytest.mark.skipif(
    not (LAUNCH.parent / ".venv" / "bin" / "python").exists(), reason="no repository .venv"
)
def test_the_routing_script_runs_without_an_activated_venv(tmp_path):
    """`configs/routing_cpu.sh` from another directory with no `python` on PATH uses the
    repository's interpreter: here its first step reaches `moe-jax sweep`, which names the
    missing family file."""
    script = LAUNCH.parent / "configs" / "routing_cpu.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # no venv's bin, no `python`
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "root"), str(tmp_path / "none.toml")],
        cwd=tmp_path,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert f"{tmp_path / 'none.toml'}: no such family file" in done.stderr
