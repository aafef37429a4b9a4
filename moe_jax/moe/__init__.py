"""Mixture-of-Experts layer, its configuration, routers, dispatch, auxiliary losses and
router freezing.

Modules, one job each:
  config           MoeConfig and its parts: one config per router (ROUTER_CONFIGS, the
                   registry of routers), capacity, execution, auxiliary losses (frozen,
                   gin-configurable; every option is validated here)
  options          the option values (typing.Literal types) the configs accept
  collections      names of the layer's variable collections (aux_loss, moe_metrics, ...)
  layer            MoeLayer: route, dispatch, run the experts, combine
  execution        the execution plan: how the layer runs on the target platform (all
                   platform policy: implementation, loop, combine order, exchange)
  routers          token-choice and expert-choice routers and their routing decisions
  selection        top-k selection options of token-choice routers (DeepSeek-V3)
  hierarchical     two-level (hierarchical) routers
  capacity         routing groups and expert capacity
  dispatch         dispatch to expert buffers and combine back (einsum, sort, ragged)
  permute          row moves whose gradient gathers through the inverse map
  grouped_matmul   the dropless path's grouped matmul (jax.lax.ragged_dot, the project's
                   Pallas kernel of grouped_matmul_pallas, or tokamax)
  expert_parallel  the exchange interface: local, or experts split over the expert mesh
                   axis (all-to-all of padded buffers, ragged all-to-all of rows)
  experts          the experts' weights (ExpertWeights) and feed-forward computation
  shared           shared experts every token uses
  losses           auxiliary routing losses and routing statistics
  freeze           learned vs frozen routers (optimizer side); data-initialised routers
  upcycle          sparse upcycling: MoE parameters from a dense model's

Nothing here reads gin: :mod:`moe_jax.runtime.configured` registers the gin names of the
MoE layer (``MoeConfig`` and its parts, the router configs, ``freeze.router_mode``...).
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
