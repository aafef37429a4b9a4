"""PNGs of the positional routing analysis (matplotlib, Agg backend).

``activation_<stack>_<layer>.png``  heatmap of the top-k activation rate ``[position, expert]``
``correlation_length.png``          ``xi_int``, ``corr_lag`` and ``xi_domain`` per layer, model vs shuffled
``probe_accuracy.png``              probe accuracy per layer and target, with chance and majority
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def activation_heatmap(name: str, stats: dict[str, Any], path: str, title: str = "") -> None:
    """Heatmap of ``stats["activation_rate"]["top_k"]`` (``[positions, experts]``)."""
    plt = _pyplot()
    rates = np.asarray(stats["activation_rate"]["top_k"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    image = ax.imshow(rates, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"activation rate (rows sum to k={stats['k']})")
    ax.set_xlabel("expert")
    ax.set_ylabel("token position")
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
    metrics = (("xi_int", "xi_int = 1 + 2 sum rho", "integrated autocorrelation time (tokens)"),
               ("corr_lag", "corr_lag (lags with rho >= thr)", "leading correlated lags"),
               ("xi_domain", "xi_domain (mean run length)", "mean run of one expert (tokens)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4), squeeze=False)
    x = np.arange(len(names))
    for ax, (key, label, unit) in zip(axes[0], metrics):
        model = [layers[n]["correlation"]["model"][key] for n in names]
        shuffled = [layers[n]["correlation"]["shuffled"][key] for n in names]
        ax.bar(x - 0.2, model, 0.4, label="model", color="tab:blue")
        ax.bar(x + 0.2, shuffled, 0.4, label="shuffled positions", color="tab:gray")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, max(1.0, *model, *shuffled) * 1.1)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{title}: correlation length of the top-1 expert sequence".strip(": "), fontsize=10)
    return fig


def probe_bars(layers: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """One panel per layer: probe accuracy per target, chance (dash) and majority (dot)."""
    plt = _pyplot()
    names = list(layers)
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.2), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names):
        probes = layers[name]["probe"]
        targets = list(probes)
        x = np.arange(len(targets))
        ax.bar(x, [probes[t]["accuracy"] for t in targets], 0.6, color="tab:green", label="probe")
        ax.scatter(x, [probes[t]["chance"] for t in targets], marker="_", s=300, color="k", label="1/C")
        ax.scatter(x, [probes[t]["majority"] for t in targets], marker=".", s=60, color="tab:red",
                   label="majority")
        ax.set_xticks(x, targets, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, 1.02)
        ax.set_title(name, fontsize=9)
    axes[0, 0].set_ylabel("held-out accuracy")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{title}: position probes on router inputs".strip(": "), fontsize=10)
    _save(plt, fig, path)


def write_all(layers: dict[str, dict[str, Any]], out_dir: str, title: str = "") -> list[str]:
    """Writes every PNG into ``out_dir``; returns their file names."""
    files = []
    for name, stats in layers.items():
        fname = f"activation_{name.replace('/', '_')}.png"
        activation_heatmap(name, stats, os.path.join(out_dir, fname), title)
        files.append(fname)
    correlation_bars(layers, os.path.join(out_dir, "correlation_length.png"), title)
    probe_bars(layers, os.path.join(out_dir, "probe_accuracy.png"), title)
    return files + ["correlation_length.png", "probe_accuracy.png"]
