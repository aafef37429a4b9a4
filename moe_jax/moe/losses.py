"""Auxiliary routing losses and routing statistics (unweighted; the layer applies the
gin weights). All averages run over real tokens only (``padding_mask`` 1) of all groups.

Shapes: ``probs``, ``logits``, ``assigned``, ``gates`` are ``[groups, tokens_per_group,
experts]``; ``padding_mask`` is ``[groups, tokens_per_group]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.moe.routers import RouterOutput

Array = jax.Array
_EPS = 1e-9


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
    return num_experts * jnp.sum(expert_load(assigned, padding_mask) * _token_mean(probs, padding_mask))


def router_z_loss(logits: Array, padding_mask: Array) -> Array:
    """ST-MoE: mean over tokens of ``logsumexp(logits)^2``."""
    return _token_mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), padding_mask)


def cv_squared(values: Array) -> Array:
    """Squared coefficient of variation ``var / mean^2`` of ``[experts]``."""
    return jnp.var(values) / (jnp.square(jnp.mean(values)) + _EPS)


def importance_loss(gates: Array, padding_mask: Array) -> Array:
    """Shazeer: CV^2 of each expert's summed gate values over the batch."""
    return cv_squared(jnp.sum(gates * padding_mask[..., None], axis=(0, 1)))


def load_loss(router_output: RouterOutput, padding_mask: Array) -> Array:
    """Shazeer: CV^2 of the load. Uses the smooth (normal-CDF) estimate of noisy top-k in
    training, which has gradients; otherwise the hard token counts (no gradient)."""
    if router_output.smooth_load is not None:
        return cv_squared(router_output.smooth_load)
    return cv_squared(jnp.sum(router_output.assigned * padding_mask[..., None], axis=(0, 1)))


def routing_entropy(probs: Array, padding_mask: Array) -> Array:
    """Mean over tokens of the entropy (nats) of the router distribution."""
    return _token_mean(-jnp.sum(probs * jnp.log(probs + _EPS), axis=-1), padding_mask)


def auxiliary_losses(router_output: RouterOutput, padding_mask: Array) -> dict[str, Array]:
    """Every unweighted auxiliary loss, by the name used in the sown collections."""
    probs, mask = router_output.probs, padding_mask
    return {
        "load_balancing_loss": load_balancing_loss(probs, router_output.assigned, mask),
        "router_z_loss": router_z_loss(router_output.logits, mask),
        "importance_loss": importance_loss(router_output.gates, mask),
        "load_loss": load_loss(router_output, mask),
        "entropy_loss": routing_entropy(probs, mask),
    }


def routing_metrics(router_output: RouterOutput, padding_mask: Array,
                    dropped_fraction: Array) -> dict[str, Array]:
    """Statistics sown per layer: ``expert_load [experts]``, ``dropped_fraction``,
    ``router_confidence`` (mean top-1 probability), ``router_entropy``,
    ``max_router_logit`` (over real tokens)."""
    real = padding_mask[..., None] > 0
    return {
        "expert_load": expert_load(router_output.assigned, padding_mask),
        "dropped_fraction": dropped_fraction,
        "router_confidence": _token_mean(jnp.max(router_output.probs, axis=-1), padding_mask),
        "router_entropy": routing_entropy(router_output.probs, padding_mask),
        "max_router_logit": jnp.max(jnp.where(real, router_output.logits, -jnp.inf)),
    }
