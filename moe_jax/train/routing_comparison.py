"""The routing comparison table and plot of a sweep family (configs/routing_cpu*.toml).

    python -m moe_jax.train.routing_comparison configs/routing_cpu_budget.toml \\
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
import os
import re
import sys
from typing import Any

import numpy as np

from moe_jax import storage
from moe_jax.train import summaries, sweep

QUANTITIES = ("accuracy", "cross_entropy", "dropped_fraction", "max_load")
_DROPPED = re.compile(r"^moe/(.+)/dropped_fraction$")
_LOAD = re.compile(r"^moe/(.+)/expert_load$")


def last_eval(model_dir: str) -> dict[str, Any] | None:
    """The last eval record of ``model_dir/metrics.jsonl`` (None if it has none)."""
    records = summaries.read_metrics(model_dir, "eval")
    return max(records, key=lambda r: r["step"], default=None)


def routing_quantities(record: dict[str, Any]) -> dict[str, float]:
    """Accuracy, cross-entropy, dropped fraction and max load of one eval record (NaN for
    the MoE quantities of a dense model)."""
    dropped = [v for k, v in record.items() if _DROPPED.match(k)]
    loads = [np.asarray(v, np.float64) for k, v in record.items() if _LOAD.match(k)]
    max_load = max((float(l.max() / (l.sum() / l.size)) for l in loads if l.sum() > 0), default=float("nan"))
    return {"accuracy": float(record["accuracy"]), "cross_entropy": float(record["cross_entropy"]),
            "dropped_fraction": float(np.mean(dropped)) if dropped else float("nan"), "max_load": max_load,
            "step": int(record["step"])}


def compare(family: sweep.Family, root: str) -> dict[str, dict[str, Any]]:
    """``{run group: {quantity: mean over seeds, "seeds": n, "step": last eval step}}``."""
    rows: dict[str, list[dict[str, float]]] = {}
    for spec in family.runs:
        record = last_eval(spec.model_dir(root))
        if record is not None:
            rows.setdefault(spec.group, []).append(routing_quantities(record))
    return {group: {**{q: float(np.mean([r[q] for r in runs])) for q in QUANTITIES},
                    "seeds": len(runs), "step": min(r["step"] for r in runs)}
            for group, runs in rows.items()}


def format_table(table: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'run':<24} {'step':>5} {'accuracy':>9} {'x-entropy':>10} {'dropped':>8} {'max load':>9}"]
    for group, row in table.items():
        lines.append(f"{group:<24} {row['step']:>5} {row['accuracy']:>9.4f} {row['cross_entropy']:>10.4f} "
                     f"{row['dropped_fraction']:>8.3f} {row['max_load']:>9.2f}")
    return "\n".join(lines)


def plot(table: dict[str, dict[str, Any]], title: str, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    colors = ["tab:gray" if "dense" in n else "tab:orange" if "frozen" in n else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(4.2 * len(QUANTITIES), 0.35 * len(names) + 1.8),
                             sharey=True)
    for ax, quantity in zip(axes, QUANTITIES):
        values = [table[n][quantity] for n in names]
        ax.barh(range(len(names)), np.nan_to_num(values), color=colors)
        ax.set_title(quantity.replace("_", " ") + (" (1 = balanced)" if quantity == "max_load" else ""))
        finite = [v for v in values if np.isfinite(v)]
        if quantity in ("accuracy", "cross_entropy") and finite:
            spread = max(finite) - min(finite)
            ax.set_xlim(min(finite) - spread - 1e-3, max(finite) + 0.2 * spread + 1e-3)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)), names)
    axes[0].invert_yaxis()
    fig.suptitle(title + "  (blue learned, orange frozen, gray dense)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.train.routing_comparison", description=__doc__.splitlines()[0])
    parser.add_argument("family")
    parser.add_argument("--root", type=storage.normalize, required=True)
    parser.add_argument("--out", type=storage.normalize, required=True)
    args = parser.parse_args(argv)
    try:
        family = sweep.load_family(args.family)
    except sweep.FamilyError as err:
        print(f"routing_comparison: {err}", file=sys.stderr)
        return 2
    table = compare(family, args.root)
    if not table:
        print(f"routing_comparison: no eval records under {args.root}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{family.name}_routing.json"), "w") as f:
        json.dump(table, f, indent=1)
    png = plot(table, family.name, os.path.join(args.out, f"{family.name}_routing.png"))
    print(format_table(table))
    print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
