"""``train.profile_steps``: a device trace of exactly the chosen steps in MODEL_DIR/profile,
and a bad value refused by name before anything runs."""

from __future__ import annotations

import collections
import gzip
import json
import pathlib

import pytest

from moe_jax import errors
from tests.train.test_train import run


def _traced_iterations(model_dir: pathlib.Path) -> collections.Counter:
    """How often the loop's iteration and the step's executable appear in the trace."""
    (trace,) = (model_dir / "profile" / "plugins" / "profile").glob("*/*.trace.json.gz")
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = collections.Counter(e.get("name", "") for e in events if e.get("ph") == "X")
    return collections.Counter(
        {
            "iterations": sum(n for k, n in names.items() if "training_loop_iteration" in k),
            "steps": names["PjitFunction(jit(train_step))"],
        }
    )


def test_the_trace_holds_the_chosen_steps_only(tmp_path, capsys):
    result = run(tmp_path / "run", 4, "--gin.train_script.train.profile_steps=(2, 2)")
    assert result["step"] == 4
    traced = _traced_iterations(tmp_path / "run")
    assert traced["iterations"] == 2  # steps 2 and 3 of 4
    assert traced["steps"] >= 2
    assert "traced steps 2-3 into" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["(0, 2)", "(3,)", "'5'", "(2, -1)"])
def test_a_bad_window_is_refused_by_name(tmp_path, value):
    with pytest.raises(errors.ConfigError, match=r"train.profile_steps=.*\(first step, count\)"):
        run(tmp_path / "run", 2, f"--gin.train_script.train.profile_steps={value}")
    assert not (tmp_path / "run").exists()
