"""Compile time of the initial state's program for a GPU target: threefry inlined against
the CUDA kernel call ``TrainSetup.init_state`` lowers it to.

    python benchmarks/init_program.py                          # T5-Base dense and MoE, one H100
    python benchmarks/init_program.py --runs runs/smoke_cpu.gin --target gpu:h100:1

Each run (a gin file under ``gin/``; ``experiments/X.gin`` at batch 32, the size measured on
one chip by ``accelerator_step.py``) is compiled with unrolled and scanned layers
(``SCAN_LAYERS``), each twice, in a fresh process without the compilation cache:

* ``inlined``: threefry's rounds inlined as element-wise instructions, JAX's default (the
  program ``init_state`` compiled before it set ``hardware.init_program_config``);
* ``kernel``: ``TrainSetup.lower_init`` as ``init_state`` runs it (on GPUs one call of
  jaxlib's threefry kernel per random array; the same bits).

The compile runs on this machine's CPU for the target's devices (the CUDA PJRT plugin of
``make compilers``; no GPU needed), as it would on a GPU machine's host. Prints a table of
compile seconds and of the optimized program's instructions and kernel calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time

import fresh_process

LOWERINGS = ("inlined", "kernel")
BASE_RUNS = ("experiments/base_dense.gin", "experiments/base_learned.gin")
# One HLO instruction: ``%name = type opcode(`` (or ``ROOT %name = ...``).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = .*? ([a-z][\w-]*)\(", re.M)


def measure(gin_file: str, target: str, scan: bool, lowering: str) -> dict:
    """Compiles the initial state's program of ``gin_file`` for ``target`` in this process:
    seconds to lower and compile, the optimized HLO's instruction count and its threefry
    kernel calls."""
    from moe_jax import hardware

    devices = hardware.target_devices(hardware.parse_target(target))
    import jax

    from moe_jax import partitioning
    from moe_jax.commands.compile import parse_gin_for_compile
    from moe_jax.runtime import aot, builders, configured, gin_flags

    argv = [f"--gin_file={gin_file}", f"--gin_bindings=SCAN_LAYERS = {scan}"]
    if gin_file.startswith("experiments/"):
        argv.append("--gin_bindings=BATCH_SIZE = 32")
    parse_gin_for_compile(gin_flags.parse_flags(builders.build_parser("init_program", ""), argv))
    args = aot.train_bindings()
    ctx = configured.run_context(devices=devices[:1])
    setup = configured.train_setup(args["model"], args["train_dataset_cfg"].input_shapes(), ctx)
    platform = devices[0].platform
    start = time.perf_counter()
    if lowering == "kernel":
        lowered = setup.lower_init()
    else:  # the same program without hardware.init_program_config's settings
        with partitioning.activate(ctx.mesh, ctx.rules):
            lowered = jax.jit(
                setup._init_fn,
                out_shardings=setup.shardings,
                compiler_options=hardware.init_compiler_options(platform),
            ).lower()
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


def measure_in_child(gin_file: str, target: str, scan: bool, lowering: str) -> dict:
    """:func:`measure` in a fresh process."""
    return fresh_process.run_json(__file__, "--measure", gin_file, target, str(scan), lowering)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--measure":
        gin_file, target, scan, lowering = argv[1:5]
        print(json.dumps(measure(gin_file, target, scan == "True", lowering)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(BASE_RUNS), help="gin files")
    parser.add_argument("--target", default="gpu:h100:1")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args(argv)
    found = []
    for gin_file in args.runs:
        for scan in (False, True):
            got = {
                lowering: measure_in_child(gin_file, args.target, scan, lowering)
                for lowering in LOWERINGS
            }
            found.append({"run": gin_file, "scan_layers": scan, **got})
            print(f"[init_program] {gin_file} scan={scan}: {got}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    print(
        "| run | layers | compile, threefry inlined (s) | compile, kernel (s) "
        "| inlined / kernel | instructions, inlined | instructions, kernel | kernel calls |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in found:
        inlined, kernel = row["inlined"], row["kernel"]
        print(
            f"| {row['run']} | {'scanned' if row['scan_layers'] else 'unrolled'} "
            f"| {inlined['compile_s']:.1f} | {kernel['compile_s']:.1f} "
            f"| {inlined['compile_s'] / kernel['compile_s']:.1f}x "
            f"| {inlined['instructions']:,} | {kernel['instructions']:,} "
            f"| {kernel['threefry_kernel_calls']} |"
        )
    print(f"\nTarget: {args.target}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
