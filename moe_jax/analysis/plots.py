"""PNGs of the routing analyses (matplotlib, Agg backend).

Positions (:func:`write_all`):

* ``activation_<stack>_<layer>.png``: heatmap of the top-k activation rate
  ``[position, expert]``;
* ``correlation_length.png``: ``xi_int``, ``corr_lag`` and ``xi_domain`` per layer, model
  vs shuffled;
* ``probe_accuracy.png``: probe accuracy per layer and target, with chance and majority;
* ``drops_by_position.png``: the share of choices dropped by capacity by position, per layer.

Languages (:func:`write_languages`):

* ``languages_<run>_step<N>.png``: per MoE layer, heatmap of the top-1 share
  ``[language, expert]``;
* ``languages_curves.png``: I(language; expert) and sparsity per cluster vs step, per run
  and layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_jax import plotting, storage
from moe_jax.runtime import run_names


def _pyplot():
    return plotting.pyplot()


def _save(plt, fig, path: str) -> None:
    plotting.save(fig, path, dpi=100)


def activation_heatmap(name: str, stats: dict[str, Any], path: str, title: str = "") -> None:
    """Heatmap of ``stats["activation_rate"]["top_k"]`` (``[positions, experts]``)."""
    plt = _pyplot()
    rates = np.asarray(stats["activation_rate"]["top_k"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    image = ax.imshow(rates, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"activation rate (rows sum to k={stats['k']})")
    ax.set_xlabel("expert")
    ax.set_ylabel("token position")
    plotting.integer_ticks(ax)
    ax.set_title(f"{title}  {name}".strip(), fontsize=9)
    _save(plt, fig, path)


def correlation_bars(layers: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """Grouped bars per layer: each correlation length for the model and shuffled positions."""
    plt = _pyplot()
    _save(plt, correlation_figure(layers, title), path)


def correlation_figure(layers: dict[str, dict[str, Any]], title: str = ""):
    """The figure of :func:`correlation_bars` (one panel per length, each with its unit)."""
    plt = _pyplot()
    names = list(layers)
    metrics = (
        ("xi_int", "xi_int = 1 + 2 sum rho", "integrated autocorrelation time (tokens)"),
        ("corr_lag", "corr_lag (lags with rho >= thr)", "leading correlated lags"),
        ("xi_domain", "xi_domain (mean run length)", "mean run of one expert (tokens)"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4), squeeze=False)
    x = np.arange(len(names))
    for ax, (key, label, unit) in zip(axes[0], metrics, strict=True):
        model = [layers[n]["correlation"]["model"][key] for n in names]
        shuffled = [layers[n]["correlation"]["shuffled"][key] for n in names]
        ax.bar(x - 0.2, model, 0.4, label="model", color="tab:blue")
        ax.bar(x + 0.2, shuffled, 0.4, label="shuffled positions", color="tab:gray")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, max(1.0, *model, *shuffled) * 1.1)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
        if key == "corr_lag":  # a count of lags
            plotting.integer_ticks(ax, "y")
    plotting.legend_outside(axes[0, -1])
    fig.suptitle(
        f"{title}: correlation length of the top-1 expert sequence".strip(": "), fontsize=10
    )
    return fig


def probe_bars(layers: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """One panel per layer: probe accuracy per target, chance (dash) and majority (dot)."""
    plt = _pyplot()
    names = list(layers)
    fig, axes = plt.subplots(
        1, len(names), figsize=(3.6 * len(names), 3.2), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], names, strict=True):
        probes = layers[name]["probe"]
        targets = list(probes)
        x = np.arange(len(targets))
        ax.bar(x, [probes[t]["accuracy"] for t in targets], 0.6, color="tab:green", label="probe")
        ax.scatter(
            x, [probes[t]["chance"] for t in targets], marker="_", s=300, color="k", label="1/C"
        )
        ax.scatter(
            x,
            [probes[t]["majority"] for t in targets],
            marker=".",
            s=60,
            color="tab:red",
            label="majority",
        )
        ax.set_xticks(x, targets, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, 1.02)
        ax.set_title(name, fontsize=9)
    axes[0, 0].set_ylabel("held-out accuracy")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{title}: position probes on router inputs".strip(": "), fontsize=10)
    _save(plt, fig, path)


def drop_rate_lines(layers: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """Writes :func:`drop_rate_figure` to ``path``."""
    _save(_pyplot(), drop_rate_figure(layers, title), path)


def drop_rate_figure(layers: dict[str, dict[str, Any]], title: str = ""):
    """The share of choices dropped by capacity vs position, one line per layer, its
    position-blind level (over all positions) dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, stats) in enumerate(layers.items()):
        drops = stats["drop_rate"]
        colour = plt.get_cmap("tab10")(i % 10)
        ax.plot(drops["choices"], "-", color=colour, label=name)
        ax.axhline(drops["overall_choices"], ls="--", lw=0.8, color=colour)
    ax.set_xlabel("token position")
    ax.set_ylabel("share of choices dropped\n(dashed: all positions)")
    ax.set_ylim(bottom=0)
    plotting.legend_outside(ax)
    ax.set_title(f"{title}: drops by position".strip(": "), fontsize=9)
    return fig


def write_all(layers: dict[str, dict[str, Any]], out_dir: str, title: str = "") -> list[str]:
    """Writes every PNG into ``out_dir``; returns their file names."""
    files = []
    for name, stats in layers.items():
        fname = f"activation_{name.replace('/', '_')}.png"
        activation_heatmap(name, stats, storage.join(out_dir, fname), title)
        files.append(fname)
    correlation_bars(layers, storage.join(out_dir, "correlation_length.png"), title)
    probe_bars(layers, storage.join(out_dir, "probe_accuracy.png"), title)
    drop_rate_lines(layers, storage.join(out_dir, "drops_by_position.png"), title)
    return [*files, "correlation_length.png", "probe_accuracy.png", "drops_by_position.png"]


def language_heatmaps(result: dict[str, Any], labels: list[str], path: str) -> None:
    """One heatmap per MoE layer of ``result["layers"][name]["top1_share"]``."""
    plt = _pyplot()
    names = list(result["layers"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols, 0.16 * len(labels) * rows + 1.6), squeeze=False
    )
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat[: len(names)], names, strict=True):
        stats = result["layers"][name]
        image = ax.imshow(
            np.asarray(stats["top1_share"]),
            aspect="auto",
            cmap="viridis",
            interpolation="nearest",
            vmin=0,
        )
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_xlabel("expert", fontsize=8)
        plotting.integer_ticks(ax, "x")
        ax.set_title(
            f"{name}: I = {stats['bits']:.2f} bits (floor {stats['shuffled_label_bits']:.2f})",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, fraction=0.046, label="share of the language's tokens")
    fig.suptitle(
        f"{result['run']} step {result['step']}: share of each language's tokens by top-1 expert",
        fontsize=10,
    )
    _save(plt, fig, path)


def language_curves(
    checkpoints: list[dict[str, Any]], path: str, seed_summary: list[dict[str, Any]] | None = None
) -> None:
    """Per MoE layer: I(language; top-1 expert) (solid) with its shuffled-label floor
    (dotted), and sparsity per language (solid) with the shuffled router (dashed), vs step,
    one colour per run family (``run_names.family_of``: its seeds as thin lines and, from
    ``seed_summary``, their mean in bold)."""

    plt = _pyplot()
    runs = list(dict.fromkeys(c["run"] for c in checkpoints))
    families = list(dict.fromkeys(run_names.family_of(run) for run in runs))
    means = {
        f: sorted((s for s in seed_summary or [] if s["family"] == f), key=lambda s: s["step"])
        for f in families
    }
    names = list(checkpoints[0]["layers"])
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 6.2), squeeze=False)
    colours = plt.get_cmap("tab10")
    for run in runs:
        family = run_names.family_of(run)
        colour, thin = colours(families.index(family)), bool(means[family])
        points = sorted((c for c in checkpoints if c["run"] == run), key=lambda c: c["step"])
        steps = [c["step"] for c in points]
        style = dict(color=colour, lw=0.7 if thin else 1.5, alpha=0.5 if thin else 1.0)
        label = None if thin else run
        for j, name in enumerate(names):
            layer = [c["layers"][name] for c in points]
            axes[0, j].plot(
                steps, [s["bits"] for s in layer], "-o", ms=2 if thin else 3, label=label, **style
            )
            axes[0, j].plot(steps, [s["shuffled_label_bits"] for s in layer], ":", **style)
            axes[1, j].plot(
                steps,
                [s["sparsity"] for s in layer],
                "-o",
                ms=2 if thin else 3,
                label=label,
                **style,
            )
            if layer[0]["sparsity_shuffled_router"] is not None:
                axes[1, j].plot(
                    steps, [s["sparsity_shuffled_router"] for s in layer], "--", **style
                )
    for f, family in enumerate(families):
        if not means[family]:
            continue
        steps = [s["step"] for s in means[family]]
        label = f"{family} (mean of {len(means[family][-1]['seeds'])} seeds)"
        for j, name in enumerate(names):
            for row, key in ((0, "bits"), (1, "sparsity")):
                axes[row, j].plot(
                    steps,
                    [s["layers"][name][key][0] for s in means[family]],
                    "-",
                    lw=2.2,
                    color=colours(f),
                    label=label,
                )
    for j, name in enumerate(names):
        axes[0, j].set_title(name, fontsize=9)
        axes[1, j].set_xlabel("step")
    axes[0, 0].set_ylabel("I(language; top-1 expert), bits\n(dotted: shuffled labels)", fontsize=8)
    axes[1, 0].set_ylabel(
        "sparsity per language (eff. experts)\n(dashed: shuffled router)", fontsize=8
    )
    plotting.legend_outside(axes[0, -1])
    _save(plt, fig, path)


def write_languages(report: dict[str, Any], out_dir: str) -> list[str]:
    """The heatmap of each run's last analysed step and, when a run has several steps, the
    curves; returns the file names."""
    files = []
    last: dict[str, dict[str, Any]] = {}
    for result in report["checkpoints"]:
        if result["run"] not in last or result["step"] > last[result["run"]]["step"]:
            last[result["run"]] = result
    for run, result in last.items():
        fname = f"languages_{run_names.file_stem(run)}_step{result['step']}.png"
        language_heatmaps(result, report["labels"], storage.join(out_dir, fname))
        files.append(fname)
    if len(report["checkpoints"]) > len(last):
        language_curves(
            report["checkpoints"],
            storage.join(out_dir, "languages_curves.png"),
            report.get("seed_summary"),
        )
        files.append("languages_curves.png")
    return files
