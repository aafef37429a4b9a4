"""Figure 6 (Section 3.3, Appendix C.1): mixture of k random rank-t subspaces.

x = U_c z + eps, label w_c^T eps: the clusters are not linearly separable, so the router is
a depth-3 MLP; the k experts are depth-3 MLPs (``expert``). Learned vs frozen router:
soft-MoE test loss vs training-set size, the learned vs shuffled sparsity, and the
uniformity of the norms of the router weights feeding each expert's logit,
E||M_i||^2 / (E||M_i||)^2 (1 = every expert used alike).

Deviation (quick preset): k = 4 linear experts. With MLP experts at this size the frozen
router's MoE is already a dense model that fits the task, and larger k needs far more
steps than CPU minutes allow (docs/synthetic.md).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from moe_jax.synthetic import data, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        k=4,
        d=8,
        t=2,
        noise=0.25,
        expert="linear",
        hidden=32,
        sizes=[1024, 8192],
        steps=3000,
        batch=128,
        n_test=2048,
        lr_router=3.2e-3,
        lr_experts=1e-3,
    ),
    "converged": dict(
        k=4,
        d=8,
        t=2,
        noise=0.25,
        expert="linear",
        hidden=32,
        sizes=[1024, 8192],
        steps=6000,
        batch=256,
        n_test=4096,
        lr_router=3.2e-3,
        lr_experts=1e-3,
        schedule="cosine",
        converge_window=1000,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        k=64,
        d=24,
        t=8,
        noise=0.25,
        expert="mlp",
        hidden=96,
        sizes=[640, 1600, 3200, 6400, 12800, 25600],
        steps=20000,
        batch=256,
        n_test=8192,
        lr_router=3.2e-3,
        lr_experts=1e-3,
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
    make = functools.partial(data.make_subspace_mixture, k=k, d=d, t=cfg["t"], noise=cfg["noise"])
    _, train_set, test_set = common.seed_datasets(
        make, data.sample_subspace_mixture, seeds, max(cfg["sizes"]), cfg["n_test"]
    )
    runs, coords = train.grid(seeds, cfg["sizes"], [k])
    model = models.MoE(
        "mlp", cfg["expert"], k, d, 1, expert_hidden=cfg["hidden"], router_hidden=cfg["hidden"]
    )
    rows = []
    for mode in ("learned", "frozen"):
        opt = common.train_config(
            cfg,
            steps=cfg["steps"],
            batch_size=cfg["batch"],
            optimizer="adam",
            lr_router=cfg["lr_router"],
            lr_experts=cfg["lr_experts"],
            router_mode=mode,
        )
        log = train.TrainLog()
        params = train.train_runs(model, opt, runs, train_set, desc=f"fig6 {mode}", log=log)
        rows += common.table(
            coords,
            {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()},
            model=f"MoE {mode}",
        )
    summary = common.summarise(rows, ("model", "num_train"), METRICS)

    fig, (ax_a, ax_b) = common.figure(2)
    common.plot_curves(
        ax_a,
        summary,
        "num_train",
        "loss_soft",
        {m: dict(model=m) for m in ("MoE learned", "MoE frozen")},
        ylabel="normalised test loss (soft MoE)",
        title=f"(fig6) subspaces, k = {k}, t = {cfg['t']}",
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
        title="sparsity per subspace",
    )
    result = {"experiment": "fig6", "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, "fig6", result, rows, fig)
    return result


EXPERIMENTS = {
    "fig6": common.Experiment(
        "fig6",
        "mixture of subspaces, MLP router + MLP experts: learned vs frozen (Fig. 6)",
        PRESETS,
        run,
    )
}
