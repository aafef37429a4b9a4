"""`moe-jax compile`: compile a run for its TPU, GPU or CPU target before launching it.

Ahead of time: nothing runs, no device is needed (:mod:`moe_jax.compile`).

    moe-jax compile --target=tpu:v5p:2x2x4 --gin_file=gin/experiments/base_learned.gin \\
        --gin_file=gin/meshes/v4_32.gin [--out=report.json] [--hlo_dir=DIR]

Takes the flags of `moe-jax train`. Builds the run's exact train step and eval step (same
model, optimizer with frozen-router masking, shardings, donation:
``builders.build_train_setup``) over the target's devices from abstract shapes, compiles
both (no device, data or vocabulary file needed), and prints per device: parameter +
optimizer bytes, temporaries, the total against the chip's HBM, the collectives of the HLO
by kind (bytes as ``moe_jax.compile.collectives`` defines them), FLOPs and bytes per step,
a roofline estimate of step time and tokens/s, and the MoE layer's choices for the target.
Exits 1, naming what to change, when the run does not fit. ``--hlo_dir`` keeps each compiled step's
optimized HLO (``train.hlo.txt``, ``eval.hlo.txt``), the text the collective counts are read
from. What a compiler does not report is printed as unknown, never as zero: GPU executables
compiled without a GPU have no cost analysis, so their estimate's HBM term counts the bytes
of the HLO text instead (every loop body once per trip) and says so. The compilers' own
start-up output (libtpu's host and worker warnings, CUDA's) is hidden unless
``--verbose``."""

from __future__ import annotations

import json
import sys

from moe_jax import hardware, storage
from moe_jax.compile import aot, report, targets
from moe_jax.runtime import builders, gin_flags, gin_text


def main(argv: list[str] | None = None) -> int:

    parser = builders.build_parser("moe-jax compile", __doc__.splitlines()[0])
    parser.add_argument(
        "--target",
        required=True,
        metavar="PLATFORM:CHIP:TOPOLOGY",
        help="tpu:v5e:4x4, tpu:v5p:2x2x4, gpu:h100:8, cpu:8, ...",
    )
    parser.add_argument("--out", default=None, metavar="FILE.json", help="write the report as JSON")
    parser.add_argument("--no_eval", action="store_true", help="compile the train step only")
    parser.add_argument(
        "--hlo_dir",
        default=None,
        metavar="DIR",
        help="write each compiled step's HLO text to DIR/<step>.hlo.txt",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the compilers' own start-up output and logs (libtpu, CUDA, XLA)",
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    hint = ""
    try:
        target = targets.parse_target(args.target)
        hint = "" if args.verbose else " (--verbose shows the compiler's own output)"
        with hardware.native_output_hidden(not args.verbose) as messages:
            devices = targets.target_devices(target)
            aot.parse_gin_for_compile(args)
            compiled = aot.compile_run(
                devices,
                hardware.device_facts(devices, target.chip, target.num_chips),
                target=target.spec,
                eval_step=not args.no_eval,
                hlo_dir=args.hlo_dir,
                progress=lambda m: print(m, file=messages, flush=True),
            )
    except (gin_text.GinConfigError, FileNotFoundError, ValueError) as err:
        print(f"moe-jax compile: error: {err}{hint}", file=sys.stderr)
        return 1
    print(report.format_report(compiled), flush=True)
    if args.out:
        storage.write_text(args.out, json.dumps(compiled, indent=1))
    return 0 if compiled["fits"] else 1
