"""Mean and spread over a run family's seeds, for any per-layer statistic of the analyses.

Runs that differ only by their seed directory (``learned/seed0``, ``learned/seed1``: a
sweep family's layout, :func:`moe_jax.runtime.run_names.family_of`) form one family. Per
family, the analyses report each statistic as ``[mean, std]`` over the seeds (sample
standard deviation, ddof 1), so a learned-vs-frozen comparison can be read against the
spread between seeds: :func:`checkpoint_summary` for statistics of one checkpoint (the
steps the seeds share), :func:`curve_summary` for per-run curves over steps (saturation).
A statistic that is ``None`` or absent for a layer (co-activation of a top-1 layer) is
``None``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moe_jax.runtime import run_names


def mean_std(values: Sequence[float | None]) -> list[float] | None:
    """``[mean, std (ddof 1)]`` of two or more values; None when any value is None."""
    present = [v for v in values if v is not None]
    if len(present) < len(values):
        return None
    return [float(np.mean(present)), float(np.std(present, ddof=1))]


def _families(runs: Sequence[Mapping[str, Any]], key: Any) -> list[tuple[Any, list]]:
    """``runs`` grouped by ``(family, key(run))``, groups of two or more, sorted."""
    groups: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for result in runs:
        groups[(run_names.family_of(result["run"]), key(result))].append(result)
    return [(group, results) for group, results in sorted(groups.items()) if len(results) > 1]


def checkpoint_summary(
    checkpoints: Sequence[Mapping[str, Any]], statistics: Sequence[str]
) -> list[dict[str, Any]]:
    """Per family and step held by two or more of its seeds: ``{"family", "step", "seeds",
    "layers": {name: {statistic: [mean, std] | None}}}``, sorted by family and step.

    Args:
      checkpoints: ``[{"run", "step", "layers": {name: {statistic: value}}}]``, one entry
        per checkpoint (an analysis report's ``checkpoints``).
      statistics: the keys of each layer's entry to summarise.
    """
    return [
        {
            "family": family,
            "step": step,
            "seeds": sorted(r["run"] for r in results),
            "layers": {
                name: {
                    key: mean_std([r["layers"][name].get(key) for r in results])
                    for key in statistics
                }
                for name in results[0]["layers"]
            },
        }
        for (family, step), results in _families(checkpoints, lambda r: r["step"])
    ]


def curve_summary(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per family of runs with the same ``steps``: ``{"family", "steps", "seeds", "layers":
    {name: {curve: [[mean, std] per step]}}}``.

    Args:
      runs: ``[{"run", "steps": [...], "layers": {name: {curve: [value per step]}}}]``
        (saturation's ``runs``).
    """
    return [
        {
            "family": family,
            "steps": list(steps),
            "seeds": sorted(r["run"] for r in results),
            "layers": {
                name: {
                    curve: [
                        mean_std(at_step)
                        for at_step in zip(
                            *(r["layers"][name][curve] for r in results), strict=True
                        )
                    ]
                    for curve in curves
                }
                for name, curves in results[0]["layers"].items()
            },
        }
        for (family, steps), results in _families(runs, lambda r: tuple(r["steps"]))
    ]


def _shown(value: list[float] | None) -> str:
    return "-" if value is None else f"{value[0]:.3f} +- {value[1]:.3f}"


def summary_lines(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per family, step and layer of :func:`checkpoint_summary`'s result: each
    statistic's mean +- standard deviation over the seeds."""
    return [
        f"{entry['family']} ({len(entry['seeds'])} seeds)@{entry['step']} {name}: "
        + "; ".join(f"{key} {_shown(value)}" for key, value in stats.items())
        for entry in summary
        for name, stats in entry["layers"].items()
    ]


def curve_lines(summary: Sequence[Mapping[str, Any]], curve: str) -> list[str]:
    """One line per family and layer of :func:`curve_summary`'s result: ``curve``'s mean
    +- standard deviation over the seeds at each step."""
    return [
        f"{entry['family']} ({len(entry['seeds'])} seeds) {name} {curve}: "
        + ", ".join(
            f"step {step} {_shown(value)}"
            for step, value in zip(entry["steps"], curves[curve], strict=True)
        )
        for entry in summary
        for name, curves in entry["layers"].items()
    ]
