"""What a user reads: --help of the gin commands, no gin search-path noise from outside the
repository, and the eval expert-load plot."""

from __future__ import annotations

import logging
import pathlib
import re

import gin
import numpy as np
import pytest

from moe_jax import cli
from moe_jax.commands import evaluate
from moe_jax.runtime import builders, gin_flags, gin_utils

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["train", "eval", "infer", "export"])
def test_help_documents_gin_dot_flags_and_macros(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--gin.NAME=VALUE" in out and "--gin.TRAIN_STEPS=1000" in out
    for macro in (
        "MODEL_DIR",
        "MIXTURE_OR_TASK_NAME",
        "MIXTURE_OR_TASK_MODULE",
        "CHECKPOINT_PATH",
        "EVAL_OUTPUT_DIR",
        "INFER_OUTPUT_DIR",
        "TEXT_TRAIN_FILES",
    ):
        assert re.search(rf"^  {macro} ", out, re.M), macro


def test_every_macro_in_the_help_is_defined_where_it_says():
    for macro, (path, _) in gin_flags.MACROS.items():
        text = (REPO / "gin" / path).read_text()
        assert re.search(rf"^{macro}\s*=", text, re.M), f"{macro} is not defined in gin/{path}"


def test_no_search_path_errors_when_run_outside_the_repository(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    args = gin_flags.parse_flags(builders.build_parser("t", "t"), ["--gin_file=runs/smoke_cpu.gin"])
    try:
        with caplog.at_level(logging.INFO):
            gin_utils.parse_gin(args)
        assert gin.query_parameter("%TRAIN_STEPS") == 300  # the includes were found
    finally:
        gin.clear_config()
    assert not [r for r in caplog.records if "Path not found" in r.getMessage()]


def test_expert_load_plot_marks_uniform_at_k_over_e_with_integer_expert_ticks():
    layers = {
        "encoder/layers_1": {"expert_load": [0.9, 0.5, 0.4, 0.2]},  # top-2 of 4: sums to 2
        "decoder/layers_1": {"expert_load": [0.25] * 8},
    }  # top-2 of 8, balanced
    fig = evaluate.expert_load_figure(layers, "run (step 1)")
    for ax, (k, experts) in zip(fig.axes, [(2.0, 4), (2.0, 8)], strict=True):
        (uniform,) = ax.get_lines()
        np.testing.assert_allclose(uniform.get_ydata(), k / experts)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("uniform" in label and f"/{experts}" in label for label in labels)
        ticks = [t for t in ax.get_xticks() if -0.5 <= t <= experts - 0.5]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert fig.axes[-1].get_xlabel() == "expert"
    fig.clear()
