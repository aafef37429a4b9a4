"""Multi-gate Mixture-of-Experts (Ma et al., KDD 2018): per-task gates vs one gate vs a shared
bottom.

Data (Ma et al.'s synthetic data): two regression tasks whose correlation is a parameter rho.
u1, u2 orthonormal in R^d, w1 = c u1, w2 = c (rho u1 + sqrt(1 - rho^2) u2), x ~ N(0, I_d),
y_t = w_t^T x + sum_{i<m} sin(alpha_i w_t^T x + beta_i) + eps_t, eps_t ~ N(0, noise^2);
alpha_i, beta_i ~ N(0, 1) are shared by both tasks. rho is the cosine of w1 and w2 (the
Pearson correlation of the linear parts); the label correlation grows with it.

Models (the sizes of Ma et al.'s synthetic experiments): E = 8 experts, each relu(W_i x + b_i)
with 16 units; per task a tower 16 -> 8 -> 1 (ReLU).
* MMoE: one softmax gate per task, g^k(x) = softmax(W_k x), y^k = t^k(sum_i g^k_i(x) f_i(x));
* OMoE: the same experts and towers, one gate shared by the tasks;
* shared bottom: one relu(W x + b) layer whose width matches MMoE's parameter count
  (gates included), the same towers.

All runs of a model (rho values x seeds) train together in one jit through
``train.train_runs``: run (rho, seed) reads dataset ``rho_index * S + seed_index`` and a
seed's model initialisation is the same for every rho. The training loss is
``metrics.mse`` over ``[n, 2]`` predictions, i.e. half the sum of the per-task MSEs
(Adam is invariant to that factor). Reported: per-task test MSE, their sum, each
model's loss over MMoE's on the same data, the test labels' Pearson correlation, the gate
divergence Delta = E_x ||g^1(x) - g^2(x)||_1, and the test loss every 500 steps.

Deviations: alpha_i, beta_i ~ N(0, 1) are drawn per seed (Ma et al. call them given
parameters); far fewer steps and seeds than their 200 runs.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import experts, models, routers, train
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.experiments import common
from moe_jax.synthetic.routers import Params

Array = jax.Array

PRESETS = {
    "quick": dict(
        d=100,
        rhos=[0.0, 0.5, 0.9, 1.0],
        c=1.0,
        num_sines=10,
        noise=0.1,
        num_experts=8,
        expert_hidden=16,
        tower_hidden=8,
        n_train=16384,
        n_test=4096,
        steps=3000,
        batch=128,
        lr=3e-3,
    ),
    "converged": dict(
        d=100,
        rhos=[0.0, 0.5, 0.9, 1.0],
        c=1.0,
        num_sines=10,
        noise=0.1,
        num_experts=8,
        expert_hidden=16,
        tower_hidden=8,
        n_train=16384,
        n_test=4096,
        steps=6000,
        batch=128,
        lr=3e-3,
        chunk=500,
        converge_window=1000,
        converge_rtol=1e-3,
    ),
    "paper": dict(
        d=100,
        rhos=[0.0, 0.25, 0.5, 0.75, 0.9, 1.0],
        c=1.0,
        num_sines=10,
        noise=0.1,
        num_experts=8,
        expert_hidden=16,
        tower_hidden=8,
        n_train=65536,
        n_test=8192,
        steps=20000,
        batch=128,
        lr=1e-3,
    ),
}
MODELS = ("MMoE", "OMoE", "shared bottom")
METRICS = (
    "loss",
    "loss_task1",
    "loss_task2",
    "loss_vs_mmoe",
    "label_corr",
    "gate_divergence",
    "steps",
    "converged",
    "train_loss",
)


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


class CorrelatedTasks(NamedTuple):
    """Two regression tasks: label vectors w ``[2, d]`` (cosine rho, norm c), sine
    frequencies alpha ``[m]`` and phases beta ``[m]``, label noise std ``noise`` (scalar)."""

    w: Array
    alpha: Array
    beta: Array
    noise: Array


def make_correlated_tasks(
    key: Array, d: int, rho: float, *, c: float = 1.0, num_sines: int = 10, noise: float = 0.1
) -> CorrelatedTasks:
    """Ma et al.'s task pair with weight-vector cosine ``rho`` in [-1, 1].

    u1, u2, alpha, beta depend on ``key`` only, so one key gives the same pair of
    directions (and sines) for every rho.
    """
    if not -1.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [-1, 1], got {rho}")
    k_u, k_a, k_b = jax.random.split(key, 3)
    u, _ = jnp.linalg.qr(jax.random.normal(k_u, (d, 2)))  # orthonormal columns u1, u2
    w = c * jnp.stack([u[:, 0], rho * u[:, 0] + (1.0 - rho**2) ** 0.5 * u[:, 1]])
    return CorrelatedTasks(
        w,
        jax.random.normal(k_a, (num_sines,)),
        jax.random.normal(k_b, (num_sines,)),
        jnp.asarray(noise),
    )


def sample_correlated_tasks(task: CorrelatedTasks, key: Array, n: int) -> Batch:
    """x ``[n, d]`` ~ N(0, I); y ``[n, 2]`` (one column per task); cluster ``[n]`` zeros
    (the task has no clusters)."""
    k_x, k_e = jax.random.split(key)
    x = jax.random.normal(k_x, (n, task.w.shape[1]))
    z = x @ task.w.T  # [n, 2]
    sines = jnp.sin(z[..., None] * task.alpha + task.beta).sum(axis=-1)
    y = z + sines + task.noise * jax.random.normal(k_e, z.shape)
    return Batch(x, y, jnp.zeros(n, jnp.int32))


# ---------------------------------------------------------------------------------------
# Models (the interface of ``models``: params {"router", "experts"}, apply -> (pred, gates))
# ---------------------------------------------------------------------------------------


def _towers_init(key: Array, num_tasks: int, d_in: int, hidden: int) -> list[Params]:
    """One ReLU tower d_in -> hidden -> 1 per task, every leaf stacked ``[K, ...]``."""
    return jax.vmap(lambda k: routers.mlp_init(k, [d_in, hidden, 1]))(
        jax.random.split(key, num_tasks)
    )


def _towers_apply(towers: list[Params], h: Array) -> Array:
    """Task k's tower on its representation: ``h`` ``[n, K, m]`` -> predictions ``[n, K]``."""
    return jax.vmap(routers.mlp_apply, in_axes=(0, 1), out_axes=1)(towers, h)[..., 0]


@dataclasses.dataclass(frozen=True)
class MultiGateMoE:
    """MMoE (``per_task_gates``, one gate per task) or OMoE (one gate for all tasks).

    Gates: W ``[G, E, d]`` (G = K or 1), g(x) = softmax(W x), under "router"; experts
    relu(W_i x + b_i) ``[E, d, expert_hidden]`` and the towers under "experts".
    """

    d_in: int
    num_tasks: int
    num_experts: int
    expert_hidden: int
    tower_hidden: int
    per_task_gates: bool = True

    @property
    def num_gates(self) -> int:
        return self.num_tasks if self.per_task_gates else 1

    def init(self, key: Array) -> Params:
        k_g, k_e, k_t = jax.random.split(key, 3)
        gates = jax.vmap(lambda k: routers.linear_init(k, self.d_in, self.num_experts))(
            jax.random.split(k_g, self.num_gates)
        )
        return {
            "router": gates,
            "experts": {
                "experts": experts.init(
                    "linear", k_e, self.num_experts, self.d_in, self.expert_hidden
                ),
                "towers": _towers_init(k_t, self.num_tasks, self.expert_hidden, self.tower_hidden),
            },
        }

    def apply(
        self, params: Params, x: Array, *, expert_count: Array | None = None
    ) -> tuple[Array, Array]:
        """``x`` ``[n, d]`` -> (predictions ``[n, K]``, gates ``[n, G, E]``); only the first
        ``expert_count`` experts are used when it is given."""
        logits = jnp.einsum("nd,ged->nge", x, params["router"]["w"])
        if expert_count is not None:
            logits = jnp.where(jnp.arange(self.num_experts) < expert_count, logits, -jnp.inf)
        gates = jax.nn.softmax(logits, axis=-1)
        outputs = jax.nn.relu(experts.apply(params["experts"]["experts"], x))  # [n, E, h]
        mixed = jnp.einsum("nge,neh->ngh", gates, outputs)
        # OMoE: one mixture for all
        mixed = jnp.broadcast_to(mixed, (x.shape[0], self.num_tasks, self.expert_hidden))
        return _towers_apply(params["experts"]["towers"], mixed), gates


@dataclasses.dataclass(frozen=True)
class SharedBottom:
    """One shared relu(W x + b) layer of width ``hidden`` and a tower per task; all params
    under "experts" (no gate)."""

    d_in: int
    num_tasks: int
    hidden: int
    tower_hidden: int

    def init(self, key: Array) -> Params:
        k_b, k_t = jax.random.split(key)
        return {
            "experts": {
                "bottom": routers.dense_init(k_b, self.d_in, self.hidden),
                "towers": _towers_init(k_t, self.num_tasks, self.hidden, self.tower_hidden),
            }
        }

    def apply(
        self, params: Params, x: Array, *, expert_count: Array | None = None
    ) -> tuple[Array, Array]:
        """``x`` ``[n, d]`` -> (predictions ``[n, K]``, gates ``[n, 1, 1]`` of ones);
        ``expert_count`` is ignored (there are no experts)."""
        bottom = params["experts"]["bottom"]
        h = jax.nn.relu(x @ bottom["w"] + bottom["b"])
        h = jnp.broadcast_to(h[:, None], (x.shape[0], self.num_tasks, self.hidden))
        return _towers_apply(params["experts"]["towers"], h), jnp.ones((x.shape[0], 1, 1))

    @classmethod
    def matching(
        cls, num_params: int, d_in: int, num_tasks: int, tower_hidden: int
    ) -> SharedBottom:
        """The width whose parameter count, h (d_in + 1) + K (h t + 2 t + 1), is closest to
        ``num_params``."""
        per_unit = d_in + 1 + num_tasks * tower_hidden
        return cls(
            d_in,
            num_tasks,
            max(1, round((num_params - num_tasks * (2 * tower_hidden + 1)) / per_unit)),
            tower_hidden,
        )


def build_models(cfg: dict[str, Any]) -> dict[str, MultiGateMoE | SharedBottom]:
    """MMoE, OMoE and the shared bottom matched to MMoE's parameter count, for 2 tasks."""
    mmoe = MultiGateMoE(cfg["d"], 2, cfg["num_experts"], cfg["expert_hidden"], cfg["tower_hidden"])
    size = models.count_params(mmoe.init(jax.random.PRNGKey(0)))
    return {
        "MMoE": mmoe,
        "OMoE": dataclasses.replace(mmoe, per_task_gates=False),
        "shared bottom": SharedBottom.matching(size, cfg["d"], 2, cfg["tower_hidden"]),
    }


# ---------------------------------------------------------------------------------------
# Metrics and the experiment
# ---------------------------------------------------------------------------------------


def gate_divergence(gates: Array) -> Array:
    """Mean over inputs and ordered pairs of distinct gates of ||g^k(x) - g^k'(x)||_1:
    gates ``[n, G, E]`` -> scalar (0 when G = 1)."""
    num_gates = gates.shape[1]
    if num_gates == 1:
        return jnp.zeros(())
    l1 = jnp.abs(gates[:, :, None] - gates[:, None, :]).sum(axis=-1)  # [n, G, G]
    return l1.sum(axis=(1, 2)).mean() / (num_gates * (num_gates - 1))


def pearson(a: Array, b: Array) -> Array:
    """Pearson correlation of two ``[n]`` samples."""
    a, b = a - a.mean(), b - b.mean()
    return jnp.sum(a * b) / jnp.sqrt(jnp.sum(a * a) * jnp.sum(b * b))


@functools.partial(jax.jit, static_argnums=0)
def _test_metrics(
    model: MultiGateMoE | SharedBottom,
    params: Params,
    data_index: Array,
    expert_count: Array,
    test: Batch,
) -> dict[str, Array]:
    """``evaluate``'s metrics, jitted once per model (params ``[R, ...]``, test
    ``[S', n, ...]``)."""

    def one(p: Params, index: Array, count: Array) -> dict[str, Array]:
        batch = jax.tree.map(lambda leaf: leaf[index], test)
        pred, gates = model.apply(p, batch.x, expert_count=count)
        per_task = jnp.mean((pred - batch.y) ** 2, axis=0)  # [K]
        return dict(
            loss=per_task.sum(),
            loss_task1=per_task[0],
            loss_task2=per_task[1],
            label_corr=pearson(batch.y[:, 0], batch.y[:, 1]),
            gate_divergence=gate_divergence(gates),
        )

    return jax.vmap(one)(params, data_index, expert_count)


def evaluate(
    model: MultiGateMoE | SharedBottom, params: Params, runs: train.Runs, test: Batch
) -> dict[str, np.ndarray]:
    """Test metrics of every run, each ``[R]``: loss_task1, loss_task2 (MSE), loss (their
    sum), label_corr (Pearson correlation of the two test labels), gate_divergence."""
    result = _test_metrics(model, params, runs.data_index, runs.expert_count, test)
    return {name: np.asarray(value) for name, value in result.items()}


def relative_to_mmoe(
    rows: list[dict[str, Any]], keys: tuple[str, ...] = ("rho", "seed")
) -> list[dict[str, Any]]:
    """Each row with ``loss_vs_mmoe``: its loss over the loss of the MMoE row with the same
    ``keys`` (the same dataset and init; > 1: MMoE is better)."""
    reference = {tuple(r[k] for k in keys): r["loss"] for r in rows if r["model"] == "MMoE"}
    return [dict(r, loss_vs_mmoe=r["loss"] / reference[tuple(r[k] for k in keys)]) for r in rows]


def recorder(
    model: MultiGateMoE | SharedBottom,
    name: str,
    runs: train.Runs,
    coords: list[dict[str, Any]],
    test: Batch,
    out: list[dict[str, Any]],
) -> Callable[[int, Params], None]:
    """A ``train_runs`` callback appending to ``out`` one row per run: its test loss at
    that step (Ma et al.'s Figure 4 plots such curves)."""

    def record(step: int, params: Params) -> None:
        out.extend(
            common.table(
                coords, {"loss": evaluate(model, params, runs, test)["loss"]}, model=name, step=step
            )
        )

    return record


def rho_grid(
    seeds: list[int], rhos: list[float], num_train: int, num_experts: int
) -> tuple[train.Runs, list[dict[str, Any]]]:
    """Runs rho x seed over datasets stacked rho-major (``[len(rhos) * S, ...]``) and a
    row {rho, seed} per run; a seed has the same init key for every rho."""
    base, _ = train.grid(seeds, [num_train], [num_experts])
    shifted = (base._replace(data_index=base.data_index + i * len(seeds)) for i in range(len(rhos)))
    return train.concat(
        *(
            (runs, [dict(rho=rho, seed=s) for s in seeds])
            for runs, rho in zip(shifted, rhos, strict=True)
        )
    )


def datasets(cfg: dict[str, Any], seeds: list[int]) -> tuple[Batch, Batch]:
    """Train and test sets of every (rho, seed), stacked rho-major ``[len(rhos) * S, n, ...]``."""
    per_rho = [
        common.seed_datasets(
            functools.partial(
                make_correlated_tasks,
                d=cfg["d"],
                rho=rho,
                c=cfg["c"],
                num_sines=cfg["num_sines"],
                noise=cfg["noise"],
            ),
            sample_correlated_tasks,
            seeds,
            cfg["n_train"],
            cfg["n_test"],
        )
        for rho in cfg["rhos"]
    ]

    def stack(batches: list[Batch]) -> Batch:
        return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *batches)

    return stack([t for _, t, _ in per_rho]), stack([t for _, _, t in per_rho])


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    """Train the three models on every (rho, seed), evaluate, write mmoe.{json,csv,png}."""
    train_set, test_set = datasets(cfg, seeds)
    runs, coords = rho_grid(seeds, cfg["rhos"], cfg["n_train"], cfg["num_experts"])
    opt = common.train_config(
        cfg,
        steps=cfg["steps"],
        batch_size=cfg["batch"],
        optimizer="adam",
        lr_router=cfg["lr"],
        lr_experts=cfg["lr"],
        chunk=cfg.get("chunk", min(500, cfg["steps"])),
    )
    rows, sizes = [], {}
    curve_rows: list[dict[str, Any]] = []
    for name, model in build_models(cfg).items():
        log = train.TrainLog()
        params = train.train_runs(
            model,
            opt,
            runs,
            train_set,
            desc=f"mmoe {name}",
            callback=recorder(model, name, runs, coords, test_set, curve_rows),
            log=log,
        )
        sizes[name] = models.count_params(jax.tree.map(lambda leaf: leaf[0], params))
        rows += common.table(
            coords, {**evaluate(model, params, runs, test_set), **log.columns()}, model=name
        )
    rows = relative_to_mmoe(rows)
    summary = common.summarise(rows, ("model", "rho"), METRICS)
    curves = common.summarise(
        relative_to_mmoe(curve_rows, ("rho", "seed", "step")),
        ("model", "rho", "step"),
        ("loss", "loss_vs_mmoe"),
    )

    fig, (ax_a, ax_b, ax_c, ax_d) = common.figure(4)
    common.plot_curves(
        ax_a,
        summary,
        "rho",
        "loss",
        {m: dict(model=m) for m in MODELS},
        logx=False,
        ylabel="test MSE, task 1 + task 2",
        title=f"(a) final test loss ({len(seeds)} seeds)",
    )
    common.plot_curves(
        ax_b,
        summary,
        "rho",
        "loss_vs_mmoe",
        {m: dict(model=m) for m in MODELS},
        logx=False,
        ylabel="loss / MMoE loss (same data, init)",
        title="(b) final loss relative to MMoE",
    )
    common.plot_curves(
        ax_c,
        curves,
        "step",
        "loss_vs_mmoe",
        {f"rho = {rho}": dict(model="OMoE", rho=rho) for rho in cfg["rhos"]},
        logx=False,
        ylabel="OMoE loss / MMoE loss",
        title="(c) one gate vs per-task gates in training",
    )
    ax_c.axhline(1.0, color="gray", ls=":")
    common.plot_curves(
        ax_d,
        summary,
        "rho",
        "gate_divergence",
        {"MMoE": dict(model="MMoE")},
        logx=False,
        ylabel="E ||g1(x) - g2(x)||_1",
        title="(d) MMoE gate divergence",
    )
    result = {
        "experiment": "mmoe",
        "config": cfg,
        "seeds": seeds,
        "num_params": sizes,
        "summary": summary,
        "curves": curves,
    }
    result["files"] = common.write_outputs(out_dir, "mmoe", result, rows, fig)
    return result


EXPERIMENTS = {
    "mmoe": common.Experiment(
        "mmoe",
        "multi-task regression with task correlation rho: MMoE vs OMoE vs shared bottom "
        "(Ma et al. 2018)",
        PRESETS,
        run,
    )
}
