"""Where the train step's device-memory traffic goes, compiled for one H100.

    python benchmarks/step_traffic.py                        # base_dense and fig5_dense
    python benchmarks/step_traffic.py --runs base_dense --hlo_dir DIR   # keep / reuse the HLO

Each run (``gin/experiments/<run>.gin``, layers unrolled, no remat), with the default XLA
attention and with the project's Pallas flash kernel (``--attention``), is compiled by
`moe-jax compile --no_eval` for one H100 at the batch
``benchmarks/accelerator_step.py`` measures (a fresh process each; the compile and its HLO
are ``layer_forms.compile_form``'s), and its optimised HLO read by ``moe_jax.compile.hlo_costs``:
the bytes of device memory read and written per step, split by the part of the model that
moves them (``hlo_costs.bytes_by_part``) and by kind of operation (:func:`bytes_by_kind`:
the attention's ``[batch, heads, q, k]`` arrays, layout transposes, the rest), beside the
memory per device and the compile report's roofline estimate. Read from executables
compiled on this machine, not run: the traffic the step's own kernels cannot avoid,
whatever their speed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import layer_forms
import report

from moe_jax.compile import hlo_costs

# run -> bindings after layer_forms' one-H100 target (batch 32, accelerator_step.py's for
# Base: the run's 256 is sized for a mesh); Figure 5's d32 models at their own batch of 256
RUNS: dict[str, tuple[str, ...]] = {
    "base_dense": (),
    "fig5_dense": ("--gin.BATCH_SIZE=256",),
}
TARGET = "1xH100"
# attention kernels compiled per run: the default, and the fused Pallas kernel (cuDNN's
# cannot be compiled without a GPU: jax asks the device for its cuDNN version)
KERNELS = ("xla", "pallas")
PARTS = 6  # the largest parts listed per run
KINDS = (
    "[b,h,q,k] arrays",
    "transposes",
    "matmuls and kernels",
    "optimizer and loss",
    "other",
)
# XLA pads a score array's lengths up to this multiple (114 -> 120 or 128)
_PAD = 16


def bytes_by_kind(ops: list[hlo_costs.Op], report: dict) -> dict[str, float]:
    """Bytes per step by kind of operation (first that applies): it reads or writes an
    attention ``[batch, heads, q, k]`` array (``q, k`` the run's feature lengths, or up to
    ``_PAD`` more), it is a layout transpose / concatenation / copy (no matmul), a matmul or
    a fused kernel (cuBLAS, Triton: the flash-attention kernels count here), element-wise
    work outside the model (the optimizer's update, the loss), else ``other``."""
    lengths = report["task_feature_lengths"]
    pairs = [(lengths["inputs"], lengths["inputs"]), (lengths["targets"], lengths["targets"])]
    pairs.append((lengths["targets"], lengths["inputs"]))
    batch_heads = report["batch_size"] * report["model_dims"]["num_heads"]
    scores = {
        batch_heads * (q + i) * (k + j) for q, k in pairs for i in range(_PAD) for j in range(_PAD)
    }
    totals = dict.fromkeys(KINDS, 0.0)
    for op in ops:
        if op.element_counts & scores:
            kind = KINDS[0]
        elif op.flops == 0 and (op.opcode == "copy" or {"transpose", "concatenate"} & op.kinds):
            kind = KINDS[1]
        elif op.flops > 0:
            kind = KINDS[2]
        elif hlo_costs.part(op.source) == "outside the model":
            kind = KINDS[3]
        else:
            kind = KINDS[4]
        totals[kind] += op.bytes * op.trips
    return totals


def traffic(run: str, kernel: str, keep: pathlib.Path) -> list[str]:
    """One row: the run's memory with attention by ``kernel`` (``T5Config.attention_kernel``),
    bytes per step, its largest parts and the estimate."""
    bindings = (*RUNS[run], f"--gin.T5Config.attention_kernel='{kernel}'")
    step = layer_forms.compile_form(run, TARGET, "unrolled", "none", keep, bindings)
    ops = hlo_costs.parse(pathlib.Path(step["hlo"]).read_text())
    total = hlo_costs.summary(ops)["bytes"]
    parts = sorted(hlo_costs.bytes_by_part(ops).items(), key=lambda kv: -kv[1])[:PARTS]
    with open(keep / "report.json") as f:
        compiled = json.load(f)
    kinds = bytes_by_kind(ops, compiled)
    return [
        run,
        kernel,
        str(compiled["batch_size"]),
        f"{step['bytes']['total'] / 2**30:.2f}",
        f"{total / 1e9:.1f}",
        ", ".join(f"{name} {gb / 1e9:.1f}" for name, gb in parts),
        ", ".join(f"{name} {gb / 1e9:.1f}" for name, gb in kinds.items()),
        f"{step['estimate']['step_s'] * 1e3:.1f}",
    ]


COLUMNS = [
    "run",
    "attention",
    "batch",
    "GiB/device",
    "HBM GB per step",
    "largest parts (GB)",
    "by kind (GB)",
    "estimate ms (compiled, not run)",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--attention", nargs="+", default=list(KERNELS), choices=list(KERNELS),
        help="T5Config.attention_kernel of each row (the project's Pallas kernel beside XLA's)",
    )  # fmt: skip
    parser.add_argument("--hlo_dir", help="keep each run's report and HLO here (and reuse)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(args.hlo_dir or tmp)
        table = [
            traffic(run, kernel, root / f"{run}__{kernel}__{TARGET}")
            for run in args.runs
            for kernel in args.attention
        ]
    print(report.markdown_table(COLUMNS, table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
