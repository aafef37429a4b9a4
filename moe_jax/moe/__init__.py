"""Mixture-of-Experts layer, its configuration, routers, dispatch, auxiliary losses and
router freezing.

Importing this package registers every gin configurable of the MoE layer (``MoeConfig``
and its parts, the router configs, ``freeze.router_mode``...).
"""

from moe_jax.moe import freeze
from moe_jax.moe.config import (
    ROUTER_CONFIGS,
    AuxLossConfig,
    CapacityConfig,
    ExecutionConfig,
    ExpertChoiceRouterConfig,
    HashRouterConfig,
    HierarchicalRouterConfig,
    MoeConfig,
    NoisyHierarchicalRouterConfig,
    NoisyTopKRouterConfig,
    RandomRouterConfig,
    RouterConfig,
    TopKRouterConfig,
)
from moe_jax.moe.layer import MoeLayer

__all__ = [
    "ROUTER_CONFIGS",
    "AuxLossConfig",
    "CapacityConfig",
    "ExecutionConfig",
    "ExpertChoiceRouterConfig",
    "HashRouterConfig",
    "HierarchicalRouterConfig",
    "MoeConfig",
    "MoeLayer",
    "NoisyHierarchicalRouterConfig",
    "NoisyTopKRouterConfig",
    "RandomRouterConfig",
    "RouterConfig",
    "TopKRouterConfig",
    "freeze",
]
