"""The train step's work per step in each layer form, as its compiled program counts it.

    python benchmarks/layer_forms.py                        # base_dense on v5p-32 and one H100
    python benchmarks/layer_forms.py --runs base_learned --targets v5p-32
    python benchmarks/layer_forms.py --hlo_dir DIR          # keep each form's HLO; reuse kept

For each run (``gin/experiments/<run>.gin``) and target, the train step is compiled by
`moe-jax compile --no_eval` (a fresh process each, JAX's compilation cache off) in four
forms: layers unrolled or scanned (``SCAN_LAYERS``), without activation checkpointing or
with ``'minimal'`` (``REMAT_POLICY``: keep the projections' outputs, recompute the rest in
the backward pass). Its optimised HLO is then read by ``moe_jax.compile.hlo_costs`` with every loop
body counted once per trip (scanned layers, and XLA:TPU's windowed einsum loops that
multiply FSDP-sharded weights in steps), which XLA's own cost analysis does not do:

* matmul TFLOP per device (what the recomputation adds);
* device-memory GB per device (one read of each operand, one write of each result, a slice
  as sliced, an in-place update as its update; TPU VMEM left out);
* on TPU targets, the sum of the TPU compiler's ``estimated_cycles`` of the instructions it
  schedules, one after another (no overlap);

beside the step's memory per device (compile times: ``benchmarks/scan_layers.py``, which
measures them one at a time). The ratios are to the unrolled
form without remat (the default). Everything is read from executables compiled on this
machine for the target, not run: an estimate of what each form costs, for the choice of
``SCAN_LAYERS`` / ``REMAT_POLICY`` per target, until a device measures the step times
(``benchmarks/accelerator_step.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import fresh_process
import report

from moe_jax.compile import hlo_costs

REPO = pathlib.Path(__file__).resolve().parents[1]

# target name -> (--target, flags): the compile table's v5p-32 slice, and one H100 at the
# batch benchmarks/accelerator_step.py measures (the runs' 256 is sized for a mesh)
TARGETS: dict[str, tuple[str, list[str]]] = {
    "v5p-32": ("tpu:v5p:2x2x4", ["--gin_file=meshes/v4_32.gin"]),
    "1xH100": ("gpu:h100:1", ["--gin.BATCH_SIZE=32"]),
}
# (layers, remat): the default first, the ratios' base
FORMS: tuple[tuple[str, str], ...] = (
    ("unrolled", "none"),
    ("unrolled", "minimal"),
    ("scanned", "none"),
    ("scanned", "minimal"),
)


def compile_form(
    run: str,
    target: str,
    layers: str,
    remat: str,
    keep: pathlib.Path,
    bindings: tuple[str, ...] = (),
) -> dict:
    """The compile report of one form (``keep/report.json``, with the HLO beside it as
    ``keep/train.hlo.txt``), compiled unless both are there; ``bindings``: more flags
    after the target's (``--gin.BATCH_SIZE=256``)."""
    report, hlo = keep / "report.json", keep / "train.hlo.txt"
    if not (report.exists() and hlo.exists()):
        chip, flags = TARGETS[target]
        cmd = [
            sys.executable, "-m", "moe_jax.cli", "compile", f"--target={chip}", "--no_eval",
            f"--gin_file=experiments/{run}.gin", *flags, *bindings,
            f"--gin.SCAN_LAYERS={layers == 'scanned'}", f"--gin.REMAT_POLICY='{remat}'",
            f"--hlo_dir={keep}", f"--out={report}",
        ]  # fmt: skip
        print(f"[layer_forms] {run} on {target}: {layers}, remat {remat}", file=sys.stderr)
        proc = subprocess.run(
            cmd, cwd=REPO, env=fresh_process.env(), capture_output=True, text=True, check=False
        )
        if not report.exists():
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
            )
    with open(report) as f:
        return json.load(f)["steps"]["train"] | {"hlo": str(hlo)}


def work(step: dict) -> dict:
    """What one compiled step does per run, loops counted per trip (``hlo_costs.summary``)."""
    totals = hlo_costs.summary(hlo_costs.parse(pathlib.Path(step["hlo"]).read_text()))
    return {
        "gib": step["bytes"]["total"] / 2**30,
        "tflop": totals["flops"] / 1e12,
        "gb": totals["bytes"] / 1e9,
        "mcycles": totals["cycles"] / 1e6 if totals["cycles"] else None,
        "xla_gb": (step.get("hlo_bytes_accessed_per_device") or 0) / 1e9 or None,
    }


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def rows(run: str, target: str, found: dict[tuple[str, str], dict]) -> list[list[str]]:
    """The table's rows of one run on one target, each form against the first."""
    base = found[FORMS[0]]
    out = []
    for (layers, remat), w in found.items():
        out.append(
            [
                run,
                target,
                layers,
                remat,
                f"{w['gib']:.2f}",
                f"{w['tflop']:.2f}",
                _ratio(w["tflop"], base["tflop"]),
                f"{w['gb']:.1f}",
                _ratio(w["gb"], base["gb"]),
                f"{w['mcycles']:.0f}" if w["mcycles"] else "-",
                _ratio(w["mcycles"], base["mcycles"]),
                f"{w['xla_gb']:.1f}" if w["xla_gb"] else "-",
            ]
        )
    return out


COLUMNS = [
    "run",
    "target",
    "layers",
    "remat",
    "GiB/device",
    "TFLOP/device",
    "vs default",
    "HBM GB/device",
    "vs default",
    "TPU est. Mcycles",
    "vs default",
    "XLA's GB (loop bodies once)",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["base_dense"])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--hlo_dir", help="keep each form's report and HLO here (and reuse)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(args.hlo_dir or tmp)
        table = []
        for run in args.runs:
            for target in args.targets:
                found = {
                    (layers, remat): work(
                        compile_form(
                            run, target, layers, remat, root / f"{run}__{target}__{layers}_{remat}"
                        )
                    )
                    for layers, remat in FORMS
                }
                table += rows(run, target, found)
    print(report.markdown_table(COLUMNS, table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
