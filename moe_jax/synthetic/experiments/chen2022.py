"""Chen et al. (2022), "Towards Understanding Mixture of Experts in Deep Learning", Table 1.

The mixture of classification (their Definition 3.1, ``data.sample_patch_mixture``):
P patches of dimension d, one feature signal alpha y v_k, one cluster centre beta c_k, one
feature noise gamma eps v_k' of another cluster, Gaussian noise in the rest, shuffled.
A single two-layer CNN (linear or cubic) cannot classify it; a mixture of M such CNNs
behind a linear top-1 router can, if the experts are non-linear: the router learns the
cluster centres and sends each cluster to its own experts (dispatch entropy -> 0).

Four models, all trained by ``train.train_runs`` (seeds vmapped in one jit): the MoEs by
normalised gradient descent on the experts (``TrainConfig.normalize_experts``) and
gradient descent on the zero-initialised router, full batch; the single CNNs (a
``PatchMoE`` with one expert, whose gate is always 1) by Adam with weight decay, as the
paper's appendix A.2. Every (setting, seed) pair is one run: a model's runs over both noise
levels sigma_p and all seeds train together in one jit.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import data, metrics, train
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.experiments import common
from moe_jax.synthetic.routers import Params

Array = jax.Array

ACTIVATIONS = ("linear", "cubic")


@dataclasses.dataclass(frozen=True)
class PatchMoE:
    """F(x) = pi_m(x) f_m(x) for the top-1 expert m = argmax_i h_i(x) + r_i, r_i ~ U[0, noise].

    Router: h(x) = Theta^T sum_p x_p, Theta ``[d, E]`` initialised to zero; pi = softmax(h)
    (unperturbed). Expert m, a two-layer CNN of ``filters`` filters w_j ``[d]`` shared over
    patches: f_m(x) = sum_j a_j sum_p sigma(<w_j, x_p>), a_j = +1 for the first half of the
    filters and -1 for the second, sigma the identity ("linear") or z^3 ("cubic"); filters
    ~ N(0, init_scale^2). With one expert pi = 1 and F is a single CNN. Training loss:
    logistic loss of y F plus ``load_balance`` times Switch's M sum_m f_m P_m.
    """

    num_experts: int
    filters: int
    d: int
    activation: str = "cubic"
    init_scale: float = 1e-4
    noise: float = 1.0
    load_balance: float = 0.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.filters % 2:
            raise ValueError(
                f"filters must be even (half +1, half -1 output weights), got {self.filters}"
            )

    def init(self, key: Array, x_train: Array | None = None) -> Params:
        """router theta ``[d, E]`` = 0; experts w ``[E, filters, d]`` ~ N(0, init_scale^2)."""
        return {
            "router": {"theta": jnp.zeros((self.d, self.num_experts))},
            "experts": {
                "w": self.init_scale
                * jax.random.normal(key, (self.num_experts, self.filters, self.d))
            },
        }

    def expert_outputs(self, params: Params, x: Array) -> Array:
        """Every expert on every example: x ``[n, P, d]`` -> f ``[n, E]``."""
        pre = jnp.einsum("npd,ejd->nejp", x, params["experts"]["w"])
        act = pre**3 if self.activation == "cubic" else pre
        signs = jnp.where(jnp.arange(self.filters) < self.filters // 2, 1.0, -1.0)
        return jnp.einsum("nejp,j->ne", act, signs)

    def route(self, params: Params, x: Array, key: Array) -> tuple[Array, Array]:
        """(pi ``[n, E]`` = softmax of the unperturbed logits, top-1 expert ``[n]`` of the
        logits perturbed by U[0, noise])."""
        logits = jnp.sum(x, axis=1) @ params["router"]["theta"]
        perturbed = logits + self.noise * jax.random.uniform(key, logits.shape)
        return jax.nn.softmax(logits, axis=-1), jnp.argmax(perturbed, axis=-1)

    def apply(self, params: Params, x: Array, key: Array) -> tuple[Array, Array, Array]:
        """x ``[n, P, d]`` -> (F ``[n]``, pi ``[n, E]``, top-1 expert ``[n]``)."""
        probs, expert = self.route(params, x, key)
        gated = probs * self.expert_outputs(params, x)
        return jnp.take_along_axis(gated, expert[:, None], axis=1)[:, 0], probs, expert

    def loss(self, params: Params, batch: Batch, key: Array) -> Array:
        """Mean logistic loss log(1 + exp(-y F(x))) (+ the load-balancing term)."""
        out, probs, expert = self.apply(params, batch.x, key)
        loss = jnp.mean(jax.nn.softplus(-batch.y[:, 0] * out))
        if self.load_balance:
            dispatched = jnp.mean(jax.nn.one_hot(expert, self.num_experts), axis=0)
            loss += (
                self.load_balance * self.num_experts * jnp.sum(dispatched * jnp.mean(probs, axis=0))
            )
        return loss


def evaluate(
    model: PatchMoE, params: Params, runs: train.Runs, test: Batch, num_clusters: int
) -> dict[str, np.ndarray]:
    """Test accuracy (sign of F vs y) and dispatch entropy (eq. 6.1) of every run, each ``[R]``;
    no dispatch entropy for a single CNN (the paper's "NA").

    Routing at test time keeps the uniform perturbation, as the authors' evaluation does
    (with the zero-initialised router it dispatches uniformly, their Table 4).
    """
    result = _evaluate(model, params, runs.key, runs.data_index, test, num_clusters)
    return {
        name: np.asarray(value)
        for name, value in result.items()
        if model.num_experts > 1 or name != "dispatch_entropy"
    }


@functools.partial(jax.jit, static_argnums=(0, 5))
def _evaluate(
    model: PatchMoE, params: Params, keys: Array, data_index: Array, test: Batch, num_clusters: int
) -> dict[str, Array]:
    """``evaluate`` on device, compiled once per model: params ``[R, ...]``, keys ``[R, 2]``,
    data_index ``[R]``, test stacked ``[S, n, ...]`` -> metrics ``[R]``."""

    def one(args: tuple[Params, Array, Array]) -> dict[str, Array]:
        p, key, index = args
        batch = jax.tree.map(lambda leaf: leaf[index], test)
        out, _, expert = model.apply(p, batch.x, jax.random.fold_in(key, 3))
        return {
            "accuracy": jnp.mean(jnp.sign(out) == batch.y[:, 0]),
            "dispatch_entropy": metrics.dispatch_entropy(
                expert, batch.cluster, model.num_experts, num_clusters
            ),
        }

    return jax.lax.map(one, (params, keys, data_index))


MODELS = {
    "Single (linear)": ("linear", 1),
    "Single (nonlinear)": ("cubic", 1),
    "MoE (linear)": ("linear", None),
    "MoE (nonlinear)": ("cubic", None),
}
PAPER_SETTINGS = {"setting 1": 1.0, "setting 2": 2.0}  # Table 1: sigma_p of the noise patches
SHARED = dict(
    k=4,
    d=50,
    num_patches=4,
    alpha=(0.5, 2.0),
    beta=(1.0, 2.0),
    gamma=(0.5, 3.0),
    scale=10.0,
    settings=PAPER_SETTINGS,
    num_experts=8,
    expert_filters=16,
    single_filters=128,
    moe_init=1e-4,
    single_init=0.08,
    route_noise=1.0,
    load_balance=0.0,
    lr_experts=1e-3,
    lr_router=0.1,
    lr_single={"linear": 3e-3, "cubic": 1e-2},
    single_decay=5e-4,
    chunk=50,
    models=list(MODELS),
)
PRESETS = {
    "quick": dict(SHARED, n_train=2000, n_test=2000, moe_steps=200, single_steps=200),
    "converged": dict(SHARED, n_train=4000, n_test=4000, moe_steps=300, single_steps=300),
    "paper": dict(SHARED, n_train=16000, n_test=16000, moe_steps=600, single_steps=800),
}
METRICS = ("accuracy", "dispatch_entropy")


def build(cfg: dict[str, Any], label: str) -> tuple[PatchMoE, train.TrainConfig]:
    """The model and optimiser of one of ``MODELS`` under config ``cfg``."""
    activation, experts = MODELS[label]
    if experts == 1:
        model = PatchMoE(
            1, cfg["single_filters"], cfg["d"], activation, init_scale=cfg["single_init"]
        )
        opt = train.TrainConfig(
            steps=cfg["single_steps"],
            batch_size=None,
            optimizer="adam",
            lr_experts=cfg["lr_single"][activation],
            weight_decay=cfg["single_decay"],
            chunk=cfg["chunk"],
        )
    else:
        model = PatchMoE(
            cfg["num_experts"],
            cfg["expert_filters"],
            cfg["d"],
            activation,
            init_scale=cfg["moe_init"],
            noise=cfg["route_noise"],
            load_balance=cfg["load_balance"],
        )
        opt = train.TrainConfig(
            steps=cfg["moe_steps"],
            batch_size=None,
            optimizer="sgd",
            momentum=0.0,
            lr_router=cfg["lr_router"],
            lr_experts=cfg["lr_experts"],
            normalize_experts=True,
            chunk=cfg["chunk"],
        )
    return model, opt


def setting_runs(
    cfg: dict[str, Any], seeds: list[int]
) -> tuple[train.Runs, list[dict[str, Any]], Batch, Batch]:
    """Every (setting, seed) pair as one run, so that all train in one jit per model.

    Returns the runs (setting-major), one coordinate row per run, and the train / test
    sets stacked ``[settings * seeds, n, P, d]`` in the same order. A seed draws the same
    signals, clusters and labels in every setting; only the noise level differs.
    """
    runs, coords = train.grid(seeds, [cfg["n_train"]], [cfg["num_experts"]])
    settings = cfg["settings"]
    train_sets, test_sets = [], []
    for sigma_p in settings.values():
        make = functools.partial(
            data.make_patch_mixture,
            k=cfg["k"],
            d=cfg["d"],
            num_patches=cfg["num_patches"],
            alpha=cfg["alpha"],
            beta=cfg["beta"],
            gamma=cfg["gamma"],
            sigma_p=sigma_p,
            scale=cfg["scale"],
        )
        _, train_set, test_set = common.seed_datasets(
            make, data.sample_patch_mixture, seeds, cfg["n_train"], cfg["n_test"]
        )
        train_sets.append(train_set)
        test_sets.append(test_set)
    repeat = len(settings)
    runs = train.Runs(
        jnp.tile(runs.key, (repeat, 1)),
        jnp.arange(repeat * len(seeds)),
        jnp.tile(runs.num_train, repeat),
        jnp.tile(runs.expert_count, repeat),
    )
    coords = [
        dict(row, setting=name, sigma_p=sigma_p)
        for name, sigma_p in settings.items()
        for row in coords
    ]

    def stack(sets: list[Batch]) -> Batch:
        return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *sets)

    return runs, coords, stack(train_sets), stack(test_sets)


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k = cfg["k"]
    runs, coords, train_set, test_set = setting_runs(cfg, seeds)
    settings = np.array([row["setting"] for row in coords])
    rows, trajectories = [], []
    for label in cfg["models"]:
        model, opt = build(cfg, label)

        def record(step: int, params: Params, model: PatchMoE = model, label: str = label) -> None:
            result = evaluate(model, params, runs, test_set, k)
            for setting in cfg["settings"]:
                trajectories.append(
                    dict(
                        setting=setting,
                        model=label,
                        step=step,
                        **{m: float(v[settings == setting].mean()) for m, v in result.items()},
                    )
                )

        params = train.init_runs(model, runs, train_set)
        record(0, params)
        params = train.train_runs(
            model, opt, runs, train_set, params, desc=f"chen2022 {label}", callback=record
        )
        metrics = evaluate(model, params, runs, test_set, k)
        rows += common.table(coords, metrics, model=label)
    summary = common.summarise(rows, ("setting", "model"), METRICS)

    fig, axes = common.figure(2 * len(cfg["settings"]))
    for i, setting in enumerate(cfg["settings"]):
        for label in cfg["models"]:
            points = [t for t in trajectories if t["setting"] == setting and t["model"] == label]
            steps = [t["step"] for t in points]
            style = dict(marker="o", ms=2, label=label, color=f"C{list(MODELS).index(label)}")
            axes[2 * i].plot(steps, [100 * t["accuracy"] for t in points], **style)
            if MODELS[label][1] is None:
                axes[2 * i + 1].plot(steps, [t["dispatch_entropy"] for t in points], **style)
        axes[2 * i].set(
            xlabel="step",
            ylabel="test accuracy (%)",
            title=f"{setting} (sigma_p = {cfg['settings'][setting]})",
        )
        axes[2 * i + 1].axhline(np.log(k), color="gray", ls=":", label="log K (uniform)")
        axes[2 * i + 1].set(
            xlabel="step",
            ylabel="dispatch entropy (nats)",
            title=f"{setting}: dispatch entropy",
            ylim=(-0.05, 1.1 * np.log(k)),
        )
        for ax in axes[2 * i : 2 * i + 2]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    result = {
        "experiment": "chen2022",
        "config": cfg,
        "seeds": seeds,
        "summary": summary,
        "trajectories": trajectories,
    }
    result["files"] = common.write_outputs(out_dir, "chen2022", result, rows, fig)
    return result


EXPERIMENTS = {
    "chen2022": common.Experiment(
        "chen2022",
        "Chen et al. 2022 mixture of classification: single CNN vs linear / cubic MoE, "
        "accuracy and dispatch entropy (Table 1)",
        PRESETS,
        run,
    )
}
