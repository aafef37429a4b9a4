"""The MoE layer's opt-in ``routing`` collection: per-token choices, probabilities and
router inputs when asked for, nothing (and the same outputs) otherwise."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.moe import ExpertChoiceRouterConfig, MoeLayer
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTING_COLLECTION,
)
from tests.moe.moe_testlib import SMALL, init_params, make_inputs


def _apply(layer, params, x, collections, **kwargs):
    fn = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=collections, **kwargs))
    return fn(params, x)


def test_routing_is_sown_per_token_only_when_mutable():
    layer = MoeLayer(SMALL)
    x = make_inputs(3, 8)  # 24 tokens in 2 groups of 16 (one padded)
    params = init_params(layer, x)
    mask = jnp.ones((3, 8)).at[2, 5:].set(0)
    y, state = _apply(
        layer, params, x, [MOE_METRICS_COLLECTION, ROUTING_COLLECTION], padding_mask=mask
    )
    routing = {k: v[0] for k, v in state[ROUTING_COLLECTION].items()}
    assert routing["expert_index"].shape == (3, 8, 2) and routing["expert_index"].dtype == jnp.int32
    assert routing["router_probs"].shape == (3, 8, 4)
    np.testing.assert_allclose(routing["router_inputs"], x)  # the layer's input feeds the router
    np.testing.assert_allclose(jnp.sum(routing["router_probs"], -1), 1.0, rtol=1e-5)
    # the choices are the top-2 of the probabilities, best first; padding is not routed
    top2 = np.argsort(-np.asarray(routing["router_probs"]), axis=-1)[..., :2]
    index = np.asarray(routing["expert_index"])
    real = np.asarray(mask) > 0
    np.testing.assert_array_equal(index[real], top2[real])
    assert (index[~real] == 4).all()
    # per-choice kept flags: padding never kept; the dropped share is the sown metric's
    kept = np.asarray(routing["kept"])
    assert kept.shape == (3, 8, 2) and kept.dtype == bool and not kept[~real].any()
    np.testing.assert_allclose(
        1.0 - kept[real].mean(), state[MOE_METRICS_COLLECTION]["dropped_fraction"][0], atol=1e-6
    )
    # per-token choices agree with the sown expert load
    load = np.bincount(index[real].ravel(), minlength=4) / real.sum()
    np.testing.assert_allclose(load, state[MOE_METRICS_COLLECTION]["expert_load"][0], rtol=1e-5)
    # training-style calls see no routing collection and the same outputs
    y_plain, plain = _apply(
        layer, params, x, [AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION], padding_mask=mask
    )
    assert ROUTING_COLLECTION not in plain
    np.testing.assert_array_equal(y, y_plain)
    assert ROUTING_COLLECTION not in layer.init(jax.random.PRNGKey(0), x)


def test_expert_choice_sows_probabilities_without_per_token_choices():
    layer = MoeLayer(replace(SMALL, router=ExpertChoiceRouterConfig()))
    x = make_inputs(2, 8)
    params = init_params(layer, x)
    _, state = _apply(layer, params, x, [ROUTING_COLLECTION, MOE_METRICS_COLLECTION])
    assert set(state[ROUTING_COLLECTION]) == {"router_inputs", "router_probs", "kept"}
    taken = np.asarray(state[ROUTING_COLLECTION]["kept"][0])  # [2, 8, 1]: any expert took it
    assert taken.shape == (2, 8, 1)
    np.testing.assert_allclose(
        1.0 - taken.mean(), state[MOE_METRICS_COLLECTION]["dropped_fraction"][0], atol=1e-6
    )
