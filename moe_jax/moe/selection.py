"""How a token-choice router turns scores into a top-k selection (DeepSeek-V3 options).

* **Sigmoid gating** (DeepSeek-V3, Sec. 2.1.2): scores ``sigmoid(logits)`` instead of a
  softmax; the selected scores are normalised to sum to 1 (:func:`scores`).
* **Auxiliary-loss-free balancing** (Wang et al., 2024; DeepSeek-V3; axlearn's
  ``TopKBiasGating``): a per-expert bias is added to the scores for *selection only*; the
  gates are the unbiased scores. After every training step the bias moves by
  ``u * sign(mean load - load_e)`` (:func:`bias_update`): under-loaded experts become
  more likely to be selected. The bias is not a parameter: it lives in the
  ``collections.BIAS_COLLECTION`` variable collection, which the train step carries (see
  ``models/model.py`` ``STATE_COLLECTIONS``).
* **Group-limited routing** (DeepSeek-V3 node-limited routing, Sec. 2.1.2): the experts
  form ``G`` contiguous groups (the shards of the ``expert`` mesh axis by default); a
  token first keeps its ``M`` groups with the largest sum of their best scores, then
  picks its top-k experts inside them (:func:`group_limited`), so it reaches at most
  ``M`` devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.moe.options import ScoreFunction

Array = jax.Array

# DeepSeek-V3 ranks groups by the sum of each group's best two scores.
GROUP_SCORE_TOP = 2


def scores(logits: Array, score_function: ScoreFunction) -> tuple[Array, Array]:
    """``logits [..., experts]`` -> (selection scores, distribution over experts).

    softmax: both are the softmax. sigmoid: the scores are ``sigmoid(logits)``; the
    distribution (used by the load-balancing loss, confidence and entropy statistics) is
    the scores normalised to sum to 1 per token.
    """
    if score_function == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        return probs, probs
    s = jax.nn.sigmoid(logits)
    return s, s / jnp.sum(s, axis=-1, keepdims=True)


def group_limited(selection: Array, num_groups: int, groups_per_token: int) -> Array:
    """``selection [..., experts]`` with experts outside each token's best
    ``groups_per_token`` of ``num_groups`` contiguous groups set to ``-inf``.

    A group's score is the sum of its ``min(2, experts / G)`` best selection scores.
    """
    *lead, num_experts = selection.shape
    size = num_experts // num_groups
    grouped = selection.reshape(*lead, num_groups, size)
    best, _ = jax.lax.top_k(grouped, min(GROUP_SCORE_TOP, size))
    _, chosen = jax.lax.top_k(jnp.sum(best, axis=-1), groups_per_token)  # [..., M]
    keep = jnp.sum(jax.nn.one_hot(chosen, num_groups, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(selection.shape)


def expert_counts(expert_index: Array, num_experts: int) -> Array:
    """``[experts]`` tokens assigned to each expert (before capacity); index
    ``num_experts`` (padding, not routed) counts nowhere."""
    return jnp.sum(
        jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32),
        axis=tuple(range(expert_index.ndim)),
    )


def bias_update(bias: Array, load: Array, rate: float) -> Array:
    """``bias + rate * sign(mean(load) - load)``: raise under-loaded experts' bias, lower
    over-loaded ones' (DeepSeek-V3's update with speed ``u = rate``)."""
    return bias + rate * jnp.sign(jnp.mean(load) - load)


def check_expert_groups(
    num_experts: int,
    num_groups: int,
    groups_per_token: int,
    groups_option: str,
    per_token_option: str,
) -> None:
    """Refuses G not dividing the experts or a per-token group count outside ``[1, G]``,
    naming the router config's options (``Config.option``: group-limited and hierarchical
    routing)."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"{groups_option}={num_groups} must be >= 1 and divide the number "
            f"of experts ({num_experts})"
        )
    if not 1 <= groups_per_token <= num_groups:
        raise ValueError(
            f"{per_token_option}={groups_per_token} must be between 1 and "
            f"{groups_option.rsplit('.', 1)[-1]}={num_groups}"
        )


def check_group_limit(num_experts: int, k: int, num_groups: int, groups_per_token: int) -> None:
    """Refuses group-limited routing (G groups, M per token; M = 0: off) that the routed
    experts cannot hold, naming the ``TopKRouterConfig`` option. Checked when the layer is
    traced: G defaults to the size of the ``expert`` mesh axis."""
    if not groups_per_token:
        return
    check_expert_groups(
        num_experts,
        num_groups,
        groups_per_token,
        "TopKRouterConfig.num_limited_groups",
        "TopKRouterConfig.max_groups_per_token",
    )
    reachable = groups_per_token * (num_experts // num_groups)
    if k > reachable:
        raise ValueError(
            f"TopKRouterConfig.num_selected_experts: {k} experts per token, but "
            f"max_groups_per_token={groups_per_token} groups of "
            f"{num_experts // num_groups} experts reach only {reachable}"
        )
