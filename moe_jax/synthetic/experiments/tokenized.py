"""Tables 1 and 2 (Section 3.5, Appendix C.2): the tokenized mixture of Gaussians.

Each input is a sequence of s tokens drawn from a mixture of k Gaussians; the label is
sum_i w_{g_i}^T x_i (linear) or sum_i (w_{g_i}^T x_i)^2 (quadratic). The MoE routes every
token on its own to one of E linear experts and sums the per-token outputs; it is compared
with the same MoE behind a frozen router and with a dense 2-layer MLP (applied per token,
outputs summed) holding the MoE's parameter count. Table 1: test loss vs s of the soft
MoE (the paper evaluates "a soft variant" here; the top-1 loss is in the JSON too); Table 2:
sparsity (effective experts) of the learned, shuffled and frozen routers vs s. The router
starts small (``router_scale``) so that the frozen router routes almost uniformly, as
Table 2's 28.5 of 32 experts shows the paper's did.
``label_reduce`` "mean" averages the label over the tokens instead of summing it (a trial
of the reading under which the paper's dense MSE can fall with s; docs/synthetic.md).

Sequence lengths change the data's shape, so each (output, s) pair is its own jit; seeds
are vmapped inside it.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

from moe_jax.synthetic import data, models, train
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        k=32,
        d=32,
        c=2.0,
        num_experts=32,
        lengths=[4, 8, 16],
        outputs=["linear", "quadratic"],
        n_train=4096,
        n_test=1024,
        steps=1500,
        batch=64,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        router_scale=0.05,
        label_reduce="sum",
    ),
    "converged": dict(
        k=32,
        d=32,
        c=2.0,
        num_experts=32,
        lengths=[4, 8, 16],
        outputs=["linear"],
        n_train=8192,
        n_test=2048,
        steps=4000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        router_scale=0.25,
        label_reduce="sum",
        schedule="cosine",
        converge_window=500,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        k=32,
        d=32,
        c=2.0,
        num_experts=32,
        lengths=[4, 8, 16],
        outputs=["linear", "quadratic"],
        n_train=51200,
        n_test=8192,
        steps=20000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        router_scale=0.05,
        label_reduce="sum",
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
)
MODELS = ("MoE learned", "MoE frozen", "dense 2 layers")


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k, d, e = cfg["k"], cfg["d"], cfg["num_experts"]
    runs, coords = train.grid(seeds, [cfg["n_train"]], [e])
    moe = models.MoE("linear", "linear", e, d, 1, router_scale=cfg["router_scale"])
    dense = models.Dense.matching(models.count_params(moe.init(common.seed_key(0, 1))), d, 1, 2)
    candidates = {
        "MoE learned": (moe, "learned"),
        "MoE frozen": (moe, "frozen"),
        "dense 2 layers": (dense, "learned"),
    }
    rows = []
    for output in cfg["outputs"]:
        for length in cfg["lengths"]:
            make = functools.partial(
                data.make_tokenized_mixture,
                k=k,
                d=d,
                length=length,
                c=cfg["c"],
                quadratic=output == "quadratic",
                label_reduce=cfg["label_reduce"],
            )
            _, train_set, test_set = common.seed_datasets(
                make, data.sample_tokenized_mixture, seeds, cfg["n_train"], cfg["n_test"]
            )
            for label, (model, mode) in candidates.items():
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
                params = train.train_runs(
                    model,
                    opt,
                    runs,
                    train_set,
                    desc=f"tokenized {output} s={length} {label}",
                    log=log,
                )
                rows += common.table(
                    coords,
                    {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()},
                    model=label,
                    output=output,
                    length=length,
                )
    summary = common.summarise(rows, ("output", "model", "length"), METRICS)

    result = {
        "experiment": "tokenized",
        "config": cfg,
        "seeds": seeds,
        "dense_hidden": dense.hidden,
        "summary": summary,
    }
    result["files"] = common.write_outputs(out_dir, "tokenized", result, rows, plot(result))
    return result


def plot(result: dict[str, Any]):
    """Tables 1 and 2 as curves vs sequence length, from the JSON's ``summary``: test loss
    per output, then the sparsity of every output and router in one panel, its legend in
    the band above E (the largest sparsity) so that it covers no curve."""
    cfg, summary = result["config"], result["summary"]
    fig, axes = common.figure(len(cfg["outputs"]) + 1)
    for ax, output in zip(axes[:-1], cfg["outputs"], strict=True):
        common.plot_curves(
            ax,
            summary,
            "length",
            "loss_soft",
            {m: dict(model=m, output=output) for m in MODELS},
            ylabel="normalised test loss (soft MoE)",
            title=f"Table 1: {output} output",
        )
    ax = axes[-1]
    for output in cfg["outputs"]:
        common.plot_curves(
            ax,
            summary,
            "length",
            "sparsity",
            {
                f"{output}, learned": dict(model="MoE learned", output=output),
                f"{output}, frozen": dict(model="MoE frozen", output=output),
            },
            ylabel="sparsity (effective experts)",
        )
        common.plot_curves(
            ax,
            summary,
            "length",
            "shuffled_sparsity",
            {f"{output}, shuffled": dict(model="MoE learned", output=output)},
            ylabel="sparsity (effective experts)",
            title=f"Table 2: sparsity (E = {cfg['num_experts']})",
        )
    for axis in axes:
        axis.set_xlabel("sequence length s (tokens)")
    ax.set_ylim(0, cfg["num_experts"] * 1.6)  # sparsity <= E: the band above it holds the legend
    ax.axhline(cfg["num_experts"], color="gray", lw=0.6, ls=":")
    ax.legend(fontsize=6, ncol=2, loc="upper center")
    return fig


EXPERIMENTS = {
    "tokenized": common.Experiment(
        "tokenized",
        "tokenized MoG, linear / quadratic outputs: loss and sparsity vs s (Tables 1-2)",
        PRESETS,
        run,
        plot,
    )
}
