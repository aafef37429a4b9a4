"""Mixture-of-Experts layer, routers, dispatch, auxiliary losses and router freezing.

Importing this package registers every gin configurable of the MoE layer
(``MoeLayer``, ``freeze.router_mode``...).
"""

from moe_jax.moe import freeze
from moe_jax.moe.layer import MoeLayer

__all__ = ["MoeLayer", "freeze"]
