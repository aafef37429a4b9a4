"""The routing comparison table and plot of a sweep family (configs/routing_cpu*.toml).

    python -m moe_jax.experiments.routing_comparison configs/routing_cpu_budget.toml \\
        --root=/tmp/routing_cpu --out=docs/img/routing

For every run of the family: its last eval record's accuracy and cross-entropy, the
dropped fraction (mean over MoE layers) and the max load (over MoE layers, the busiest
expert's share of assignments relative to a perfectly balanced router: 1.0 = balanced,
E / k = every token on the same experts), mean over seeds. Writes ``<family>_routing.json``
and ``<family>_routing.png`` (one bar chart per quantity) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import numpy as np

from moe_jax import plotting, storage
from moe_jax.experiments import sweep
from moe_jax.runtime.metrics import read_metrics
from moe_jax.runtime.run_dir import RunDir

QUANTITIES = ("accuracy", "cross_entropy", "dropped_fraction", "max_load")
_DROPPED = re.compile(r"^moe/(.+)/dropped_fraction$")
_LOAD = re.compile(r"^moe/(.+)/expert_load$")


def last_eval(run_dir: RunDir) -> dict[str, Any] | None:
    """The last eval record of ``MODEL_DIR/metrics.jsonl`` (None if it has none)."""
    records = read_metrics(run_dir, "eval")
    return max(records, key=lambda r: r["step"], default=None)


def routing_quantities(record: dict[str, Any]) -> dict[str, float]:
    """Accuracy, cross-entropy, dropped fraction and max load of one eval record (NaN for
    the MoE quantities of a dense model)."""
    dropped = [v for k, v in record.items() if _DROPPED.match(k)]
    loads = [np.asarray(v, np.float64) for k, v in record.items() if _LOAD.match(k)]
    max_load = max(
        (float(load.max() / (load.sum() / load.size)) for load in loads if load.sum() > 0),
        default=float("nan"),
    )
    return {
        "accuracy": float(record["accuracy"]),
        "cross_entropy": float(record["cross_entropy"]),
        "dropped_fraction": float(np.mean(dropped)) if dropped else float("nan"),
        "max_load": max_load,
        "step": int(record["step"]),
    }


def compare(family: sweep.Family, root: str) -> dict[str, dict[str, Any]]:
    """``{run group: {quantity: mean over seeds, "seeds": n, "step": last eval step}}``."""
    rows: dict[str, list[dict[str, float]]] = {}
    for spec in family.runs:
        record = last_eval(spec.run_dir(root))
        if record is not None:
            rows.setdefault(spec.group, []).append(routing_quantities(record))
    return {
        group: {
            **{q: float(np.mean([r[q] for r in runs])) for q in QUANTITIES},
            "seeds": len(runs),
            "step": min(r["step"] for r in runs),
        }
        for group, runs in rows.items()
    }


def format_table(table: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'run':<24} {'step':>5} {'accuracy':>9} {'x-entropy':>10} {'dropped':>8} {'max load':>9}"
    ]
    for group, row in table.items():
        lines.append(
            f"{group:<24} {row['step']:>5} {row['accuracy']:>9.4f} {row['cross_entropy']:>10.4f} "
            f"{row['dropped_fraction']:>8.3f} {row['max_load']:>9.2f}"
        )
    return "\n".join(lines)


# Axis labels (with units) per quantity; the zoomed ones are drawn as points, not bars, so
# that no bar starts anywhere but at zero.
AXIS_LABELS = {
    "accuracy": "eval token accuracy (fraction of targets)",
    "cross_entropy": "eval cross-entropy (nats per target token)",
    "dropped_fraction": "dropped assignments (fraction, mean of MoE layers)",
    "max_load": "max load (busiest expert / balanced share; 1 = balanced)",
}
ZOOMED = ("accuracy", "cross_entropy")


def plot(table: dict[str, dict[str, Any]], title: str, path: str) -> str:
    """One panel per quantity, one row per run (blue learned, orange frozen, gray dense):
    accuracy and cross-entropy as points on a zoomed axis, dropped fraction and max load as
    bars from zero; a run without the quantity (a dense model has no routing) says so."""

    plt = plotting.pyplot()
    names = list(table)
    colors = [
        "tab:gray" if "dense" in n else "tab:orange" if "frozen" in n else "tab:blue" for n in names
    ]
    fig, axes = plt.subplots(
        1, len(QUANTITIES), figsize=(4.2 * len(QUANTITIES), 0.35 * len(names) + 2.0), sharey=True
    )
    y = np.arange(len(names))
    for ax, quantity in zip(axes, QUANTITIES, strict=True):
        values = np.asarray([table[n][quantity] for n in names], float)
        finite = np.isfinite(values)
        if quantity in ZOOMED:
            ax.scatter(
                values[finite],
                y[finite],
                c=[c for c, f in zip(colors, finite, strict=True) if f],
                s=40,
                zorder=3,
            )
            ax.hlines(
                y[finite], values[finite].min(), values[finite], colors="lightgray", lw=1, zorder=2
            )
        else:
            ax.barh(
                y[finite],
                values[finite],
                color=[c for c, f in zip(colors, finite, strict=True) if f],
            )
            ax.set_xlim(left=0)
        for row in y[~finite]:
            ax.text(
                0.02,
                row,
                "n/a (no routing)",
                transform=ax.get_yaxis_transform(),
                va="center",
                fontsize=7,
                color="gray",
            )
        ax.set_xlabel(AXIS_LABELS[quantity], fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    fig.suptitle(
        f"{title}: last eval per run (blue learned router, orange frozen, gray dense)", fontsize=10
    )
    return plotting.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.experiments.routing_comparison", description=__doc__.splitlines()[0]
    )
    parser.add_argument("family")
    parser.add_argument("--root", type=storage.normalize, required=True)
    parser.add_argument("--out", type=storage.normalize, required=True)
    parser.add_argument(
        "--table",
        type=storage.normalize,
        default=None,
        metavar="JSON",
        help="redraw the plot from a <family>_routing.json written before (no runs needed)",
    )
    args = parser.parse_args(argv)
    try:
        family = sweep.load_family(args.family)
    except sweep.FamilyError as err:
        print(f"routing_comparison: {err}", file=sys.stderr)
        return 2
    if args.table:
        table = json.loads(storage.read_text(args.table))
        print(
            "wrote", plot(table, family.name, storage.join(args.out, f"{family.name}_routing.png"))
        )
        return 0
    table = compare(family, args.root)
    if not table:
        print(f"routing_comparison: no eval records under {args.root}", file=sys.stderr)
        return 1
    storage.makedirs(args.out)
    storage.write_text(
        storage.join(args.out, f"{family.name}_routing.json"), json.dumps(table, indent=1)
    )
    png = plot(table, family.name, storage.join(args.out, f"{family.name}_routing.png"))
    print(format_table(table))
    print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
