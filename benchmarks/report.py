"""benchmarks/RESULTS.md, generated: one section per question, each rendered from JSON.

    python benchmarks/report.py            # write benchmarks/RESULTS.md
    python benchmarks/report.py --check    # exit 1 when the committed file differs

Each measured section is ``benchmarks/results/<name>.json``, written by
``benchmarks/run_all.py`` from the tables its benchmark script prints::

    {"command": "python benchmarks/moe_layer.py --reps 3", "machine": "...", "date": "...",
     "tables": [{"columns": [...], "rows": [[...], ...]}, ...], "notes": ["...", ...]}

(``notes``: readings of those numbers, kept with them; a rerun leaves them out.) The
compiled-run sections are made from ``benchmarks/compile_reports/*.json``
(``benchmarks/compile_table.py``), the accelerator section from
``benchmarks/accelerator/*.json`` (``benchmarks/accelerator_step.py`` run on the device).
The question each section answers, and which script answers it, is ``SECTIONS`` below.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import types
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUTPUT = HERE / "RESULTS.md"
ACCELERATOR = HERE / "accelerator"  # accelerator_step.py's JSON, one file per device measured
ACCELERATOR_COMMAND = (
    "python benchmarks/accelerator_step.py --out benchmarks/accelerator/DEVICE.json"
)


@dataclasses.dataclass(frozen=True)
class Section:
    """One question of RESULTS.md and the benchmark that answers it.

    Attributes:
      name: ``benchmarks/results/<name>.json``; for a generated section, its id.
      question: the section's heading.
      what: one paragraph saying what is measured (no numbers: those are in the JSON).
      argv: the benchmark's arguments (``benchmarks/<script> ...``) that ``run_all.py``
        runs; empty for a section generated from other files.
      compiled: True when the benchmark compiles for a TPU/GPU target (``run_all.py
        --compiled``), False for a measurement.
      device: True when it measures the accelerator of the machine it runs on
        (``run_all.py --device``, on that machine), False for a CPU measurement.
      generate: for a generated section, the function returning its Markdown body.
    """

    name: str
    question: str
    what: str
    argv: tuple[str, ...] = ()
    compiled: bool = False
    device: bool = False
    generate: Callable[[], str] | None = None


def _compile_table() -> str:
    sys.path.insert(0, str(HERE))
    import compile_table

    return (
        "`python benchmarks/compile_table.py run` compiles each (run, target) pair with "
        "`moe-jax compile --no_eval` into `benchmarks/compile_reports/`; "
        "`python benchmarks/compile_table.py table` prints this table from those reports. "
        "Machine: each target compiled on a 2-core x86_64 CPU (no chip ran it). `code`: the "
        "commit whose code compiled the row (`+changes`: with uncommitted changes to `moe_jax/` "
        "or `gin/`).\n\n" + compile_table.table() + _older_code_note(compile_table)
    )


# The commit (and its date) from which `moe-jax compile` counts each collective once
# (moe_jax/compile/collectives.py).
COLLECTIVES_COUNTED_ONCE = ("2026-11-25T22:16:30+00:00", "1c11bc6")


def _older_code_note(compile_table: types.ModuleType) -> str:
    """Which rows were compiled from older code than the newest rows, and what that means."""

    def listed(older: dict[str, list[str]]) -> str:
        return "; ".join(f"{target}: {', '.join(runs)}" for target, runs in older.items())

    (newest_date, newest), (counted_date, counted) = (
        compile_table.newest_code(),
        COLLECTIVES_COUNTED_ONCE,
    )
    older, uncounted = (compile_table.older_than(d) for d in (newest_date, counted_date))
    note = ""
    if older:
        note += (
            f"\n\n- Rows compiled from older code than `{newest}` ({listed(older)}) predate "
            "later changes to the model and its compiled step (CHANGELOG). "
            "`compile_table.py run --force --only RUN__TARGET` recompiles a row."
        )
    if uncounted:
        note += (
            f"\n- Rows compiled before `{counted}` ({listed(uncounted)}) "
            "counted every collective instruction of the HLO text: on TPU each piece of an "
            "asynchronous collective split over a chain of fusions (start, continuation "
            "fusions, done) counted once, so the all-gathers (possibly the "
            "collective-permutes) of their FSDP Base rows are over-counted. `moe-jax compile` "
            "now counts each collective once, with the bytes moved per device that "
            "`moe_jax/compile/collectives.py` defines."
        )
    return note


def _moe_vs_dense() -> str:
    """The T5-Base MoE train step against its FLOP-matched dense step, per target."""
    sys.path.insert(0, str(HERE))
    import compile_table

    lines = [
        "| target | `base_learned` step, estimate (compiled, not run) | `base_dense` step, "
        "estimate (compiled, not run) | MoE / dense | bytes accessed per device, MoE / dense |",
        "|---|---|---|---|---|",
    ]
    for target in compile_table.TARGETS:
        reports = []
        for run in ("base_learned", "base_dense"):
            path = compile_table.report_path(run, target)
            if not path.exists():
                break
            reports.append(json.loads(path.read_text())["steps"]["train"])
        if len(reports) < 2 or any(r["estimate"] is None for r in reports):
            continue
        moe, dense = reports
        ratio = moe["estimate"]["step_s"] / dense["estimate"]["step_s"]
        traffic = [r.get("hlo_bytes_accessed_per_device") for r in reports]
        traffic_cell = (
            f"{traffic[0] / 2**30:.1f} / {traffic[1] / 2**30:.1f} GiB" if all(traffic) else "-"
        )
        lines.append(
            f"| {target} | {moe['estimate']['step_s'] * 1e3:.1f} ms | "
            f"{dense['estimate']['step_s'] * 1e3:.1f} ms | {ratio:.3f}x | {traffic_cell} |"
        )
    return (
        "From the reports of the table below (`python benchmarks/compile_table.py run "
        "--only base_`): roofline estimates of executables compiled for each target on a "
        "2-core x86_64 CPU, bfloat16 activations with FSDP, batch 256 x 512/114, Adam. "
        "GPU executables compiled without a GPU have no cost analysis: their HBM term counts "
        "the bytes of the HLO text (the traffic column is XLA's count). A roofline cannot "
        "see contention or kernel efficiency: the section 'Measured on an accelerator' has the "
        "measured steps (one H200: MoE / dense 1.09x).\n\n" + "\n".join(lines)
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _ratio(part: float | None) -> str:
    return "-" if part is None else f"{part:.1%}"


def _accelerator_runs(measured: dict) -> list[str]:
    """The tables of one device's ``accelerator_step.py`` JSON."""
    phases, versus, kernels = [], [], []
    for r in measured["runs"]:
        ph = r.get("phases_s", {})
        done = [
            f"{ph['gin'] + ph['setup']:.1f}" if "setup" in ph else "-",
            *(f"{ph[k]:.1f}" if k in ph else "-" for k in ("compile", "init_state")),
            f"{ph['first_step']:.2f}" if "first_step" in ph else "-",
        ]
        if "error" in r:  # the phases it finished, then why it stopped
            phases.append([r["run"], "-", *done, f"failed: {r['error']}", "-", "-", "-"])
            continue
        step, est = r["step_s"], r["estimate"]
        lengths = r["task_feature_lengths"]
        phases.append(
            [
                r["run"],
                f"{r['batch_size']} x {lengths['inputs']}/{lengths['targets']}",
                *done,
                f"{step['min'] * 1e3:.1f} / {step['median'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                _ratio(r["mfu"]["of_peak"]),
                _ratio(r["mfu"]["of_matmul"]),
            ]
        )
        memory = r["memory"]
        versus += [
            [
                r["run"],
                "estimate (compiled, not run)",
                f"{est['step_s'] * 1e3:.1f} ({' + '.join(est['covers'])})",
                f"{est['tokens_per_s']:,.0f}",
                f"{_gib(memory['compiled_total_bytes'])} (compiled total)",
            ],
            [
                r["run"],
                "measured",
                f"{step['median'] * 1e3:.1f} (median of {step['steps']})",
                f"{r['tokens_per_s']:,.0f}",
                "unknown (the backend keeps no memory stats)"
                if memory["peak_bytes_in_use"] is None
                else f"{_gib(memory['peak_bytes_in_use'])} (peak in use)",
            ],
            [r["run"], "measured / estimate", f"{r['measured_over_estimate']:.1f}x", "", ""],
        ]
        for k in (r.get("profile") or {}).get("kernels", [])[:5]:
            name = k["name"] if len(k["name"]) <= 60 else k["name"][:57] + "..."
            kernels.append(
                [r["run"], f"`{name}`", str(k["count"]), f"{k['ms']:.2f}", f"{k['share']:.0%}"]
            )
    tables = [
        "Phases to the first step (seconds), step time, tokens/s and model FLOPs per second "
        "as a fraction of the chip's peak and of a bf16 matmul measured in the same process:",
        markdown_table(
            [
                "run",
                "batch x lengths",
                "gin + setup",
                "compile",
                "init_state",
                "first step",
                "step min / median (ms)",
                "tokens/s",
                "MFU of peak",
                "of bf16 matmul",
            ],
            phases,
        ),
        "The compile report's roofline estimate for this device beside the measurement "
        "(memory per device, GiB):",
        markdown_table(["run", "", "step (ms)", "tokens/s", "memory (GiB)"], versus),
    ]
    notes = [f"- {r['run']}: {r['note']}" for r in measured["runs"] if r.get("note")]
    notes += [f"- {reading}" for reading in measured.get("notes", [])]
    if notes:
        tables.append("\n".join(notes))
    if kernels:
        tables += [
            "Where the time goes (one traced step; the five longest kernels by total time):",
            markdown_table(["run", "kernel", "count", "ms", "share"], kernels),
        ]
    layers = measured.get("layers") or {}
    if layers.get("rows"):
        dense_rate = {
            row["experts"]: row["useful_tflops"]
            for row in layers["rows"]
            if row["impl"] == "dense FFN" and "error" not in row
        }
        rows = [
            [
                str(row["experts"]),
                row["impl"],
                row.get("error", f"{row['ms']:.2f}"),
                "" if "error" in row else f"{row['vs_dense']:.2f}x",
                "" if "error" in row else f"{row['useful_tflops']:.3g}",
                ""
                if "error" in row or row["experts"] not in dense_rate
                else f"{row['useful_tflops'] / dense_rate[row['experts']]:.2f}",
                "" if "error" in row else f"{row['of_matmul']:.0%}",
            ]
            for row in layers["rows"]
        ]
        tables += [
            "The MoE layer's forward + backward per implementation (`moe_layer.device_table`: "
            "64 x 512 tokens, d_model 768, d_ff 2048, top-2, capacity factor 1.25, bfloat16) "
            "against a dense FFN of the same useful FLOPs and a bfloat16 8192^3 matmul, timed "
            "in the same rounds; both measures: the time against the dense FFN, and the useful "
            "rate against the dense FFN's (dropless computes every assignment, 1.6x the "
            "capacity layer's rows, so its time ratio cannot reach 1):",
            markdown_table(
                [
                    "E",
                    "impl",
                    "ms",
                    "time vs dense FFN",
                    "useful TFLOP/s",
                    "of dense FFN rate",
                    "of matmul rate",
                ],
                rows,
            ),
        ]
    elif layers.get("error"):
        tables.append(f"MoE layer: {layers['error']}.")
    return tables


def _accelerator() -> str:
    """The accelerator section: every non-quick, non-CPU ``benchmarks/accelerator/*.json``."""
    measured = [json.loads(p.read_text()) for p in sorted(ACCELERATOR.glob("*.json"))]
    measured = [
        m for m in measured if not m["quick"] and m["device"] and not m["device"].endswith("(cpu)")
    ]
    if not measured:
        return (
            f"Not yet measured. On a machine with an accelerator: `{ACCELERATOR_COMMAND}`, "
            "then `python benchmarks/report.py` (`benchmarks/gpu_session.sh` does it all in "
            'one call on a GPU machine without gin-config; docs/training.md, "Measured and '
            'estimated step time").'
        )
    parts = []
    for m in measured:
        parts.append(f"Device: {m['device']}, {m['date']}. Command: `{m['command']}`.")
        parts += _accelerator_runs(m)
    return "\n\n".join(parts)


SECTIONS: tuple[Section, ...] = (
    Section(
        "checksums",
        "Checkpoint integrity: what the CRC32C of every file costs",
        "Seconds per GiB to compute the integrity record (size and CRC32C of every file, what "
        "`train` writes after each save and checks before each restore, locally) beside a plain "
        "read of the same bytes, on 64 MiB files in the page cache.",
        ("checksums.py", "--gib", "1"),
    ),
    Section(
        "synthetic_quick",
        "Synthetic quick suite: wall time",
        "`moe-jax synthetic <experiment> --preset quick` for every experiment of the suite, "
        "compile included.",
        ("synthetic_suite.py", "--preset", "quick", "--seeds", "0,1"),
    ),
    Section(
        "synthetic_converged",
        "Synthetic converged suite: wall time",
        "The same with `--preset converged` (each run trained until its training loss stops "
        "moving), 3 seeds vmapped in every experiment.",
        ("synthetic_suite.py", "--preset", "converged", "--seeds", "0,1,2"),
    ),
    Section(
        "moe_layer_cpu",
        "MoE layer on CPU: dispatch against the einsum reference and the matmul rate",
        "Forward + backward of `MoeLayer` for both dispatches beside a dense FFN of equal "
        "useful FLOPs and a 2048^3 float32 matmul timed in the same rounds.",
        ("moe_layer.py", "--reps", "10"),
    ),
    Section(
        "moe_layer_accelerator",
        "MoE layer on an accelerator: each implementation against a dense FFN (measured)",
        "Forward + backward (`value_and_grad` of `sum(y * r)`) of `MoeLayer` at the shape of "
        "the GPU measurements of docs/moe.md (64 x 512 tokens, d_model 768, d_ff 2048, top-2, "
        "capacity factor 1.25, groups of 4096, bfloat16 activations, float32 parameters) for "
        "each implementation (`einsum`, `sort`, dropless with each grouped matmul) beside a "
        "dense ReLU FFN of the capacity layer's useful FLOPs and a bfloat16 8192^3 matmul, "
        "timed in the same rounds on the machine's accelerator (`measure_layers`); the last "
        "column compares outputs and gradients with the reference implementation's.",
        (
            "moe_layer.py",
            "--device",
            "--impls",
            "einsum",
            "sort",
            "dropless:mosaic_gpu",
            "dropless:triton",
            "dropless:xla",
        ),
        device=True,
    ),
    Section(
        "matmul_shapes",
        "The expert matmuls alone (CPU)",
        "Each of the six matmuls of one expert's forward + backward (640 x 768 x 2048 at "
        "T5-Base, E = 8) and of the dense FFN of equal useful FLOPs, as a share of the "
        "2048^3 rate: what the layer would reach if it were only its matmuls.",
        ("matmul_shapes.py",),
    ),
    Section(
        "moe_layer_options",
        "Routing options against plain top-2 (CPU)",
        "The MoE layer step at T5-Base, E = 8, `sort`, with each routing option of "
        "docs/moe.md; time, useful FLOPs and XLA's compiled FLOPs and bytes, as ratios to "
        "plain top-2.",
        ("moe_layer.py", "--options", "--reps", "5"),
    ),
    Section(
        "t5_train_step",
        "T5 train step: MoE against its FLOP-matched dense model (CPU)",
        "One jitted train step (forward, backward, Adam) of the MoE T5 next to the dense "
        "model with the same FLOPs per token.",
        ("t5_train_step.py",),
    ),
    Section(
        "input_pipeline",
        "Input pipeline throughput (CPU)",
        "The seqio training iterator on the embedded corpus: start-up, packed rows and tokens "
        "per second, resumption.",
        ("input_pipeline.py",),
    ),
    Section(
        "smoke_start",
        "Smoke run: time to the first step",
        "Seconds from the start of `moe-jax smoke --gin.TRAIN_STEPS=2` to its first line of "
        "output, its first finished training step and its end, in a fresh process on a "
        "(pseudo-)terminal with an empty JAX compilation cache (cold) and again with the "
        "cache the first run filled (warm).",
        ("smoke_start.py", "--steps", "2"),
    ),
    Section(
        "train_loop",
        "Train loop: loss checked one step late against every step (CPU)",
        "Steps per second of `moe-jax train`'s loop on the smoke config with both loss checks, "
        "alternated in one process.",
        ("train_loop.py", "--steps", "150", "--rounds", "2", "--devices", "8"),
    ),
    Section(
        "moe_compiled_tpu",
        "MoE layer compiled for a TPU v5p chip",
        "The MoE layer's forward + backward compiled for one chip: FLOPs, bytes, temporaries "
        "and roofline against a dense FFN of equal FLOPs; three models of time; where the "
        "excess bytes go.",
        ("moe_compiled.py", "--target", "tpu:v5p:2x2x1", "--breakdown"),
        compiled=True,
    ),
    Section(
        "moe_compiled_gpu",
        "MoE layer compiled for an H100",
        "The same layer and step compiled for one H100 SXM.",
        ("moe_compiled.py", "--target", "gpu:h100"),
        compiled=True,
    ),
    Section(
        "moe_compiled_expert_parallel",
        "Expert parallelism compiled for an 8-GPU node and v5p slices",
        "The layer with its experts split over the devices of the target: all-to-alls, bytes "
        "sent, overlap with compute, and dropless (padded or ragged) exchange. Bytes sent: "
        "the collective bytes of `moe_jax/compile/collectives.py` (an all-to-all's operands, "
        "a ragged all-to-all's first operand), the count `moe-jax compile` reports.",
        (
            "moe_compiled.py",
            "--target",
            "gpu:h100:8",
            "--experts",
            "8",
            "64",
            "--dispatch",
            "sort",
            "einsum",
            "--expert-parallel",
            "8",
        ),
        compiled=True,
    ),
    Section(
        "moe_compiled_options",
        "Routing options compiled for H100 and v5p",
        "Each routing option's compiled FLOPs and bytes as ratios to plain top-2.",
        ("moe_compiled.py", "--target", "gpu:h100", "--options"),
        compiled=True,
    ),
    Section(
        "moe_compiled_sort_gpu",
        "The `sort` dispatch compiled for an H100: bytes and indexed operations",
        "Forward + backward of the `sort` layer (T5-Base shape, 8 x 512 tokens in one group, "
        "bfloat16 compute, the weights as the train step passes them: bfloat16 compute copies) "
        "compiled for one H100 from a CPU host beside a "
        "dense FFN of equal expert-matmul FLOPs; the last column counts the gather, scatter "
        "and sort operations of the compiled step.",
        ("moe_compiled.py", "--target", "gpu:h100", "--dispatch", "sort", "--breakdown"),
        compiled=True,
    ),
    Section(
        "scan_layers",
        "Scanned layers: compile and init time",
        "The T5-Base train step compiled for a TPU slice and for 8 CPU devices, and the "
        "initial state's program compiled and run on 8 CPU devices, with unrolled layers "
        "(the default) and scanned layers (`SCAN_LAYERS=True`), each in a fresh process "
        "without the compilation cache, the two forms one after the other in one invocation; "
        "with parameter counts and bytes per device of both.",
        ("scan_layers.py", "--target", "tpu:v5p:2x2x4"),
        compiled=True,
    ),
    Section(
        "layer_forms",
        "Scanned layers and remat: the train step's work per step, loops counted per trip",
        "The T5-Base train step compiled for a TPU slice and for one H100 in four forms "
        "(layers unrolled or scanned, no remat or `'minimal'`), each in a fresh process, and "
        "read from its optimised HLO with every loop body counted once per trip (XLA's cost "
        "analysis counts a body once): memory per device, matmul TFLOP, bytes of device "
        "memory read and written, and on the TPU the sum of its compiler's estimated cycles, "
        "each against the default form (unrolled, no remat). Estimates from the compiled "
        "programs, not step times.",
        ("layer_forms.py",),
        compiled=True,
    ),
    Section(
        "step_traffic",
        "Train step compiled for one H100: device-memory traffic by part",
        "The default train step (layers unrolled, no remat, bfloat16 activations, Adam) of "
        "T5-Base dense at batch 32 x 512/114 and of Figure 5's dense d32 model at batch 256, "
        "with XLA's attention (the default) and with the project's Pallas flash-attention "
        "kernel, compiled for one H100 and read from its optimised HLO: "
        "bytes of device memory read and written per step (each operand read once, each "
        "result written once, slices and gathers as taken), split by the part of the model "
        "that moves them, beside the memory per device and the roofline estimate. Estimates "
        "from the compiled programs, not step times.",
        ("step_traffic.py",),
        compiled=True,
    ),
    Section(
        "init_program",
        "The initial state's program compiled for a GPU: threefry inlined or one kernel",
        "The program `TrainSetup.init_state` runs (T5-Base dense and MoE at batch 32, one "
        "H100), compiled for the GPU on a CPU host as a GPU machine's host compiles it, each "
        "in a fresh process without the compilation cache: with threefry's rounds inlined "
        "(JAX's default) and as `init_state` lowers it (`hardware.init_program_config`: one "
        "call of jaxlib's CUDA threefry kernel per random array, the same function), unrolled "
        "and scanned layers; with the optimized program's instruction count.",
        ("init_program.py", "--target", "gpu:h100:1"),
        compiled=True,
    ),
    Section(
        "moe_vs_dense_compiled",
        "T5-Base MoE train step against the FLOP-matched dense step, compiled",
        "Roofline step time of the whole train step on each target.",
        generate=_moe_vs_dense,
    ),
    Section(
        "accelerator",
        "Measured on an accelerator",
        "The documented runs' train step (`builders.build_train_setup`, what `moe-jax train` "
        "runs; random token batches) measured on the device named, next to the compile "
        "report's roofline estimate for that device: phases to the first step, step time, "
        "tokens/s, MFU against the chip's peak and a bf16 matmul, peak memory against the "
        "compiled total; and the MoE layer per dispatch (`benchmarks/accelerator_step.py`).",
        generate=_accelerator,
    ),
    Section(
        "compile_table",
        "Documented runs on their targets",
        "Every documented run (Figure 5, Figure 7, Base; two Base memory variants on v5e) "
        "compiled for its targets: fit, memory per device, collectives, roofline step. "
        "Numbers of the executables and the chip table (`moe_jax.hardware.CHIPS`), not "
        "measurements on hardware.",
        generate=_compile_table,
    ),
)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (cells as given)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_tables(text: str) -> list[dict[str, list]]:
    """The Markdown tables of a script's output: ``[{"columns": [...], "rows": [[...]]}]``.

    A table is a run of lines starting with ``|`` whose second line is the ``---``
    separator; a row's cells are stripped.
    """
    tables, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and set(lines[i + 1].replace("|", "").replace(" ", "")) <= set("-:")
            and "-" in lines[i + 1]
        ):
            columns, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append({"columns": columns, "rows": rows})
        else:
            i += 1
    return tables


def render_section(section: Section) -> str:
    """One section of RESULTS.md: heading, what is measured, command and machine, tables."""
    head = f"## {section.question}\n\n{section.what}"
    if section.generate is not None:
        return f"{head}\n\n{section.generate()}\n"
    path = RESULTS / f"{section.name}.json"
    if not path.exists():
        return (
            f"{head}\n\nNot measured yet: `python benchmarks/run_all.py --only {section.name}`.\n"
        )
    result = json.loads(path.read_text())
    parts = [
        head,
        f"Command: `{result['command']}`. Machine: {result['machine']}, {result['date']}.",
    ]
    parts += [markdown_table(t["columns"], t["rows"]) for t in result["tables"]]
    if result.get("notes"):
        parts.append("\n".join(f"- {note}" for note in result["notes"]))
    return "\n\n".join(parts) + "\n"


def render() -> str:
    """The whole of benchmarks/RESULTS.md."""
    intro = (
        "# Benchmark results\n\n"
        "Generated by `python benchmarks/report.py` from the JSON in `benchmarks/results/` and\n"
        "`benchmarks/compile_reports/`; do not edit by hand. `make bench` reruns the CPU\n"
        "benchmarks on this machine and regenerates the file (`make bench-compiled` the\n"
        "compiled-target ones). Each section gives the command that reproduces it and the\n"
        "machine it ran on. CPU rates are only comparable within one run: ratios are measured\n"
        "side by side. Compiled-target numbers come from executables compiled for the target\n"
        "(memory analysis, cost analysis, HLO) and a roofline model, not from a chip.\n"
    )
    toc = "\n".join(f"- [{s.question}](#{_anchor(s.question)})" for s in SECTIONS)
    return intro + "\n" + toc + "\n\n" + "\n".join(render_section(s) for s in SECTIONS)


def _anchor(heading: str) -> str:
    from pymdownx.slugs import slugify

    return slugify(case="lower")(heading, "-")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when RESULTS.md is not the report"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(
                f"{OUTPUT} differs from `python benchmarks/report.py`; regenerate it",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
