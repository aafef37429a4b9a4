"""What a reader sees of `analyze positions`: every plot's axes labelled, every console
name explained."""

from __future__ import annotations

import re

from moe_jax.analysis import plots, positions


def _layer(xi: float) -> dict:
    lengths = {"xi_int": xi, "corr_lag": 2, "xi_domain": xi + 0.5}
    return {
        "correlation": {
            "model": lengths,
            "shuffled": {"xi_int": 1.0, "corr_lag": 0, "xi_domain": 1.3},
        },
        "position_information": {"bits": 0.4, "shuffled_bits": 0.01},
        "probe": {"parity": {"accuracy": 0.9, "chance": 0.5, "majority": 0.5}},
        "consecutive": {
            "model": {"top1_repeat": 0.6, "topk_overlap": 0.9},
            "shuffled": {"top1_repeat": 0.25, "topk_overlap": 0.7},
        },
        "drop_rate": {"choices": [0.0, 0.1, 0.4], "overall_choices": 0.1667},
    }


def test_every_correlation_panel_has_a_y_label_and_the_values():
    layers = {"encoder/layers_1": _layer(1.5), "decoder/layers_1": _layer(2.5)}
    fig = plots.correlation_figure(layers, "run")
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.get_xlabel() == "" and ax.get_title()
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    assert heights == [1.5, 2.5, 1.0, 1.0]  # model bars per layer, then shuffled
    fig.clear()


def test_console_names_are_explained_before_the_table():
    table = positions.summary_table({"encoder/layers_1": _layer(1.5)})
    legend, rows = table.split("\n\n", 1)
    used = set(re.findall(r"\b(xi_int|corr_lag|xi_domain|I\(pos;expert\)|repeat|dropped)", rows))
    assert used == {"xi_int", "corr_lag", "xi_domain", "I(pos;expert)", "repeat", "dropped"}
    explained = {
        line.split()[0] for line in legend.splitlines() if line and not line.startswith(" ")
    }
    assert used <= explained
    assert "xi_int 1.50 vs 1.00" in rows
    assert "repeat 0.600 vs 0.250" in rows and "dropped 0.400, all 0.167" in rows


def test_the_drops_plot_has_its_axes_labelled_and_a_line_per_layer():
    layers = {"encoder/layers_1": _layer(1.5), "decoder/layers_1": _layer(2.5)}
    fig = plots.drop_rate_figure(layers, "run")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "token position" and "dropped" in ax.get_ylabel()
    solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [list(line.get_ydata()) for line in solid] == [[0.0, 0.1, 0.4]] * 2
    assert [line.get_ydata()[0] for line in dashed] == [0.1667] * 2  # over all positions
    fig.clear()
