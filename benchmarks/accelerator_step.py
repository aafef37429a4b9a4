"""The documented runs' train step measured on whatever accelerator is present, beside the
compile report's estimate for it; and the MoE layer's forward + backward per dispatch.

    python benchmarks/accelerator_step.py --out accelerator.json            # every run
    python benchmarks/accelerator_step.py --runs base_dense,base_learned --steps 20
    python benchmarks/accelerator_step.py --quick --out /tmp/quick.json     # tiny, CPU
    python benchmarks/accelerator_step.py --runs base_learned --profile /tmp/trace
    benchmarks/gpu_session.sh                 # all of it in one call on a bare GPU machine

Each run is the project's own train step (``configured.train_setup``: what
``moe-jax train`` runs) of a documented run's gin files, fed random token batches (no
dataset, no seqio or TensorFlow: jax, flax, optax, orbax and gin-config suffice) on the
first device. Each run goes in a fresh process (so that peak memory is its own) and
reports:

- the phases to the first step: gin (parse, model), setup (abstract state, shardings),
  compile (``.lower().compile()`` through ``moe_jax.compile.aot.compile_train``, the
  compile report's own path), ``init_state()``, the first step;
- step time min / median over ``--steps`` steps, tokens/s (encoder + decoder positions);
- model FLOPs per step (``EncoderDecoderModel.flops_per_step``, active experts only) as a
  fraction of the chip's peak (``moe_jax.hardware.CHIPS``; unknown on CPU) and of a bf16
  ``n^3`` matmul measured in the same process;
- peak device memory (``memory_stats()['peak_bytes_in_use']`` where the backend has it)
  against the compiled executable's total (arguments + outputs - aliased + temporaries);
- the compile report's roofline estimate for this device beside the measured step.

``--profile DIR`` traces one extra step per run (``jax.profiler.trace``) and adds the
device's top kernels by time, read from the trace. The MoE layer section times each
implementation (einsum, sort, dropless with the platform's grouped matmul) against a dense
FFN of the same useful FLOPs (``moe_layer.device_table``; :func:`layer_rows`). ``--quick``
shrinks every model (``models/size_tiny.gin``, short sequences, batch 4) so that the whole
benchmark runs on a CPU in seconds: the structure is checked by the tests, the numbers mean
nothing (on a CPU it also compiles with XLA's cheapest code generation). The ``*_cudnn``
and ``*_pallas`` runs are skipped where an earlier run found no GPU (the report's
``skipped``). Each run's JSON lists which of the packages a bare accelerator machine
lacks (TensorFlow, seqio, TFDS, clu, google-crc32c) it imported: none.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gzip
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Run:
    """A documented run: its gin files and the bindings this benchmark adds."""

    gin_files: tuple[str, ...]
    bindings: tuple[str, ...] = ()
    note: str = ""


RUNS: dict[str, Run] = {
    "base_dense": Run(
        ("experiments/base_dense.gin",),
        ("BATCH_SIZE = 32",),
        "batch 32 on one device (the run's 256 is sized for a multi-device mesh)",
    ),
    "base_learned": Run(
        ("experiments/base_learned.gin",),
        ("BATCH_SIZE = 32",),
        "batch 32 on one device (the run's 256 is sized for a multi-device mesh)",
    ),
    "fig5_learned": Run(("experiments/fig5_learned.gin",)),
    "fig5_frozen": Run(("experiments/fig5_frozen.gin",)),
    "fig5_dense": Run(("experiments/fig5_dense.gin",)),
}
# Each run again with a fused attention kernel (``T5Config.attention_kernel``; NVIDIA GPUs):
# cuDNN's, and the project's Pallas (Triton) flash kernel.
FUSED_ATTENTION = {
    "cudnn": "cuDNN fused attention",
    "pallas": "the Pallas flash-attention kernel",
}
RUNS.update(
    {
        f"{name}_{kernel}": dataclasses.replace(
            run,
            bindings=(*run.bindings, f"T5Config.attention_kernel = '{kernel}'"),
            note="; ".join(filter(None, (run.note, what))),
        )
        for name, run in list(RUNS.items())
        for kernel, what in FUSED_ATTENTION.items()
    }
)
# The Base pair again with scanned layers (``T5Config.scan_layers``), without and with
# 'minimal' remat (the step times that decide where scanning is worth turning on), and
# with the attention logits in bfloat16 (float32 by default, as T5X: their matmuls and
# gradients run as float32 GEMMs).
BASE_VARIANTS = {
    "scanned": ("SCAN_LAYERS = True",),
    "scanned_minimal": ("SCAN_LAYERS = True", "REMAT_POLICY = 'minimal'"),
    "bf16_logits": ("T5Config.float32_attention_logits = False",),
}
RUNS.update(
    {
        f"{name}_{form}": dataclasses.replace(
            RUNS[name],
            bindings=(*RUNS[name].bindings, *bindings),
            note="; ".join(filter(None, (RUNS[name].note, " and ".join(bindings)))),
        )
        for name in ("base_dense", "base_learned")
        for form, bindings in BASE_VARIANTS.items()
    }
)
# --quick: every model at the tiny test shape, short sequences, small batch, float32.
QUICK_GIN_FILES = ("models/size_tiny.gin",)
QUICK_BINDINGS = (
    "VOCAB_SIZE = 256",
    "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}",
    "BATCH_SIZE = 4",
    "ACTIVATION_DTYPE = 'float32'",
)
# --quick on a CPU: XLA's cheapest code generation (compiles 2-3x faster; the numbers of a
# quick run mean nothing anyway).
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
LAYERS = "moe_layer"  # the name of the MoE layer section in --runs
MIN_RUN_S = 30.0  # --budget: a run with less time left than this is skipped, not started
# What a bare accelerator machine lacks: none of it may be imported by a run.
NOT_IMPORTED = ("tensorflow", "seqio", "tensorflow_datasets", "clu", "google_crc32c")


# ----------------------------------------------------------------------------- one run


def random_batch(abstract: dict[str, Any], vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """A batch of uniformly random tokens laid out like ``abstract`` (``builders.abstract_batch``:
    shapes, dtypes, shardings): one packed segment per row, decoder inputs the targets
    shifted right, every target weighted."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    enc = abstract["encoder_input_tokens"].shape
    dec = abstract["decoder_input_tokens"].shape
    targets = rng.integers(2, vocab_size, dec)
    values = {
        "encoder_input_tokens": rng.integers(2, vocab_size, enc),
        "decoder_target_tokens": targets,
        "decoder_input_tokens": np.concatenate([np.zeros((dec[0], 1), int), targets[:, :-1]], 1),
        "decoder_loss_weights": np.ones(dec),
        "encoder_segment_ids": np.ones(enc),
        "decoder_segment_ids": np.ones(dec),
        "encoder_positions": np.broadcast_to(np.arange(enc[1]), enc),
        "decoder_positions": np.broadcast_to(np.arange(dec[1]), dec),
    }
    return {
        name: jax.device_put(values[name].astype(spec.dtype), spec.sharding)
        for name, spec in abstract.items()
    }


# Steps traced back to back with --profile: the idle time between steps shows beside the
# idle time inside them.
PROFILED_STEPS = 3


def dispatch_ahead(compiled: Any, state: Any, batch: Any, steps: int) -> tuple[Any, Any, list]:
    """Runs ``steps`` steps as the train loop does: each step is dispatched before the
    previous one's metrics are waited for (one step in flight, no other sync). Returns the
    state, the last metrics and the time between consecutive steps' completions."""
    import jax

    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    last, times = time.perf_counter(), []
    for _ in range(steps):
        state, next_metrics = compiled(state, batch)
        jax.block_until_ready(metrics)  # the previous step (already done but the first)
        metrics = next_metrics
        now = time.perf_counter()
        times.append(now - last)
        last = now
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - last)
    return state, metrics, times[1:]


def top_kernels(trace_dir: str, limit: int = 15) -> dict[str, Any]:
    """The device's kernels by total time in the ``jax.profiler.trace`` output under
    ``trace_dir``: the complete ("X") events of the processes named ``/device:...``, grouped
    by name, with their count, total milliseconds, share of the summed kernel time and the
    launch shape (``args.kernel_details``) of the first occurrence; and how busy the device
    was over the traced steps (``profiling.device_timeline``: busy against span, the longest
    idle gaps). Empty where the trace has no device process (CPU)."""
    from moe_jax.runtime import profiling

    path = profiling.trace_file(trace_dir)
    if path is None:
        return {"trace": None, "device_kernel_ms": 0.0, "kernels": []}
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    timeline = profiling.device_timeline(events)
    devices = profiling.device_processes(events)
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    details: dict[str, str] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            total[e["name"]] += e.get("dur", 0.0)
            count[e["name"]] += 1
            details.setdefault(e["name"], str(e.get("args", {}).get("kernel_details", "")))
    summed = sum(total.values())
    return {
        "trace": str(path),
        "device_kernel_ms": summed / 1e3,
        "steps": PROFILED_STEPS,
        "span_ms": timeline.span_ms,
        "busy_ms": timeline.busy_ms,
        "busy_fraction": timeline.busy_fraction,
        "gaps": [dataclasses.asdict(g) for g in timeline.gaps],
        "kernels": [
            {
                "name": name,
                "count": count[name],
                "ms": us / 1e3,
                "share": us / summed,
                "kernel_details": details[name],
            }
            for name, us in total.most_common(limit)
        ],
    }


def measure_run(
    name: str,
    *,
    quick: bool,
    steps: int,
    matmul_n: int,
    profile: str | None,
    partial: pathlib.Path,
) -> dict[str, Any]:
    """Phases, step times, rates, memory and the compile report's estimate of one run.
    After each phase the phases so far are written to ``partial``, which is what a run
    stopped by its timeout leaves."""
    import jax

    from moe_jax import hardware
    from moe_jax.compile import aot
    from moe_jax.runtime import builders, configured, gin_flags

    run = RUNS[name]
    phases: dict[str, float] = {}

    def done(phase: str, seconds: float) -> None:
        phases[phase] = seconds
        partial.write_text(json.dumps({"phases_s": phases}))

    start = time.perf_counter()
    argv = [f"--gin_file={f}" for f in run.gin_files + (QUICK_GIN_FILES if quick else ())]
    bindings = run.bindings + (QUICK_BINDINGS if quick else ())
    argv += [f"--gin_bindings={b}" for b in bindings]
    args = gin_flags.parse_flags(builders.build_parser("accelerator_step", ""), argv)
    aot.parse_gin_for_compile(args)
    train_args = aot.train_bindings()
    model, cfg = train_args["model"], train_args["train_dataset_cfg"]
    done("gin", time.perf_counter() - start)

    start = time.perf_counter()
    devices = jax.devices()[:1]  # one chip: the rates below are per chip
    ctx = configured.run_context(devices=devices)
    setup = configured.train_setup(
        model, cfg.input_shapes(), ctx, seed=train_args.get("random_seed", 0)
    )
    done("setup", time.perf_counter() - start)

    chip = hardware.chip_of_device_kind(devices[0].device_kind)
    facts = hardware.device_facts(devices)
    compiled, report = aot.compile_train(setup, cfg, model, facts)
    if compiled is None:
        raise RuntimeError(f"{name}: does not fit: {report.get('compiler_error')}")
    done("compile", report["compile_s"])

    start = time.perf_counter()
    state = jax.block_until_ready(setup.init_state())
    done("init_state", time.perf_counter() - start)

    abstract = builders.abstract_batch(ctx, cfg.input_shapes(), cfg.pack)
    batch = random_batch(abstract, model.module.config.vocab_size)
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    done("first_step", time.perf_counter() - start)

    blocking = []  # each step waited for before the next is dispatched
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        blocking.append(time.perf_counter() - start)
    state, metrics, times = dispatch_ahead(compiled, state, batch, steps)
    median = statistics.median(times)
    stats = devices[0].memory_stats() or {}  # before the reference matmul allocates
    kernels = None
    if profile:
        trace_dir = os.path.join(profile, name)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            state, metrics, _ = dispatch_ahead(compiled, state, batch, PROFILED_STEPS)
        kernels = top_kernels(trace_dir)

    shapes = cfg.input_shapes()
    tokens = sum(b * length for b, length in shapes.values())
    flops = report["flops_per_step"]
    matmul = hardware.measured_matmul_flops(matmul_n, repeats=10, dtype="bfloat16")
    peak = chip.peak_bf16_flops if chip else None
    estimate = report["estimate"]
    return {
        "run": name,
        "note": run.note,
        "gin_files": list(args.gin_file),
        "bindings": list(bindings),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "devices": len(devices),
        "jax": jax.__version__,
        "parameters": sum(math.prod(p.shape) for p in jax.tree.leaves(setup.abstract_state.params)),
        "batch_size": cfg.batch_size,
        "task_feature_lengths": dict(cfg.task_feature_lengths),
        "tokens_per_step": tokens,
        "activation_dtype": model.module.config.activation_dtype_name,
        "phases_s": phases,
        "step_s": {"min": min(times), "median": median, "steps": len(times), "all": times},
        "step_s_blocking": {"min": min(blocking), "median": statistics.median(blocking)},
        "tokens_per_s": tokens / median,
        "final_loss": float(metrics["loss"]),
        "model_flops_per_step": flops,
        "matmul": {"n": matmul_n, "dtype": "bfloat16", "flops_per_s": matmul},
        "peak_flops_per_s": peak,
        "mfu": {
            "of_peak": flops / median / peak if peak else None,
            "of_matmul": flops / median / matmul,
        },
        "memory": {
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "compiled_total_bytes": report["bytes"]["total"],
            "compiled_temporaries_bytes": report["bytes"]["temporaries"],
            "device_bytes": facts.hbm_bytes,
        },
        "estimate": {
            **estimate,
            "peak_flops_per_s": facts.peak_flops,
            "peak_is_measured": chip is None,
            "hlo_flops_per_device": report["hlo_flops_per_device"],
            "hlo_bytes_accessed_per_device": report["hlo_bytes_accessed_per_device"],
            # the HLO text's work with every loop body once per trip (scanned layers)
            "per_step": report["per_step"],
        },
        "measured_over_estimate": median / estimate["step_s"],
        "profile": kernels,
    }


# ----------------------------------------------------------------------------- MoE layer


LAYER_IMPLEMENTATIONS = ("einsum", "sort", "dropless", "dropless:xla")
# The grouped-matmul kernels measured where the device has them: tokamax's, and on GPU the
# project's Pallas (Triton) kernel.
KERNEL_IMPLEMENTATIONS = {
    "gpu": ("dropless:triton", "dropless:pallas"),
    "tpu": ("dropless:mosaic_tpu",),
}


def layer_rows(quick: bool, reps: int) -> list[dict[str, Any]]:
    """The MoE layer's forward + backward per implementation beside a dense FFN of the same
    useful FLOPs and a matmul, timed in the same rounds: ``moe_layer.device_table`` (64 x
    512 tokens at T5-Base width, bfloat16, E = 8 / 32 / 64; ``--quick``: its tiny float32
    sizes, E = 8). One row per timed run, as ``moe_layer.measure_layers`` gives them."""
    import jax
    import moe_layer

    experts = (8,) if quick else (8, 32, 64)
    kernels = KERNEL_IMPLEMENTATIONS.get(jax.devices()[0].platform, ())
    return moe_layer.device_table(experts, (*LAYER_IMPLEMENTATIONS, *kernels), quick, reps)


def measure_layers(quick: bool, reps: int) -> dict[str, Any]:
    """The MoE layer section: its rows and the device they ran on."""
    import jax

    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "rows": layer_rows(quick, reps),
    }


# ----------------------------------------------------------------------------- driver


def child_main(name: str, out: str, args: argparse.Namespace) -> None:
    """Measures one run (or the layer section) in this process and writes its JSON."""
    if name == LAYERS:
        result = measure_layers(args.quick, args.layer_reps)
    else:
        result = measure_run(
            name,
            quick=args.quick,
            steps=args.steps,
            matmul_n=args.matmul_n or (512 if args.quick else 8192),
            profile=args.profile,
            partial=pathlib.Path(out + ".partial"),
        )
    result["imported_of_not_needed"] = [m for m in NOT_IMPORTED if m in sys.modules]
    pathlib.Path(out).write_text(json.dumps(result, indent=1))


def run_child(name: str, argv: Sequence[str], timeout: float, quick: bool) -> dict[str, Any]:
    """One run in a fresh process; ``{"run": name, "error": ...}`` when it fails or times out."""
    env = dict(os.environ)
    if quick:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, __file__, *argv, "--child", name, "--child_out", out]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, timeout=timeout, check=False, env=env)
            error = None if proc.returncode == 0 else f"exit status {proc.returncode} (see log)"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        if error or not os.path.exists(out):
            partial = pathlib.Path(out + ".partial")
            phases = json.loads(partial.read_text()) if partial.exists() else {}
            return {"run": name, "error": error or "no result written", **phases}
        result = json.loads(pathlib.Path(out).read_text())
        result["process_s"] = time.perf_counter() - start
        return {"run": name, **result}


def not_for_this_platform(name: str, results: Sequence[dict[str, Any]]) -> str | None:
    """Why run ``name`` cannot run where the earlier ``results`` ran, or None: the fused
    attention kernels (the ``*_cudnn`` and ``*_pallas`` runs) are NVIDIA GPU kernels
    (elsewhere the Pallas one runs in Pallas's interpreter: no step time to measure)."""
    platform = next((r["platform"] for r in results if "platform" in r), None)
    kernel = name.rsplit("_", 1)[-1]
    if kernel in FUSED_ATTENTION and platform not in (None, "gpu"):
        return f"{FUSED_ATTENTION[kernel]} needs an NVIDIA GPU (this platform: {platform})"
    return None


def device_name(results: Sequence[dict[str, Any]]) -> str | None:
    """``"1 x NVIDIA H100 80GB HBM3 (gpu)"`` from the first run that got a device."""
    for r in results:
        if "device_kind" in r:
            return f"{r.get('devices', 1)} x {r['device_kind']} ({r['platform']})"
    return None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [*RUNS, LAYERS]
    parser.add_argument(
        "--runs", default=",".join(names), help=f"comma-separated, of {', '.join(names)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models (CPU, tests)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    parser.add_argument(
        "--matmul_n", type=int, default=0, help="bf16 reference matmul size (8192; quick: 512)"
    )
    parser.add_argument("--layer_reps", type=int, default=10, help="MoE layer timing rounds")
    parser.add_argument("--profile", default=None, metavar="DIR", help="trace one step per run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    parser.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds for all runs together (0: none); a run is given what remains, and "
        f"one with less than {MIN_RUN_S:.0f} s left is skipped",
    )
    parser.add_argument("--out", default=None, metavar="FILE.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, args.child_out, args)
        return 0
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    chosen = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(names)}")
    passed = [
        *(["--quick"] if args.quick else []),
        *(["--profile", args.profile] if args.profile else []),
        f"--steps={args.steps}",
        f"--matmul_n={args.matmul_n}",
        f"--layer_reps={args.layer_reps}",
    ]
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    deadline = time.monotonic() + (args.budget or float("inf"))
    for name in chosen:
        left = deadline - time.monotonic()
        if left < MIN_RUN_S:
            results.append({"run": name, "error": "skipped: the time budget was spent"})
            continue
        if (reason := not_for_this_platform(name, results)) is not None:
            skipped[name] = reason
            print(f"[accelerator_step] {name} skipped: {reason}", file=sys.stderr, flush=True)
            continue
        print(f"[accelerator_step] {name}", file=sys.stderr, flush=True)
        results.append(run_child(name, passed, min(args.timeout, left), args.quick))
    runs = [r for r in results if r["run"] != LAYERS]
    layers = next((r for r in results if r["run"] == LAYERS), None)
    report = {
        "command": "python benchmarks/accelerator_step.py " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "device": device_name(results),
        "quick": args.quick,
        "runs": runs,
        "layers": layers,
        "skipped": skipped,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(summary(report))
    return 0 if all("error" not in r for r in results) else 1


def summary(report: dict[str, Any]) -> str:
    """A few lines per run for the terminal (the JSON has everything)."""
    lines = [f"device: {report['device']}"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"{r['run']}: {r['error']}")
            continue
        mfu = r["mfu"]
        peak = "peak unknown" if mfu["of_peak"] is None else f"{mfu['of_peak']:.1%} of peak"
        lines.append(
            f"{r['run']}: step {r['step_s']['median'] * 1e3:.1f} ms median "
            f"(estimate {r['estimate']['step_s'] * 1e3:.1f} ms), {r['tokens_per_s']:,.0f} "
            f"tokens/s, MFU {peak}, {mfu['of_matmul']:.1%} of the bf16 matmul; phases "
            + ", ".join(f"{k} {v:.1f} s" for k, v in r["phases_s"].items())
        )
        profile = r["profile"] or {}
        if profile.get("span_ms"):
            lines.append(
                f"  device busy {profile['busy_fraction']:.0%} of {profile['steps']} steps "
                f"({profile['busy_ms']:.1f} of {profile['span_ms']:.1f} ms); longest gaps: "
                + ", ".join(
                    f"{g['ms']:.2f} ms before {g['before'][:40]}" for g in profile["gaps"][:3]
                )
            )
        for k in profile.get("kernels", [])[:5]:
            lines.append(f"  {k['share']:.0%} {k['ms']:.2f} ms x{k['count']} {k['name'][:100]}")
    layers = report["layers"]
    if layers and "rows" in layers:
        lines.append("MoE layer: printed above by moe_layer.device_table")
    elif layers:
        lines.append(f"{LAYERS}: {layers['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
