"""`moe-jax compile` (moe_jax/train/aot.py), target parsing and the chip table
(moe_jax/hardware.py), and `train`'s up-front memory check.

The TPU compiles run in a subprocess (the compiler pins JAX to describe, never open, the
TPU) with the libtpu that `make compilers` installs (`make test` installs it first).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from moe_jax import cli, hardware
from moe_jax.train import aot

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = ["--gin_file=runs/smoke_cpu.gin", "--no_eval"]  # the train step only; one test compiles both


def compile_cli(tmp_path, *flags: str) -> tuple[int, str, dict | None]:
    """(exit code, stdout + stderr, JSON report) of `moe-jax compile` in a fresh process."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # the test session's 8 forced CPU devices are not the target's
    proc = subprocess.run([sys.executable, "-m", "moe_jax.cli", "compile", *flags, f"--out={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, report


def test_parse_target_and_chip_table():
    v5e = hardware.parse_target("tpu:v5e:4x4")
    assert (v5e.platform, v5e.chip.name, v5e.num_chips) == ("tpu", "v5e", 16)
    assert v5e.chip.hbm_bytes == 16 * hardware.GiB
    assert hardware.parse_target("gpu:h100:8").num_chips == 8
    assert hardware.parse_target("cpu:8").chip is None
    # Cloud TPU accelerator types: TensorCores for v4/v5p (2 per chip), chips for v5e/v6e;
    # v4 chips show as two devices to libtpu, so half the chips give the slice's device count
    for accelerator, (chip, topology) in {"v5p-32": ("v5p", "2x2x4"), "v5p-128": ("v5p", "4x4x4"),
                                          "v5litepod-16": ("v5e", "4x4"), "v6e-8": ("v6e", "2x4"),
                                          "v4-32": ("v4", "2x2x2")}.items():
        target = hardware.parse_target(f"tpu:{accelerator}")
        assert (target.chip.name, target.topology) == (chip, topology), accelerator
    for bad, named in [("tpu:v9:2x2", "v9"), ("gpu:h100:2x2", "2x2"), ("tpu:v5e", "PLATFORM:CHIP"),
                       ("tpu:h100:2x2", "h100"), ("cpu:0", "PLATFORM"), ("tpu:v5p-6", "tpu:v5p:TOPOLOGY")]:
        with pytest.raises(hardware.TargetError, match=named) as err:
            hardware.parse_target(bad)
        assert "tpu:v5e:4x4" in str(err.value) and "gpu:h100:8" in str(err.value)  # known ones
    # device kinds: the longest prefix wins (v5e shows as "TPU v5 lite", v5p as "TPU v5")
    assert hardware.chip_of_device_kind("TPU v5 lite").name == "v5e"
    assert hardware.chip_of_device_kind("TPU v5").name == "v5p"
    assert hardware.chip_of_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.chip_of_device_kind("cpu") is None

    class Core:  # libtpu describes a v4 chip as two TensorCore devices
        device_kind = "TPU v4"

    facts = hardware.device_facts([Core()] * 16, hardware.CHIPS["v4"], num_chips=8)
    assert facts.hbm_bytes == 16 * hardware.GiB and facts.peak_flops == 275e12 / 2


def test_bad_target_mesh_and_missing_compiler_are_one_line(tmp_path, monkeypatch, capsys):
    assert aot.main(["--target=tpu:v7x:2x2", *SMOKE]) == 1
    assert "v7x" in capsys.readouterr().err
    assert aot.main(["--target=cpu:4", *SMOKE, "--gin.make_mesh.mesh_shape=(1,3,1)"]) == 1
    err = capsys.readouterr().err
    assert "mesh_shape=(1, 3, 1)" in err and "4" in err and "Traceback" not in err
    monkeypatch.setenv("MOE_JAX_COMPILERS", str(tmp_path))  # nothing installed there
    assert aot.main(["--target=gpu:h100:8", *SMOKE]) == 1
    assert "compile-gpu" in capsys.readouterr().err


@pytest.mark.parametrize("mesh,with_eval", [("(1,4,1)", False), ("(2,2,1)", True)])
def test_tpu_compile_of_the_smoke_config(tmp_path, mesh, with_eval):
    flags = SMOKE if not with_eval else [f for f in SMOKE if f != "--no_eval"]
    code, output, report = compile_cli(tmp_path, "--target=tpu:v5e:2x2", *flags,
                                       f"--gin.make_mesh.mesh_shape={mesh}", f"--hlo_dir={tmp_path}")
    assert code == 0, output
    step = report["steps"]["train"]
    # the counts are those of the kept HLO (the TPU's async forms: -start/-done pairs once)
    hlo = (tmp_path / "train.hlo.txt").read_text()
    assert step["collectives"] == aot.collectives(hlo) and "all-to-all" in hlo
    assert (tmp_path / "eval.hlo.txt").exists() == with_eval == ("eval" in report["steps"])
    if with_eval:  # the eval step: forward only, no optimizer state
        evaluation = report["steps"]["eval"]
        assert evaluation["fits"] and evaluation["flops_per_step"] == pytest.approx(step["flops_per_step"] / 3)
        assert evaluation["bytes"]["params_and_optimizer"] < step["bytes"]["params_and_optimizer"]
    moe = step["moe_layers"]  # the MoE layers' share of the step's operations
    assert 0 < moe["indexed_bytes"] < moe["hlo_bytes"] < moe["step_hlo_bytes"] and moe["flops"] > 0
    assert "MoE layers:" in output
    assert report["devices"] == 4 and report["device_kind"].startswith("TPU v5")
    # float32 activations over data and expert axes: the batched expert matmuls made libtpu
    # 0.0.42 abort (ReshapeIsBitcast) over (2,2,1); on TPU float32 runs one matmul per expert
    assert report["moe_layer"] == {"platform": "tpu", "dispatch": "sort", "per_expert_loop": True}
    assert step["collectives"]["all-to-all"]["count"] >= 2  # experts over the expert axis
    # bound from the shapes: the whole Adam state (params + 2 moments, fp32) twice, plus
    # per device a quarter of the batch's [tokens, vocab + 100 x d_ff] fp32 activations
    dims = report["model_dims"]
    tokens = report["batch_size"] * sum(report["task_feature_lengths"].values())
    bound = 2 * 3 * 4 * report["parameters"] + 4 * tokens / 4 * (dims["vocab_size"] + 100 * dims["mlp_dim"])
    assert 0 < step["bytes"]["params_and_optimizer"] < step["bytes"]["total"] < bound
    assert step["bytes"]["device_memory"] == 16 * hardware.GiB and step["fits"]
    assert "verdict: fits" in output


def test_tpu_compile_refuses_a_run_too_big_for_the_chip(tmp_path):
    code, output, report = compile_cli(tmp_path, "--target=tpu:v5e:2x2", *SMOKE,
                                       "--gin.make_mesh.mesh_shape=(1,4,1)", "--gin.BATCH_SIZE=131072")
    assert code == 1, output
    assert not report["fits"] and report["steps"]["train"]["bytes"]["total"] > 16 * hardware.GiB
    assert "DOES NOT FIT" in output and "--gin.BATCH_SIZE=65536" in output


def test_train_refuses_a_step_bigger_than_the_machine(tmp_path, capsys):
    code = cli.main(["train", "--gin_file=runs/smoke_cpu.gin", f"--gin.MODEL_DIR={tmp_path}",
                     "--gin.BATCH_SIZE=131072"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "available memory" in err and "--gin.BATCH_SIZE=65536" in err
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


def test_compiler_options_follow_the_platform():
    # GPU steps compile without Triton GEMMs (XLA 0.10.2 aborts tiling Base's attention dots);
    # CPU and TPU steps compile with XLA's defaults
    assert hardware.compiler_options("cuda") == hardware.compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert hardware.compiler_options("cpu") == hardware.compiler_options("tpu") == {}


def test_collectives_parses_sync_and_async_ops():
    hlo = """
  %all-to-all.1 = f32[4,8]{1,0} all-to-all(f32[4,8]{1,0} %x), dimensions={0}
  %ars = (bf16[16]{0}, bf16[16]{0}) all-reduce-start(bf16[16]{0} %y), to_apply=%add
  %ard = bf16[16]{0} all-reduce-done(%ars)
  %ag = s32[2,3]{1,0} all-gather(s32[1,3]{1,0} %z), dimensions={0}
  %all-to-all-start = ((f32[8,128]{1,0}), f32[8,128]{1,0}) all-to-all-start(%p), dimensions={0}
  ROOT %all-to-all-done = f32[8,128]{1,0} all-to-all-done(%all-to-all-start)
  %all-reduce.94 = (f32[32]{0}, f32[32]{0}, f32[32]{0}, f32[32]{0}, f32[32]{0}, /*index=5*/f32[32,4]{0,1}) all-reduce(%a, %b, %c, %d, %e, %f), to_apply=%add
  %ragged_all_to_all.3 = bf16[64,256]{1,0} ragged-all-to-all(%r, %buf, %io, %ss, %oo, /*index=5*/%rs), channel_id=1
  %cps = (bf16[48,12,64]{2,0,1}, bf16[48,12,64]{2,0,1}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%w), source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[48,12,64]{2,0,1} collective-permute-done(%cps)
"""
    # a gradient tuple long enough for XLA's /*index=5*/ comments (was missed); an async
    # collective-permute, whose start tuple ends in two u32 sync flags (was counted as 8 B)
    assert aot.collectives(hlo) == {"all-to-all": {"count": 2, "bytes": 4 * 32 + 4 * 8 * 128},
                                    "all-reduce": {"count": 2, "bytes": 2 * 16 + 4 * (5 * 32 + 128)},
                                    "collective-permute": {"count": 1, "bytes": 2 * 48 * 12 * 64},
                                    "all-gather": {"count": 1, "bytes": 4 * 6},
                                    "ragged-all-to-all": {"count": 1, "bytes": 2 * 64 * 256}}


@pytest.mark.slow
def test_gpu_compile_of_the_smoke_config(tmp_path):
    """8 H100s from the bare CUDA PJRT plugin (`make compilers`; no CUDA libraries)."""
    code, output, report = compile_cli(tmp_path, "--target=gpu:h100:8", *SMOKE,
                                       "--gin_file=meshes/gpu_8x_h100.gin", "--gin.NUM_EXPERTS=8")
    assert code == 0, output
    assert report["device_kind"].startswith("NVIDIA H100") and report["devices"] == 8
    assert report["moe_layer"] == {"platform": "gpu", "dispatch": "sort", "per_expert_loop": False}
    step = report["steps"]["train"]
    assert step["collectives"]["all-to-all"]["count"] >= 2
    assert 0 < step["bytes"]["total"] < step["bytes"]["device_memory"]
