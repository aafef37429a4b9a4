"""The MoE layer configurations the layer benchmarks time and compile (``moe_layer.py``,
``moe_compiled.py``): top-2 at the T5X capacity rule, built from typed ``MoeConfig`` parts."""

from __future__ import annotations

import dataclasses

from moe_jax.moe import (
    CapacityConfig,
    ExecutionConfig,
    MoeConfig,
    TopKRouterConfig,
)


def layer_config(experts: int, d_ff: int, dispatch: str, **parts: dict) -> MoeConfig:
    """Top-2 over ``experts`` experts of ``d_ff`` (T5X capacity rule, factor 1.25, groups of
    4096, ``dispatch``), with ``parts`` changed: ``model={...}`` (``MoeConfig`` fields),
    ``router``, ``capacity``, ``execution``, ``losses`` ({field: value} of those parts)."""
    config = MoeConfig(
        num_experts=experts,
        d_ff=d_ff,
        router=TopKRouterConfig(num_selected_experts=2),
        capacity=CapacityConfig(train_capacity_factor=1.25, capacity_rule="t5x", group_size=4096),
        execution=ExecutionConfig(dispatch=dispatch),
    )
    changed = {
        part: dataclasses.replace(getattr(config, part), **fields)
        for part, fields in parts.items()
        if part != "model"
    }
    return dataclasses.replace(config, **parts.get("model", {}), **changed)


# The routing options of docs/moe.md ("Routing of current MoE models"), as parts of
# layer_config (fine-grained: granularity 4, capacity factor x 4 keeps the slots' FLOPs).
ROUTING_OPTIONS: dict[str, dict[str, dict]] = {
    "shared expert (1 x d_ff) + top-2": dict(model=dict(num_shared_experts=1)),
    "balancing bias (u = 1e-3)": dict(router=dict(bias_update_rate=1e-3)),
    "sigmoid scores": dict(router=dict(score_function="sigmoid")),
    "fine-grained m = 4 (4E experts of d_ff / 4, top-8)": dict(
        model=dict(expert_granularity=4), capacity=dict(train_capacity_factor=5.0)
    ),
    "group-limited G = 4, M = 2": dict(router=dict(num_limited_groups=4, max_groups_per_token=2)),
}
