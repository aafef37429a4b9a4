"""Section 3.1, last paragraph (and Theorem 1): a mixture of Gaussians whose clusters live
in the first d' of d dims (the rest iid N(0, 1) noise). The fraction of router weight in
the signal subspace, sum_i ||w_i'||^2 / sum_i ||w_i||^2, starts near d'/d and rises with
training; weight decay pushes it further (Theorem 1: at a regularised optimum it is 1).

Deviation from the paper (quick preset): constant experts instead of depth-3 MLP experts,
which keeps the run in CPU seconds; the router, the metric and the claim are the same.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax
import numpy as np

from moe_jax.synthetic import data, metrics, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(k=16, d=120, d_signal=12, c=2.0, expert="constant", n_train=8192, n_test=2048, steps=2000, batch=256, weight_decay=1e-3),
    "paper": dict(k=64, d=240, d_signal=24, c=2.0, expert="mlp", n_train=51200, n_test=8192, steps=20000, batch=256, weight_decay=1e-3),
}


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k, d, ds = cfg["k"], cfg["d"], cfg["d_signal"]
    make = functools.partial(data.make_gaussian_mixture, k=k, d=d, d_signal=ds, c=cfg["c"], labels="constant", out_dim=10)
    _, train_set, test_set = common.seed_datasets(make, data.sample_gaussian_mixture, seeds, cfg["n_train"], cfg["n_test"])
    runs, coords = train.grid(seeds, [cfg["n_train"]], [k])
    model = models.MoE("linear", cfg["expert"], k, d, 10)
    ratio = jax.jit(jax.vmap(lambda p: metrics.subspace_weight_fraction(p["router"]["w"], ds)))
    init = train.init_runs(model, runs, train_set)
    rows, curves = [], {}
    for wd in (0.0, cfg["weight_decay"]):
        trajectory = [(0, np.asarray(ratio(init)))]
        opt = train.TrainConfig(steps=cfg["steps"], batch_size=cfg["batch"], optimizer="adam", lr_router=3.2e-3, lr_experts=3.2e-3, weight_decay=wd)
        params = train.train_runs(model, opt, runs, train_set, init, desc=f"spurious wd={wd}", callback=lambda step, p: trajectory.append((step, np.asarray(ratio(p)))))
        results = train.evaluate_runs(model, params, runs, test_set, k)
        results["ratio_init"], results["ratio_final"] = trajectory[0][1], trajectory[-1][1]
        rows += common.table(coords, results, weight_decay=wd)
        curves[wd] = trajectory
    summary = common.summarise(rows, ("weight_decay",), ("loss", "ratio_init", "ratio_final", "sparsity", "shuffled_sparsity"))

    fig, (ax,) = common.figure(1, 5.0)
    for wd, trajectory in curves.items():
        steps = [s for s, _ in trajectory]
        values = np.stack([v for _, v in trajectory])
        ax.plot(steps, values.mean(axis=1), marker="o", ms=3, label=f"weight decay {wd:g}")
    ax.axhline(ds / d, color="gray", ls=":", label=f"d'/d = {ds / d:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("router weight in signal subspace")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    result = {"experiment": "spurious", "config": cfg, "seeds": seeds, "summary": summary,
              "trajectory": {str(wd): [[s, float(v.mean())] for s, v in t] for wd, t in curves.items()}}
    result["files"] = common.write_outputs(out_dir, "spurious", result, rows, fig)
    return result


EXPERIMENTS = {"spurious": common.Experiment("spurious", "router weight moves into the non-spurious subspace (Sec. 3.1, Thm. 1)", PRESETS, run)}
