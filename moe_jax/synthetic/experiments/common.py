"""What every experiment shares: per-seed datasets, summaries over seeds, output files."""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from moe_jax import plotting
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.train import TrainConfig, stack_datasets

PRESETS = ("quick", "converged", "paper")

# TrainConfig fields a preset may set (the convergence criterion and the schedule)
TRAINING_KEYS = ("schedule", "warmup", "converge_window", "converge_rtol", "converge_atol", "chunk")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A CLI experiment: ``run(config, seeds, out_dir)`` writes ``<out_dir>/<name>.{json,csv,png}``
    and returns the JSON dict; ``presets`` maps "quick" / "converged" / "paper" to its config
    dict; ``description`` is the one line ``moe-jax synthetic list`` prints."""

    name: str
    description: str
    presets: dict[str, dict[str, Any]]
    run: Callable[[dict[str, Any], list[int], pathlib.Path], dict[str, Any]]
    # the figure from the JSON alone (`synthetic plot`)
    plot: Callable[[dict[str, Any]], Any] | None = None

    def run_preset(
        self, preset: str, cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path
    ) -> dict[str, Any]:
        """``run(cfg, seeds, out_dir)`` of preset ``preset`` (``cfg``: that preset as
        overridden), the preset recorded in the result and its JSON (``"preset"``, beside
        ``"seeds"``): the report judges only converged runs against the paper."""
        result = {"preset": preset, **self.run(cfg, seeds, out_dir)}
        write_json(result["files"]["json"], {k: v for k, v in result.items() if k != "files"})
        return result


def train_config(cfg: dict[str, Any], **fixed: Any) -> TrainConfig:
    """The experiment's ``TrainConfig``: ``fixed`` fields plus any ``TRAINING_KEYS`` the
    preset ``cfg`` sets (a ``converged`` preset's schedule and stopping criterion)."""
    return TrainConfig(**{**{k: cfg[k] for k in TRAINING_KEYS if k in cfg}, **fixed})


def seed_key(seed: int, purpose: int) -> jax.Array:
    """The PRNG key of one ``purpose`` (0 task, 1 runs, 2 train set, 3 test set) of a seed."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), purpose)


def seed_datasets(
    make: Callable[[jax.Array], Any],
    sample: Callable[[Any, jax.Array, int], Batch],
    seeds: list[int],
    n_train: int,
    n_test: int,
) -> tuple[list[Any], Batch, Batch]:
    """One task per seed (``make(key)``) and its train / test sets stacked ``[S, n, ...]``."""
    tasks = [make(seed_key(s, 0)) for s in seeds]
    pairs = list(zip(tasks, seeds, strict=True))
    train = stack_datasets([sample(t, seed_key(s, 2), n_train) for t, s in pairs])
    test = stack_datasets([sample(t, seed_key(s, 3), n_test) for t, s in pairs])
    return tasks, train, test


def table(
    rows: list[dict[str, Any]], results: dict[str, np.ndarray], **extra: Any
) -> list[dict[str, Any]]:
    """One row per run: its coordinates, ``extra`` columns and every metric."""
    return [
        {**row, **extra, **{k: float(v[i]) for k, v in results.items()}}
        for i, row in enumerate(rows)
    ]


def summarise(
    rows: list[dict[str, Any]], by: Iterable[str], metrics: Iterable[str]
) -> list[dict[str, Any]]:
    """Mean and std over seeds of ``metrics`` for each distinct value of the ``by`` columns."""
    by, metrics = list(by), list(metrics)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[b] for b in by), []).append(row)
    out = []
    for key, members in groups.items():
        entry = dict(zip(by, key, strict=True), seeds=len(members))
        for m in metrics:
            values = np.array([r[m] for r in members if m in r], dtype=float)
            if values.size:
                entry[m] = float(values.mean())
                entry[m + "_std"] = float(values.std())
        out.append(entry)
    return out


def curve(
    summary: list[dict[str, Any]], x: str, y: str, **where: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, std) of metric ``y`` over the summary entries matching ``where``, sorted by x."""
    entries = sorted(
        (e for e in summary if all(e.get(k) == v for k, v in where.items()) and y in e),
        key=lambda e: e[x],
    )
    return (
        np.array([e[x] for e in entries]),
        np.array([e[y] for e in entries]),
        np.array([e[y + "_std"] for e in entries]),
    )


def plot_curves(
    ax,
    summary: list[dict[str, Any]],
    x: str,
    y: str,
    series: dict[str, dict[str, Any]],
    *,
    logx: bool = True,
    ylabel: str | None = None,
    title: str = "",
) -> None:
    """One line (mean +- std over seeds) per ``series`` label -> filter on the summary."""
    ticks = set(getattr(ax, "_data_ticks", ()))
    for label, where in series.items():
        xs, mean, std = curve(summary, x, y, **where)
        if xs.size:
            ax.errorbar(xs, mean, yerr=std, marker="o", ms=3, capsize=2, label=label)
            ticks.update(xs.tolist())
    ax._data_ticks = ticks  # several calls on one axis share its ticks
    if logx:
        ax.set_xscale("log")
    style_log_axes(ax, sorted(ticks) if logx else None)
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(ylabel or y.replace("_", " "))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def style_log_axes(ax, xticks: list[float] | None = None) -> None:
    """Readable log axes: labels only at 1, 2 and 5 x 10^i (10^i alone over more than two
    decades), written plainly (0.2, 5, 100), none
    on minor ticks (matplotlib's overlap within a decade, the fig4 bug) and, when
    ``xticks`` is given, major ticks exactly at the data's x values, labelled plainly
    (640, 3200, 25600) with every other label dropped if there are more than 6."""
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        LogLocator,
        NullFormatter,
        NullLocator,
    )

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log" and not isinstance(axis.get_major_locator(), FixedLocator):
            low, high = sorted(abs(v) for v in axis.get_view_interval())
            decades = np.log10(high / max(low, 1e-300))  # over 2 decades: powers of ten only
            axis.set_major_locator(
                LogLocator(base=10, subs=(1.0,) if decades > 2 else (1.0, 2.0, 5.0))
            )
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
    if xticks and ax.get_xscale() == "log":
        ax.xaxis.set_major_locator(FixedLocator(xticks))
        ax.xaxis.set_minor_locator(NullLocator())
        step = 2 if len(xticks) > 6 else 1
        ax.set_xticks(
            xticks, [f"{v:g}" if i % step == 0 else "" for i, v in enumerate(xticks)], fontsize=7
        )


# what ``console_table`` shows, in this order, when an experiment's summary has it
CONSOLE_METRICS = (
    "loss",
    "loss_soft",
    "mse",
    "mse_soft",
    "accuracy",
    "dispatch_entropy",
    "sparsity",
    "shuffled_sparsity",
    "coverage",
    "ratio_final",
    "off_norm_final",
    "abs_cos_w_z",
    "norm_w",
    "rel_err_u",
    "loss_vs_mmoe",
    "gate_divergence",
    "steps",
)
CONSOLE_COLUMNS = 7


def console_table(result: dict[str, Any]) -> str:
    """The experiment's results as a plain-text table for the console: one line per summary
    entry, its coordinates (model, n, ...) then up to ``CONSOLE_COLUMNS`` metrics as
    mean +- std over seeds (``summary`` as a dict of scalars is printed one per line)."""
    summary = result["summary"]
    if isinstance(summary, dict):
        return "\n".join(f"{k:>20}  {v:.4g}" for k, v in summary.items())
    keys = list(dict.fromkeys(k for e in summary for k in e))
    metrics = [m for m in CONSOLE_METRICS if m in keys][:CONSOLE_COLUMNS]
    coords = [
        k
        for k in keys
        if (
            not k.endswith("_std")
            and k not in CONSOLE_METRICS
            and not isinstance(summary[0].get(k), float)
        )
        or k in ("weight_decay", "rho")
    ]
    coords = [
        k for k in coords if k != "seeds" and not any(k == m or k == m + "_std" for m in metrics)
    ]

    def cell(e: dict[str, Any], m: str) -> str:
        if m not in e:
            return "-"
        return f"{e[m]:.4g}" + (f" +- {e[m + '_std']:.2g}" if e.get(m + "_std") else "")

    table = [coords + metrics] + [
        [str(e.get(c, "-")) for c in coords] + [cell(e, m) for m in metrics] for e in summary
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def figure(ncols: int, width: float = 4.0):
    """A row of ``ncols`` matplotlib axes (``moe_jax.plotting``'s set-up)."""

    fig, axes = plotting.pyplot().subplots(1, ncols, figsize=(width * ncols, 3.2), squeeze=False)
    return fig, list(axes[0])


def write_json(path: str, result: dict[str, Any]) -> None:
    """Writes an experiment's result dict as ``path``."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)


def write_outputs(
    out_dir: pathlib.Path, name: str, result: dict[str, Any], rows: list[dict[str, Any]], fig
) -> dict[str, str]:
    """Write ``<out_dir>/<name>.json`` (``result``), ``<name>.csv`` (``rows``) and
    ``<name>.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: str(out_dir / f"{name}.{ext}") for ext in ("json", "csv", "png")}
    write_json(paths["json"], result)
    if rows:
        columns = list(dict.fromkeys(k for row in rows for k in row))
        with open(paths["csv"], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    else:
        paths.pop("csv")

    plotting.save(fig, paths["png"], dpi=80, fixed_size=True)
    return paths
