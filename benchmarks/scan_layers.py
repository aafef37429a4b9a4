"""Compile and init time of scanned against unrolled layers (``T5Config.scan_layers``).

    python benchmarks/scan_layers.py                       # base_dense and base_learned
    python benchmarks/scan_layers.py --runs base_dense --skip tpu --gin.BATCH_SIZE=8

For each run (``gin/experiments/<run>.gin``) each measurement is taken twice, unrolled
(``--gin.SCAN_LAYERS=False``) then scanned, one after the other in this invocation, each
in a fresh process with JAX's compilation cache off:

* ``tpu``: the train step compiled for a TPU slice by `moe-jax compile --no_eval` (tracing,
  lowering and XLA:TPU; ``--target``, default ``tpu:v5p:2x2x4`` with meshes/v4_32.gin,
  the compile table's v5p-32 row);
* ``cpu``: the same for 8 CPU devices (meshes/cpu_8.gin);
* ``init``: the initial state's program on 8 CPU devices, compiled as
  ``TrainSetup.init_state`` compiles it (``TrainSetup.compile_init``), then run
  when the state takes less than half of this machine's available memory.

Prints a table of seconds per measurement with the ratio unrolled / scanned, and one of the
parameter count and the train step's bytes per device of both forms (the same network).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import fresh_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASUREMENTS = ("tpu", "cpu", "init")
CPU_MESH = "--gin_file=meshes/cpu_8.gin"


def compile_seconds(target: str, flags: list[str]) -> dict:
    """`moe-jax compile --no_eval` of the train step in a fresh process: its ``compile_s``,
    parameter count and bytes per device."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "moe_jax.cli", "compile", f"--target={target}", "--no_eval"]
        proc = subprocess.run(
            [*cmd, *flags, f"--out={out}"],
            cwd=REPO,
            env=fresh_process.env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd + flags)} failed:\n{proc.stdout}{proc.stderr}")
        with open(out) as f:
            report = json.load(f)
    step = report["steps"]["train"]
    return {
        "seconds": step["compile_s"],
        "parameters": report["parameters"],
        "bytes": step["bytes"]["total"],
    }


def init_seconds(flags: list[str]) -> dict:
    """:func:`measure_init` in a fresh process."""
    return fresh_process.run_json(__file__, "--measure-init", *flags)


def measure_init(flags: list[str]) -> dict:
    """Seconds to compile the initial state's program of the gin-configured run on 8 CPU
    devices and, when its state takes less than half the available memory, to run it."""
    from moe_jax import hardware
    from moe_jax.compile import targets

    devices = targets.target_devices(targets.parse_target("cpu:8"))
    import jax

    from moe_jax.compile import aot
    from moe_jax.runtime import builders, configured, gin_flags

    aot.parse_gin_for_compile(
        gin_flags.parse_flags(builders.build_parser("scan_layers", ""), flags)
    )
    args = aot.train_bindings()
    ctx = configured.run_context(devices=devices)
    run = configured.train_setup(args["model"], args["train_dataset_cfg"].input_shapes(), ctx)
    state_bytes = sum(
        math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(run.abstract_state)
    )
    start = time.perf_counter()
    compiled = run.compile_init()  # what TrainSetup.init_state runs
    compiled_s = time.perf_counter() - start
    run_s = None
    if state_bytes < hardware.available_memory_bytes() / 2:
        start = time.perf_counter()
        jax.block_until_ready(compiled())
        run_s = time.perf_counter() - start
    return {"compile": compiled_s, "run": run_s, "state_bytes": state_bytes}


def _cell(before: float | None, after: float | None) -> list[str]:
    if before is None or after is None:
        return ["-", "-", "-"]
    return [f"{before:.1f}", f"{after:.1f}", f"{before / after:.2f}x"]


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--measure-init":
        print(json.dumps(measure_init(argv[1:])), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["base_dense", "base_learned"])
    parser.add_argument("--target", default="tpu:v5p:2x2x4", help="the TPU target")
    parser.add_argument("--tpu-mesh", default="meshes/v4_32.gin", help="its mesh gin file")
    parser.add_argument("--skip", nargs="*", default=[], choices=MEASUREMENTS)
    args, extra = parser.parse_known_args(argv)  # extra: --gin.NAME=value flags for every run
    rows, sizes = [], []
    for run in args.runs:
        flags = [f"--gin_file=experiments/{run}.gin", *extra]
        found: dict[str, dict[bool, dict]] = {m: {} for m in MEASUREMENTS}
        for scan in (False, True):
            form = [*flags, f"--gin.SCAN_LAYERS={scan}"]
            if "tpu" not in args.skip:
                found["tpu"][scan] = compile_seconds(
                    args.target, [*form, f"--gin_file={args.tpu_mesh}"]
                )
            if "cpu" not in args.skip:
                found["cpu"][scan] = compile_seconds("cpu:8", [*form, CPU_MESH])
            if "init" not in args.skip:
                found["init"][scan] = init_seconds([*form, CPU_MESH])
            print(f"[scan_layers] {run} scan={scan}: {found}", file=sys.stderr, flush=True)
        for name, label in (
            ("tpu", f"train step compile, {args.target}"),
            ("cpu", "train step compile, 8 CPU devices"),
        ):
            if found[name]:
                rows.append(
                    [
                        run,
                        label,
                        *_cell(found[name][False]["seconds"], found[name][True]["seconds"]),
                    ]
                )
                sizes.append(
                    [
                        run,
                        label.split(", ")[1],
                        *(f"{found[name][s]['parameters']:,}" for s in (False, True)),
                        *(f"{found[name][s]['bytes'] / 2**30:.2f}" for s in (False, True)),
                    ]
                )
        if found["init"]:
            init = found["init"]
            rows.append(
                [
                    run,
                    "init program compile, 8 CPU devices",
                    *_cell(init[False]["compile"], init[True]["compile"]),
                ]
            )
            rows.append(
                [
                    run,
                    "init program run, 8 CPU devices",
                    *_cell(init[False]["run"], init[True]["run"]),
                ]
            )
    print("| run | measurement | unrolled (s) | scanned (s) | unrolled / scanned |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if sizes:
        print()
        print(
            "| run | target | parameters, unrolled | parameters, scanned "
            "| train step GiB/device, unrolled | scanned |"
        )
        print("|---|---|---|---|---|---|")
        for row in sizes:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
