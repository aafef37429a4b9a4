"""Compile time of the initial state's program for a GPU target: threefry inlined against
the CUDA kernel call ``TrainSetup.init_state`` lowers it to.

    python benchmarks/init_program.py                          # T5-Base dense and MoE, one H100
    python benchmarks/init_program.py --runs runs/smoke_cpu.gin --target gpu:h100:1
    python benchmarks/init_program.py --device --layers scanned     # on this machine's GPU

Each run (a gin file under ``gin/``; ``experiments/X.gin`` at batch 32, the size measured on
one chip by ``accelerator_step.py``) is compiled with unrolled and scanned layers
(``SCAN_LAYERS``), each twice, in a fresh process without the compilation cache:

* ``inlined``: threefry's rounds inlined as element-wise instructions, JAX's default (the
  program ``init_state`` compiled before it set ``hardware.init_program_config``);
* ``kernel``: ``TrainSetup.lower_init`` as ``init_state`` runs it (on GPUs one call of
  jaxlib's threefry kernel per random array; the same function).

The compile runs on this machine's CPU for the target's devices (the CUDA PJRT plugin of
``make compilers``; no GPU needed), as it would on a GPU machine's host. Prints a table of
compile seconds and of the optimized program's instructions and kernel calls.

``--device``: on the machine's first device instead (``benchmarks/gpu_session.sh`` runs it
on a GPU), each run in a fresh process: ``init_state()`` as a run calls it, then each form
compiled and run, and whether the two make the same initial state bit for bit.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import fresh_process
import report

LOWERINGS = ("inlined", "kernel")
BASE_RUNS = ("experiments/base_dense.gin", "experiments/base_learned.gin")
# One HLO instruction: ``%name = type opcode(`` (or ``ROOT %name = ...``).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = .*? ([a-z][\w-]*)\(", re.M)


def train_setup(gin_file: str, scan: bool, devices: list) -> Any:
    """The ``TrainSetup`` of ``gin_file`` (``experiments/X.gin`` at batch 32) with
    ``SCAN_LAYERS = scan`` on the first of ``devices``."""
    from moe_jax.compile import aot
    from moe_jax.runtime import builders, configured, gin_flags

    argv = [f"--gin_file={gin_file}", f"--gin_bindings=SCAN_LAYERS = {scan}"]
    if gin_file.startswith("experiments/"):
        argv.append("--gin_bindings=BATCH_SIZE = 32")
    aot.parse_gin_for_compile(
        gin_flags.parse_flags(builders.build_parser("init_program", ""), argv)
    )
    args = aot.train_bindings()
    ctx = configured.run_context(devices=devices[:1])
    return configured.train_setup(args["model"], args["train_dataset_cfg"].input_shapes(), ctx)


def measure(gin_file: str, target: str, scan: bool, lowering: str) -> dict:
    """Compiles the initial state's program of ``gin_file`` for ``target`` in this process:
    seconds to lower and compile, the optimized HLO's instruction count and its threefry
    kernel calls."""
    from moe_jax.compile import targets

    setup = train_setup(gin_file, scan, targets.target_devices(targets.parse_target(target)))
    start = time.perf_counter()
    lowered = setup.lower_init(kernel_random=lowering == "kernel")
    lowered_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lowered_s
    hlo = compiled.as_text()
    opcodes = collections.Counter(_INSTRUCTION.findall(hlo))
    return {
        "lower_s": lowered_s,
        "compile_s": compile_s,
        "instructions": sum(opcodes.values()),
        "threefry_kernel_calls": len(re.findall(r'custom_call_target="cu_threefry2x32', hlo)),
        "xor": opcodes["xor"],
    }


def measure_on_device(gin_file: str, scan: bool) -> dict:
    """On this machine's first device: ``init_state()`` as a run calls it (``compile_init``:
    the kernel form where it fits), then each form's seconds to lower and compile and to
    run, and whether the two give the same initial state, bit for bit."""
    import jax
    import numpy as np

    setup = train_setup(gin_file, scan, jax.devices())
    found: dict[str, Any] = {"device": jax.devices()[0].device_kind}
    start = time.perf_counter()
    jax.block_until_ready(setup.init_state())
    found["init_state_s"] = time.perf_counter() - start
    states = {}
    for lowering in LOWERINGS:
        jax.clear_caches()  # each program compiled afresh (the persistent cache is off)
        start = time.perf_counter()
        compiled = setup.lower_init(kernel_random=lowering == "kernel").compile()
        compiled_s = time.perf_counter() - start
        states[lowering] = jax.block_until_ready(compiled())
        found[lowering] = {
            "compile_s": compiled_s,
            "run_s": time.perf_counter() - start - compiled_s,
        }
    found["equal"] = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(*(jax.tree.leaves(states[lowering]) for lowering in LOWERINGS), strict=True)
    )
    return found


def measure_in_child(gin_file: str, target: str, scan: bool, lowering: str) -> dict:
    """:func:`measure` in a fresh process."""
    return fresh_process.run_json(__file__, "--measure", gin_file, target, str(scan), lowering)


COMPILED_COLUMNS = (
    "run",
    "layers",
    "compile, threefry inlined (s)",
    "compile, kernel (s)",
    "inlined / kernel",
    "instructions, inlined",
    "instructions, kernel",
    "kernel calls",
)
DEVICE_COLUMNS = (
    "run",
    "layers",
    "device",
    "inlined: compile / run (s)",
    "kernel: compile / run (s)",
    "same state",
    "init_state (s)",
)


def collect(runs: list[str], forms: tuple[bool, ...], measure_one: Callable) -> list[dict]:
    """``measure_one(gin_file, scan)`` of each run and layer form, as rows."""
    found = []
    for gin_file in runs:
        for scan in forms:
            got = measure_one(gin_file, scan)
            found.append({"run": gin_file, "scan_layers": scan, **got})
            print(f"[init_program] {gin_file} scan={scan}: {got}", file=sys.stderr, flush=True)
    return found


def compiled_cells(row: dict) -> list[str]:
    inlined, kernel = row["inlined"], row["kernel"]
    return [
        row["run"],
        _layers(row),
        f"{inlined['compile_s']:.1f}",
        f"{kernel['compile_s']:.1f}",
        f"{inlined['compile_s'] / kernel['compile_s']:.1f}x",
        f"{inlined['instructions']:,}",
        f"{kernel['instructions']:,}",
        str(kernel["threefry_kernel_calls"]),
    ]


def device_cells(row: dict) -> list[str]:
    inlined, kernel = row["inlined"], row["kernel"]
    return [
        row["run"],
        _layers(row),
        row["device"],
        f"{inlined['compile_s']:.1f} / {inlined['run_s']:.2f}",
        f"{kernel['compile_s']:.1f} / {kernel['run_s']:.2f}",
        "yes" if row["equal"] else "no",
        f"{row['init_state_s']:.1f}",
    ]


def _layers(row: dict) -> str:
    return "scanned" if row["scan_layers"] else "unrolled"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--measure":
        gin_file, target, scan, lowering = argv[1:5]
        print(json.dumps(measure(gin_file, target, scan == "True", lowering)), flush=True)
        return 0
    if argv and argv[0] == "--measure-device":
        gin_file, scan = argv[1:3]
        print(json.dumps(measure_on_device(gin_file, scan == "True")), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(BASE_RUNS), help="gin files")
    parser.add_argument("--target", default="gpu:h100:1")
    parser.add_argument(
        "--device", action="store_true", help="compile and run on this machine's first device"
    )
    parser.add_argument("--layers", choices=("both", "unrolled", "scanned"), default="both")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args(argv)
    forms = {"both": (False, True), "unrolled": (False,), "scanned": (True,)}[args.layers]
    if args.device:
        found = collect(
            args.runs,
            forms,
            lambda gin_file, scan: fresh_process.run_json(
                __file__, "--measure-device", gin_file, str(scan)
            ),
        )
        print(report.markdown_table(list(DEVICE_COLUMNS), [device_cells(row) for row in found]))
    else:
        found = collect(
            args.runs,
            forms,
            lambda gin_file, scan: {
                lowering: measure_in_child(gin_file, args.target, scan, lowering)
                for lowering in LOWERINGS
            },
        )
        print(report.markdown_table(list(COMPILED_COLUMNS), [compiled_cells(row) for row in found]))
        print(f"\nTarget: {args.target}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
