"""The one training loop and evaluator of the laboratory, vectorised over runs.

A *run* is one training of one model: a seed's dataset, a training-set size and (for
sweeps over expert counts) a number of active experts. ``train_runs`` trains R runs at
once: ``vmap`` over runs of a ``lax.scan`` over ``cfg.chunk`` steps, jitted once; a Python
loop over chunks only advances a tqdm bar (and an optional callback). Different
training-set sizes share one jit because minibatch indices are drawn in ``[0, n_run)``
from a dataset padded to the largest size.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from moe_jax.synthetic import metrics, routers
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.models import MoE
from moe_jax.synthetic.routers import Params

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation of one run (Appendix C).

    batch_size None means full-batch gradient descent (the theory's population GD).
    router_mode "frozen" keeps the router's initial weights bit-for-bit (its updates are
    zeroed by the optimizer). weight_decay is an L2 penalty added to the gradients of
    every parameter (router and experts). normalize_experts divides each expert's gradient
    by its norm before the expert optimizer (normalised gradient descent with "sgd" and
    momentum 0, Chen et al. 2022), see ``normalize_per_expert``.

    schedule "cosine" decays both learning rates to 1 % along ``steps`` (after ``warmup``
    linear steps from 0); "constant" keeps them. converge_window > 0 turns on the
    convergence criterion (``converged``): a run stops updating once the mean training
    loss of its last ``converge_window`` steps differs by at most ``converge_rtol`` (relative)
    from that of the ``converge_window`` steps before, or falls below ``converge_atol``;
    ``steps`` is then the cap. The window must be a multiple of ``chunk``.
    """

    steps: int
    batch_size: int | None = 256
    optimizer: str = "adam"
    lr_router: float = 3.2e-3
    lr_experts: float = 3.2e-4
    momentum: float = 0.9
    weight_decay: float = 0.0
    router_mode: str = "learned"
    normalize_experts: bool = False
    chunk: int = 250
    schedule: str = "constant"
    warmup: int = 0
    converge_window: int = 0
    converge_rtol: float = 1e-3
    converge_atol: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.router_mode not in ("learned", "frozen"):
            raise ValueError(f"router_mode must be 'learned' or 'frozen', got {self.router_mode!r}")
        if self.steps % self.chunk and self.steps > self.chunk:
            raise ValueError(f"steps ({self.steps}) must be a multiple of chunk ({self.chunk})")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.converge_window % self.chunk:
            raise ValueError(
                f"converge_window ({self.converge_window}) must be a multiple of chunk "
                f"({self.chunk})"
            )


def param_labels(params: Params) -> Params:
    """Label every leaf with its top-level group, "router" or "experts"."""
    return {group: jax.tree.map(lambda _, g=group: g, tree) for group, tree in params.items()}


def normalize_per_expert(eps: float = 1e-30) -> optax.GradientTransformation:
    """Scale each expert's gradient to unit norm: every leaf is ``[E, ...]`` and expert i's
    norm is taken over slice i of all leaves together (an expert that got no gradient
    keeps its zero)."""

    def update_fn(
        updates: Params, state: optax.EmptyState, params: Params | None = None
    ) -> tuple[Params, optax.EmptyState]:
        leaves = jax.tree.leaves(updates)
        sq = sum(jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1) for leaf in leaves)  # [E]
        scale = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
        return jax.tree.map(
            lambda g: g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Separate learning rates for router and experts; a frozen router gets zero updates."""

    def branch(peak: float) -> optax.GradientTransformation:
        lr = peak
        if cfg.schedule == "cosine":
            lr = optax.warmup_cosine_decay_schedule(
                0.0 if cfg.warmup else peak,
                peak,
                cfg.warmup,
                max(cfg.steps, cfg.warmup + 1),
                end_value=0.01 * peak,
            )
        base = optax.adam(lr) if cfg.optimizer == "adam" else optax.sgd(lr, momentum=cfg.momentum)
        return (
            optax.chain(optax.add_decayed_weights(cfg.weight_decay), base)
            if cfg.weight_decay
            else base
        )

    router = optax.set_to_zero() if cfg.router_mode == "frozen" else branch(cfg.lr_router)
    experts = (
        optax.chain(normalize_per_expert(), branch(cfg.lr_experts))
        if cfg.normalize_experts
        else branch(cfg.lr_experts)
    )
    return optax.multi_transform({"router": router, "experts": experts}, param_labels)


def converged(history: np.ndarray, window: int, rtol: float, atol: float = 0.0) -> np.ndarray:
    """The convergence criterion on training-loss histories.

    history: ``[R, C]`` mean training loss of each run over each of C chunks; window: in
    chunks. Returns ``[R]`` bool: run r has converged when the mean of its last ``window``
    chunks differs from the mean of the ``window`` chunks before by at most ``rtol`` of the
    latter (so it needs ``2 * window`` chunks), or when its last chunk's loss is <= ``atol``.
    A rising loss counts as a change, so a diverging run never converges.
    """
    history = np.asarray(history, dtype=float)
    floor = history[:, -1] <= atol if history.shape[1] else np.zeros(history.shape[0], bool)
    if history.shape[1] < 2 * window or window <= 0:
        return floor
    now = history[:, -window:].mean(axis=1)
    before = history[:, -2 * window : -window].mean(axis=1)
    return floor | (np.abs(now - before) <= rtol * np.abs(before))


@dataclasses.dataclass
class TrainLog:
    """What ``train_runs`` records per run: train_loss ``[R, C]`` (mean minibatch loss of each
    chunk; chunks after a run stopped repeat its last value), steps ``[R]`` (the updates it
    took) and converged ``[R]`` (whether the criterion stopped it before the step cap)."""

    train_loss: np.ndarray | None = None
    steps: np.ndarray | None = None
    converged: np.ndarray | None = None

    def columns(self) -> dict[str, np.ndarray]:
        """Per-run columns for result tables: steps, converged, final train loss."""
        if self.steps is None or self.converged is None or self.train_loss is None:
            raise ValueError("TrainLog.columns: the log is empty; pass it to train_runs first")
        return {
            "steps": self.steps,
            "converged": self.converged.astype(float),
            "train_loss": self.train_loss[:, -1],
        }


class Runs(NamedTuple):
    """R runs. key ``[R, 2]`` (init + minibatches), data_index ``[R]`` (which seed's
    dataset), num_train ``[R]``, expert_count ``[R]`` (active experts; E when unswept)."""

    key: Array
    data_index: Array
    num_train: Array
    expert_count: Array


def grid(
    seeds: list[int], num_train: list[int], expert_count: list[int]
) -> tuple[Runs, list[dict[str, int]]]:
    """The cartesian product seeds x num_train x expert_count as ``Runs`` plus one row of
    coordinates per run (for tables)."""
    rows = [
        dict(seed=s, num_train=n, num_experts=e)
        for s, n, e in itertools.product(seeds, num_train, expert_count)
    ]
    runs = Runs(
        key=jnp.stack([jax.random.fold_in(jax.random.PRNGKey(r["seed"]), 1) for r in rows]),
        data_index=jnp.array([seeds.index(r["seed"]) for r in rows]),
        num_train=jnp.array([r["num_train"] for r in rows]),
        expert_count=jnp.array([r["num_experts"] for r in rows]),
    )
    return runs, rows


def concat(*grids: tuple[Runs, list[dict[str, Any]]]) -> tuple[Runs, list[dict[str, Any]]]:
    """Several ``grid`` results as one batch of runs (trained in one jit)."""
    runs = Runs(*(jnp.concatenate(fields) for fields in zip(*(g[0] for g in grids), strict=True)))
    return runs, [row for g in grids for row in g[1]]


def _select(data: Batch, data_index: Array, index: Array) -> Batch:
    """Examples ``index`` of dataset ``data_index`` from data stacked ``[S, n, ...]``."""
    return jax.tree.map(lambda leaf: leaf[data_index, index], data)


def init_runs(model: Any, runs: Runs, train: Batch) -> Params:
    """Initial params of every run, stacked ``[R, ...]`` (the data-initialised router
    draws its rows from the run's own training set)."""
    with_data = getattr(model, "router_init", "random") == "data"

    def init(key: Array, i: Array) -> Params:
        if with_data:
            return model.init(jax.random.fold_in(key, 0), train.x[i])
        return model.init(jax.random.fold_in(key, 0))

    return jax.jit(jax.vmap(init))(runs.key, runs.data_index)


def train_runs(
    model: Any,
    cfg: TrainConfig,
    runs: Runs,
    train: Batch,
    params: Params | None = None,
    *,
    desc: str = "train",
    callback: Callable[[int, Params], None] | None = None,
    log: TrainLog | None = None,
) -> Params:
    """Train R runs for ``cfg.steps`` steps; returns the final params ``[R, ...]``.

    train: the training sets stacked ``[S, n_max, ...]``; run r reads dataset
    ``runs.data_index[r]`` and samples minibatches among its first ``runs.num_train[r]``
    examples. ``callback(step, params)`` runs after each chunk (for trajectories).
    A model with a ``loss(params, batch, key)`` method (noisy routing, auxiliary losses)
    is trained on it, with a fresh key each step; others on the MSE of ``apply``.
    With ``cfg.converge_window`` a run that meets ``converged`` stops updating (its params
    stay as they were) and training ends when every run has stopped; ``log`` (if given)
    receives each run's loss history, steps and convergence flag.
    """
    optimizer = make_optimizer(cfg)
    params = init_runs(model, runs, train) if params is None else params
    opt_state = jax.jit(jax.vmap(optimizer.init))(params)
    chunk = min(cfg.chunk, cfg.steps)

    def loss_fn(p: Params, batch: Batch, expert_count: Array, key: Array) -> Array:
        if hasattr(model, "loss"):
            return model.loss(p, batch, key)
        pred, _ = model.apply(p, batch.x, expert_count=expert_count)
        return metrics.mse(pred, batch.y)

    def one_run(p, state, key, data_index, num_train, expert_count, active, start):
        def step(carry, t):
            p, state = carry
            step_key = jax.random.fold_in(key, t)
            if cfg.batch_size is None:
                batch = jax.tree.map(lambda leaf: leaf[data_index], train)
            else:
                idx = jax.random.randint(step_key, (cfg.batch_size,), 0, num_train)
                batch = _select(train, data_index, idx)
            loss, grads = jax.value_and_grad(loss_fn)(
                p, batch, expert_count, jax.random.fold_in(step_key, 1)
            )
            updates, new_state = optimizer.update(grads, state, p)

            def keep(new: Array, old: Array) -> Array:
                return jnp.where(active, new, old)  # a stopped run keeps its params

            return (
                jax.tree.map(keep, optax.apply_updates(p, updates), p),
                jax.tree.map(keep, new_state, state),
            ), loss

        (p, state), losses = jax.lax.scan(step, (p, state), start + jnp.arange(chunk))
        return p, state, jnp.mean(losses)

    run_chunk = jax.jit(jax.vmap(one_run, in_axes=(0, 0, 0, 0, 0, 0, 0, None)))
    num_runs = runs.key.shape[0]
    active = np.ones(num_runs, bool)
    steps = np.zeros(num_runs, int)
    history: list[np.ndarray] = []
    window = cfg.converge_window // chunk
    with tqdm(total=cfg.steps, desc=desc, leave=False, mininterval=1.0) as bar:
        for start in range(0, cfg.steps, chunk):
            params, opt_state, loss = run_chunk(
                params,
                opt_state,
                runs.key,
                runs.data_index,
                runs.num_train,
                runs.expert_count,
                jnp.asarray(active),
                start,
            )
            loss = np.asarray(loss)
            history.append(np.where(active, loss, history[-1] if history else loss))
            steps += chunk * active
            bar.update(chunk)
            if callback is not None:
                callback(start + chunk, params)
            if window:
                active &= ~converged(
                    np.stack(history, axis=1), window, cfg.converge_rtol, cfg.converge_atol
                )
                bar.set_postfix(running=int(active.sum()), refresh=False)
                if not active.any():
                    break
    if log is not None:
        log.train_loss, log.steps = np.stack(history, axis=1), steps
        log.converged = ~active if window else np.zeros(num_runs, bool)
    return params


def evaluate_runs(
    model: Any, params: Params, runs: Runs, test: Batch, num_clusters: int
) -> dict[str, np.ndarray]:
    """Test metrics of every run (top-1 routing, Section 2), each ``[R]``:

    loss (normalised, top-1), loss_soft (normalised, probability-weighted), mse / mse_soft
    (the same unnormalised: the paper's Tables 1 and C.3 report MSE), and for MoE models
    sparsity_nats (mean over clusters of the entropy), sparsity (mean over clusters of its
    exp) and sparsity_exp_mean_nats (exp of the mean entropy), the same for the shuffled router
    (linear / MLP routers), purity, and for those routers norm_uniformity of the weights
    feeding each expert's logit (``routers.expert_weight``).
    ``test.cluster`` is flattened alongside the routing probabilities (tokens).
    """
    is_moe = isinstance(model, MoE)
    shuffleable = is_moe and model.router in ("linear", "mlp")

    def one(args):
        p, key, data_index, expert_count = args
        batch = jax.tree.map(lambda leaf: leaf[data_index], test)
        pred, probs = model.apply(p, batch.x, top1=True, expert_count=expert_count)
        soft, _ = model.apply(p, batch.x, expert_count=expert_count)
        out = {
            "loss": metrics.normalised_loss(pred, batch.y),
            "loss_soft": metrics.normalised_loss(soft, batch.y),
            "mse": metrics.mse(pred, batch.y),
            "mse_soft": metrics.mse(soft, batch.y),
        }
        if not is_moe:
            return out
        flat = probs.reshape(-1, probs.shape[-1])
        cluster = batch.cluster.reshape(-1)
        s = metrics.sparsity(flat, cluster, num_clusters)
        out.update(
            sparsity_nats=s["nats"],
            sparsity=s["effective"],
            sparsity_exp_mean_nats=jnp.exp(s["nats"]),
            purity=metrics.purity(flat, cluster, num_clusters),
        )
        if shuffleable:
            shuffled = {
                **p,
                "router": routers.shuffle_columns(
                    model.router, p["router"], jax.random.fold_in(key, 2)
                ),
            }
            _, sprobs = model.apply(shuffled, batch.x, expert_count=expert_count)
            s = metrics.sparsity(sprobs.reshape(flat.shape), cluster, num_clusters)
            out.update(
                shuffled_sparsity_nats=s["nats"],
                shuffled_sparsity=s["effective"],
                shuffled_sparsity_exp_mean_nats=jnp.exp(s["nats"]),
            )
            out["norm_uniformity"] = metrics.norm_uniformity(
                routers.expert_weight(model.router, p["router"])
            )
        return out

    result = jax.jit(lambda p: jax.lax.map(one, (p, runs.key, runs.data_index, runs.expert_count)))(
        params
    )
    return {name: np.asarray(value) for name, value in result.items()}


def stack_datasets(batches: list[Batch]) -> Batch:
    """One dataset per seed -> stacked ``[S, n, ...]``."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *batches)
