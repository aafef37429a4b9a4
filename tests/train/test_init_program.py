"""The initial state's program: on GPUs its random numbers come from jaxlib's threefry
kernel, one call per random array, instead of threefry's rounds inlined per parameter (the
program's compile time); elsewhere it is JAX's default program."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import pytest

from moe_jax import hardware
from moe_jax.compile import targets

REPO = pathlib.Path(__file__).resolve().parents[2]
FLAG = "jax_threefry_gpu_kernel_lowering"


def _benchmark():
    """benchmarks/init_program.py as a module (benchmarks/ is not a package)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "init_program", REPO / "benchmarks" / "init_program.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_lowering_is_set_for_gpus_only_and_only_inside_the_block():
    assert getattr(jax.config, FLAG) is False
    for platform in ("gpu", "cuda"):
        with hardware.init_program_config(platform) as settings:
            assert settings == {FLAG: True}
            assert getattr(jax.config, FLAG) is True
        assert getattr(jax.config, FLAG) is False
    for platform in ("cpu", "tpu"):
        with hardware.init_program_config(platform) as settings:
            assert settings == {}
            assert getattr(jax.config, FLAG) is False
    with pytest.raises(RuntimeError), hardware.init_program_config("gpu"):
        raise RuntimeError("a failed lowering")
    assert getattr(jax.config, FLAG) is False  # restored on errors too


@pytest.mark.skipif(
    not (targets.compilers_dir() / "gpu").is_dir(), reason="no GPU compiler (make compilers)"
)
def test_the_gpu_init_program_calls_the_threefry_kernel_instead_of_inlining_it():
    """The smoke model's initial state compiled for one H100 (in fresh processes, by
    ``benchmarks/init_program.py``): as ``init_state`` lowers it, the random arrays come
    from kernel calls and threefry's rounds (its xors) are gone from the program, which is
    a fraction of the inlined one."""
    benchmark = _benchmark()
    args = ("runs/smoke_cpu.gin", "gpu:h100:1", False)
    inlined = benchmark.measure_in_child(*args, "inlined")
    kernel = benchmark.measure_in_child(*args, "kernel")
    assert inlined["threefry_kernel_calls"] == 0 and inlined["xor"] > 1000
    assert kernel["threefry_kernel_calls"] > 10
    assert kernel["xor"] < inlined["xor"] / 10
    assert kernel["instructions"] < inlined["instructions"] / 2


FALLBACK_CHILD = """
import dataclasses, json, re, sys
from moe_jax import hardware
from moe_jax.compile import aot, targets
devices = targets.target_devices(targets.parse_target("gpu:h100:1"))
from moe_jax.runtime import builders, configured, gin_flags
flags = ["--gin_file=runs/smoke_cpu.gin"]
aot.parse_gin_for_compile(gin_flags.parse_flags(builders.build_parser("t", ""), flags))
args = aot.train_bindings()
ctx = configured.run_context(devices=devices)
setup = configured.train_setup(args["model"], args["train_dataset_cfg"].input_shapes(), ctx)
kernel_calls = lambda c: len(re.findall('custom_call_target="cu_threefry2x32', c.as_text()))
found = {"fits": kernel_calls(setup.compile_init())}
facts = hardware.device_facts(devices)
hardware.device_facts = lambda *a, **k: dataclasses.replace(facts, hbm_bytes=1024)
found["does_not_fit"] = kernel_calls(setup.compile_init())
print(json.dumps(found))
"""


@pytest.mark.skipif(
    not (targets.compilers_dir() / "gpu").is_dir(), reason="no GPU compiler (make compilers)"
)
def test_the_init_program_falls_back_to_sharded_generation_when_the_kernel_form_does_not_fit(
    tmp_path,
):
    """The kernel form makes each random array whole on every device; where that would not
    fit the device's memory (here: an H100 said to have 1 KiB), ``compile_init`` compiles
    JAX's default program, which generates only each device's shards."""
    child = tmp_path / "child.py"
    child.write_text(FALLBACK_CHILD)
    found = _benchmark().fresh_process.run_json(str(child))
    assert found["fits"] > 10 and found["does_not_fit"] == 0


def test_the_device_mode_compares_both_programs_on_this_machine(tmp_path):
    """``init_program.py --device`` (what ``gpu_session.sh`` runs on a GPU) on this CPU:
    ``init_state`` timed, both forms compiled afresh and run, their states compared; on a
    CPU the two forms are one program, so the states are equal."""
    import json
    import subprocess

    benchmark = _benchmark()
    out = tmp_path / "init.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "init_program.py"),
            "--device",
            "--runs=runs/smoke_cpu.gin",
            "--layers=unrolled",
            f"--json={out}",
        ],
        cwd=REPO,
        env=benchmark.fresh_process.env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    assert (row["run"], row["scan_layers"], row["device"], row["equal"]) == (
        "runs/smoke_cpu.gin",
        False,
        "cpu",
        True,
    )
    for lowering in benchmark.LOWERINGS:
        assert row[lowering]["compile_s"] > 0.1  # compiled afresh, not from a cache
    assert "| runs/smoke_cpu.gin | unrolled | cpu |" in proc.stdout
