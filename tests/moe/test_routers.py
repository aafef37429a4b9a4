"""Router behaviour and auxiliary losses."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.moe import (
    ROUTER_CONFIGS,
    ExpertChoiceRouterConfig,
    HashRouterConfig,
    MoeLayer,
    RandomRouterConfig,
    TopKRouterConfig,
    losses,
)
from moe_jax.moe.collections import ROUTING_COLLECTION
from moe_jax.moe.routers import NoisyTopKRouter, TopKRouter
from tests.moe.moe_testlib import SMALL, apply, init_params, make_inputs, metric


def _route(router, x, deterministic=True, rngs=None):
    mask = jnp.ones(x.shape[:2])
    variables = router.init(jax.random.PRNGKey(0), x, mask, None, 4, True)
    return router.apply(variables, x, mask, None, 4, deterministic, rngs=rngs), variables


def test_top1_picks_the_argmax_and_renormalised_gates_sum_to_one():
    x = make_inputs(2, 8)
    out, _ = _route(TopKRouter(4, 1), x)
    np.testing.assert_array_equal(out.routing.expert_index[..., 0], jnp.argmax(out.probs, -1))
    out2, _ = _route(TopKRouter(4, 2, renormalize_gates=True), x)
    np.testing.assert_allclose(jnp.sum(out2.routing.combine_weights, -1), 1.0, rtol=1e-6)
    assert bool(jnp.all(out2.routing.expert_index[..., 0] != out2.routing.expert_index[..., 1]))


def test_jitter_only_in_training():
    x = make_inputs(2, 8)
    router = TopKRouter(4, 2, jitter_noise=0.5)
    eval_out, _ = _route(router, x)
    train_out, _ = _route(router, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
    assert float(jnp.max(jnp.abs(train_out.logits - eval_out.logits))) > 0
    again, _ = _route(router, x)
    np.testing.assert_array_equal(again.logits, eval_out.logits)


def test_noisy_top_k_smooth_load_has_gradients_and_eval_is_clean():
    x = make_inputs(2, 16)
    router = NoisyTopKRouter(4, 2)
    mask = jnp.ones(x.shape[:2])
    variables = nn.unbox(router.init(jax.random.PRNGKey(0), x, mask, None, 4, True))
    assert set(variables["params"]) == {"weights", "noise"}
    clean = router.apply(variables, x, mask, None, 4, True)
    assert clean.smooth_load is None

    def load_loss(v):
        out = router.apply(v, x, mask, None, 4, False, rngs={"dropout": jax.random.PRNGKey(1)})
        return losses.load_loss(out, mask)

    grads = jax.grad(load_loss)(variables)
    assert float(jnp.max(jnp.abs(grads["params"]["noise"]["w"]))) > 0
    noisy = router.apply(
        variables, x, mask, None, 4, False, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    assert noisy.smooth_load.shape == (4,)
    assert 0 < float(jnp.sum(noisy.smooth_load)) <= 2 * 32 + 1e-3


def test_expert_choice_fills_every_expert_to_capacity():
    layer = MoeLayer(
        replace(
            SMALL,
            router=ExpertChoiceRouterConfig(),
            capacity=replace(SMALL.capacity, eval_capacity_factor=1.0),
        )
    )
    x = make_inputs()
    _, state = apply(layer, init_params(layer, x), x)
    # capacity round(1.0 * 16 / 4) = 4 tokens per expert and group -> load 4/16 each.
    np.testing.assert_allclose(metric(state, "expert_load"), 0.25, rtol=1e-6)


def test_hash_router_depends_only_on_token_ids():
    layer = MoeLayer(replace(SMALL, router=HashRouterConfig(num_selected_experts=1)))
    x = make_inputs(1, 8)
    ids = jnp.array([[3, 3, 7, 7, 3, 11, 12, 13]])
    params = init_params(layer, x, token_ids=ids)
    assert "router" not in params
    _, state = apply(layer, params, x, token_ids=ids)
    _, state2 = apply(layer, params, 2.0 * make_inputs(1, 8, seed=4), token_ids=ids)
    np.testing.assert_array_equal(metric(state, "expert_load"), metric(state2, "expert_load"))


def test_random_router_is_fixed_and_has_no_params():
    layer = MoeLayer(replace(SMALL, router=RandomRouterConfig()))
    x = make_inputs()
    params = init_params(layer, x)
    assert "router" not in params
    y1, _ = apply(layer, params, x)
    y2, _ = apply(layer, params, x)
    np.testing.assert_array_equal(y1, y2)
    other, _ = apply(MoeLayer(replace(SMALL, router=RandomRouterConfig(seed=1))), params, x)
    assert float(jnp.max(jnp.abs(other - y1))) > 0


@pytest.mark.parametrize(
    "router",
    [
        *(
            cls(num_expert_groups=2) if cls.hierarchical else cls()
            for cls in ROUTER_CONFIGS.values()
        ),
        TopKRouterConfig(score_function="sigmoid"),
    ],
    ids=[*ROUTER_CONFIGS, "top_k_sigmoid"],
)
def test_every_router_gives_each_token_a_distribution_over_the_experts(router):
    """``RouterOutput.probs`` (sown as ``router_probs``): non-negative, summing to 1 for
    every token, padding included, whatever the router computes it from."""
    layer = MoeLayer(replace(SMALL, router=router))
    x, ids = make_inputs(2, 8), jnp.arange(16).reshape(2, 8)
    mask = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
    variables = layer.init(jax.random.PRNGKey(0), x, token_ids=ids)
    _, state = layer.apply(
        variables, x, token_ids=ids, padding_mask=mask, mutable=[ROUTING_COLLECTION]
    )
    probs = state[ROUTING_COLLECTION]["router_probs"][0]
    assert probs.shape == (2, 8, 4) and float(jnp.min(probs)) >= 0
    np.testing.assert_allclose(jnp.sum(probs, axis=-1), 1.0, rtol=1e-5)


def test_losses_on_known_distributions():
    g, s, e = 1, 8, 4
    mask = jnp.ones((g, s))
    uniform = jnp.full((g, s, e), 1 / e)
    assigned = (
        jax.nn.one_hot(jnp.arange(s) % e, e)[None]
        + jax.nn.one_hot((jnp.arange(s) + 1) % e, e)[None]
    )
    # balanced top-2: E * sum f_i P_i = k
    np.testing.assert_allclose(losses.load_balancing_loss(uniform, assigned, mask), 2.0, rtol=1e-6)
    np.testing.assert_allclose(
        losses.router_z_loss(jnp.zeros((g, s, e)), mask), np.log(e) ** 2, rtol=1e-6
    )
    np.testing.assert_allclose(losses.routing_entropy(uniform, mask), np.log(e), rtol=1e-5)
    np.testing.assert_allclose(losses.cv_squared(jnp.array([1.0, 1.0, 1.0])), 0.0, atol=1e-6)
    np.testing.assert_allclose(losses.cv_squared(jnp.array([2.0, 0.0])), 1.0, rtol=1e-6)
    collapsed = jax.nn.one_hot(jnp.zeros(s, int), e)[None]
    assert float(losses.load_balancing_loss(collapsed, collapsed, mask)) == pytest.approx(e)
