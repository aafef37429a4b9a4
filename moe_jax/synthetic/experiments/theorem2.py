"""Theorem 2: with the router's rows initialised to random training examples and
O(k log k) constant experts, every cluster of a c-separated mixture gets a specialist.

We sweep the number of experts E (masked in one jit) for a data-initialised router and a
random one, train with a small router learning rate (the theorem's regime) and report the
fraction of clusters covered by specialists (``metrics.cluster_coverage``) and the loss.
"""

from __future__ import annotations

import functools
import math
import pathlib
from typing import Any

import jax

from moe_jax.synthetic import data, metrics, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        k=16,
        d=32,
        c=2.0,
        multiples=[1.0, 2.0, 1.0 * math.log(16), 2.0 * math.log(16)],
        n_train=8192,
        n_test=2048,
        steps=1500,
        batch=256,
    ),
    "converged": dict(
        k=16,
        d=32,
        c=2.0,
        multiples=[1.0, 2.0, 1.0 * math.log(16), 2.0 * math.log(16)],
        n_train=8192,
        n_test=4096,
        steps=4000,
        batch=256,
        converge_window=500,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        k=64,
        d=64,
        c=2.0,
        multiples=[1.0, 2.0, math.log(64), 2.0 * math.log(64)],
        n_train=65536,
        n_test=8192,
        steps=10000,
        batch=256,
    ),
}


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k, d = cfg["k"], cfg["d"]
    counts = sorted({math.ceil(m * k) for m in cfg["multiples"]})
    make = functools.partial(
        data.make_gaussian_mixture, k=k, d=d, c=cfg["c"], labels="constant", out_dim=10
    )
    _, train_set, test_set = common.seed_datasets(
        make, data.sample_gaussian_mixture, seeds, cfg["n_train"], cfg["n_test"]
    )
    runs, coords = train.grid(seeds, [cfg["n_train"]], counts)
    opt = common.train_config(
        cfg,
        steps=cfg["steps"],
        batch_size=cfg["batch"],
        optimizer="adam",
        lr_router=1e-4,
        lr_experts=1e-2,
    )
    rows = []
    for init in ("data", "random"):
        model = models.MoE("linear", "constant", max(counts), d, 10, router_init=init)
        log = train.TrainLog()
        params = train.train_runs(model, opt, runs, train_set, desc=f"theorem2 {init}", log=log)
        results = {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()}

        def coverage(p, i, e, model: models.MoE = model):
            x, cluster = test_set.x[i], test_set.cluster[i]
            _, probs = model.apply(p, x, expert_count=e)
            return metrics.cluster_coverage(probs, cluster, k)

        results["coverage"] = jax.device_get(
            jax.jit(jax.vmap(coverage))(params, runs.data_index, runs.expert_count)
        )
        rows += common.table(coords, results, router_init=init)
    summary = common.summarise(
        rows,
        ("router_init", "num_experts"),
        ("loss", "loss_soft", "steps", "converged", "train_loss", "coverage", "sparsity", "purity"),
    )

    fig, (ax_a, ax_b) = common.figure(2)
    series = {
        "data-initialised router": dict(router_init="data"),
        "random router": dict(router_init="random"),
    }
    common.plot_curves(
        ax_a,
        summary,
        "num_experts",
        "coverage",
        series,
        logx=False,
        ylabel="clusters with a specialist",
        title=f"k = {k}; k ln k = {k * math.log(k):.0f}",
    )
    common.plot_curves(
        ax_b, summary, "num_experts", "loss", series, logx=False, ylabel="normalised test loss"
    )
    result = {"experiment": "theorem2", "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, "theorem2", result, rows, fig)
    return result


EXPERIMENTS = {
    "theorem2": common.Experiment(
        "theorem2",
        "data-initialised router + O(k log k) experts: every cluster gets a specialist (Thm. 2)",
        PRESETS,
        run,
    )
}
