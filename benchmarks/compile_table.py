"""Every documented run compiled for its documented target: the table of docs/training.md
and benchmarks/RESULTS.md ("Documented runs on their targets").

    # compile (slow: minutes each)
    python benchmarks/compile_table.py run [--only base] [--force] [--hlo_dir DIR]
    # print the markdown table
    python benchmarks/compile_table.py table
    # re-read kept HLO (parser changes)
    python benchmarks/compile_table.py recount --hlo_dir DIR

``run`` calls ``moe-jax compile --no_eval --out`` (the train step) once per (run, target)
in a fresh process, one at a time, and keeps each report as
``benchmarks/compile_reports/<run>__<target>.json``, with the code that compiled it
(``source``: the last commit that changed ``moe_jax/`` or ``gin/``; ``source_date``: its
date; the table's ``code`` column). An existing report is kept unless ``--force``;
``--hlo_dir`` keeps each pair's HLO in ``DIR/<run>__<target>/``; a failed compile leaves
``.err`` with its last lines. ``recount`` redoes what the HLO text gives (collectives, the
MoE layers' share, the roofline estimate: ``step_analysis.hlo_analysis``) for every report
whose HLO was kept, without compiling again. ``table`` renders the reports; a pair without
one is listed as not compiled. Numbers are those of the executable compiled for the
target (memory_analysis, cost_analysis, HLO) and a roofline estimate from the chip table,
not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
REPORTS = REPO / "benchmarks" / "compile_reports"

# run name -> gin flags (the documented launch: docs/lm_experiments.md, configs/*.toml)
RUNS: dict[str, list[str]] = {
    "fig5_learned": ["--gin_file=experiments/fig5_learned.gin"],
    "fig5_frozen": ["--gin_file=experiments/fig5_frozen.gin"],
    "fig5_dense": ["--gin_file=experiments/fig5_dense.gin"],
    "fig7_learned_e8": ["--gin_file=experiments/fig5_learned.gin", "--gin.NUM_EXPERTS=8"],
    "fig7_learned_e16": ["--gin_file=experiments/fig5_learned.gin", "--gin.NUM_EXPERTS=16"],
    "fig7_learned_e64": ["--gin_file=experiments/fig5_learned.gin", "--gin.NUM_EXPERTS=64"],
    "base_learned": ["--gin_file=experiments/base_learned.gin"],
    "base_frozen": ["--gin_file=experiments/base_frozen.gin"],
    "base_dense": ["--gin_file=experiments/base_dense.gin"],
    # the memory options one at a time, on the 16 GiB chip they are for
    "base_learned_no_fsdp": [
        "--gin_file=experiments/base_learned.gin",
        "--gin.partitioning.standard_logical_axis_rules.fsdp=False",
    ],
    "base_learned_remat_full": [
        "--gin_file=experiments/base_learned.gin",
        "--gin.REMAT_POLICY='full'",
    ],
}
# runs compiled only for some targets (every other run: all of TARGETS)
ONLY_ON: dict[str, tuple[str, ...]] = {
    "base_learned_no_fsdp": ("v5e-16",),
    "base_learned_remat_full": ("v5e-16",),
}
# target name -> (--target, mesh flags). v4: libtpu describes a v4 chip as 2 TensorCore
# devices (16 GiB each), so v4_32.gin's 16-device mesh is compiled on 8 chips' 16 cores:
# the same per-device program with half a megacore chip's memory (a conservative verdict).
TARGETS: dict[str, tuple[str, list[str]]] = {
    "v4-32": ("tpu:v4:2x2x2", ["--gin_file=meshes/v4_32.gin"]),
    "v5p-32": ("tpu:v5p:2x2x4", ["--gin_file=meshes/v4_32.gin"]),
    "v5p-128": ("tpu:v5p:4x4x4", ["--gin_file=meshes/v5p_128.gin"]),
    "8xH100": ("gpu:h100:8", ["--gin_file=meshes/gpu_8x_h100.gin"]),
    "v5e-16": ("tpu:v5e:4x4", ["--gin.make_mesh.mesh_shape=(1,16,1)"]),
}


def pairs() -> list[tuple[str, str]]:
    """Every (run, target) of the table, in its order."""
    return [
        (run, target) for run in RUNS for target in TARGETS if target in ONLY_ON.get(run, TARGETS)
    ]


def report_path(run: str, target: str) -> pathlib.Path:
    return REPORTS / f"{run}__{target}.json"


def compile_one(run: str, target: str, force: bool, hlo_dir: str | None) -> None:
    out = report_path(run, target)
    if out.exists() and not force:
        return
    spec, mesh = TARGETS[target]
    cmd = [
        sys.executable,
        "-m",
        "moe_jax.cli",
        "compile",
        f"--target={spec}",
        "--no_eval",
        *RUNS[run],
        *mesh,
        f"--out={out}",
    ] + ([f"--hlo_dir={pathlib.Path(hlo_dir) / out.stem}"] if hlo_dir else [])
    print(f"[compile_table] {run} on {target}: {' '.join(cmd[3:])}", flush=True)
    start = time.perf_counter()
    # a failed compile is reported below, not raised
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    err = out.with_suffix(".err")
    if not out.exists():
        err.write_text("\n".join((proc.stdout + proc.stderr).splitlines()[-5:]) + "\n")
        print(f"  failed (exit {proc.returncode}); see {err}", flush=True)
    else:
        err.unlink(missing_ok=True)
        report = json.loads(out.read_text())
        report["source"], report["source_date"] = source_commit()
        out.write_text(json.dumps(report, indent=1))
        print(f"  exit {proc.returncode} in {time.perf_counter() - start:.0f} s", flush=True)


def source_commit() -> tuple[str, str]:
    """The code that compiles now: the short hash of the last commit that changed the model
    or its configs (``moe_jax/``, ``gin/``), with ``+changes`` when the work tree differs
    from it there, and that commit's date (UTC, ISO 8601)."""
    git = ["git", "-C", str(REPO)]
    commit, date = subprocess.run(
        [*git, "log", "-1", "--format=%h %cd", "--date=iso-strict-local", "--", "moe_jax", "gin"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TZ": "UTC"},
    ).stdout.split()
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", "moe_jax", "gin"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return commit + ("+changes" if changed else ""), date


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table() -> str:
    """The markdown table of the compiled (run, target) pairs, then one line naming the
    pairs not compiled (or failed)."""
    missing = []
    rows = [
        "| run | target | fits? | GiB/device (params+opt / temps / total of HBM) | collectives "
        "(train step) | TFLOP/step | step, estimate (compiled, not run) | MoE layers' HLO bytes | "
        "compile | code |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, target in pairs():
        spec = TARGETS[target][0]
        path = report_path(run, target)
        if not path.exists():
            failed = " (failed: see .err)" if path.with_suffix(".err").exists() else ""
            missing.append(f"{run} on {target}{failed}")
            continue
        r = json.loads(path.read_text())
        step = r["steps"]["train"]
        b = step["bytes"]
        coll = ", ".join(f"{c['count']} {k}" for k, c in step["collectives"].items()) or "-"
        est = "-" if step["estimate"] is None else f"{step['estimate']['step_s'] * 1e3:.0f} ms"
        moe = step.get("moe_layers") or {}
        share = (
            f"{100 * moe['hlo_bytes'] / moe['step_hlo_bytes']:.1f}%"
            if moe.get("hlo_bytes")
            else "-"
        )
        rows.append(
            f"| {run} | {target} (`{spec}`) | {'yes' if r['fits'] else '**no**'} | "
            f"{_gib(b['params_and_optimizer'])} / {_gib(b['temporaries'])} / {_gib(b['total'])} of "
            f"{_gib(b['device_memory'])} | {coll} | {step['flops_per_step'] / 1e12:.1f} | "
            f"{est} | {share} | {step['compile_s']:.0f} s | {r.get('source', '-')} |"
        )
    if missing:
        rows += ["", "Not compiled: " + ", ".join(missing) + "."]
    return "\n".join(rows)


def _sources() -> dict[tuple[str, str], tuple[str, str]]:
    """(code date, code commit) of every compiled pair's report."""
    sources = {}
    for pair in pairs():
        if report_path(*pair).exists():
            report = json.loads(report_path(*pair).read_text())
            sources[pair] = (report.get("source_date", ""), report.get("source", "-"))
    return sources


def newest_code() -> tuple[str, str]:
    """(date, commit) of the newest code any report was compiled from."""
    return max(_sources().values())


def older_than(date: str) -> dict[str, list[str]]:
    """The pairs compiled from code committed before ``date`` (ISO 8601, UTC), by target
    (``["all"]`` where every run of the target is)."""
    sources, older = _sources(), {}
    for target in TARGETS:
        every = [run for run, t in pairs() if t == target]
        runs = [run for (run, t), (when, _) in sources.items() if t == target and when < date]
        if runs:
            older[target] = ["all"] if runs == every else runs
    return older


def recount(hlo_dir: str) -> None:
    """Re-analyses the kept HLO of every report that has one (see the module docstring)."""
    sys.path.insert(0, str(REPO))
    from moe_jax import hardware
    from moe_jax.compile import step_analysis, targets

    for run, target in pairs():
        path, hlo = (
            report_path(run, target),
            pathlib.Path(hlo_dir) / f"{run}__{target}" / "train.hlo.txt",
        )
        if not (path.exists() and hlo.exists()):
            continue
        report = json.loads(path.read_text())
        step, parsed = report["steps"]["train"], targets.parse_target(TARGETS[target][0])
        facts = hardware.device_facts(range(report["devices"]), parsed.chip, parsed.num_chips)
        step.update(
            step_analysis.hlo_analysis(
                hlo.read_text(),
                facts,
                flops_per_step=step["flops_per_step"],
                bytes_accessed=step["hlo_bytes_accessed_per_device"] or 0.0,
                num_devices=report["devices"],
                tokens_per_step=report["batch_size"] * sum(report["task_feature_lengths"].values()),
            )
        )
        path.write_text(json.dumps(report, indent=1))
        print(f"[compile_table] {run} on {target}: recounted from {hlo}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "table", "recount"))
    parser.add_argument("--only", default="", help="substring of 'run__target' to compile")
    parser.add_argument("--force", action="store_true", help="recompile existing reports")
    parser.add_argument("--hlo_dir", default=None, help="keep each pair's HLO under this folder")
    args = parser.parse_args(argv)
    if args.command == "table":
        print(table())
        return 0
    if args.command == "recount":
        recount(args.hlo_dir)
        return 0
    REPORTS.mkdir(parents=True, exist_ok=True)
    for run, target in pairs():
        if args.only in f"{run}__{target}":
            compile_one(run, target, args.force, args.hlo_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
