"""Lemma 1: gradient descent on the square loss of the weight-sharing MoE
f(x) = sum_i p_i u_i, p_i = 1 iff i = argmin_l ||u_l - x||, with target y = x, *is* k-means.

The MoE loss (1/n) sum_x ||x - u_{c(x)}||^2 is the k-means objective over n, so its
gradient is (2/n) sum_{x in C_j} (u_j - x); with step size n / (2 n_j) for centre j a
gradient step lands on the mean of C_j, i.e. a Lloyd step. We check both numerically
(jax.grad of the MoE vs the closed-form k-means gradient; GD vs Lloyd trajectories).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import data
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(k=8, d=10, n=4000, iterations=15),
    "converged": dict(k=8, d=10, n=4000, iterations=15),
    "paper": dict(k=64, d=24, n=64000, iterations=30),
}


def moe_loss(u: jax.Array, x: jax.Array) -> jax.Array:
    """Square loss of the weight-sharing MoE: u ``[k, d]`` centres, x ``[n, d]`` (y = x)."""
    assign = jnp.argmin(jnp.sum((x[:, None] - u[None]) ** 2, -1), axis=1)
    return jnp.mean(jnp.sum((x - u[assign]) ** 2, -1))


def kmeans_gradient(u: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Closed-form gradient of the k-means objective / n, and the cluster sizes ``[k]``."""
    k = u.shape[0]
    assign = jnp.argmin(jnp.sum((x[:, None] - u[None]) ** 2, -1), axis=1)
    sums = jax.ops.segment_sum(x, assign, num_segments=k)
    counts = jax.ops.segment_sum(jnp.ones(x.shape[0]), assign, num_segments=k)
    return 2 * (counts[:, None] * u - sums) / x.shape[0], counts


def trajectories(u0: jax.Array, x: jax.Array, iterations: int) -> dict[str, jax.Array]:
    """GD on the MoE loss with step n / (2 n_j) vs Lloyd's algorithm, from the same u0."""
    n = x.shape[0]

    def step(carry, _):
        u_gd, u_lloyd = carry
        grad = jax.grad(moe_loss)(u_gd, x)
        closed, counts = kmeans_gradient(u_gd, x)
        u_gd = u_gd - (n / (2 * jnp.maximum(counts, 1)))[:, None] * grad
        _, counts_l = kmeans_gradient(u_lloyd, x)
        assign = jnp.argmin(jnp.sum((x[:, None] - u_lloyd[None]) ** 2, -1), axis=1)
        means = (
            jax.ops.segment_sum(x, assign, num_segments=u0.shape[0])
            / jnp.maximum(counts_l, 1)[:, None]
        )
        u_lloyd = jnp.where(counts_l[:, None] > 0, means, u_lloyd)
        out = dict(
            grad_gap=jnp.max(jnp.abs(grad - closed)),
            centre_gap=jnp.max(jnp.abs(u_gd - u_lloyd)),
            loss_gd=moe_loss(u_gd, x),
            loss_lloyd=moe_loss(u_lloyd, x),
        )
        return (u_gd, u_lloyd), out

    _, out = jax.lax.scan(step, (u0, u0), None, length=iterations)
    return out


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    make = functools.partial(data.make_gaussian_mixture, k=cfg["k"], d=cfg["d"], c=1.0)
    _, x_all, _ = common.seed_datasets(make, data.sample_gaussian_mixture, seeds, cfg["n"], 1)
    x = x_all.x  # [S, n, d]
    u0 = jax.vmap(
        lambda xs, s: xs[
            jax.random.choice(jax.random.PRNGKey(s), xs.shape[0], (cfg["k"],), replace=False)
        ]
    )(x, jnp.array(seeds))
    out = jax.jit(jax.vmap(functools.partial(trajectories, iterations=cfg["iterations"])))(u0, x)
    out = {k: np.asarray(v) for k, v in out.items()}  # [S, T]
    rows = [
        dict(seed=s, iteration=t + 1, **{k: float(v[i, t]) for k, v in out.items()})
        for i, s in enumerate(seeds)
        for t in range(cfg["iterations"])
    ]
    summary = {
        "max_grad_gap": float(out["grad_gap"].max()),
        "max_centre_gap": float(out["centre_gap"].max()),
        "final_loss_gd": float(out["loss_gd"][:, -1].mean()),
        "final_loss_lloyd": float(out["loss_lloyd"][:, -1].mean()),
    }
    fig, (ax,) = common.figure(1, 5.0)
    steps = np.arange(1, cfg["iterations"] + 1)
    ax.plot(
        steps,
        out["loss_gd"].mean(0),
        marker="o",
        ms=4,
        label="GD on weight-sharing MoE, step n/(2 n_j)",
    )
    ax.plot(steps, out["loss_lloyd"].mean(0), marker="x", ls="--", label="Lloyd (k-means)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("k-means objective / n")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    result = {"experiment": "lemma1", "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, "lemma1", result, rows, fig)
    return result


EXPERIMENTS = {
    "lemma1": common.Experiment(
        "lemma1", "a GD step of the weight-sharing MoE is a k-means step (Lemma 1)", PRESETS, run
    )
}
