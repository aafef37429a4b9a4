"""einsum (reference) and sort dispatch agree; capacity rules; dropless ragged path."""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.moe import ExecutionConfig, ExpertChoiceRouterConfig, MoeLayer, TopKRouterConfig
from moe_jax.moe.capacity import expert_capacity, group_layout
from moe_jax.moe.collections import AUX_LOSS_COLLECTION
from moe_jax.moe.dispatch import dispatch_combine
from moe_jax.moe.routers import TokenChoiceRouting
from tests.moe.moe_testlib import SMALL, init_params, make_inputs, with_execution


def _loss_and_grads(layer, params, x):
    def loss(p, x):
        y, state = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION])
        return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(state)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize(
    "config",
    [
        SMALL,  # top-2 with drops at eval capacity 2.0 x 16 / 4
        replace(
            SMALL,
            router=TopKRouterConfig(batch_prioritized_routing=True),
            capacity=replace(SMALL.capacity, eval_capacity_factor=0.5),
        ),
        replace(SMALL, router=ExpertChoiceRouterConfig()),
        replace(SMALL, capacity=replace(SMALL.capacity, dropless=True)),  # sort: ragged_dot
    ],
    ids=["top_2", "bpr", "expert_choice", "dropless"],
)
def test_sort_dispatch_equals_einsum_reference(config):
    x = make_inputs()
    ref_layer = MoeLayer(replace(config, execution=ExecutionConfig(dispatch="einsum")))
    params = init_params(ref_layer, x)
    (_, y_ref), g_ref = _loss_and_grads(ref_layer, params, x)
    (_, y), g = _loss_and_grads(with_execution(ref_layer, dispatch="sort"), params, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert float(jnp.max(jnp.abs(g[1]))) > 0


@pytest.mark.parametrize("impl", ["einsum", "sort"])
@pytest.mark.parametrize(
    "capacity_order,kept",
    [
        ("choice_major", [[True, False], [True, False]]),  # both first choices, then no room
        ("token_major", [[True, True], [False, False]]),  # token 0's two choices fill both experts
    ],
)
def test_capacity_order_decides_which_assignments_fit(impl, capacity_order, kept):
    """Two tokens, two experts of capacity 1: token 0 picks (0, 1), token 1 picks (1, 0)."""
    routing = TokenChoiceRouting(
        expert_index=jnp.array([[[0, 1], [1, 0]]], jnp.int32),
        combine_weights=jnp.full((1, 2, 2), 0.5),
        priority=jnp.array([[0, 1]], jnp.int32),
    )
    x = jnp.array([[[1.0], [10.0]]])
    y, got = dispatch_combine(
        impl, x, routing, 2, 1, lambda buffers: buffers, capacity_order=capacity_order
    )
    np.testing.assert_array_equal(got[0], kept)
    np.testing.assert_allclose(y[0, :, 0], 0.5 * np.sum(kept, axis=1) * np.array([1.0, 10.0]))


def test_capacity_rules():
    assert expert_capacity(4096, 8, 2, 1.25, 4, "t5x") == 640
    assert expert_capacity(4096, 8, 2, 1.25, 4, "k_scaled") == 1280
    assert expert_capacity(8, 8, 2, 1.25, 4, "t5x") == 4  # min_expert_capacity
    assert expert_capacity(2, 8, 2, 2.0, 4, "t5x") == 2  # clipped to the group
    with pytest.raises(ValueError, match="min_expert_capacity"):
        expert_capacity(16, 8, 1, 0.1, 0, "t5x")


def test_group_layout_pads_to_the_shard_count():
    assert group_layout(4096, 4096, 1) == (1, 4096)
    assert group_layout(8, 4096, 8) == (8, 1)
    groups, size = group_layout(35, 16, 2)
    assert groups % 2 == 0 and groups * size >= 35 and size <= 16


def test_per_expert_loop_equals_batched_expert_matmuls():
    x = make_inputs()
    layer = MoeLayer(
        replace(SMALL, activation="gated_gelu", execution=ExecutionConfig(per_expert_loop=False))
    )
    params = init_params(layer, x)
    (_, y_ref), g_ref = _loss_and_grads(layer, params, x)
    (_, y), g = _loss_and_grads(with_execution(layer, per_expert_loop=True), params, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(inner, jax.extend.core.ClosedJaxpr):
                    yield from _equations(inner.jaxpr)
                elif isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _equations(inner)


@pytest.mark.parametrize("moves", ["jax", "gather", "scatter"])
@pytest.mark.parametrize("choice_major_combine", [False, True])
@pytest.mark.parametrize("capacity", [1, 8])  # heavy drops, none
def test_sort_gradients_equal_einsum(moves, choice_major_combine, capacity):
    """Gradients (inputs, combine weights, experts) of the sort dispatch in both combine
    layouts, with each form of its row moves, equal the einsum reference's: gathers with
    JAX's scatter-add gradients (``jax``), gathers both ways (``gather``: the backward holds
    no scatter of rows, ``permute.gather_rows``), scatters both ways (``scatter``: no
    gather of rows forward or backward, ``permute.scatter_rows``)."""
    groups, tokens, experts, k, d = 2, 8, 4, 2, 3
    keys = jax.random.split(jax.random.PRNGKey(capacity), 4)
    routing = TokenChoiceRouting(
        expert_index=jax.random.randint(keys[0], (groups, tokens, k), 0, experts + 1),
        combine_weights=jax.random.uniform(keys[1], (groups, tokens, k)),
        priority=jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (groups, tokens)),
    )
    x = jax.random.normal(keys[2], (groups, tokens, d))
    scale = jax.random.normal(keys[3], (experts, 1, d))

    def loss(impl, x, weights, scale):
        return jnp.sum(jnp.sin(outputs(impl, x, weights, scale)))

    def outputs(impl, x, weights, scale):
        r = replace(routing, combine_weights=weights)
        y, _ = dispatch_combine(
            impl,
            x,
            r,
            experts,
            capacity,
            lambda b: jnp.tanh(b * scale[None]),
            choice_major_combine=choice_major_combine,
            gather_gradients=moves == "gather",
            scatter_rows=moves == "scatter",
        )
        return y

    grads = {
        impl: jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(
            x, routing.combine_weights, scale
        )
        for impl in ("einsum", "sort")
    }
    for a, b in zip(grads["sort"], grads["einsum"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        outputs("sort", x, routing.combine_weights, scale),
        outputs("einsum", x, routing.combine_weights, scale),
        rtol=1e-5,
        atol=1e-6,
    )
    backward = jax.make_jaxpr(jax.grad(functools.partial(loss, "sort")))(
        x, routing.combine_weights, scale
    )
    scattered, gathered = (
        [
            eqn.outvars[0].aval.ndim
            for eqn in _equations(backward.jaxpr)
            if eqn.primitive.name.startswith(kind)
        ]
        for kind in ("scatter", "gather")
    )
    # with gather gradients only the int inverse permutation [groups, n] is scattered;
    # with scattered rows only int index arrays are gathered
    assert all(ndim <= 2 for ndim in scattered) == (moves == "gather"), scattered
    assert all(ndim <= 2 for ndim in gathered) == (moves == "scatter"), gathered
    # scattered rows also scatter the slot -> assignment map: the int gathers left read the
    # experts' start offsets [groups, experts + 1], not the sorted assignments [groups, n]
    int_gathered = [
        eqn.invars[0].aval.shape[-1]
        for eqn in _equations(backward.jaxpr)
        if eqn.primitive.name == "gather" and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer)
    ]
    assert all(size <= experts + 1 for size in int_gathered) == (moves == "scatter"), int_gathered
