"""Frozen routers through the optimizer partition; data-initialised routers."""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax import param_paths
from moe_jax.moe import MoeLayer, freeze
from moe_jax.moe.collections import AUX_LOSS_COLLECTION
from moe_jax.runtime import configured
from tests.moe.moe_testlib import SMALL, init_params, make_inputs


def _train(mode: str, steps: int = 3):
    layer = MoeLayer(SMALL)
    x = make_inputs()
    params = init_params(layer, x)
    tx = freeze.apply_router_mode(optax.adamw(1e-2, weight_decay=0.1), params, mode=mode)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss(p):
            y, aux = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION])
            return jnp.mean((y - 1.0) ** 2) + sum(jax.tree.leaves(aux))

        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grads

    start = params
    for _ in range(steps):
        params, state, grads = step(params, state)
    return start, params, grads


def test_frozen_router_stays_bit_identical_while_experts_move():
    start, end, grads = _train("frozen")
    assert float(jnp.max(jnp.abs(grads["router"]["weights"]["w"]))) > 0  # it did get gradients
    np.testing.assert_array_equal(end["router"]["weights"]["w"], start["router"]["weights"]["w"])
    assert float(jnp.max(jnp.abs(end["expert"]["wi"] - start["expert"]["wi"]))) > 1e-3


def test_learned_router_moves():
    start, end, _ = _train("learned")
    assert (
        float(jnp.max(jnp.abs(end["router"]["weights"]["w"] - start["router"]["weights"]["w"])))
        > 1e-4
    )


def test_router_mode_from_gin_and_bad_mode_named():
    with gin.unlock_config():
        gin.parse_config("router_mode.mode = 'frozen'")
    try:
        assert configured.router_mode() == "frozen"
    finally:
        gin.clear_config()
    with pytest.raises(ValueError, match=r"router_mode.mode"):
        freeze.router_mode("sometimes")


def test_is_router_param():
    paths = jax.tree_util.tree_flatten_with_path(
        {"moe": {"router": {"weights": {"w": 0}}, "expert": {"wi": 0}}}
    )[0]
    assert [param_paths.is_router_param(p) for p, _ in paths] == [False, True]
    assert param_paths.is_router_param("decoder/layers_1/moe/router/weights/w")


def test_data_initialised_router_uses_sampled_tokens():
    layer = MoeLayer(SMALL)
    params = init_params(layer, make_inputs())
    samples = make_inputs(1, 32, seed=7)[0]
    new = freeze.data_initialized_router(params, samples, jax.random.PRNGKey(0))
    w = new["router"]["weights"]["w"]
    assert w.shape == (8, 4)
    for col in np.asarray(w).T:
        assert np.min(np.max(np.abs(np.asarray(samples) - col), axis=1)) == 0.0
    np.testing.assert_array_equal(new["expert"]["wi"], params["expert"]["wi"])
    with pytest.raises(ValueError, match="samples"):
        freeze.data_initialized_router(params, samples[:2], jax.random.PRNGKey(0))
