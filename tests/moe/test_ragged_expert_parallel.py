"""Dropless under expert parallelism: rows exchanged by a ragged all-to-all into a grouped
matmul (``ExpertParallelExchange.rows``) on TPU, padded buffers on CPU and GPU
(``execution.resolve_plan``; tests/moe/test_execution_plan.py).

XLA:CPU cannot compile ``ragged-all-to-all``, so on the 8 forced CPU devices the layer's
ragged path runs under the TPU plan with ``emulated_ragged_all_to_all`` (the primitive's
documented semantics from a dense all-to-all, checked here on jax's own example) in its
place; the primitive itself is compiled for a TPU topology."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_jax import partitioning
from moe_jax.compile import collectives, hlo_costs, targets
from moe_jax.moe import CapacityConfig, ExecutionConfig, MoeConfig, MoeLayer, TopKRouterConfig
from moe_jax.moe import expert_parallel as ep
from moe_jax.moe import layer as layer_module
from moe_jax.moe.collections import AUX_LOSS_COLLECTION
from moe_jax.moe.execution import resolve_plan
from tests.moe.moe_testlib import compile_fwd_bwd, emulated_ragged_all_to_all, make_inputs

LAYER = MoeConfig(
    num_experts=8,
    d_ff=16,
    router=TopKRouterConfig(num_selected_experts=2),
    capacity=CapacityConfig(group_size=8, dropless=True),
    execution=ExecutionConfig(dispatch="sort"),
)


def test_emulated_ragged_all_to_all_follows_the_documented_example():
    # the two-device example of jax.lax.ragged_all_to_all's docstring
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    args = dict(
        operand=[[1, 2, 2], [3, 4, 0]],
        input_offsets=[[0, 1], [0, 1]],
        send_sizes=[[1, 2], [1, 1]],
        output_offsets=[[0, 0], [1, 2]],
        recv_sizes=[[1, 1], [2, 1]],
    )
    arrays = [
        jax.device_put(jnp.array(args[k], jnp.int32).reshape(-1), jax.NamedSharding(mesh, P("x")))
        for k in ("operand", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    ]

    def exchange(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        return emulated_ragged_all_to_all(
            operand,
            jnp.zeros(4, jnp.int32),
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
            axis_name="x",
        )

    result = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x")))(
        *arrays
    )
    np.testing.assert_array_equal(result.reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]])


def _tpu(mesh: jax.sharding.AbstractMesh) -> jax.sharding.AbstractMesh:
    """``mesh`` with TPU devices named in place of its own."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh(
        mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types, abstract_device=device
    )


def _value_and_grad(layer):
    def loss(p, x):
        y, state = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION])
        return jnp.sum(jnp.sin(y)) + sum(jax.tree.leaves(state)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _sharded_run(layer, shape, x, boxed):
    params = nn.unbox(boxed)
    mesh = partitioning.make_mesh(shape)
    rules = partitioning.standard_logical_axis_rules()
    with partitioning.activate(mesh, rules):
        sharded = jax.device_put(
            params, partitioning.tree_shardings(nn.get_partition_spec(boxed), mesh, rules)
        )
        fn = _value_and_grad(layer)
        jaxpr = str(fn.trace(sharded, x).jaxpr)
        return fn(sharded, x), jaxpr


@pytest.mark.parametrize(
    "shape",
    [
        (2, 4, 1),
        pytest.param((1, 8, 1), marks=pytest.mark.slow),
        pytest.param((2, 2, 2), marks=pytest.mark.slow),
    ],
)
def test_ragged_dropless_expert_parallel_equals_single_device(shape, monkeypatch):
    layer = MoeLayer(LAYER)
    x = make_inputs(8, 8, 8)  # 64 tokens -> 8 groups of 8 with or without a mesh
    boxed = layer.init(jax.random.PRNGKey(1), x)["params"]
    ref = _value_and_grad(layer)(nn.unbox(boxed), x)
    # the TPU plan (rows exchanged) for the CPU mesh, with the exchange XLA:CPU can compile
    monkeypatch.setattr(
        layer_module,
        "resolve_plan",
        lambda config, mesh, dtype: resolve_plan(config, _tpu(mesh), dtype),
    )
    monkeypatch.setattr(
        ep.ExpertParallelExchange, "ragged_all_to_all", staticmethod(emulated_ragged_all_to_all)
    )
    out, jaxpr = _sharded_run(layer, shape, x, boxed)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(out[1][0]["expert"]["wi"]))) > 0
    # rows, not [groups, experts, capacity, d_model] buffers, go to the grouped matmul
    assert "ragged_dot" in jaxpr and "shard_map" in jaxpr


def test_dropless_expert_parallel_on_cpu_keeps_padded_buffers():
    layer = MoeLayer(LAYER)
    x = make_inputs(8, 8, 8)
    boxed = layer.init(jax.random.PRNGKey(1), x)["params"]
    ref = _value_and_grad(layer)(nn.unbox(boxed), x)
    out, jaxpr = _sharded_run(layer, (2, 4, 1), x, boxed)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert "all_to_all" in jaxpr and "ragged_dot" not in jaxpr


def _compile_for_tpu(mesh, capacity: CapacityConfig):
    """Forward + backward of the layer (E = 16, top-2, d_model 256, bfloat16, 512 tokens per
    device)."""
    config = MoeConfig(
        num_experts=16, d_ff=256, capacity=capacity, execution=ExecutionConfig(dispatch="sort")
    )
    layer = MoeLayer(config, dtype=jnp.bfloat16)
    return compile_fwd_bwd(
        layer, jax.ShapeDtypeStruct((2 * mesh.size, 256, 256), jnp.bfloat16), mesh
    )


def test_ragged_dropless_compiled_for_tpu_exchanges_rows():
    # the TPU compiler of `make compilers` (make test installs it): never skipped
    devices = np.array(targets.target_devices(targets.parse_target("tpu:v5e:2x2")))
    mesh = jax.sharding.Mesh(devices.reshape(1, 4, 1), ("data", "expert", "model"))
    # 4 experts per device > k = 2: the ragged receive buffer (4 x a device's 1024 rows) is
    # half the padded buffers (4 x 4 experts x 512 tokens); at experts per device <= k they
    # are the same size (benchmarks/RESULTS.md, "Expert parallelism")
    ragged = _compile_for_tpu(mesh, CapacityConfig(dropless=True))
    # capacity = group: CPU's dropless layout
    padded = _compile_for_tpu(mesh, CapacityConfig(train_capacity_factor=16.0))
    found = collectives.collectives(hlo_costs.parse(ragged.as_text()))
    kinds = [c.kind for c in found]
    assert kinds.count("ragged-all-to-all") == 4  # there and back, forward and backward
    # first operands: a device's (token, choice) rows (bfloat16), there and for the cotangent
    # sent back; the receive buffer (4 devices x those rows, the static worst case) for the
    # outputs sent back and the forward exchange's cotangent. Only routed rows are sent.
    rows = 512 * 2 * 256 * 2
    assert sorted(c.bytes for c in found if c.kind == "ragged-all-to-all") == [
        rows,
        rows,
        4 * rows,
        4 * rows,
    ]
    # what else crosses devices is sizes and offsets, and the router's gradient (no psum of rows)
    assert sum(c.bytes for c in found if c.kind != "ragged-all-to-all") < rows / 8
    padded_found = collectives.collectives(hlo_costs.parse(padded.as_text()))
    assert [c.kind for c in padded_found].count("all-to-all") == 4
    assert sum(c.bytes for c in padded_found if c.kind == "all-to-all") == 4 * 8 * rows
    # temporaries: 1.42 MB ragged, 1.39 MB padded (1.55 MB before the padded `sort` scattered
    # its slot -> assignment map); the ragged layout's saving is in what crosses devices
    ragged_temp = ragged.memory_analysis().temp_size_in_bytes
    assert ragged_temp < 1.1 * padded.memory_analysis().temp_size_in_bytes
