"""Figure 2: mixture of Gaussians, constant label per cluster, linear router + constant experts.

(a) test loss vs training-set size (E = k); (b) test loss vs number of experts (largest
training set); (c) sparsity of the learned vs the shuffled router vs training-set size.
Both sweeps train together in one jit: expert counts are masks over E_max experts.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from moe_jax.synthetic import data, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        k=64,
        d=24,
        c=2.0,
        sizes=[640, 3200, 25600],
        experts=[16, 32, 64, 128],
        steps=3000,
        batch=256,
        n_test=4096,
        router_scale=1.0,
        lr_router=3.2e-3,
        lr_experts=3.2e-4,
    ),
    "converged": dict(
        k=64,
        d=24,
        c=2.0,
        sizes=[640, 1600, 6400, 25600],
        experts=[16, 32, 64, 128],
        steps=8000,
        batch=1024,
        n_test=8192,
        router_scale=0.1,
        lr_router=3.2e-3,
        lr_experts=0.1,
        schedule="cosine",
        converge_window=1000,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        k=64,
        d=24,
        c=2.0,
        sizes=[640, 1600, 3200, 6400, 12800, 25600, 51200, 102400],
        experts=[8, 16, 32, 48, 64, 80, 96, 128],
        steps=20000,
        batch=256,
        n_test=8192,
        router_scale=1.0,
        lr_router=3.2e-3,
        lr_experts=3.2e-4,
    ),
}
METRICS = (
    "loss",
    "loss_soft",
    "mse",
    "mse_soft",
    "steps",
    "converged",
    "train_loss",
    "sparsity",
    "sparsity_exp_mean_nats",
    "sparsity_nats",
    "shuffled_sparsity",
    "shuffled_sparsity_nats",
    "purity",
    "norm_uniformity",
)


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k, d = cfg["k"], cfg["d"]
    make = functools.partial(
        data.make_gaussian_mixture, k=k, d=d, c=cfg["c"], labels="constant", out_dim=10
    )
    _, train_set, test_set = common.seed_datasets(
        make, data.sample_gaussian_mixture, seeds, max(cfg["sizes"]), cfg["n_test"]
    )
    runs, rows = train.concat(
        train.grid(seeds, cfg["sizes"], [k]),  # (a), (c)
        train.grid(seeds, [max(cfg["sizes"])], [e for e in cfg["experts"] if e != k]),  # (b)
    )
    model = models.MoE(
        "linear", "constant", max(cfg["experts"]), d, 10, router_scale=cfg["router_scale"]
    )
    opt = common.train_config(
        cfg,
        steps=cfg["steps"],
        batch_size=cfg["batch"],
        optimizer="adam",
        lr_router=cfg["lr_router"],
        lr_experts=cfg["lr_experts"],
    )
    log = train.TrainLog()
    params = train.train_runs(model, opt, runs, train_set, desc="fig2", log=log)
    rows = common.table(
        rows, {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()}
    )
    summary = common.summarise(rows, ("num_train", "num_experts"), METRICS)

    fig, (ax_a, ax_b, ax_c) = common.figure(3)
    common.plot_curves(
        ax_a,
        summary,
        "num_train",
        "loss",
        {"MoE, learned router": dict(num_experts=k)},
        ylabel="normalised test loss",
        title=f"(a) E = k = {k}",
    )
    common.plot_curves(
        ax_b,
        summary,
        "num_experts",
        "loss",
        {"MoE, learned router": dict(num_train=max(cfg["sizes"]))},
        logx=False,
        ylabel="normalised test loss",
        title=f"(b) n = {max(cfg['sizes'])}",
    )
    ax_b.axvline(k, color="gray", ls=":")
    common.plot_curves(
        ax_c,
        summary,
        "num_train",
        "sparsity",
        {"learned router": dict(num_experts=k)},
        ylabel="sparsity (effective experts)",
        title="(c) sparsity per cluster",
    )
    common.plot_curves(
        ax_c,
        summary,
        "num_train",
        "shuffled_sparsity",
        {"shuffled router": dict(num_experts=k)},
        ylabel="sparsity (effective experts)",
        title="(c) sparsity per cluster",
    )
    result = {"experiment": "fig2", "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, "fig2", result, rows, fig)
    return result


EXPERIMENTS = {
    "fig2": common.Experiment(
        "fig2",
        "MoG + constant labels: loss vs n and vs E, sparsity vs shuffled (Fig. 2)",
        PRESETS,
        run,
    )
}
