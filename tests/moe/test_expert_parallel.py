"""Expert parallelism on 8 forced CPU devices (tests/conftest.py): equal to the
single-device run, all-to-all in the compiled program, experts split over devices."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from moe_jax.moe import CapacityConfig, ExecutionConfig, MoeConfig, MoeLayer, TopKRouterConfig
from moe_jax.moe.collections import AUX_LOSS_COLLECTION
from tests.moe.moe_testlib import make_inputs

LAYER = MoeConfig(
    num_experts=8,
    d_ff=16,
    router=TopKRouterConfig(num_selected_experts=2),
    capacity=CapacityConfig(group_size=8, min_expert_capacity=1, eval_capacity_factor=1.0),
)


def _value_and_grad(layer):
    def loss(p, x):
        y, state = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION])
        return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(state)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize(
    "shape",
    [
        (2, 4, 1),
        pytest.param((1, 8, 1), marks=pytest.mark.slow),
        pytest.param((2, 2, 2), marks=pytest.mark.slow),
        pytest.param((8, 1, 1), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("dispatch", ["sort", pytest.param("einsum", marks=pytest.mark.slow)])
def test_sharded_run_equals_single_device(shape, dispatch):
    assert len(jax.devices()) == 8
    layer = MoeLayer(replace(LAYER, execution=ExecutionConfig(dispatch=dispatch)))
    x = make_inputs(8, 8, 8)  # 64 tokens -> 8 groups of 8 with or without a mesh
    boxed = layer.init(jax.random.PRNGKey(1), x)["params"]
    params = nn.unbox(boxed)
    ref = _value_and_grad(layer)(params, x)
    mesh = partitioning.make_mesh(shape)
    rules = partitioning.standard_logical_axis_rules()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = partitioning.tree_shardings(nn.get_partition_spec(boxed), mesh, rules)
        sharded = jax.device_put(params, shardings)
        fn = _value_and_grad(layer)
        out = fn(sharded, x)
        hlo = fn.lower(sharded, x).compile().as_text()
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    ep = shape[1]
    assert ("all-to-all" in hlo) == (ep > 1)
    wi = sharded["expert"]["wi"]
    assert {s.data.shape for s in wi.addressable_shards} == {(8 // ep, 8, 16 // shape[2])}


def test_experts_not_divisible_by_expert_axis_refused():
    layer = MoeLayer(replace(LAYER, num_experts=6))
    with (
        jax.set_mesh(partitioning.make_mesh((2, 4, 1))),
        pytest.raises(ValueError, match="num_experts"),
    ):
        jax.eval_shape(lambda x: layer.init(jax.random.PRNGKey(0), x), make_inputs(8, 8, 8))
