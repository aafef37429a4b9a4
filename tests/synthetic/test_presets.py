"""Every experiment's ``converged`` preset loads and runs a few steps (the full runs are not
tests: their outputs are committed under docs/, see docs/synthetic.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_jax.synthetic import experiments
from moe_jax.synthetic.experiments import common

SMALL = {
    "sizes": [128],
    "n_train": 128,
    "n_test": 64,
    "n": 64,
    "steps": 4,
    "moe_steps": 4,
    "single_steps": 4,
    "chunk": 2,
    "converge_window": 2,
    "iterations": 2,
}
FIRST = {"lengths": 1, "outputs": 1, "atoms": 1, "rhos": 2, "weight_decays": 2, "experts": 2}


def shrink(cfg: dict) -> dict:
    """The preset with tiny data sizes and step counts, every other setting kept."""
    out = {k: SMALL.get(k, v) for k, v in cfg.items()}
    return {k: v[: FIRST[k]] if k in FIRST else v for k, v in out.items()}


# a few steps of these in `make test`; the others (their own jits, 20-110 s here under load)
# are slow
FAST = ("fig2", "spurious", "theorem2")  # tokenized, dictionary: their own tests train them
CASES = [
    pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
    for n in experiments.EXPERIMENTS
    if n != "cifar100"
]


@pytest.mark.parametrize("name", list(experiments.EXPERIMENTS))
def test_every_preset_is_a_valid_training_config(name):
    for preset, cfg in experiments.load(name).presets.items():
        steps = max(cfg.get(k, 0) for k in ("steps", "moe_steps", "single_steps", "iterations"))
        opt = common.train_config(
            cfg, steps=max(steps, cfg.get("converge_window", 0), cfg.get("chunk", 1))
        )
        # a stopping rule that can fire before the cap
        if preset == "converged" and "converge_window" in cfg:
            assert opt.converge_window > 0 and opt.steps >= 2 * opt.converge_window, name


@pytest.mark.parametrize("name", CASES)
def test_converged_preset_loads_and_runs_a_few_steps(name, tmp_path):
    spec = experiments.load(name)
    cfg = spec.presets["converged"]
    spec.run(shrink(cfg), [0], tmp_path)
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert saved["config"] == json.loads(json.dumps(shrink(cfg)))
    summary = saved["summary"]
    values = (
        list(summary.values())
        if isinstance(summary, dict)
        else [e.get("loss", e.get("accuracy")) for e in summary]
    )
    assert values and all(np.isfinite(v) for v in values if v is not None)
    if isinstance(summary, list) and "steps" in summary[0]:
        assert all(e["steps"] <= 4 for e in summary)  # the step cap of the shrunk preset
