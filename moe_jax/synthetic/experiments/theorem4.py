"""Theorem 4 (Appendix F): two truncated Gaussians at +-z (||z|| = 1, radius r < 1), labels
+-v, model f(x) = (2 sigmoid(w^T x) - 1) u, tiny random init, full-batch gradient descent
with eta_u >> eta_w. Claim: w / ||w|| -> +-z, ||w|| grows without bound, u -> +-v.

A large fixed sample stands in for the population; we record cos(w, z), ||w|| and
||u - sign v|| / ||v|| along training.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import data, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        d=10, out_dim=2, sigma=0.5, radius=0.8, n=4096, steps=3000, chunk=250, lr_u=0.5, lr_w=0.05
    ),
    "converged": dict(
        d=10, out_dim=2, sigma=0.5, radius=0.8, n=4096, steps=3000, chunk=250, lr_u=0.5, lr_w=0.05
    ),
    "paper": dict(
        d=50,
        out_dim=4,
        sigma=0.5,
        radius=0.8,
        n=65536,
        steps=20000,
        chunk=1000,
        lr_u=0.5,
        lr_w=0.05,
    ),
}


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    make = functools.partial(
        data.make_truncated_pair,
        d=cfg["d"],
        out_dim=cfg["out_dim"],
        sigma=cfg["sigma"],
        radius=cfg["radius"],
    )
    tasks, train_set, test_set = common.seed_datasets(
        make, data.sample_truncated_pair, seeds, cfg["n"], 2048
    )
    z = jnp.stack([t.z for t in tasks])
    v = jnp.stack([t.v for t in tasks])
    runs, coords = train.grid(seeds, [cfg["n"]], [2])
    model = models.GatedPair(cfg["d"], cfg["out_dim"])

    @jax.jit
    def stats(params):
        w, u = params["router"]["w"], params["experts"]["u"]  # [S, d], [S, out]
        cos = jnp.sum(w * z, -1) / jnp.linalg.norm(w, axis=-1)
        u_err = jnp.linalg.norm(u - jnp.sign(cos)[:, None] * v, axis=-1) / jnp.linalg.norm(
            v, axis=-1
        )
        return jnp.stack([jnp.abs(cos), jnp.linalg.norm(w, axis=-1), u_err], axis=-1)

    trace = []
    opt = train.TrainConfig(
        steps=cfg["steps"],
        chunk=cfg["chunk"],
        batch_size=None,
        optimizer="sgd",
        momentum=0.0,
        lr_router=cfg["lr_w"],
        lr_experts=cfg["lr_u"],
    )
    params = train.train_runs(
        model,
        opt,
        runs,
        train_set,
        desc="theorem4",
        callback=lambda step, p: trace.append((step, np.asarray(stats(p)))),
    )
    results = train.evaluate_runs(model, params, runs, test_set, 2)
    final = trace[-1][1]
    results.update(abs_cos_w_z=final[:, 0], norm_w=final[:, 1], rel_err_u=final[:, 2])
    rows = common.table(coords, results)
    summary = common.summarise(rows, ("num_train",), ("loss", "abs_cos_w_z", "norm_w", "rel_err_u"))

    result = {
        "experiment": "theorem4",
        "config": cfg,
        "seeds": seeds,
        "summary": summary,
        "trajectory": [[s, *map(float, t.mean(0))] for s, t in trace],
    }
    result["files"] = common.write_outputs(out_dir, "theorem4", result, rows, plot(result))
    return result


PANELS = (
    (r"$|\cos(w, z)|$", "alignment of the router with z (1 = aligned)"),
    (r"$\|w\|$", "router norm"),
    (r"$\|u \mp v\| / \|v\|$", "relative error of the expert (0 = exact)"),
)


def plot(result: dict[str, Any]):
    """The three quantities of Theorem 4 vs SGD step, mean over the seeds (the JSON's
    ``trajectory``), each panel with its y label."""
    steps = [row[0] for row in result["trajectory"]]
    values = np.asarray([row[1:] for row in result["trajectory"]])  # [T, 3]
    fig, axes = common.figure(3)
    for ax, j, (symbol, meaning) in zip(axes, range(3), PANELS, strict=True):
        ax.plot(
            steps, values[:, j], marker="o", ms=2, label=f"mean of {len(result['seeds'])} seeds"
        )
        ax.set_xlabel("SGD step")
        ax.set_ylabel(symbol)
        ax.set_title(meaning, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right")
    return fig


EXPERIMENTS = {
    "theorem4": common.Experiment(
        "theorem4",
        "two truncated Gaussians: w/||w|| -> +-z, ||w|| grows, u -> +-v (Thm. 4)",
        PRESETS,
        run,
        plot,
    )
}
