"""Hierarchical MoE routing (Shazeer et al., 2017, Appendix B): two-level gating."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from moe_jax.moe import (
    AuxLossConfig,
    CapacityConfig,
    ExecutionConfig,
    HierarchicalRouterConfig,
    MoeConfig,
    MoeLayer,
    NoisyHierarchicalRouterConfig,
    TopKRouterConfig,
    losses,
)
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.moe.hierarchical import (
    HierarchicalRouter,
    NoisyHierarchicalRouter,
    hierarchical_importance,
    hierarchical_load,
)
from moe_jax.moe.routers import TopKRouter
from tests.moe.moe_testlib import SMALL, apply, init_params, make_inputs, metric

WEIGHTS = AuxLossConfig(
    load_balancing_loss_weight=0.01,
    router_z_loss_weight=0.01,
    importance_loss_weight=0.1,
    load_loss_weight=0.1,
)


def _loss_and_grads(layer, params, x, **kwargs):
    def loss(p, x):
        y, state = layer.apply(
            {"params": p}, x, mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION], **kwargs
        )
        return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(state[AUX_LOSS_COLLECTION])), (
            y,
            state[MOE_METRICS_COLLECTION],
        )

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


def _hierarchical_params(flat: dict) -> dict:
    """The flat top-k params as one-group hierarchical params: secondary = the flat router,
    primary = 0 (its gate is 1 anyway; 0 also zeroes its z-loss term)."""
    w = flat["router"]["weights"]["w"]
    return {
        "expert": flat["expert"],
        "router": {"primary": {"w": jnp.zeros((w.shape[0], 1))}, "secondary": {"w": w}},
    }


@pytest.mark.parametrize(
    "router_options,dispatch,dropless",
    [
        (dict(), "sort", False),
        pytest.param(
            dict(renormalize_gates=True, batch_prioritized_routing=True),
            "einsum",
            False,
            marks=pytest.mark.slow,
        ),
        (dict(), "sort", True),
    ],
)
def test_one_group_equals_flat_top_k(router_options, dispatch, dropless):
    x = make_inputs()
    config = replace(
        SMALL,
        capacity=replace(SMALL.capacity, dropless=dropless),
        execution=ExecutionConfig(dispatch=dispatch),
        losses=WEIGHTS,
    )
    flat = MoeLayer(replace(config, router=TopKRouterConfig(**router_options)))
    one_group = HierarchicalRouterConfig(
        num_expert_groups=1, num_selected_groups=1, **router_options
    )
    hier = MoeLayer(replace(config, router=one_group))
    flat_params = init_params(flat, x)
    params = _hierarchical_params(flat_params)
    for deterministic in (True, False):  # eval capacity 8, train capacity 5: drops in both
        (loss_f, (y_f, m_f)), g_f = _loss_and_grads(
            flat, flat_params, x, deterministic=deterministic
        )
        (loss_h, (y_h, m_h)), g_h = _loss_and_grads(hier, params, x, deterministic=deterministic)
        np.testing.assert_allclose(y_h, y_f, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(loss_h, loss_f, rtol=1e-6)
        for name in m_f:
            np.testing.assert_allclose(
                m_h[name][0], m_f[name][0], rtol=1e-5, atol=1e-7, err_msg=name
            )
        np.testing.assert_allclose(g_h[1], g_f[1], rtol=1e-5, atol=1e-7)
        for a, b in zip(
            jax.tree.leaves(g_h[0]["expert"]), jax.tree.leaves(g_f[0]["expert"]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(
            g_h[0]["router"]["secondary"]["w"],
            g_f[0]["router"]["weights"]["w"],
            rtol=1e-5,
            atol=1e-7,
        )
        assert float(jnp.max(jnp.abs(g_h[0]["router"]["secondary"]["w"]))) > 0
    # The routing itself: same experts, same combine weights, same capacity order.
    mask = jnp.ones((2, 16))
    xg = x.reshape(2, 16, -1)
    renorm = router_options.get("renormalize_gates", False)
    out_f = TopKRouter(4, 2, renormalize_gates=renorm).apply(
        {"params": {"weights": flat_params["router"]["weights"]}}, xg, mask, None, 8, True
    )
    out_h = HierarchicalRouter(4, 2, num_groups=1, renormalize_gates=renorm).apply(
        {"params": params["router"]}, xg, mask, None, 8, True
    )
    np.testing.assert_array_equal(out_h.routing.expert_index, out_f.routing.expert_index)
    np.testing.assert_array_equal(out_h.routing.combine_weights, out_f.routing.combine_weights)
    np.testing.assert_array_equal(out_h.routing.priority, out_f.routing.priority)
    np.testing.assert_allclose(out_h.probs, out_f.probs, rtol=1e-6)


@pytest.mark.parametrize(
    "num_groups,k1,k2,renorm", [(4, 2, 1, False), (2, 2, 2, False), (2, 1, 3, True)]
)
def test_chosen_experts_lie_in_chosen_groups_and_gates_are_products(num_groups, k1, k2, renorm):
    experts = 8
    b = experts // num_groups
    router = HierarchicalRouter(
        experts, k2, num_groups=num_groups, num_selected_groups=k1, renormalize_gates=renorm
    )
    x = make_inputs(2, 16)
    mask = jnp.ones((2, 16))
    variables = nn.unbox(router.init(jax.random.PRNGKey(0), x, mask, None, 4, True))
    out = router.apply(variables, x, mask, None, 4, True)
    w_p = np.asarray(variables["params"]["primary"]["w"])
    w_s = np.asarray(variables["params"]["secondary"]["w"])
    xs = np.asarray(x, np.float64)
    p = np.asarray(jax.nn.softmax(xs @ w_p, axis=-1))  # [g, s, G]
    q = np.asarray(
        jax.nn.softmax((xs @ w_s).reshape(2, 16, num_groups, b), axis=-1)
    )  # [g, s, G, b]
    index = np.asarray(out.routing.expert_index)
    gates = np.asarray(out.routing.combine_weights)
    assert index.shape == (2, 16, k1 * k2)
    for g in range(2):
        for s in range(16):
            groups = np.argsort(-p[g, s])[:k1]
            pg = p[g, s, groups] / (p[g, s, groups].sum() if renorm else 1.0)
            expected = {}
            for group, gate in zip(groups, pg, strict=True):
                inner = np.argsort(-q[g, s, group])[:k2]
                qi = q[g, s, group, inner] / (q[g, s, group, inner].sum() if renorm else 1.0)
                for i, gi in zip(inner, qi, strict=True):
                    expected[group * b + i] = gate * gi
            assert set(index[g, s]) == set(expected)  # every chosen expert is in a chosen group
            for e, gate in zip(index[g, s], gates[g, s], strict=True):
                np.testing.assert_allclose(gate, expected[e], rtol=1e-5)
            assert np.all(np.diff(gates[g, s]) <= 0)  # choices in descending final gate
    # The hierarchical router probability is the product distribution; it sums to 1.
    np.testing.assert_allclose(out.probs, (p[..., None] * q).reshape(2, 16, experts), rtol=1e-5)
    np.testing.assert_allclose(jnp.sum(out.gates, -1), np.sum(gates, -1), rtol=1e-6)


def test_importance_h_on_a_hand_built_case():
    # 1 routing group, 3 tokens (the last one padding), G = 2 groups of b = 2 experts.
    primary = jnp.array([[[0.7, 0.0], [0.0, 1.0], [0.5, 0.5]]])
    secondary = jnp.array(
        [[[[0.6, 0.4], [0.9, 0.1]], [[0.2, 0.8], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]]]
    )
    mask = jnp.array([[1.0, 1.0, 0.0]])
    # Importance_H_{i,j} = sum_x G_primary(x)_i G_i(x)_j over real tokens.
    expected = np.zeros((2, 2))
    for t in range(2):
        for i in range(2):
            for j in range(2):
                expected[i, j] += primary[0, t, i] * secondary[0, t, i, j]
    np.testing.assert_allclose(expected, [[0.42, 0.28], [0.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(
        hierarchical_importance(primary, secondary, mask), expected.reshape(-1), rtol=1e-6
    )
    # Load_H_{i,j} = Load_primary_i * Load_i(X^(i))_j / |X^(i)|.
    load = hierarchical_load(
        jnp.array([3.0, 1.5]), jnp.array([[1.0, 3.0], [0.0, 0.0]]), jnp.array([4.0, 0.0])
    )
    np.testing.assert_allclose(load, [0.75, 2.25, 0.0, 0.0], rtol=1e-6)


def test_router_importance_and_hard_load_follow_the_definitions():
    experts, num_groups, k1, k2 = 8, 4, 2, 1
    b = experts // num_groups
    router = HierarchicalRouter(experts, k2, num_groups=num_groups, num_selected_groups=k1)
    x = make_inputs(2, 16)
    mask = jnp.ones((2, 16)).at[1, 10:].set(0.0)
    variables = nn.unbox(router.init(jax.random.PRNGKey(0), x, mask, None, 4, True))
    out = router.apply(variables, x, mask, None, 4, True)
    # Importance_H from the per-level gates (built here from the logits) ...
    xs = np.asarray(x, np.float64)
    p = np.asarray(jax.nn.softmax(xs @ np.asarray(variables["params"]["primary"]["w"]), -1))
    q = np.asarray(
        jax.nn.softmax(
            (xs @ np.asarray(variables["params"]["secondary"]["w"])).reshape(2, 16, num_groups, b),
            -1,
        )
    )
    p_sparse = np.where(p >= np.sort(p, -1)[..., -k1, None], p, 0.0)
    q_sparse = np.where(q >= np.sort(q, -1)[..., -k2, None], q, 0.0)
    m = np.asarray(mask)
    expected = np.einsum("gsi,gsij,gs->ij", p_sparse, q_sparse, m).reshape(-1)
    np.testing.assert_allclose(out.importance, expected, rtol=1e-5)
    # ... is the summed final gates, and the layer's importance loss is its CV^2.
    np.testing.assert_allclose(
        out.importance, jnp.sum(out.gates * mask[..., None], (0, 1)), rtol=1e-5
    )
    mo = losses.auxiliary_losses(out, mask)
    np.testing.assert_allclose(
        mo["importance_loss"], losses.cv_squared(jnp.asarray(expected)), rtol=1e-4
    )
    # Hard loads: Load_primary = |X^(i)|, so Load_H = the tokens sent to (i, j).
    in_group = (p_sparse > 0) * m[..., None]
    secondary_load = np.einsum("gsi,gsij->ij", in_group, (q_sparse > 0).astype(float))
    count = in_group.sum((0, 1))
    load = hierarchical_load(jnp.asarray(count), jnp.asarray(secondary_load), jnp.asarray(count))
    np.testing.assert_allclose(load, jnp.sum(out.assigned * mask[..., None], (0, 1)), rtol=1e-6)
    assert out.smooth_load is None
    np.testing.assert_allclose(mo["load_loss"], losses.cv_squared(load), rtol=1e-5)


def test_noisy_hierarchical_smooth_load_has_gradients_and_eval_is_clean():
    router = NoisyHierarchicalRouter(8, 2, num_groups=2, num_selected_groups=1)
    x = make_inputs(2, 16)
    mask = jnp.ones((2, 16))
    variables = nn.unbox(router.init(jax.random.PRNGKey(0), x, mask, None, 4, True))
    assert set(variables["params"]) == {"primary", "secondary", "primary_noise", "secondary_noise"}
    assert router.apply(variables, x, mask, None, 4, True).smooth_load is None
    rngs = {"dropout": jax.random.PRNGKey(1)}
    out = router.apply(variables, x, mask, None, 4, False, rngs=rngs)
    assert out.smooth_load.shape == (8,)
    # Each token is sent to k1 * k2 = 2 experts; the smooth load is in the same units.
    assert 0 < float(jnp.sum(out.smooth_load)) <= 2 * 32 * 2

    def load_loss(v):
        return losses.load_loss(router.apply(v, x, mask, None, 4, False, rngs=rngs), mask)

    grads = jax.grad(load_loss)(variables)["params"]
    for name in ("primary_noise", "secondary_noise", "secondary"):
        assert float(jnp.max(jnp.abs(grads[name]["w"]))) > 0, name


def test_layer_counts_k1_times_k2_assignments_per_token():
    layer = MoeLayer(
        replace(
            SMALL,
            num_experts=8,
            router=NoisyHierarchicalRouterConfig(
                num_expert_groups=4, num_selected_groups=2, num_selected_experts=2
            ),
            capacity=replace(SMALL.capacity, capacity_rule="k_scaled"),
            losses=AuxLossConfig(importance_loss_weight=0.1, load_loss_weight=0.1),
        )
    )
    x = make_inputs()
    params = init_params(layer, x)
    assert layer.config.choices_per_token == 4
    y, state = apply(layer, params, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_allclose(float(jnp.sum(metric(state, "expert_load"))), 4.0, rtol=1e-5)
    assert set(state[AUX_LOSS_COLLECTION]) >= {"importance_loss", "load_loss"}


def test_parameter_logical_axes():
    layer = MoeLayer(replace(SMALL, router=NoisyHierarchicalRouterConfig(num_expert_groups=2)))
    boxed = layer.init(jax.random.PRNGKey(0), make_inputs())["params"]["router"]
    specs = nn.get_partition_spec(boxed)
    for name, shape in (
        ("primary", (8, 2)),
        ("primary_noise", (8, 2)),
        ("secondary", (8, 4)),
        ("secondary_noise", (8, 4)),
    ):
        assert specs[name]["w"] == jax.sharding.PartitionSpec("embed", "unmodeled")
        assert nn.unbox(boxed)[name]["w"].shape == shape
        partitioning.validate_logical_axes(tuple(specs[name]["w"]))


def test_expert_parallel_equals_single_device():
    assert len(jax.devices()) == 8
    layer = MoeLayer(
        MoeConfig(
            num_experts=8,
            d_ff=16,
            router=HierarchicalRouterConfig(
                num_selected_experts=2, num_expert_groups=2, num_selected_groups=1
            ),
            capacity=CapacityConfig(group_size=8, min_expert_capacity=1, eval_capacity_factor=1.0),
            execution=ExecutionConfig(dispatch="sort"),
            losses=AuxLossConfig(importance_loss_weight=0.1),
        )
    )

    def value_and_grad(p, x):
        def loss(p, x):
            y, state = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION])
            return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(state)), y

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)

    x = make_inputs(8, 8, 8)
    boxed = layer.init(jax.random.PRNGKey(1), x)["params"]
    params = nn.unbox(boxed)
    ref = jax.jit(value_and_grad)(params, x)
    mesh = partitioning.make_mesh((2, 4, 1))
    rules = partitioning.standard_logical_axis_rules()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        sharded = jax.device_put(
            params, partitioning.tree_shardings(nn.get_partition_spec(boxed), mesh, rules)
        )
        fn = jax.jit(value_and_grad)
        out = fn(sharded, x)
        hlo = fn.lower(sharded, x).compile().as_text()
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "all-to-all" in hlo


@pytest.mark.parametrize(
    "overrides,option",
    [
        (dict(num_expert_groups=3), "num_expert_groups"),  # E = 4 not divisible by 3
        (dict(num_expert_groups=0), "num_expert_groups"),
        (
            dict(num_expert_groups=2, num_selected_experts=3),
            "num_selected_experts",
        ),  # k2 > group size 2
        (dict(num_expert_groups=2, num_selected_groups=3), "num_selected_groups"),
    ],
)
def test_bad_hierarchical_options_are_refused_by_name(overrides, option):
    with pytest.raises(ValueError, match=option):  # when the config is built
        MoeLayer(replace(SMALL, router=HierarchicalRouterConfig(**overrides)))
