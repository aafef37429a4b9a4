"""Every gin file of gin/routers parses and builds a working layer."""

from __future__ import annotations

import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import pytest
from tests.moe.moe_testlib import make_inputs

from moe_jax.moe import MoeLayer, freeze

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin" / "routers"


@pytest.mark.parametrize("path", sorted(GIN_DIR.glob("*.gin")), ids=lambda p: p.name)
def test_gin_file_builds_a_working_layer(path):
    gin.clear_config()
    try:
        gin.add_config_file_search_path(str(GIN_DIR.parents[1]))  # files that include others
        gin.parse_config_file(str(path))
        mode = freeze.router_mode()
        layer = MoeLayer(num_experts=4, d_ff=16, group_size=16, min_expert_capacity=1)
        x = make_inputs()
        ids = jnp.arange(32).reshape(4, 8)
        variables = nn.unbox(layer.init(jax.random.PRNGKey(1), x, token_ids=ids))
        state_collections = {k: v for k, v in variables.items() if k != "params"}  # e.g. router_bias
        y, state = layer.apply({**variables}, x, token_ids=ids, deterministic=False,
                               rngs={"dropout": jax.random.PRNGKey(0)},
                               mutable=["aux_loss", "moe_metrics", *state_collections])
    finally:
        gin.clear_config()
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    assert mode in freeze.ROUTER_MODES
    assert layer.router_type in ("top_k", "noisy_top_k", "expert_choice", "hash", "random",
                                 "hierarchical", "noisy_hierarchical")
    assert "expert_load" in state["moe_metrics"]
