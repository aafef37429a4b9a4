"""The project's Pallas grouped matmul (``grouped_matmul_pallas``) in Pallas's interpreter on
CPU: each of its three products equals ``jax.lax.ragged_dot_general`` with the dropless
path's dimension numbers (E = 8 / 32 / 64, empty experts, row tiles holding several experts,
sizes that are no multiple of the blocks, garbage rows past the experts' rows); and, with the
CUDA compiler of ``make compilers``, it lowers to Triton kernels for an H100 and no dense
matmul is left."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.compile import targets
from moe_jax.moe import grouped_matmul_pallas as kernels
from moe_jax.moe.grouped_matmul import FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT

ROWS, K, N = 200, 24, 40  # no multiple of the blocks below: padded
# Small blocks, so that row tiles hold several experts and each product loops over blocks.
BLOCKS = kernels.BlockSizes(m=16, n=16, k=16)


def _group_sizes(experts: int, seed: int) -> jax.Array:
    """Random sizes summing to ``ROWS - 7`` (the last rows belong to no expert), about a
    third of the experts empty, the first and the last among them."""
    rng = np.random.default_rng(seed)
    empty = rng.random(experts) < 1 / 3
    empty[[0, -1]] = True
    choice = rng.choice(np.flatnonzero(~empty), ROWS - 7)
    return jnp.asarray(np.bincount(choice, minlength=experts), jnp.int32)


def _operands(dtype, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x ``[ROWS, K]``, dy ``[ROWS, N]`` (NaN in rows past the experts') and weights
    ``[64, K, N]``."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(keys[0], (ROWS, K), dtype).at[-3:].set(jnp.nan)
    dy = jax.random.normal(keys[1], (ROWS, N), dtype).at[-2:].set(jnp.nan)
    return x, dy, jax.random.normal(keys[2], (64, K, N), dtype)


@pytest.mark.parametrize("experts", [8, 32, 64])
def test_each_product_equals_ragged_dot_general(experts):
    x, dy, w = _operands(jnp.float32, seed=experts)
    w = w[:experts]
    sizes = _group_sizes(experts, seed=experts)
    filled = int(sizes.sum())
    reference = lambda lhs, rhs, dims: jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)  # noqa: E731
    clean_x, clean_dy = x.at[filled:].set(0), dy.at[filled:].set(0)

    y = kernels.forward(x, w, sizes, jnp.float32, BLOCKS, interpret=True)
    np.testing.assert_allclose(y, reference(clean_x, w, FORWARD), rtol=1e-5, atol=1e-5)
    dx = kernels.input_gradient(dy, w, sizes, jnp.float32, BLOCKS, interpret=True)
    np.testing.assert_allclose(dx, reference(clean_dy, w, INPUT_GRADIENT), rtol=1e-5, atol=1e-5)
    dw = kernels.weight_gradient(x, dy, sizes, jnp.float32, BLOCKS, interpret=True)
    np.testing.assert_allclose(
        dw, reference(clean_x, clean_dy, WEIGHT_GRADIENT), rtol=1e-5, atol=1e-5
    )
    # rows past the experts' are zeros; empty experts get zero weight gradients
    assert y.shape == (ROWS, N) and dx.shape == (ROWS, K) and dw.shape == (experts, K, N)
    assert not np.any(y[filled:]) and not np.any(dx[filled:])
    assert not np.any(dw[np.asarray(sizes) == 0])


@pytest.mark.parametrize("experts", [8, 32, 64])
def test_gathered_rows_equal_the_products_of_the_sorted_rows(experts):
    """``row_index``: the forward and weight gradient read ``lhs`` rows through it (75
    tokens, read in random order, some several times; also past the experts' rows)."""
    x, dy, w = _operands(jnp.float32, seed=experts)
    tokens, w, sizes = x[:75], w[:experts], _group_sizes(experts, seed=experts)
    index = jax.random.randint(jax.random.PRNGKey(experts), (ROWS,), 0, tokens.shape[0])
    rows = tokens[index]
    y = kernels.forward(tokens, w, sizes, jnp.float32, BLOCKS, interpret=True, row_index=index)
    dw = kernels.weight_gradient(
        tokens, dy, sizes, jnp.float32, BLOCKS, interpret=True, row_index=index
    )
    expected_y = kernels.forward(rows, w, sizes, jnp.float32, BLOCKS, interpret=True)
    expected_dw = kernels.weight_gradient(rows, dy, sizes, jnp.float32, BLOCKS, interpret=True)
    np.testing.assert_allclose(y, expected_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-6, atol=1e-6)
    assert y.shape == (ROWS, N) and dw.shape == (experts, K, N)


def test_bfloat16_products_accumulate_in_float32():
    x, dy, w = _operands(jnp.bfloat16)
    w = w[:8]
    sizes = _group_sizes(8, seed=1)
    filled = int(sizes.sum())
    x, dy = x.at[filled:].set(0), dy.at[filled:].set(0)
    for kernel, lhs, rhs, dims in (
        (kernels.forward, x, w, FORWARD),
        (kernels.input_gradient, dy, w, INPUT_GRADIENT),
        (kernels.weight_gradient, x, dy, WEIGHT_GRADIENT),
    ):
        out = kernel(lhs, rhs, sizes, jnp.bfloat16, kernels.BlockSizes(), interpret=True)
        exact = jax.lax.ragged_dot_general(
            lhs, rhs, sizes, dims, preferred_element_type=jnp.float32
        )
        assert out.dtype == jnp.bfloat16
        # one bfloat16 rounding of the float32 sum, not one per partial sum
        np.testing.assert_allclose(
            out.astype(jnp.float32), exact.astype(jnp.bfloat16).astype(jnp.float32), rtol=1e-2
        )


H100_CHILD = """
import json, re, sys
from unittest import mock
from moe_jax.compile import targets
devices = targets.target_devices(targets.parse_target("gpu:h100:1"))
import jax, jax.numpy as jnp, numpy as np
from moe_jax.compile import hlo_costs
from moe_jax.moe import CapacityConfig, ExecutionConfig, MoeConfig, MoeLayer
from moe_jax.moe import execution, grouped_matmul
from moe_jax.moe.experts import ragged_expert_ffn
from moe_jax.moe.grouped_matmul import ragged_dot
from tests.moe.moe_testlib import compile_fwd_bwd
rows, experts, d_model, d_ff = 4096, 8, 768, 2048
mesh = jax.sharding.Mesh(devices, ("d",))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
config = MoeConfig(
    num_experts=32,
    d_ff=d_ff,
    capacity=CapacityConfig(group_size=1024, dropless=True),
    execution=ExecutionConfig(grouped_matmul="pallas"),
)
layer_mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 1), ("data", "expert", "model"))
# a Triton call's operands: the [1024, 768] tokens, one more, then the s32[2048] row index
TOKENS_THEN_INDEX = r"bf16\\[1024,768\\]\\{1,0\\}, \\w+\\[[\\d,]+\\]\\{[\\d,]+\\}, s32\\[2048\\]"
found = {}
for name in sys.argv[1:]:
    if name.startswith("layer"):  # the dropless MoE layer, its plan's platform from the mesh
        x = jax.ShapeDtypeStruct((2, 512, d_model), jnp.bfloat16)
        # layer_sorted: the plan's gather_in_kernel off (the tokens gathered into a sorted copy)
        with mock.patch.object(execution, "_gather_in_kernel", lambda *_: name == "layer"):
            hlo = compile_fwd_bwd(MoeLayer(config, dtype=jnp.bfloat16), x, layer_mesh).as_text()
    else:  # the experts' FFN through grouped matmul `name`
        matmul = ragged_dot(name, "gpu")
        def loss(w, x, sizes):
            y = ragged_expert_ffn(w, x, sizes, "relu", ragged_dot=matmul)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        w = {"wi": spec((experts, d_model, d_ff)), "wo": spec((experts, d_ff, d_model))}
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        hlo = step.lower(w, spec((rows, d_model)), spec((experts,), jnp.int32)).compile().as_text()
    found[name] = {
        "triton": len(re.findall(r'custom_call_target="__gpu\\$xla\\.gpu\\.triton"', hlo)),
        "cublas": len(re.findall(r'custom_call_target="__cublas', hlo)),
        "dot": len(re.findall(r"= \\S+ dot\\(", hlo)),
        "kernels": sorted(set(re.findall(r"grouped_matmul\\w*", hlo))),
        "fallbacks": grouped_matmul.fallbacks(),
        # gathers of [assignments = 2048, d_model] rows; Triton calls reading the
        # [tokens = 1024, d_model] activations through an int32 [assignments] row index
        "row_gathers": len(re.findall(r"= bf16\\[2048,(?:1,)*768\\]\\S* gather\\(", hlo)),
        "gathering_calls": len(re.findall(TOKENS_THEN_INDEX, hlo)),
        "hlo_bytes": hlo_costs.summary(hlo_costs.parse(hlo))["bytes"],
    }
print(json.dumps(found))
"""


def _compiled_for_an_h100(*names: str) -> dict:
    """What ``H100_CHILD`` found compiling each of ``names`` (a grouped matmul or ``layer``)
    for one H100, in a fresh process (``target_devices`` must come before JAX starts)."""
    proc = subprocess.run(
        [sys.executable, "-c", H100_CHILD, *names], capture_output=True, text=True, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


NO_GPU_COMPILER = pytest.mark.skipif(
    not (targets.compilers_dir() / "gpu").is_dir(), reason="no GPU compiler (make compilers)"
)


@NO_GPU_COMPILER
def test_the_kernels_compile_for_an_h100_as_triton_calls_without_dense_matmuls():
    """The experts' FFN (forward and gradients, bfloat16, 4096 rows, E = 8) compiled for one
    H100 from this CPU: with ``pallas`` its six products (two forward, two input and two
    weight gradients) are Triton custom calls and nothing else multiplies; ``xla``'s are
    dense matmuls over all rows (what the kernel replaces)."""
    found = _compiled_for_an_h100("pallas", "xla")
    pallas, xla = found["pallas"], found["xla"]
    assert pallas["triton"] == 6 and pallas["cublas"] == 0 and pallas["dot"] == 0, found
    assert {
        "grouped_matmul",
        "grouped_matmul_transposed",
        "grouped_matmul_weight_gradient",
    } <= set(pallas["kernels"]), found
    assert pallas["fallbacks"] == {}, found
    assert xla["triton"] == 0 and xla["cublas"] + xla["dot"] >= 6, found


@pytest.mark.slow
@NO_GPU_COMPILER
def test_the_dropless_layer_compiled_for_an_h100_runs_the_pallas_kernels():
    """The dropless MoE layer with ``grouped_matmul='pallas'`` (E = 32, forward and
    gradients) compiled for one H100: its six expert products are the Triton kernels, no
    product fell back to ``xla``; only the router's matmuls are left as dots."""
    layer = _compiled_for_an_h100("layer")["layer"]
    assert layer["triton"] == 6 and layer["fallbacks"] == {}, layer
    assert layer["dot"] == 3, layer  # the router's logits and their two gradients


@NO_GPU_COMPILER
def test_the_dropless_layer_compiled_for_an_h100_never_writes_the_sorted_tokens():
    """``pallas`` (E = 32, top-2, 1024 tokens, forward and gradients) compiled for one H100:
    the ``wi`` forward and weight gradient read the ``[tokens, d_model]`` activations
    through the row index, one ``[assignments, d_model]`` row gather fewer than with the
    sorted copy (the combine's and the gradients' gathers stay), and fewer HLO bytes."""
    found = _compiled_for_an_h100("layer", "layer_sorted")
    fused, sorted_copy = found["layer"], found["layer_sorted"]
    assert fused["gathering_calls"] == 2 and sorted_copy["gathering_calls"] == 0, found
    assert fused["row_gathers"] == sorted_copy["row_gathers"] - 1, found
    assert fused["hlo_bytes"] < sorted_copy["hlo_bytes"], found
    assert fused["triton"] == sorted_copy["triton"] == 6 and fused["fallbacks"] == {}, found
