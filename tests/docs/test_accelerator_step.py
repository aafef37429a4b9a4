"""benchmarks/accelerator_step.py in its quick mode on this CPU (so that the accelerator
benchmark cannot rot), and its section of benchmarks/RESULTS.md."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report  # noqa: E402  (benchmarks/ is not a package)

PHASES = {"gin", "setup", "compile", "init_state", "first_step"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    """One MoE run (the learned router of Figure 5) and the MoE layer section, quick."""
    out = tmp_path_factory.mktemp("accelerator") / "quick.json"
    command = [
        sys.executable,
        str(BENCHMARKS / "accelerator_step.py"),
        "--quick",
        "--runs=fig5_learned,fig5_learned_cudnn,fig5_learned_pallas,moe_layer",
        "--steps=2",
        "--layer_reps=1",
        f"--out={out}",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_quick_run_reports_phases_rates_memory_and_the_estimate(quick):
    assert quick["quick"] and quick["device"].endswith("(cpu)")
    (run,) = quick["runs"]
    assert run["run"] == "fig5_learned" and "error" not in run
    assert set(run["phases_s"]) == PHASES and all(t > 0 for t in run["phases_s"].values())
    step = run["step_s"]
    assert step["steps"] == 2 and 0 < step["min"] <= step["median"]
    assert 0 < run["step_s_blocking"]["min"] <= run["step_s_blocking"]["median"]
    lengths = run["task_feature_lengths"]
    assert run["tokens_per_step"] == run["batch_size"] * (lengths["inputs"] + lengths["targets"])
    assert run["tokens_per_s"] == pytest.approx(run["tokens_per_step"] / step["median"])
    assert run["model_flops_per_step"] > 0 and run["parameters"] > 0
    assert run["peak_flops_per_s"] is None and run["mfu"]["of_peak"] is None  # CPU: no chip
    assert run["mfu"]["of_matmul"] == pytest.approx(
        run["model_flops_per_step"] / step["median"] / run["matmul"]["flops_per_s"]
    )
    assert run["memory"]["compiled_total_bytes"] > 0
    assert run["estimate"]["step_s"] > 0 and run["estimate"]["peak_is_measured"]
    per_step = run["estimate"]["per_step"]  # the HLO text's work, loops per trip
    assert per_step["flops"] > 0 and per_step["bytes"] > 0
    assert run["measured_over_estimate"] == pytest.approx(
        step["median"] / run["estimate"]["step_s"]
    )
    assert run["final_loss"] == pytest.approx(run["final_loss"])  # finite, not NaN


def test_fused_attention_runs_are_skipped_where_there_is_no_gpu(quick):
    """On this CPU the cuDNN and Pallas variants are skipped with their reason, not failed."""
    assert [r["run"] for r in quick["runs"]] == ["fig5_learned"]
    assert quick["skipped"] == {
        "fig5_learned_cudnn": "cuDNN fused attention needs an NVIDIA GPU (this platform: cpu)",
        "fig5_learned_pallas": (
            "the Pallas flash-attention kernel needs an NVIDIA GPU (this platform: cpu)"
        ),
    }


def test_quick_layers_time_each_dispatch_and_the_dense_ffn(quick):
    rows = quick["layers"]["rows"]
    assert [r["impl"] for r in rows] == [
        "einsum",
        "sort",
        "dropless",
        "dropless:xla",
        "dense FFN",
        "matmul",
    ]
    assert all(r["ms"] > 0 and r["of_matmul"] > 0 for r in rows)
    # each implementation agrees with its reference, timed in the same rounds
    assert all(r["max_rel_diff"] < 1e-4 for r in rows if "max_rel_diff" in r)


def test_no_run_imports_what_a_bare_accelerator_machine_lacks(quick):
    # TensorFlow, seqio, TFDS, clu, google-crc32c: checked in each run's own process
    for result in [*quick["runs"], quick["layers"]]:
        assert result["imported_of_not_needed"] == [], result["run"]


def test_the_section_renders_an_accelerator_json_and_ignores_a_cpu_one(
    quick, monkeypatch, tmp_path
):
    monkeypatch.setattr(report, "ACCELERATOR", tmp_path)
    (tmp_path / "cpu.json").write_text(json.dumps(quick))
    assert "Not yet measured" in report._accelerator()
    assert report.ACCELERATOR_COMMAND in report._accelerator()
    stopped = {"run": "base_dense", "error": "timed out after 20 s", "phases_s": {"gin": 1.0}}
    gpu = dict(
        quick,
        quick=False,
        device="1 x NVIDIA H100 80GB HBM3 (gpu)",
        runs=[*quick["runs"], stopped],
    )
    (tmp_path / "h100.json").write_text(json.dumps(gpu))
    text = report._accelerator()
    assert "Device: 1 x NVIDIA H100 80GB HBM3 (gpu)" in text
    assert "| fig5_learned | estimate (compiled, not run) |" in text
    assert "| fig5_learned | measured |" in text
    assert "| base_dense | - | - | - | - | - | failed: timed out after 20 s |" in text
    assert "| 8 | sort |" in text


def test_top_kernels_reads_the_device_process_of_a_trace(tmp_path):
    import accelerator_step

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {
            "ph": "X",
            "pid": 1,
            "name": "scatter",
            "ts": 0.0,
            "dur": 300.0,
            "args": {"kernel_details": "g"},
        },
        {"ph": "X", "pid": 1, "name": "gemm", "ts": 300.0, "dur": 50.0},
        {"ph": "X", "pid": 1, "name": "gemm", "ts": 400.0, "dur": 50.0},
        {"ph": "X", "pid": 2, "name": "host op", "ts": 0.0, "dur": 9000.0},
    ]
    run_dir = tmp_path / "plugins" / "profile" / "2026_01_01"
    run_dir.mkdir(parents=True)
    (run_dir / "vm.trace.json.gz").write_bytes(
        gzip.compress(json.dumps({"traceEvents": events}).encode())
    )
    found = accelerator_step.top_kernels(str(tmp_path))
    assert found["device_kernel_ms"] == pytest.approx(0.4)
    assert [(k["name"], k["count"], k["share"]) for k in found["kernels"]] == [
        ("scatter", 1, 0.75),
        ("gemm", 2, 0.25),
    ]
    assert found["kernels"][0]["kernel_details"] == "g"
    assert (found["span_ms"], found["busy_ms"]) == (pytest.approx(0.45), pytest.approx(0.4))
    assert found["gaps"] == [{"ms": pytest.approx(0.05), "after": "gemm", "before": "gemm"}]


def test_the_gpu_session_measures_runs_the_benchmark_knows():
    """``benchmarks/gpu_session.sh``'s default runs are names of ``accelerator_step.py``
    (a misspelt one would cost a device session its measurement), and the scanned Base
    variants bind what their names say."""
    import re

    import accelerator_step

    script = (BENCHMARKS / "gpu_session.sh").read_text()
    (default,) = re.findall(r'runs="\$\{RUNS:-([\w,]+)\}"', script)
    names = default.split(",")
    assert set(names) <= {*accelerator_step.RUNS, accelerator_step.LAYERS}, names
    assert {"base_dense", "base_dense_scanned_minimal"} <= set(names)
    run = accelerator_step.RUNS["base_learned_scanned_minimal"]
    assert run.gin_files == accelerator_step.RUNS["base_learned"].gin_files
    assert {"SCAN_LAYERS = True", "REMAT_POLICY = 'minimal'"} <= set(run.bindings)
    assert "SCAN_LAYERS = True" in accelerator_step.RUNS["base_dense_scanned"].bindings
    logits = accelerator_step.RUNS["base_dense_bf16_logits"].bindings
    assert "T5Config.float32_attention_logits = False" in logits
