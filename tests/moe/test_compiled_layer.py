"""The MoE layer as compiled for a target: per-op HLO costs, the gather-free top-k, and
(with libtpu importable) the layer compiled for a small TPU topology holding no operation
that the TPU cost model counts as whole-buffer traffic."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.compile import collectives, hlo_costs, hlo_text, targets
from moe_jax.moe import MoeConfig, MoeLayer
from moe_jax.moe.dispatch import sort_token_choice
from moe_jax.moe.permute import take_rows
from moe_jax.moe.routers import TokenChoiceRouting, top_k
from tests.moe.moe_testlib import compile_fwd_bwd


def test_top_k_equals_lax_top_k_with_a_scatter_free_gradient():
    values = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 8))
    cotangent = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 2))
    (ours, index), (ref, ref_index) = top_k(values, 2), jax.lax.top_k(values, 2)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(ours, ref)
    grad = jax.grad(lambda v: jnp.sum(top_k(v, 2)[0] * cotangent))(values)
    ref_grad = jax.grad(lambda v: jnp.sum(jax.lax.top_k(v, 2)[0] * cotangent))(values)
    np.testing.assert_array_equal(grad, ref_grad)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(top_k(v, 2)[0] * cotangent)))(values))
    assert "scatter" not in jaxpr


def test_hlo_costs_count_matmul_flops_and_operand_bytes():
    a = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    b = jax.ShapeDtypeStruct((32, 48), jnp.float32)
    ops = hlo_costs.parse(jax.jit(lambda a, b: a @ b).lower(a, b).compile().as_text())
    totals = hlo_costs.summary(ops)
    assert totals["flops"] == 2 * 64 * 32 * 48
    assert totals["bytes"] >= 4 * (64 * 32 + 32 * 48 + 64 * 48)
    assert hlo_text.shape_bytes("(bf16[8,640,768]{2,1,0}, s32[2])") == 8 * 640 * 768 * 2 + 8
    assert hlo_costs.summary_of(ops, "dot_general")["flops"] == totals["flops"]
    assert hlo_costs.summary_of(ops, "MoeLayer")["bytes"] == 0


def test_hlo_costs_count_an_async_copy_once_and_only_device_memory():
    """A TPU ``copy-start`` returns (destination, source, context) and ``copy-done`` reads
    that tuple: a copy of X bytes within HBM moves 2X (read + write), not the 6X of counting
    both tuples; a prefetch into VMEM (layout ``S(1)``) reads X from HBM, and the operation
    that then reads the VMEM copy moves nothing from HBM."""
    hlo = """ENTRY %main {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %copy-start = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%x)
  %copy-done = bf16[1024,1024]{1,0} copy-done(%copy-start)
  %copy-start.1 = (bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%x)
  %copy-done.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  ROOT %negate = bf16[1024,1024]{1,0} negate(%copy-done.1)
}
"""  # noqa: E501 -- verbatim compiler HLO lines
    ops = hlo_costs.parse(hlo)
    megabytes = {op.name: op.bytes / 2**20 for op in ops}
    assert megabytes == {
        "copy-start": 2,
        "copy-done": 2,
        "copy-start.1": 2,
        "copy-done.1": 0,
        "negate": 2,
    }
    assert {
        op.name: op.alternate_memory_bytes / 2**20 for op in ops if op.alternate_memory_bytes
    } == {"copy-done.1": 2, "negate": 2}
    assert hlo_text.shape_bytes("bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)}") == 2**21


def test_hlo_costs_collectives_of_gpu_async_ops_and_ragged_all_to_all():
    hlo = """ENTRY %main {
  %rows = bf16[64,128]{1,0} parameter(0)
  %buffer = bf16[256,128]{1,0} parameter(1)
  %offsets = s64[4]{0} parameter(2)
  %ragged = bf16[256,128]{1,0} ragged-all-to-all(%rows, %buffer, %offsets, %offsets, %offsets, /*index=5*/%offsets)
  %start = ((bf16[256,128]{1,0}), bf16[256,128]{1,0}) all-to-all-start(%ragged), dimensions={0}
  %matmul = f32[64,64]{1,0} dot(%rows, %rows), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %done = bf16[256,128]{1,0} all-to-all-done(%start)
}
"""  # noqa: E501 -- verbatim compiler HLO lines
    found = collectives.collectives(hlo_costs.parse(hlo))
    # a ragged all-to-all sends at most its first operand (the second is the receive buffer);
    # GPU's async all-to-all-start counts, with the matmul scheduled before its done
    assert [(c.kind, c.bytes, c.overlapped_ops) for c in found] == [
        ("ragged-all-to-all", 64 * 128 * 2, 0),
        ("all-to-all", 256 * 128 * 2, 1),
    ]


# Bound for the layer below on v5p: cost_analysis() bytes over the bytes of one read of every
# operand and one write of every result (HLO bytes, in device memory and VMEM, an async copy
# once). 3.2x measured (gathers are counted by tile, not by row); with jax.lax.top_k in the
# router, its SparseCore scatter made it over 35x.
COST_OVER_HLO_BYTES_BOUND = 4.0


def test_layer_compiled_for_tpu_has_no_whole_buffer_traffic():
    # the TPU compiler of `make compilers` (make test installs it): never skipped
    devices = np.array(targets.target_devices(targets.parse_target("tpu:v5p:2x2x1")))
    mesh = jax.sharding.Mesh(devices[:1].reshape(1, 1, 1), ("data", "expert", "model"))
    # top-2, routing groups of 4096 tokens: one group
    layer = MoeLayer(MoeConfig(num_experts=8, d_ff=256), dtype=jnp.bfloat16)
    compiled = compile_fwd_bwd(layer, jax.ShapeDtypeStruct((8, 512, 64), jnp.bfloat16), mesh)
    ops = hlo_costs.parse(compiled.as_text())
    totals = hlo_costs.summary(ops)
    assert totals["sparse_core_ops"] == 0, [op.source for op in ops if op.sparse_core_offload]
    all_spaces = totals["bytes"] + totals["alternate_memory_bytes"]  # cost analysis counts VMEM too
    assert compiled.cost_analysis()["bytes accessed"] <= COST_OVER_HLO_BYTES_BOUND * all_spaces


def test_choice_major_combine_equals_token_major():
    groups, tokens, k, experts, capacity, d = 2, 16, 2, 4, 5, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (groups, tokens, d))
    index = jax.random.randint(keys[1], (groups, tokens, k), 0, experts + 1)  # experts = not routed
    weights = jax.random.uniform(keys[2], (groups, tokens, k))
    priority = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (groups, tokens))

    def run(choice_major_combine, x, weights):
        routing = TokenChoiceRouting(index, weights, priority)
        y, _ = sort_token_choice(
            x, routing, experts, capacity, jnp.tanh, choice_major_combine=choice_major_combine
        )
        return jnp.sum(jnp.sin(y)), y

    (_, y_ref), g_ref = jax.value_and_grad(lambda *a: run(False, *a), argnums=(0, 1), has_aux=True)(
        x, weights
    )
    (_, y), g = jax.value_and_grad(lambda *a: run(True, *a), argnums=(0, 1), has_aux=True)(
        x, weights
    )
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert float(jnp.max(jnp.abs(g[0]))) > 0


@pytest.mark.slow  # about 40 s on a 2-core CPU
def test_scattered_row_moves_access_fewer_bytes_on_tpu():
    # XLA:TPU's cost model counts a row gather from a tiled [rows, d] array of 6 MiB at
    # several times its bytes, a scatter-add at about its bytes: the TPU plan scatters
    # (ExecutionPlan). A token's 2 assignments into 4096 + 1024 buffer rows (d_model 768),
    # fwd + bwd, as in a T5-Base routing group. (From 3 MiB down, 2048 tokens, the gathers
    # cost less: 19 vs 34 MB.)
    devices = np.array(targets.target_devices(targets.parse_target("tpu:v5p:2x2x1")))
    mesh = jax.sharding.Mesh(devices[:1].reshape(1, 1, 1), ("data", "expert", "model"))
    tokens, k, slots, d = 4096, 2, 5120, 768
    x = jax.ShapeDtypeStruct((1, tokens, d), jnp.bfloat16)
    index = jax.ShapeDtypeStruct((1, slots), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, slots), jnp.bool_)
    inverse = jax.ShapeDtypeStruct((1, tokens, k), jnp.int32)
    inverse_valid = jax.ShapeDtypeStruct((1, tokens, k), jnp.bool_)

    def accessed(scatter: bool) -> float:
        def step(x, *maps):
            rows, pullback = jax.vjp(lambda x: take_rows(x, *maps, False, scatter), x)
            return pullback(rows * 2)[0]

        with jax.set_mesh(mesh):
            compiled = jax.jit(step).lower(x, index, valid, inverse, inverse_valid).compile()
        return compiled.cost_analysis()["bytes accessed"]

    assert accessed(True) < 0.6 * accessed(False)  # 0.54x compiled for v5p (libtpu 0.0.42)


# The sort layer at the T5-Base shape on one v5p chip (benchmarks/moe_compiled.py, E = 8,
# fwd+bwd, bf16 compute, the expert weights as bfloat16 compute copies): cost-analysis bytes
# accessed, 0.959 GiB, 0.975 with the slot -> assignment map gathered (with float32 weights
# cast at each call and that map gathered: 1.325 GiB with gathered row moves, 1.047 GiB
# scattered; 0.431 GiB for the FLOP-matched dense FFN): docs/moe.md, "The layer on TPU: row
# moves".
SORT_T5_BASE_E8_GIB_BOUND = 0.965


@pytest.mark.slow
def test_sort_layer_at_t5_base_shape_on_v5p_moves_at_most_its_bound():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import moe_compiled  # benchmarks/ is not a package

    devices = moe_compiled.target_devices("tpu:v5p:2x2x1")
    mesh = jax.sharding.Mesh(devices.flat[:1].reshape(1, 1, 1), ("data", "expert", "model"))
    row = moe_compiled.compile_row("sort", *moe_compiled.moe_step(8, "auto"), mesh)
    assert row.cost_bytes is not None and row.cost_bytes <= SORT_T5_BASE_E8_GIB_BOUND * 2**30
