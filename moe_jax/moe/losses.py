"""Auxiliary routing losses and routing statistics (unweighted; the layer applies the
gin weights). All averages run over real tokens only (``padding_mask`` 1) of all groups,
except Hugging Face's stack losses (:func:`hf_stack_losses`), which count every position.

Shapes: ``probs``, ``logits``, ``assigned``, ``gates`` are ``[groups, tokens_per_group,
experts]``; ``padding_mask`` is ``[groups, tokens_per_group]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from moe_jax.moe.routers import RouterOutput

Array = jax.Array
_EPS = 1e-9
# The losses that ``AuxLossConfig.router_losses='hf_stack'`` defines per stack, not per layer.
HF_STACK_LOSSES = ("load_balancing_loss", "router_z_loss")


def _token_mean(values: Array, padding_mask: Array) -> Array:
    """Mean over real tokens of ``[groups, tokens_per_group, ...]`` -> ``[...]``."""
    mask = padding_mask.reshape(padding_mask.shape + (1,) * (values.ndim - 2)).astype(values.dtype)
    return jnp.sum(values * mask, axis=(0, 1)) / jnp.maximum(jnp.sum(padding_mask), 1.0)


def expert_load(assigned: Array, padding_mask: Array) -> Array:
    """``[experts]``: fraction of tokens sent to each expert (before capacity); sums to k."""
    return _token_mean(assigned, padding_mask)


def load_balancing_loss(probs: Array, assigned: Array, padding_mask: Array) -> Array:
    """Switch / T5X: ``E * sum_i f_i P_i``, ``f_i`` the fraction of tokens sent to expert
    ``i`` by any of their k choices, ``P_i`` the mean router probability.

    Its minimum under uniform routing is ``k`` (``sum_i f_i = k``): the scale grows with
    k, so a weight tuned for top-1 acts k times stronger under top-k.
    """
    num_experts = probs.shape[-1]
    return num_experts * jnp.sum(
        expert_load(assigned, padding_mask) * _token_mean(probs, padding_mask)
    )


def load_balancing_loss_per_unit(probs: Array, assigned: Array, padding_mask: Array) -> Array:
    """:func:`load_balancing_loss` of each unit (axis 0: a routing group or a sequence) over
    its own real tokens, averaged over the units holding any: the loss asks every unit to be
    balanced, not only their union (``balance_scope`` ``group`` / ``sequence``)."""
    mask = padding_mask[..., None].astype(probs.dtype)
    tokens = jnp.sum(padding_mask, axis=1)
    load = jnp.sum(assigned * mask, axis=1) / jnp.maximum(tokens, 1.0)[:, None]
    mean_probs = jnp.sum(probs * mask, axis=1) / jnp.maximum(tokens, 1.0)[:, None]
    per_unit = probs.shape[-1] * jnp.sum(load * mean_probs, axis=-1)
    real = (tokens > 0).astype(per_unit.dtype)
    return jnp.sum(per_unit * real) / jnp.maximum(jnp.sum(real), 1.0)


def router_z_loss(logits: Array, padding_mask: Array) -> Array:
    """ST-MoE: mean over tokens of ``logsumexp(logits)^2``."""
    return _token_mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), padding_mask)


def sequence_router_sums(logits: Array) -> dict[str, Array]:
    """One sparse layer's part of Hugging Face's stack losses (:func:`hf_stack_losses`):
    float32 ``logits [batch, length, experts]`` of every position, padding included ->
    ``z_sum [batch]`` (each sequence's sum of ``logsumexp(logits)^2``), ``prob_sum [batch,
    experts]`` (its sum of the softmax) and ``top1_count [batch, experts]`` (its tokens
    whose largest logit is each expert's; no gradient)."""
    top1 = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return {
        "z_sum": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)), axis=1),
        "prob_sum": jnp.sum(jax.nn.softmax(logits, axis=-1), axis=1),
        "top1_count": jax.lax.stop_gradient(jnp.sum(top1, axis=1)),
    }


def hf_stack_losses(layer_sums: Sequence[Mapping[str, Array]]) -> dict[str, Array]:
    """Hugging Face Switch Transformers' router losses of one stack (unweighted), from the
    :func:`sequence_router_sums` of each of its sparse layers.

    transformers (``SwitchTransformersForConditionalGeneration.forward``) concatenates the
    layers' logits ``[batch, length, experts]`` along the length into ``[batch, n,
    experts]`` (``n`` = sparse layers x length, padding counted) and computes

    * ``router_z_loss`` (``router_z_loss_func``): the mean of ``logsumexp^2`` over all
      ``batch x n`` positions;
    * ``load_balancing_loss`` (``load_balancing_loss_func`` of the softmax and the argmax
      experts): ``E^2`` times the mean over sequences ``b`` and experts ``e`` of ``f_be
      P_be``, ``f_be`` the fraction of the sequence's ``n`` positions whose argmax is ``e``
      (before capacity), ``P_be`` their mean probability of ``e``: ``E sum_e f_be P_be``
      averaged over sequences.
    """
    total = {
        name: sum((s[name] for s in layer_sums[1:]), layer_sums[0][name])
        for name in ("z_sum", "prob_sum", "top1_count")
    }
    positions = jnp.sum(total["top1_count"], axis=-1)  # n per sequence: one argmax each
    fraction = total["top1_count"] / positions[:, None]
    mean_probs = total["prob_sum"] / positions[:, None]
    num_experts = fraction.shape[-1]
    return {
        "load_balancing_loss": num_experts * jnp.mean(jnp.sum(fraction * mean_probs, axis=-1)),
        "router_z_loss": jnp.sum(total["z_sum"]) / jnp.sum(positions),
    }


def cv_squared(values: Array) -> Array:
    """Squared coefficient of variation ``var / mean^2`` of ``[experts]``."""
    return jnp.var(values) / (jnp.square(jnp.mean(values)) + _EPS)


def importance_loss(gates: Array, padding_mask: Array) -> Array:
    """Shazeer: CV^2 of each expert's summed gate values over the batch."""
    return cv_squared(jnp.sum(gates * padding_mask[..., None], axis=(0, 1)))


def expert_importance(router_output: RouterOutput, padding_mask: Array) -> Array:
    """``[experts]`` summed gates over real tokens: the router's own definition when it has
    one (hierarchical: ``Importance_H``), else the sum of the dense ``gates``."""
    if router_output.importance is not None:
        return router_output.importance
    return jnp.sum(router_output.gates * padding_mask[..., None], axis=(0, 1))


def hierarchical_z_loss(
    primary_logits: Array, secondary_logits: Array, padding_mask: Array
) -> Array:
    """Z-loss of a two-level router: the primary gate's plus the mean over expert groups of
    each secondary gate's (``secondary_logits [..., G * b]``, group ``i`` in columns
    ``i * b ... (i + 1) * b - 1``)."""
    num_groups = primary_logits.shape[-1]
    inner = secondary_logits.reshape((*secondary_logits.shape[:-1], num_groups, -1))
    per_group = jnp.mean(jnp.square(jax.nn.logsumexp(inner, axis=-1)), axis=-1)
    return router_z_loss(primary_logits, padding_mask) + _token_mean(per_group, padding_mask)


def load_loss(router_output: RouterOutput, padding_mask: Array) -> Array:
    """Shazeer: CV^2 of the load. Uses the smooth (normal-CDF) estimate of noisy top-k (or
    the hierarchical ``Load_H`` of noisy hierarchical gating) in training, which has
    gradients; otherwise the hard token counts (no gradient)."""
    if router_output.smooth_load is not None:
        return cv_squared(router_output.smooth_load)
    return cv_squared(jnp.sum(router_output.assigned * padding_mask[..., None], axis=(0, 1)))


def routing_entropy(probs: Array, padding_mask: Array) -> Array:
    """Mean over tokens of the entropy (nats) of the router distribution."""
    return _token_mean(-jnp.sum(probs * jnp.log(probs + _EPS), axis=-1), padding_mask)


def auxiliary_losses(
    router_output: RouterOutput,
    padding_mask: Array,
    balance_units: tuple[Array, Array, Array] | None = None,
) -> dict[str, Array]:
    """Every unweighted auxiliary loss, by the name used in the sown collections.

    Args:
      balance_units: ``(probs, assigned, padding_mask)`` as ``[units, tokens_per_unit,
        experts]`` (mask ``[units, tokens_per_unit]``): the load-balancing loss of each
        unit, averaged (:func:`load_balancing_loss_per_unit`); None: one loss over every
        token (``balance_scope='batch'``).
    """
    probs, mask = router_output.probs, padding_mask
    if router_output.primary_logits is None:
        z_loss = router_z_loss(router_output.logits, mask)
    else:
        z_loss = hierarchical_z_loss(router_output.primary_logits, router_output.logits, mask)
    if balance_units is None:
        balance = load_balancing_loss(probs, router_output.assigned, mask)
    else:
        balance = load_balancing_loss_per_unit(*balance_units)
    return {
        "load_balancing_loss": balance,
        "router_z_loss": z_loss,
        "importance_loss": cv_squared(expert_importance(router_output, mask)),
        "load_loss": load_loss(router_output, mask),
        "entropy_loss": routing_entropy(probs, mask),
    }


def routing_metrics(
    router_output: RouterOutput, padding_mask: Array, dropped_fraction: Array
) -> dict[str, Array]:
    """Statistics sown per layer: ``expert_load [experts]``, ``dropped_fraction``,
    ``router_confidence`` (mean top-1 probability), ``gate_margin`` (mean top-1 minus
    top-2 probability: how decided the router is), ``router_entropy``,
    ``max_router_logit`` (over real tokens)."""
    real = padding_mask[..., None] > 0
    top2 = jax.lax.top_k(router_output.probs, min(2, router_output.probs.shape[-1]))[0]
    margin = top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0.0)
    return {
        "expert_load": expert_load(router_output.assigned, padding_mask),
        "dropped_fraction": dropped_fraction,
        "router_confidence": _token_mean(jnp.max(router_output.probs, axis=-1), padding_mask),
        "gate_margin": _token_mean(margin, padding_mask),
        "router_entropy": routing_entropy(router_output.probs, padding_mask),
        "max_router_logit": jnp.max(jnp.where(real, router_output.logits, -jnp.inf)),
    }
