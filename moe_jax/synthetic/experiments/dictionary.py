"""Appendix C.3 (Section 3.6): dictionary learning, a setting the simple router finds hard.

x = sum of samples around r = 2 of c atoms (drawn without replacement), y = (w_i + w_j)^T x.
MoE with E linear experts (learned and frozen router) vs a dense 2-layer MLP with the MoE's
parameter count and a depth-1 (linear) dense model. Sparsity is measured two ways: per
*pair* of atoms (every pair its own cluster; the paper's "samples from different pairs")
and per *atom* (examples grouped by one of their atoms, the other one varying: the paper's
"fix one of the Gaussians"), each beside the shuffled router's.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax.numpy as jnp

from moe_jax.synthetic import data, models, train
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        atoms=[32, 128],
        d=32,
        c=2.0,
        num_experts=32,
        n_train=8192,
        n_test=2048,
        steps=1500,
        batch=128,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
    ),
    "converged": dict(
        atoms=[32, 128],
        d=32,
        c=2.0,
        num_experts=32,
        n_train=102400,
        n_test=4096,
        steps=20000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        schedule="cosine",
        converge_window=500,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        atoms=[32, 128],
        d=32,
        c=2.0,
        num_experts=32,
        n_train=102400,
        n_test=8192,
        steps=20000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
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
    "shuffled_sparsity",
    "sparsity_atom",
    "shuffled_sparsity_atom",
)
MODELS = ("MoE learned", "MoE frozen", "dense 2 layers", "dense 1 layer")


def by_pair(test: Batch, num_atoms: int) -> Batch:
    """Cluster = the unordered pair of atoms, ``[..., 2]`` -> ``[...]`` in [0, c^2)."""
    return test._replace(cluster=jnp.min(test.cluster, -1) * num_atoms + jnp.max(test.cluster, -1))


def by_atom(test: Batch) -> Batch:
    """Cluster = one of the example's two atoms (a uniformly random one: the sampler draws
    them in random order), ``[..., 2]`` -> ``[...]``."""
    return test._replace(cluster=test.cluster[..., 0])


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    d, e = cfg["d"], cfg["num_experts"]
    runs, coords = train.grid(seeds, [cfg["n_train"]], [e])
    moe = models.MoE("linear", "linear", e, d, 1)
    moe_params = models.count_params(moe.init(common.seed_key(0, 1)))
    candidates = {
        "MoE learned": (moe, "learned"),
        "MoE frozen": (moe, "frozen"),
        "dense 2 layers": (models.Dense.matching(moe_params, d, 1, 2), "learned"),
        "dense 1 layer": (models.Dense(d, 1, d, 1), "learned"),
    }
    rows = []
    for c in cfg["atoms"]:
        make = functools.partial(data.make_dictionary, num_atoms=c, d=d, c=cfg["c"])
        _, train_set, test_set = common.seed_datasets(
            make, data.sample_dictionary, seeds, cfg["n_train"], cfg["n_test"]
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
                model, opt, runs, train_set, desc=f"dictionary c={c} {label}", log=log
            )
            results = {
                **train.evaluate_runs(model, params, runs, by_pair(test_set, c), c * c),
                **log.columns(),
            }
            if isinstance(model, models.MoE):
                per_atom = train.evaluate_runs(model, params, runs, by_atom(test_set), c)
                results.update(
                    sparsity_atom=per_atom["sparsity"],
                    shuffled_sparsity_atom=per_atom["shuffled_sparsity"],
                )
            rows += common.table(coords, results, model=label, atoms=c)
    summary = common.summarise(rows, ("atoms", "model"), METRICS)

    fig, (ax_a, ax_b) = common.figure(2)
    common.plot_curves(
        ax_a,
        summary,
        "atoms",
        "loss_soft",
        {m: dict(model=m) for m in MODELS},
        ylabel="normalised test loss (soft MoE)",
        title=f"dictionary, r = 2, E = {e}",
    )
    series = {
        "per pair, learned": "sparsity",
        "per pair, shuffled": "shuffled_sparsity",
        "per atom, learned": "sparsity_atom",
        "per atom, shuffled": "shuffled_sparsity_atom",
    }
    for label, metric in series.items():
        common.plot_curves(
            ax_b,
            summary,
            "atoms",
            metric,
            {label: dict(model="MoE learned")},
            ylabel="sparsity (effective experts)",
            title="sparsity",
        )
    result = {"experiment": "dictionary", "config": cfg, "seeds": seeds, "summary": summary}
    result["files"] = common.write_outputs(out_dir, "dictionary", result, rows, fig)
    return result


EXPERIMENTS = {
    "dictionary": common.Experiment(
        "dictionary",
        "dictionary learning, r = 2 atoms: MoE vs dense vs frozen, sparsity (App. C.3)",
        PRESETS,
        run,
    )
}
