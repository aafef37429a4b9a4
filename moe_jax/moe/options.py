"""The values of the MoE configuration's named options, as ``typing.Literal`` types.

Each Literal here is the one definition of an option's values: the configs
(:mod:`moe_jax.moe.config`) refuse any other value when they are built, naming the option
(so a gin string is checked there), and the modules that act on an option take it with its
Literal type, so mypy checks every value written in code. The tuples list the same values
for error messages and loops.
"""

from __future__ import annotations

from typing import Literal, get_args

# ``RouterConfig.router_type``: one per router config (``config.ROUTER_CONFIGS``).
RouterType = Literal[
    "top_k", "noisy_top_k", "expert_choice", "hash", "random", "hierarchical", "noisy_hierarchical"
]
# ``MoeConfig.activation``: the experts' MLP.
Activation = Literal["relu", "gelu", "gated_gelu"]
# ``TopKRouterConfig.score_function``.
ScoreFunction = Literal["softmax", "sigmoid"]
# ``CapacityConfig.capacity_rule`` (capacity.py).
CapacityRule = Literal["t5x", "k_scaled"]
# Order in which assignments get buffer slots (dispatch.py); ``CapacityConfig.capacity_order``
# also takes ``auto``.
CapacityOrder = Literal["choice_major", "token_major"]
CapacityOrderOption = Literal[CapacityOrder, "auto"]
# Dispatch implementation (dispatch.py); ``ExecutionConfig.dispatch`` also takes ``auto``.
Dispatch = Literal["einsum", "sort"]
DispatchOption = Literal[Dispatch, "auto"]
# The dropless path's grouped matmul (grouped_matmul.py); ``ExecutionConfig.grouped_matmul``
# also takes ``auto``.
GroupedMatmul = Literal["xla", "pallas", "triton", "mosaic_gpu", "mosaic_tpu"]
GroupedMatmulOption = Literal[GroupedMatmul, "auto"]
# ``AuxLossConfig.balance_scope``: the tokens over which the load-balancing loss measures
# the load (losses.py).
BalanceScope = Literal["batch", "group", "sequence"]
# ``AuxLossConfig.router_losses``: where the load-balancing and router z-losses are defined
# (losses.py): per layer, or per stack as Hugging Face's Switch Transformers.
RouterLosses = Literal["per_layer", "hf_stack"]

ROUTER_TYPES: tuple[RouterType, ...] = get_args(RouterType)
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)
SCORE_FUNCTIONS: tuple[ScoreFunction, ...] = get_args(ScoreFunction)
CAPACITY_RULES: tuple[CapacityRule, ...] = get_args(CapacityRule)
CAPACITY_ORDERS: tuple[CapacityOrderOption, ...] = get_args(CapacityOrderOption)
DISPATCHES: tuple[DispatchOption, ...] = get_args(DispatchOption)
GROUPED_MATMULS: tuple[GroupedMatmul, ...] = get_args(GroupedMatmul)
GROUPED_MATMUL_OPTIONS: tuple[GroupedMatmulOption, ...] = get_args(GroupedMatmulOption)
BALANCE_SCOPES: tuple[BalanceScope, ...] = get_args(BalanceScope)
ROUTER_LOSSES: tuple[RouterLosses, ...] = get_args(RouterLosses)
