"""PNGs of the analyses over routing traces (matplotlib, Agg backend).

* ``vocabulary_<run>_step<N>.png``: per MoE layer, the share of each token category's
  tokens by top-1 expert, titled with the token-id consistency and its random-router floor;
* ``saturation.png``: per MoE layer, top-1 and top-k agreement with the final checkpoint vs
  the share of training, one colour per run, the random router dotted;
* ``coactivation_<run>_step<N>.png``: per MoE layer, the co-activation matrix, then the
  cross-layer predictability matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from moe_jax import plotting, storage
from moe_jax.runtime import run_names


def _grid(count: int, width: float, height: float):
    """A figure with ``count`` panels, at most 3 a row; unused panels hidden."""
    plt = plotting.pyplot()
    cols = min(3, count)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    return fig, list(axes.flat[:count])


def _file(prefix: str, result: dict[str, Any]) -> str:
    return f"{prefix}_{run_names.file_stem(result['run'])}_step{result['step']}.png"


def vocabulary_figure(result: dict[str, Any], categories: list[str]):
    """Heatmaps ``[category, expert]`` of ``category_share`` per layer."""
    fig, axes = _grid(len(result["layers"]), 4.6, 3.4)
    for ax, (name, s) in zip(axes, result["layers"].items(), strict=True):
        image = ax.imshow(
            np.asarray(s["category_share"]), aspect="auto", cmap="viridis", vmin=0, vmax=1
        )
        labels = [f"{c} ({n})" for c, n in zip(categories, s["category_tokens"], strict=True)]
        ax.set_yticks(range(len(categories)), labels, fontsize=7)
        ax.set_xlabel("top-1 expert", fontsize=8)
        plotting.integer_ticks(ax, "x")
        consistency = s["token_consistency"]
        ax.set_title(
            f"{name}\ntoken-id consistency "
            + ("-" if consistency is None else f"{consistency:.2f}")
            + ("" if s["random_router"] is None else f" (random {s['random_router']:.2f})")
            + f"\nI(category; expert) {s['category_bits']:.2f} bits "
            f"(shuffled {s['category_shuffled_bits']:.2f})",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.046, label="share of the category's tokens")
    fig.suptitle(f"{result['run']} step {result['step']}: token categories by expert", fontsize=10)
    return fig


def _per_checkpoint(
    report: dict[str, Any], prefix: str, figure: Callable[[dict[str, Any]], Any], out_dir: str
) -> list[str]:
    """``figure(result)`` of each of ``report["checkpoints"]`` as
    ``<prefix>_<run>_step<N>.png``; returns the file names."""
    files = []
    for result in report["checkpoints"]:
        name = _file(prefix, result)
        plotting.save(figure(result), storage.join(out_dir, name), dpi=100)
        files.append(name)
    return files


def write_vocabulary(report: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per checkpoint; returns the file names."""
    return _per_checkpoint(
        report, "vocabulary", lambda r: vocabulary_figure(r, report["categories"]), out_dir
    )


def _run_curves(ax, run: dict[str, Any], name: str, colour) -> None:
    """One run's top-1 and top-k agreement (solid) and its random router's (dotted)."""
    fraction = np.asarray(run["steps"]) / max(run["final_step"], 1)
    curves = run["layers"][name]
    style = dict(color=colour, ms=3)
    ax.plot(fraction, curves["top1"], "-o", label=f"{run['run']} top-1", **style)
    ax.plot(fraction, curves["topk"], "-s", label=f"{run['run']} top-k", alpha=0.6, **style)
    ax.plot(fraction, curves["top1_random"], ":", color=colour)
    ax.plot(fraction, curves["topk_random"], ":", color=colour, alpha=0.6)


def _family_curves(ax, family: dict[str, Any], name: str, colour) -> None:
    """A family's mean top-k agreement over its seeds with a band of one standard
    deviation (solid), and its random router's mean (dotted)."""
    fraction = np.asarray(family["steps"]) / max(family["steps"][-1], 1)
    curves = family["layers"][name]
    mean, std = np.asarray(curves["topk"], float).T
    label = f"{family['family']} top-k ({len(family['seeds'])} seeds)"
    ax.plot(fraction, mean, "-s", color=colour, ms=3, label=label)
    ax.fill_between(fraction, mean - std, mean + std, color=colour, alpha=0.2)
    ax.plot(fraction, np.asarray(curves["topk_random"], float)[:, 0], ":", color=colour)


def saturation_figure(report: dict[str, Any]):
    """Per layer: agreement with the final checkpoint vs share of training; a run family
    with a ``seed_summary`` as its seeds' mean top-k agreement and spread, other runs one
    by one."""
    names = list(report["runs"][0]["layers"])
    fig, axes = _grid(len(names), 4.2, 3.4)
    colours = plotting.pyplot().get_cmap("tab10")
    families = report.get("seed_summary") or []
    summarised = {run for family in families for run in family["seeds"]}
    shown: list[tuple[Callable, dict[str, Any]]] = [(_family_curves, f) for f in families]
    shown += [(_run_curves, r) for r in report["runs"] if r["run"] not in summarised]
    for i, (draw, entry) in enumerate(shown):
        for ax, name in zip(axes, names, strict=True):
            draw(ax, entry, name, colours(i % 10))
    for ax, name in zip(axes, names, strict=True):
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("step / final step", fontsize=8)
        ax.set_ylabel("agreement with the final step\n(dotted: random router)", fontsize=8)
    plotting.legend_outside(axes[-1])
    fig.suptitle("router saturation", fontsize=10)
    return fig


def write_saturation(report: dict[str, Any], out_dir: str) -> list[str]:
    plotting.save(saturation_figure(report), storage.join(out_dir, "saturation.png"), dpi=100)
    return ["saturation.png"]


def coactivation_figure(result: dict[str, Any]):
    """A co-activation heatmap per layer with pairs, then the cross-layer matrix."""
    paired = {n: s for n, s in result["layers"].items() if s["coactivation"] is not None}
    fig, axes = _grid(len(paired) + 1, 4.2, 3.6)
    for ax, (name, s) in zip(axes, paired.items(), strict=False):
        image = ax.imshow(np.asarray(s["coactivation"]), cmap="magma", vmin=0)
        ax.set_xlabel("expert j", fontsize=8)
        ax.set_ylabel("expert i", fontsize=8)
        plotting.integer_ticks(ax)
        ax.set_title(
            f"{name}: P(j | i)\ntop partner {s['top_partner']:.2f} "
            f"(random {s['top_partner_random']:.2f})",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.046)
    cross = result["cross_layer"]
    matrix = np.asarray(
        [[np.nan if v is None else v for v in row] for row in cross["predictability"]], float
    )
    ax = axes[-1]
    image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=1)
    ticks = range(len(cross["layers"]))
    ax.set_xticks(ticks, cross["layers"], rotation=30, ha="right", fontsize=6)
    ax.set_yticks(ticks, cross["layers"], fontsize=6)
    ax.set_title("layer i's top-1 predicts layer j's\n(blank: different tokens)", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"{result['run']} step {result['step']}: expert co-activation", fontsize=10)
    return fig


def write_coactivation(report: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per checkpoint; returns the file names."""
    return _per_checkpoint(report, "coactivation", coactivation_figure, out_dir)
