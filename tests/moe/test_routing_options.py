"""Shared and fine-grained experts, sigmoid gating, the auxiliary-loss-free balancing bias
and group-limited routing (moe/selection.py, moe/shared.py): each option's defining
property, its bad-input message, and each under expert parallelism on a (2, 4, 1) mesh."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from moe_jax.models import accounting
from moe_jax.models.t5 import T5Config
from moe_jax.moe import (
    CapacityConfig,
    ExecutionConfig,
    ExpertChoiceRouterConfig,
    MoeConfig,
    MoeLayer,
    TopKRouterConfig,
)
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    BIAS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTING_COLLECTION,
)
from moe_jax.moe.routers import TopKRouter
from tests.moe.moe_testlib import SMALL, apply, init_params, make_inputs, metric


def _route(router, x, variables=None, deterministic=True, mutable=False):
    mask = jnp.ones(x.shape[:2])
    if variables is None:
        variables = router.init(jax.random.PRNGKey(0), x, mask, None, 4, True)
    out = router.apply(variables, x, mask, None, 4, deterministic, mutable=mutable)
    return out, variables


def test_bias_changes_selection_but_not_gate_values():
    x = make_inputs(2, 16, 8)
    router = TopKRouter(4, 2, bias_update_rate=1e-3)
    plain, variables = _route(router, x)
    favour = jnp.array([0.0, 0.0, 0.0, 10.0])  # expert 3 selected by every token
    biased, _ = _route(router, x, {**variables, BIAS_COLLECTION: {"bias": favour}})
    index = biased.routing.expert_index
    assert bool(jnp.all(jnp.any(index == 3, axis=-1)))
    assert not bool(jnp.all(jnp.any(plain.routing.expert_index == 3, axis=-1)))
    # Gates are the unbiased probabilities of the selected experts.
    np.testing.assert_allclose(
        biased.routing.combine_weights, jnp.take_along_axis(plain.probs, index, axis=-1), rtol=1e-6
    )
    np.testing.assert_allclose(biased.probs, plain.probs)


def test_bias_moves_toward_under_loaded_experts_and_balances_load():
    layer = MoeLayer(
        replace(
            SMALL,
            num_experts=8,
            router=TopKRouterConfig(bias_update_rate=0.01),
            capacity=replace(SMALL.capacity, group_size=64),
        )
    )
    x = make_inputs(4, 16, 8) + 0.5  # a shifted input: a skewed router at initialisation
    variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)

    @jax.jit
    def train_apply(bias):
        _, state = layer.apply(
            {"params": variables["params"], BIAS_COLLECTION: bias},
            x,
            deterministic=False,
            rngs={"dropout": jax.random.PRNGKey(0)},
            mutable=[MOE_METRICS_COLLECTION, BIAS_COLLECTION],
        )
        return nn.unbox(state[BIAS_COLLECTION]), metric(state, "expert_load")

    bias = nn.unbox(variables[BIAS_COLLECTION])
    np.testing.assert_array_equal(bias["router"]["bias"], 0.0)
    new_bias, load = train_apply(bias)
    step = new_bias["router"]["bias"] - bias["router"]["bias"]
    np.testing.assert_allclose(step, 0.01 * np.sign(np.mean(load) - load), atol=1e-7)
    # Sign updates make the per-step load oscillate; the load averaged over steps evens out.
    loads = []
    for _ in range(60):
        bias, load = train_apply(bias)
        loads.append(load)
    assert float(jnp.max(jnp.mean(jnp.stack(loads[-10:]), axis=0))) < 0.75 * float(
        jnp.max(loads[0])
    )
    # Eval (deterministic) never updates the bias.
    _, state = layer.apply(
        {"params": variables["params"], BIAS_COLLECTION: bias}, x, mutable=[BIAS_COLLECTION]
    )
    np.testing.assert_array_equal(
        nn.unbox(state[BIAS_COLLECTION])["router"]["bias"], bias["router"]["bias"]
    )


def test_bias_without_its_collection_is_refused_by_name():
    layer = MoeLayer(replace(SMALL, router=TopKRouterConfig(bias_update_rate=0.01)))
    x = make_inputs()
    params = init_params(layer, x)
    with pytest.raises(ValueError, match=r"bias_update_rate.*router_bias"):
        apply(layer, params, x)


def test_sigmoid_gates_of_selected_experts_sum_to_one():
    x = make_inputs(2, 16, 8)
    out, _ = _route(TopKRouter(8, 3, score_function="sigmoid"), x)
    gates = out.routing.combine_weights
    np.testing.assert_allclose(jnp.sum(gates, axis=-1), 1.0, rtol=1e-6)
    scores = jax.nn.sigmoid(out.logits)
    picked = jnp.take_along_axis(scores, out.routing.expert_index, axis=-1)
    np.testing.assert_allclose(gates, picked / jnp.sum(picked, -1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(out.routing.expert_index, jax.lax.top_k(scores, 3)[1])


def test_every_token_reaches_the_shared_experts():
    starved = replace(SMALL, capacity=replace(SMALL.capacity, train_capacity_factor=0.01))
    layer = MoeLayer(replace(starved, num_shared_experts=2, shared_expert_d_ff=8))
    x = make_inputs()
    params = init_params(layer, x)
    assert params["shared_expert"]["wi"].shape == (8, 16) and "expert" not in str(
        nn.get_partition_spec(layer.init(jax.random.PRNGKey(1), x)["params"])["shared_expert"]
    )
    # Capacity 1 per expert: most routed assignments are dropped; the shared MLP still
    # reaches every token.
    y, state = apply(layer, params, x, deterministic=False)
    without_shared, _ = apply(
        MoeLayer(starved),
        {k: v for k, v in params.items() if k != "shared_expert"},
        x,
        deterministic=False,
    )
    shared = jax.nn.relu(x @ params["shared_expert"]["wi"]) @ params["shared_expert"]["wo"]
    np.testing.assert_allclose(y - without_shared, shared, rtol=1e-5, atol=1e-6)
    assert float(metric(state, "dropped_fraction")) > 0.5
    assert bool(jnp.all(jnp.linalg.norm(y, axis=-1) > 0))


def _groups_reached(layer, params, x) -> jax.Array:
    """``[batch, length]`` number of the 4 expert groups (of 2 experts) each token uses."""
    _, state = layer.apply({"params": params}, x, mutable=[ROUTING_COLLECTION])
    index = state[ROUTING_COLLECTION]["expert_index"][0]
    return jnp.sum(jnp.stack([jnp.any(index // 2 == g, axis=-1) for g in range(4)]), axis=0)


def test_no_token_reaches_more_than_m_groups():
    config = replace(SMALL, num_experts=8, capacity=replace(SMALL.capacity, group_size=64))
    x = make_inputs(4, 16, 8)
    limited = MoeLayer(
        replace(
            config,
            router=TopKRouterConfig(
                num_selected_experts=4, num_limited_groups=4, max_groups_per_token=2
            ),
        )
    )
    unlimited = MoeLayer(replace(config, router=TopKRouterConfig(num_selected_experts=4)))
    params = init_params(limited, x)
    assert int(jnp.max(_groups_reached(limited, params, x))) == 2
    assert int(jnp.max(_groups_reached(unlimited, params, x))) > 2  # the limit binds here


def _d32_config() -> T5Config:
    return T5Config(
        vocab_size=256,
        emb_dim=32,
        num_heads=2,
        head_dim=8,
        mlp_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
    )


def _flops(config: T5Config, layer) -> float:
    """Forward FLOPs of one 8 + 8 token example of ``config`` with ``layer``'s MoE config."""
    return accounting.forward_flops_per_example(replace(config, moe=layer.config), 8, 8)


def test_fine_grained_and_coarse_have_equal_expert_parameters_and_flops():
    x = make_inputs(2, 8, 8)
    coarse = MoeLayer(replace(SMALL, d_ff=16, activation="gated_gelu"))
    fine = MoeLayer(replace(SMALL, d_ff=16, activation="gated_gelu", expert_granularity=4))
    counts = {}
    for name, layer in (("coarse", coarse), ("fine", fine)):
        params = init_params(layer, x)
        counts[name] = sum(v.size for v in jax.tree.leaves(params["expert"]))
    assert counts["coarse"] == counts["fine"]
    assert init_params(fine, x)["expert"]["wi_0"].shape == (16, 8, 4)
    config = _d32_config()
    flops = {name: _flops(config, layer) for name, layer in (("coarse", coarse), ("fine", fine))}
    # Only the router widens (E -> m * E columns): 2 FLOPs x tokens x d_model x 12 more experts.
    router_extra = 2 * (8 + 8) * config.emb_dim * (16 - 4)
    assert flops["fine"] - flops["coarse"] == router_extra
    shared = MoeLayer(replace(SMALL, num_shared_experts=2, activation="relu"))
    plain = _flops(config, MoeLayer(SMALL))
    with_shared = _flops(config, shared)
    assert with_shared - plain == 2 * (8 + 8) * 2 * config.emb_dim * 2 * 16


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: replace(SMALL, expert_granularity=3), "expert_granularity"),
        (
            lambda: replace(
                SMALL, router=TopKRouterConfig(num_limited_groups=2, max_groups_per_token=3)
            ),
            "max_groups_per_token",
        ),
        (
            lambda: replace(
                SMALL, router=TopKRouterConfig(num_limited_groups=3, max_groups_per_token=1)
            ),
            "num_limited_groups",
        ),
        (
            lambda: replace(
                SMALL,
                router=TopKRouterConfig(
                    num_limited_groups=4, max_groups_per_token=1, num_selected_experts=2
                ),
            ),
            "num_selected_experts",
        ),
        (
            lambda: replace(SMALL, num_shared_experts=1, router=ExpertChoiceRouterConfig()),
            "num_shared_experts",
        ),
        (lambda: TopKRouterConfig(score_function="tanh"), "score_function"),
    ],
)
def test_bad_options_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):  # building the config, or tracing the layer
        layer = MoeLayer(build())
        jax.eval_shape(lambda x: layer.init(jax.random.PRNGKey(0), x), make_inputs())


EP_LAYER = MoeConfig(
    num_experts=8,
    d_ff=16,
    router=TopKRouterConfig(num_selected_experts=2),
    capacity=CapacityConfig(group_size=8, min_expert_capacity=1, eval_capacity_factor=1.0),
)
OPTIONS = {
    "shared": replace(EP_LAYER, num_shared_experts=2),
    "fine_grained": replace(EP_LAYER, num_experts=4, expert_granularity=2),
    "sigmoid": replace(EP_LAYER, router=TopKRouterConfig(score_function="sigmoid")),
    "bias": replace(EP_LAYER, router=TopKRouterConfig(bias_update_rate=1e-3)),
    "group_limited": replace(
        EP_LAYER,
        router=TopKRouterConfig(
            num_limited_groups=4, max_groups_per_token=2, num_selected_experts=3
        ),
    ),
    "all": replace(
        EP_LAYER,
        num_experts=4,
        expert_granularity=2,
        num_shared_experts=1,
        router=TopKRouterConfig(
            score_function="sigmoid",
            bias_update_rate=1e-3,
            num_limited_groups=4,
            max_groups_per_token=2,
        ),
    ),
}


@pytest.mark.parametrize("dispatch", ["sort", "einsum"])
@pytest.mark.parametrize(
    "option",
    [pytest.param(name, marks=() if name == "all" else pytest.mark.slow) for name in OPTIONS],
)
def test_option_under_expert_parallelism_equals_one_device(option, dispatch):
    assert len(jax.devices()) == 8
    layer = MoeLayer(replace(OPTIONS[option], execution=ExecutionConfig(dispatch=dispatch)))
    x = make_inputs(8, 8, 8)
    boxed = layer.init(jax.random.PRNGKey(1), x)
    state = {k: nn.unbox(v) for k, v in boxed.items() if k != "params"}
    if BIAS_COLLECTION in state:  # a bias that changes the selection
        bias = state[BIAS_COLLECTION]["router"]["bias"]
        state[BIAS_COLLECTION]["router"]["bias"] = 0.3 * jnp.sin(
            jnp.arange(bias.shape[0], dtype=jnp.float32)
        )

    def loss(p, x):
        y, sown = layer.apply({"params": p, **state}, x, mutable=[AUX_LOSS_COLLECTION])
        return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(sown)), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    params = nn.unbox(boxed["params"])
    ref = fn(params, x)
    mesh = partitioning.make_mesh((2, 4, 1))
    rules = partitioning.standard_logical_axis_rules()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = partitioning.tree_shardings(nn.get_partition_spec(boxed["params"]), mesh, rules)
        out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            jax.device_put(params, shardings), x
        )
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
