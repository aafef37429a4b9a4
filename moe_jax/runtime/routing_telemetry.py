"""Routing telemetry per MoE layer (``moe/<stack>/layers_<i>/<name>``), derived from what the
layers sow (no extra forward pass in training): ``dead_experts`` (experts receiving under
``1 / (10 E)`` of the assignments), ``shard_imbalance`` (max / mean tokens per device along
the ``expert`` mesh axis: what makes the all-to-all wait; 1 = balanced or one shard),
``expert_imbalance`` (max / mean tokens per expert), ``max_violation`` (MaxVio,
arXiv:2408.15664: ``expert_imbalance - 1``), ``gate_margin`` (sown: mean top-1 minus
top-2 router probability). At each evaluation :class:`ChurnProbe` adds ``routing_churn``:
the fraction of a fixed probe batch's tokens whose top-1 expert changed since the previous
evaluation (one extra eval-mode forward pass of one batch).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from moe_jax import param_paths, storage
from moe_jax.runtime import builders, routing
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.run_dir import RunDir

DEAD_EXPERT_FRACTION = 0.1  # dead: under DEAD_EXPERT_FRACTION / E of the assignments
_LOAD_SUFFIX = "/expert_load"


def dead_experts(expert_load: np.ndarray, fraction: float = DEAD_EXPERT_FRACTION) -> np.ndarray:
    """Experts receiving under ``fraction / E`` of the assignments.

    Args:
      expert_load: ``[..., experts]`` tokens (or fractions of tokens) sent to each expert.

    Returns:
      int ``[...]`` counts.
    """
    load = np.asarray(expert_load, np.float64)
    share = load / np.maximum(load.sum(-1, keepdims=True), 1e-12)
    return (share < fraction / load.shape[-1]).sum(-1)


def shard_imbalance(expert_load: np.ndarray, num_shards: int) -> np.ndarray:
    """Max / mean tokens per shard when the experts are split into ``num_shards``
    contiguous blocks (the ``expert`` mesh axis): ``[..., experts]`` -> ``[...]``; 1 when
    balanced, ``num_shards`` when one shard gets every token."""
    load = np.asarray(expert_load, np.float64)
    if load.shape[-1] % num_shards:
        raise ValueError(f"{load.shape[-1]} experts do not split over {num_shards} shards")
    per_shard = load.reshape((*load.shape[:-1], num_shards, -1)).sum(-1)
    return per_shard.max(-1) / np.maximum(per_shard.mean(-1), 1e-12)


def max_violation(expert_load: np.ndarray) -> np.ndarray:
    """MaxVio (Wang et al., arXiv:2408.15664, eq. 4): ``max_i (load_i - mean load) / mean
    load`` over ``[..., experts]`` -> ``[...]``; 0 when balanced, ``E - 1`` when one expert
    gets every token."""
    load = np.asarray(expert_load, np.float64)
    return shard_imbalance(load, load.shape[-1]) - 1.0


def routing_telemetry(metrics: dict[str, Any], expert_shards: int = 1) -> dict[str, Any]:
    """``metrics`` plus, for every ``<layer>/expert_load``, ``<layer>/dead_experts``,
    ``<layer>/shard_imbalance`` (over ``expert_shards`` devices),
    ``<layer>/expert_imbalance`` and ``<layer>/max_violation`` (:func:`max_violation`)."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(_LOAD_SUFFIX):
            layer = key[: -len(_LOAD_SUFFIX)]
            load = np.asarray(value)
            out[f"{layer}/dead_experts"] = int(dead_experts(load))
            out[f"{layer}/shard_imbalance"] = float(shard_imbalance(load, expert_shards))
            out[f"{layer}/expert_imbalance"] = float(shard_imbalance(load, load.shape[-1]))
            out[f"{layer}/max_violation"] = float(max_violation(load))
    return out


def routing_churn(previous: np.ndarray, current: np.ndarray, valid: np.ndarray) -> float:
    """Fraction of the ``valid`` tokens whose top-1 expert differs: ``[n, length]`` x3."""
    valid = np.asarray(valid, bool)
    return (
        float(np.mean(np.asarray(previous)[valid] != np.asarray(current)[valid]))
        if valid.any()
        else 0.0
    )


class ChurnProbe:
    """Top-1 experts of a fixed probe batch at each evaluation, and the churn since the
    previous one. The last choices persist in ``MODEL_DIR/routing_probe.npz``, so a resumed
    run measures churn against the evaluation before the interruption."""

    def __init__(
        self,
        model: Model,
        params_shardings: Any,
        ctx: builders.RunContext,
        probe_batch: dict[str, np.ndarray],
        run_dir: RunDir,
        collections_shardings: Any = None,
    ):
        """``probe_batch``: this process's share of the probe batch (numpy);
        ``collections_shardings``: of the model's state collections (None: it has none)."""

        self._fn = routing.routing_fn(
            model, params_shardings, ctx.mesh, ctx.rules, ctx.batch_axes, collections_shardings
        )
        self._batch = builders.global_batch(probe_batch, ctx)
        self._path = run_dir.routing_probe_file
        self._previous: dict[str, np.ndarray] = {}
        if storage.exists(self._path):
            self._previous = {
                k.replace("|", "/"): v for k, v in storage.load_npz(self._path).items()
            }

    def __call__(self, params: Any, collections: Any = None) -> dict[str, float]:
        """``{"moe/<layer>/routing_churn": fraction}`` (empty at the first evaluation);
        ``collections``: the state collections (e.g. ``router_bias``, which moves the
        selection, so churn counts its changes too)."""

        if not param_paths.router_params(params):  # a dense model: nothing routes
            return {}
        layers = routing.collect_routing(self._fn, params, [self._batch], collections)
        top1 = {name: layer.expert_index[..., 0] for name, layer in layers.items()}
        churn = {
            f"moe/{name}/routing_churn": routing_churn(
                self._previous[name], choice, layers[name].valid
            )
            for name, choice in top1.items()
            if name in self._previous and self._previous[name].shape == choice.shape
        }
        self._previous = top1
        if jax.process_index() == 0:
            storage.save_npz(self._path, {k.replace("/", "|"): v for k, v in top1.items()})
        return churn
