"""Routing groups and expert capacity.

Tokens ``[batch * length]`` are cut into ``groups`` of ``tokens_per_group``; routing,
capacity and (for expert choice / BPR) token competition happen inside a group.

* ``tokens_per_group = min(group_size, ceil(num_tokens / group_shards))`` and
  ``groups = ceil(num_tokens / tokens_per_group)`` rounded up to a multiple of
  ``group_shards`` (the number of devices the groups are split over: ``data x expert``
  under a mesh, else 1). Missing tokens are padding (never routed, never counted). When
  ``num_tokens`` is a multiple of ``group_size * group_shards`` this is exactly T5X's
  grouping; otherwise T5X searches for a divisor of ``num_tokens`` where we pad.
* Capacity (tokens per expert per group), two rules:

  - ``t5x``: ``round(capacity_factor * tokens_per_group / num_experts)`` (T5X / Flaxformer;
    *not* multiplied by k: with top-2 and factor 1.25 the buffers hold 1.25 / 2 = 62.5% of
    the assignments of a balanced router). The paper's gin files use it.
  - ``k_scaled``: ``round(capacity_factor * k * tokens_per_group / num_experts)`` (GShard,
    Switch with k > 1: a factor of 1 fits a perfectly balanced router).

  then ``max(capacity, min_expert_capacity)``, clipped to ``tokens_per_group`` (an expert
  never receives more than one assignment per token). A capacity below 1 is refused.
  A fixed capacity (``CapacityConfig.expert_capacity``, Hugging Face Switch Transformers'
  ``expert_capacity``) replaces the rule, clipped the same way.
* ``CapacityConfig.group_by_sequence``: each sequence is one routing group
  (:func:`sequence_layout`), as Hugging Face's Switch Transformers fill capacity per
  sequence in token order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_jax.moe.options import CapacityRule


def group_layout(num_tokens: int, group_size: int, group_shards: int = 1) -> tuple[int, int]:
    """``(groups, tokens_per_group)`` for ``num_tokens`` tokens (see module docstring)."""
    tokens_per_group = max(1, min(group_size, math.ceil(num_tokens / group_shards)))
    groups = math.ceil(num_tokens / tokens_per_group)
    return math.ceil(groups / group_shards) * group_shards, tokens_per_group


def sequence_layout(batch: int, length: int, group_shards: int = 1) -> tuple[int, int]:
    """``(groups, tokens_per_group)`` with one sequence per group: ``length`` tokens per
    group, ``batch`` groups rounded up to a multiple of ``group_shards`` (the extra groups
    are padding)."""
    return math.ceil(batch / group_shards) * group_shards, length


def to_groups(x: jax.Array, groups: int, tokens_per_group: int) -> jax.Array:
    """``[num_tokens, ...]`` -> ``[groups, tokens_per_group, ...]``, zero-padded."""
    pad = groups * tokens_per_group - x.shape[0]
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((groups, tokens_per_group, *x.shape[1:]))


def from_groups(x: jax.Array, num_tokens: int) -> jax.Array:
    """``[groups, tokens_per_group, ...]`` -> ``[num_tokens, ...]`` (drops the padding)."""
    return x.reshape((-1, *x.shape[2:]))[:num_tokens]


def expert_capacity(
    tokens_per_group: int,
    num_experts: int,
    num_selected_experts: int,
    capacity_factor: float,
    min_expert_capacity: int,
    rule: CapacityRule = "t5x",
    fixed: int | None = None,
) -> int:
    """Buffer size per expert and group (see module docstring); ``fixed``: that capacity
    instead of the rule's (clipped to ``tokens_per_group``).

    Raises:
      ValueError: a capacity below 1 (the factor and the sizes it came from named).
    """
    if fixed is not None:
        return min(fixed, tokens_per_group)
    scale = num_selected_experts if rule == "k_scaled" else 1
    capacity = max(
        # capacity_factor may be a numpy scalar, whose round() is not a Python int
        int(round(capacity_factor * scale * tokens_per_group / num_experts)),  # noqa: RUF046
        min_expert_capacity,
    )
    if capacity < 1:
        raise ValueError(
            f"expert capacity {capacity} < 1 from capacity_factor={capacity_factor}, "
            f"tokens_per_group={tokens_per_group}, num_experts={num_experts}, "
            f"min_expert_capacity={min_expert_capacity}: raise the capacity factor or "
            f"CapacityConfig.min_expert_capacity"
        )
    return min(capacity, tokens_per_group)
