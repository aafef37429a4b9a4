"""Figures 3 and 4: mixture of Gaussians, linear router + depth-3 MLP experts.

fig3: constant label per cluster; learned vs frozen router and two dense baselines (one
with a single expert's parameters, one with the whole MoE's, each one layer deeper).
fig4: centred linear label w_c^T (x - mu_c); learned vs frozen router.
Both: loss vs training-set size, and learned vs shuffled sparsity.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from moe_jax.synthetic import data, experts, models, train
from moe_jax.synthetic.experiments import common

_QUICK = dict(
    k=16,
    d=16,
    c=2.0,
    hidden=64,
    sizes=[256, 1024, 4096],
    steps=1000,
    batch=128,
    n_test=2048,
    lr_router=1e-1,
    lr_experts=1e-2,
)
_CONVERGED = dict(
    k=64,
    d=24,
    c=2.0,
    hidden=96,
    sizes=[640, 25600],
    steps=3000,
    batch=32,
    n_test=4096,
    lr_router=1e-1,
    lr_experts=1e-2,
    schedule="cosine",
    converge_window=500,
    converge_rtol=1e-2,
    converge_atol=1e-5,
    chunk=250,
)
_PAPER = dict(
    k=64,
    d=24,
    c=2.0,
    hidden=96,
    sizes=[640, 1600, 3200, 6400, 12800, 25600],
    steps=20000,
    batch=256,
    n_test=8192,
    lr_router=1e-1,
    lr_experts=1e-2,
)
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


def _run(
    name: str,
    labels: str,
    with_dense: bool,
    cfg: dict[str, Any],
    seeds: list[int],
    out_dir: pathlib.Path,
) -> dict[str, Any]:
    k, d = cfg["k"], cfg["d"]
    out = 10 if labels == "constant" else 1
    make = functools.partial(
        data.make_gaussian_mixture, k=k, d=d, c=cfg["c"], labels=labels, out_dim=out
    )
    _, train_set, test_set = common.seed_datasets(
        make, data.sample_gaussian_mixture, seeds, max(cfg["sizes"]), cfg["n_test"]
    )
    runs, coords = train.grid(seeds, cfg["sizes"], [k])
    moe = models.MoE("linear", "mlp", k, d, out, expert_hidden=cfg["hidden"])
    candidates: dict[str, tuple[models.MoE | models.Dense, str]] = {
        "MoE learned": (moe, "learned"),
        "MoE frozen": (moe, "frozen"),
    }
    if with_dense:
        moe_params = models.count_params(moe.init(common.seed_key(0, 1)))
        one_expert = experts.num_params(
            experts.init("mlp", common.seed_key(0, 1), k, d, out, cfg["hidden"])
        )
        candidates["dense (1 expert's params)"] = (
            models.Dense.matching(one_expert, d, out, 4),
            "learned",
        )
        candidates["dense (whole MoE's params)"] = (
            models.Dense.matching(moe_params, d, out, 4),
            "learned",
        )
    rows = []
    for label, (model, mode) in candidates.items():
        opt = common.train_config(
            cfg,
            steps=cfg["steps"],
            batch_size=cfg["batch"],
            optimizer="sgd",
            lr_router=cfg["lr_router"],
            lr_experts=cfg["lr_experts"],
            router_mode=mode,
        )
        log = train.TrainLog()
        params = train.train_runs(model, opt, runs, train_set, desc=f"{name} {label}", log=log)
        rows += common.table(
            coords,
            {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()},
            model=label,
        )
    summary = common.summarise(rows, ("model", "num_train"), METRICS)

    fig, (ax_a, ax_b) = common.figure(2)
    common.plot_curves(
        ax_a,
        summary,
        "num_train",
        "loss",
        {m: dict(model=m) for m in candidates},
        ylabel="normalised test loss",
        title=f"({name}a) loss vs n",
    )
    common.plot_curves(
        ax_b,
        summary,
        "num_train",
        "sparsity",
        {"learned router": dict(model="MoE learned")},
        ylabel="sparsity (effective experts)",
    )
    common.plot_curves(
        ax_b,
        summary,
        "num_train",
        "shuffled_sparsity",
        {"shuffled router": dict(model="MoE learned")},
        ylabel="sparsity (effective experts)",
        title=f"({name}b) sparsity",
    )
    result = {"experiment": name, "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, name, result, rows, fig)
    return result


EXPERIMENTS = {
    "fig3": common.Experiment(
        "fig3",
        "MoG + constant labels, MLP experts: learned vs frozen vs dense (Fig. 3)",
        {"quick": _QUICK, "converged": dict(_CONVERGED, steps=12000), "paper": _PAPER},
        functools.partial(_run, "fig3", "constant", True),
    ),
    "fig4": common.Experiment(
        "fig4",
        "MoG + linear labels, MLP experts: learned vs frozen (Fig. 4)",
        {"quick": _QUICK, "converged": _CONVERGED, "paper": _PAPER},
        functools.partial(_run, "fig4", "linear", False),
    ),
}
