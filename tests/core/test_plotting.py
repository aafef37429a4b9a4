"""The shared matplotlib set-up (moe_jax/plotting.py) and the figures drawn from committed
JSON: distinct styles for many runs, legends beside the data, labelled axes, nothing left
out without saying so."""

from __future__ import annotations

import json
import pathlib

from moe_jax import plotting
from moe_jax.experiments import routing_comparison, sweep
from moe_jax.synthetic.experiments import load

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_eleven_runs_get_eleven_distinct_styles():
    styles = plotting.run_styles([f"run{i}" for i in range(11)])
    looks = {(s["color"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == 11


def test_sweep_curves_of_eleven_runs_are_distinct_labelled_and_the_legend_is_beside_them(tmp_path):
    family = sweep.load_family(str(REPO / "configs" / "routing_cpu.toml"))
    summary = json.loads((REPO / "docs/img/routing/routing_cpu_accuracy.json").read_text())
    plt = plotting.pyplot()
    captured = []
    original = plotting.save
    plotting.save = lambda fig, path, dpi=110, **kw: (
        captured.append(fig) or original(fig, path, dpi, **kw)
    )
    try:
        (png,) = sweep.plot_summary(summary, family, str(tmp_path))
    finally:
        plotting.save = original
    assert pathlib.Path(png).stat().st_size > 0
    (ax,) = captured[0].axes
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert (
        len(lines) == 11 and len({(line.get_color(), line.get_linestyle()) for line in lines}) == 11
    )
    assert "fraction" in ax.get_ylabel() and ax.get_xlabel() == "training step"
    captured[0].canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # outside the data area
    plt.close("all")


def test_routing_bars_start_at_zero_and_missing_values_are_marked(tmp_path):
    table = json.loads((REPO / "docs/img/routing/routing_cpu_routing.json").read_text())
    plt = plotting.pyplot()
    original, captured = plotting.save, []
    plotting.save = lambda fig, path, dpi=110, **kw: (
        captured.append(fig) or original(fig, path, dpi, **kw)
    )
    try:
        routing_comparison.plot(table, "routing_cpu", str(tmp_path / "r.png"))
    finally:
        plotting.save = original
    axes = captured[0].axes
    for ax, quantity in zip(axes, routing_comparison.QUANTITIES, strict=True):
        assert ax.get_xlabel()
        if ax.patches:  # bars
            assert quantity not in routing_comparison.ZOOMED and ax.get_xlim()[0] == 0
    dense = sum("dense" in name for name in table)
    assert sum(t.get_text() == "n/a (no routing)" for t in axes[2].texts) == dense > 0
    plt.close("all")


def test_synthetic_figures_redrawn_from_json_have_labelled_axes():
    for name in ("theorem4", "theorem1", "spurious", "tokenized"):
        result = json.loads((REPO / "docs/synthetic_converged" / f"{name}.json").read_text())
        fig = load(name).plot(result)
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
        assert any(ax.get_legend() is not None for ax in fig.axes), name
        plotting.pyplot().close(fig)
