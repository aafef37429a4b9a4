"""Section 3.1, last paragraph, and Theorem 1: a mixture of Gaussians whose clusters live
in the first d' of d dims V (the rest iid N(0, 1) noise).

spurious: the fraction of router weight in V, sum_i ||w_i'||^2 / sum_i ||w_i||^2, starts
near d'/d and rises with training; weight decay pushes it further.
theorem1: the component of the router rows outside V, mean_i ||Proj_{V^perp}(w_i)||,
decays toward 0 under weight regularisation (Theorem 1: it is 0 at any regularised local
minimum) and does not without it. Both record the two trajectories; each plots its own.

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
from moe_jax.synthetic.routers import Params

SPURIOUS = {
    "quick": dict(
        k=16,
        d=120,
        d_signal=12,
        c=2.0,
        expert="constant",
        n_train=8192,
        n_test=2048,
        steps=2000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        weight_decays=[0.0, 1e-3],
    ),
    "converged": dict(
        k=16,
        d=120,
        d_signal=12,
        c=2.0,
        expert="constant",
        n_train=8192,
        n_test=4096,
        steps=4000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-2,
        weight_decays=[0.0, 1e-3],
        converge_window=500,
        converge_rtol=1e-3,
        converge_atol=1e-5,
        chunk=250,
    ),
    "paper": dict(
        k=64,
        d=240,
        d_signal=24,
        c=2.0,
        expert="mlp",
        n_train=51200,
        n_test=8192,
        steps=20000,
        batch=256,
        lr_router=3.2e-3,
        lr_experts=3.2e-3,
        weight_decays=[0.0, 1e-3],
    ),
}
THEOREM1 = {
    "quick": dict(SPURIOUS["quick"], steps=3000, weight_decays=[0.0, 1e-3, 1e-2]),
    "converged": dict(SPURIOUS["converged"], weight_decays=[0.0, 1e-3, 1e-2]),
    "paper": dict(SPURIOUS["paper"], weight_decays=[0.0, 1e-4, 1e-3, 1e-2]),
}
# the trajectory each experiment plots: metric name -> (fn of router rows [E, d] and d', y label)
TRACKED = {
    "ratio": (
        metrics.subspace_weight_fraction,
        "router weight in the signal subspace V\n(fraction of the total)",
    ),
    "off_norm": (
        metrics.off_subspace_norm,
        r"mean $\|\mathrm{Proj}_{V^\perp}(w_i)\|$ / its initial value",
    ),
}


def _run(
    name: str, plotted: str, cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path
) -> dict[str, Any]:
    k, d, ds = cfg["k"], cfg["d"], cfg["d_signal"]
    make = functools.partial(
        data.make_gaussian_mixture, k=k, d=d, d_signal=ds, c=cfg["c"], labels="constant", out_dim=10
    )
    _, train_set, test_set = common.seed_datasets(
        make, data.sample_gaussian_mixture, seeds, cfg["n_train"], cfg["n_test"]
    )
    runs, coords = train.grid(seeds, [cfg["n_train"]], [k])
    model = models.MoE("linear", cfg["expert"], k, d, 10)
    track = jax.jit(
        jax.vmap(lambda p: {m: fn(p["router"]["w"], ds) for m, (fn, _) in TRACKED.items()})
    )
    init = train.init_runs(model, runs, train_set)
    rows, curves = [], {}
    for wd in cfg["weight_decays"]:
        trajectory = [(0, track(init))]

        def record(step: int, p: Params, trajectory: list[tuple[int, Any]] = trajectory) -> None:
            trajectory.append((step, track(p)))

        opt = common.train_config(
            cfg,
            steps=cfg["steps"],
            batch_size=cfg["batch"],
            optimizer="adam",
            lr_router=cfg["lr_router"],
            lr_experts=cfg["lr_experts"],
            weight_decay=wd,
        )
        log = train.TrainLog()
        params = train.train_runs(
            model,
            opt,
            runs,
            train_set,
            init,
            desc=f"{name} wd={wd}",
            callback=record,
            log=log,
        )
        results = {**train.evaluate_runs(model, params, runs, test_set, k), **log.columns()}
        for m in TRACKED:
            results[f"{m}_init"], results[f"{m}_final"] = (
                np.asarray(trajectory[0][1][m]),
                np.asarray(trajectory[-1][1][m]),
            )
        rows += common.table(coords, results, weight_decay=wd)
        curves[wd] = trajectory
    tracked = [f"{m}_{when}" for m in TRACKED for when in ("init", "final")]
    summary = common.summarise(
        rows,
        ("weight_decay",),
        (
            "loss",
            "loss_soft",
            "steps",
            "converged",
            "train_loss",
            *tracked,
            "sparsity",
            "shuffled_sparsity",
        ),
    )

    result = {
        "experiment": name,
        "config": cfg,
        "seeds": seeds,
        "summary": summary,
        "trajectory": {
            str(wd): [[s, {m: float(np.mean(v[m])) for m in TRACKED}] for s, v in t]
            for wd, t in curves.items()
        },
    }
    result["files"] = common.write_outputs(out_dir, name, result, rows, plot(result))
    return result


PLOTTED = {"spurious": "ratio", "theorem1": "off_norm"}


def plot(result: dict[str, Any]):
    """The tracked quantity (``ratio`` for spurious, ``off_norm`` relative to step 0 for
    theorem1) vs step, one line per weight decay, mean over seeds (the JSON's ``trajectory``)."""
    plotted, cfg = PLOTTED[result["experiment"]], result["config"]
    fig, (ax,) = common.figure(1, 5.0)
    for wd, trajectory in result["trajectory"].items():
        values = np.asarray([v[plotted] for _, v in trajectory])
        if plotted == "off_norm":
            values = values / values[0]
        ax.plot(
            [s for s, _ in trajectory],
            values,
            marker="o",
            ms=3,
            label=f"weight decay {float(wd):g}",
        )
    if plotted == "ratio":
        ax.axhline(
            cfg["d_signal"] / cfg["d"],
            color="gray",
            ls=":",
            label=f"d'/d = {cfg['d_signal'] / cfg['d']:.2f}",
        )
        ax.set_ylim(0, 1)
    ax.set_xlabel("training step")
    ax.set_ylabel(TRACKED[plotted][1])
    ax.set_title(f"mean of {len(result['seeds'])} seeds", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


EXPERIMENTS = {
    "spurious": common.Experiment(
        "spurious",
        "router weight moves into the non-spurious subspace (Sec. 3.1)",
        SPURIOUS,
        functools.partial(_run, "spurious", "ratio"),
        plot,
    ),
    "theorem1": common.Experiment(
        "theorem1",
        "router rows lose their component outside V under weight decay (Thm. 1)",
        THEOREM1,
        functools.partial(_run, "theorem1", "off_norm"),
        plot,
    ),
}
