"""Small shared helpers for the MoE tests (imported by the test modules)."""

from __future__ import annotations

import flax.linen as nn
import jax

from moe_jax.moe import MoeLayer

SMALL = dict(num_experts=4, num_selected_experts=2, d_ff=16, group_size=16, min_expert_capacity=1)


def make_inputs(batch: int = 4, length: int = 8, d_model: int = 8, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, d_model))


def _split(kwargs: dict) -> tuple[dict, dict]:
    static = {k: v for k, v in kwargs.items() if isinstance(v, bool)}
    return static, {k: v for k, v in kwargs.items() if k not in static}


def init_params(layer: MoeLayer, x: jax.Array, **kwargs) -> dict:
    """Unboxed params of ``layer`` (jitted init)."""
    static, dynamic = _split(kwargs)
    init = jax.jit(lambda key, x, kw: layer.init(key, x, **kw, **static))
    return nn.unbox(init(jax.random.PRNGKey(1), x, dynamic)["params"])


def apply(layer: MoeLayer, params: dict, x: jax.Array, **kwargs):
    """Jitted apply; returns (outputs, sown collections)."""
    static, dynamic = _split(kwargs)
    fn = jax.jit(lambda p, x, kw: layer.apply({"params": p}, x, mutable=["aux_loss", "moe_metrics"],
                                              **kw, **static))
    return fn(params, x, dynamic)


def metric(state: dict, name: str) -> jax.Array:
    return state["moe_metrics"][name][0]


