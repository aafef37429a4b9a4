"""The dropless path's grouped matmul on CPU: the ragged dispatch with
``jax.lax.ragged_dot`` gives the einsum reference's outputs and gradients (empty experts,
unrouted assignments), and so does the project's Pallas kernel (``pallas``, in Pallas's
interpreter here), also through the layer, and a kernel that fails to trace here (tokamax
refuses a CPU device; ``pallas`` has no TPU lowering), its three products (forward, input
gradient, weight gradient) then through ``jax.lax.ragged_dot_general``, with one warning; a
CPU run never imports tokamax.
tokamax's kernels need a GPU: benchmarks/moe_layer.py checks the layer with them against
the ``xla`` grouped matmul on the device it times."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.moe import ExecutionConfig, MoeLayer, grouped_matmul
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.moe.dispatch import einsum_token_choice, ragged_token_choice
from moe_jax.moe.execution import resolve_plan
from moe_jax.moe.experts import expert_ffn, ragged_expert_ffn
from moe_jax.moe.grouped_matmul import GatheredRaggedDot, RaggedDot, gathered_ragged_dot, ragged_dot
from moe_jax.moe.permute import RowMap
from moe_jax.moe.routers import TokenChoiceRouting
from tests.moe.moe_testlib import SMALL, init_params, make_inputs, with_execution

GROUPS, TOKENS, D_MODEL, D_FF = 2, 16, 16, 32


def _routing(experts: int, k: int, seed: int) -> TokenChoiceRouting:
    """Random top-k over ``experts`` that never picks experts 1 and ``experts - 1`` (empty)
    and leaves a quarter of the tokens unrouted (index ``experts``: padding)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    allowed = jnp.array([e for e in range(experts) if e not in (1, experts - 1)])
    scores = jax.random.uniform(keys[0], (GROUPS, TOKENS, len(allowed)))
    index = allowed[jnp.argsort(-scores, axis=-1)[..., :k]].astype(jnp.int32)
    padding = (jnp.arange(TOKENS) % 4 == 3)[None, :, None]
    return TokenChoiceRouting(
        expert_index=jnp.where(padding, experts, index),
        combine_weights=jax.random.uniform(keys[1], (GROUPS, TOKENS, k)),
        priority=jnp.broadcast_to(jnp.arange(TOKENS, dtype=jnp.int32), (GROUPS, TOKENS)),
    )


def _loss_and_grads(run, x, weights, combine_weights):
    def loss(x, w, cw):
        y = run(x, w, cw)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    return grad(x, weights, combine_weights)


def _operands(experts: int, seed: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    x = jax.random.normal(keys[0], (GROUPS, TOKENS, D_MODEL))
    weights = {
        "wi": jax.random.normal(keys[1], (experts, D_MODEL, D_FF)) * 0.3,
        "wo": jax.random.normal(keys[2], (experts, D_FF, D_MODEL)) * 0.3,
    }
    return x, weights


def _ragged_loss_and_grads(
    experts: int,
    k: int,
    matmul: RaggedDot,
    seed: int = 0,
    scatter_rows: bool = False,
    gathered: GatheredRaggedDot | None = None,
):
    """The ragged dispatch's loss, outputs and gradients (x, weights, combine weights);
    with ``gathered``, its input projections gather the token rows (``gather_in_kernel``)."""
    routing = _routing(experts, k, seed)

    def ragged(x, w, cw):
        def ffn(rows, sizes, row_map: RowMap | None):
            def in_dot(lhs, rhs, group_sizes):
                assert gathered is not None and row_map is not None
                return gathered(lhs, rhs, group_sizes, row_map)

            first = None if row_map is None else in_dot
            return ragged_expert_ffn(w, rows, sizes, "relu", ragged_dot=matmul, in_dot=first)

        r = dataclasses.replace(routing, combine_weights=cw)
        return ragged_token_choice(
            x, r, experts, ffn, scatter_rows=scatter_rows, gather_in_kernel=gathered is not None
        )[0]

    return _loss_and_grads(ragged, *_operands(experts, seed), routing.combine_weights)


def _check_against_einsum(experts: int, k: int, matmul: RaggedDot, seed: int = 0, **options):
    """The ragged dispatch (``_ragged_loss_and_grads`` with ``options``) against the einsum
    dispatch: outputs and gradients."""
    routing = _routing(experts, k, seed)

    def reference(x, w, cw):
        r = dataclasses.replace(routing, combine_weights=cw)
        return einsum_token_choice(x, r, experts, TOKENS, lambda b: expert_ffn(w, b, "relu"))[0]

    (_, y_ref), g_ref = _loss_and_grads(
        reference, *_operands(experts, seed), routing.combine_weights
    )
    (_, y), g = _ragged_loss_and_grads(experts, k, matmul, seed, **options)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # empty experts get no weight gradient; every routed token has an input gradient
    assert not np.any(g[1]["wi"][1]) and not np.any(g[1]["wo"][experts - 1])
    assert np.all(np.any(g[0] != 0, axis=-1) == np.any(routing.expert_index < experts, axis=-1))


@pytest.mark.parametrize("experts", [8, 32, 64])
@pytest.mark.parametrize("k", [1, 2])
def test_xla_ragged_dot_equals_einsum_reference(experts, k):
    _check_against_einsum(experts, k, ragged_dot("xla"))


@pytest.mark.parametrize("experts", [8, 32, 64])
@pytest.mark.parametrize("k", [1, 2])
def test_kernel_that_fails_to_trace_falls_back_to_the_reference_products(experts, k):
    # tokamax's Triton kernel raises NotImplementedError on a CPU device: each of the three
    # products then runs jax.lax.ragged_dot_general with this module's dimension numbers
    _check_against_einsum(experts, k, ragged_dot("triton"), seed=experts + k)


@pytest.mark.parametrize("gathered", [False, True], ids=["sorted_rows", "gathered_rows"])
@pytest.mark.parametrize(
    ("experts", "k"),
    [
        (8, 2),
        (64, 1),
        pytest.param(8, 1, marks=pytest.mark.slow),
        pytest.param(32, 1, marks=pytest.mark.slow),
        pytest.param(32, 2, marks=pytest.mark.slow),
        pytest.param(64, 2, marks=pytest.mark.slow),
    ],
)
def test_pallas_kernel_equals_einsum_reference(experts, k, gathered):
    """On the sorted rows, and reading the token rows through the row map in its kernel."""
    rows = gathered_ragged_dot("pallas", "cpu") if gathered else None
    _check_against_einsum(experts, k, ragged_dot("pallas", "cpu"), experts * k, gathered=rows)


@pytest.mark.parametrize(("experts", "k"), [(8, 1), (32, 2), (64, 2)])
def test_gathered_rows_give_the_sorted_rows_outputs_and_gradients(experts, k):
    """The input projections reading the token rows through the row map (``xla``: a
    gather, then ``jax.lax.ragged_dot_general``) give what the sorted copy gives."""
    xla = ragged_dot("xla")
    gathered = _ragged_loss_and_grads(experts, k, xla, experts, gathered=gathered_ragged_dot("xla"))
    sorted_rows = _ragged_loss_and_grads(experts, k, xla, experts)
    for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(sorted_rows), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pallas_kernel_gathering_its_rows_equals_it_on_sorted_rows():
    pallas = ragged_dot("pallas", "cpu")
    gathered = gathered_ragged_dot("pallas", "cpu")
    fused = _ragged_loss_and_grads(32, 2, pallas, 5, gathered=gathered)
    for a, b in zip(
        jax.tree.leaves(fused),
        jax.tree.leaves(_ragged_loss_and_grads(32, 2, pallas, 5)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_layer_with_the_pallas_kernel_has_the_xla_kernels_outputs_and_gradients(k):
    """With ``pallas`` the layer's input projections gather the token rows in the kernel
    (``ExecutionPlan.gather_in_kernel``); ``xla`` runs on the sorted copy."""
    config = dataclasses.replace(
        SMALL,
        num_experts=8,
        router=dataclasses.replace(SMALL.router, num_selected_experts=k),
        capacity=dataclasses.replace(SMALL.capacity, dropless=True),
    )
    x = make_inputs()
    xla = with_execution(MoeLayer(config), grouped_matmul="xla")
    params = init_params(xla, x)

    def loss_and_grads(layer):
        def loss(p, x):
            y = layer.apply({"params": p}, x, mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION])
            return jnp.sum(jnp.sin(y[0]))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    expected = loss_and_grads(xla)
    pallas = with_execution(xla, grouped_matmul="pallas")
    assert resolve_plan(pallas.config, "cpu", jnp.float32).gather_in_kernel
    assert not resolve_plan(xla.config, "cpu", jnp.float32).gather_in_kernel
    found = loss_and_grads(pallas)
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (64, 1)])
def test_ragged_dispatch_with_scattered_row_moves_equals_einsum_reference(experts, k):
    _check_against_einsum(experts, k, ragged_dot("xla"), seed=3, scatter_rows=True)


def test_a_kernel_that_fails_to_trace_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(grouped_matmul, "_FAILED", {})
    with caplog.at_level(logging.WARNING, logger=grouped_matmul.__name__):
        _check_against_einsum(8, 2, ragged_dot("triton"))
        _check_against_einsum(32, 1, ragged_dot("triton"), seed=1)  # traced again
    warnings = [r.getMessage() for r in caplog.records if r.name == grouped_matmul.__name__]
    assert len(warnings) == 1, warnings
    assert "'triton'" in warnings[0] and "forward" in warnings[0]
    assert "NotImplementedError" in warnings[0], warnings[0]


def test_the_pallas_kernel_without_a_lowering_falls_back_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(grouped_matmul, "_FAILED", {})
    with caplog.at_level(logging.WARNING, logger=grouped_matmul.__name__):
        _check_against_einsum(8, 2, ragged_dot("pallas", "tpu"))
        _check_against_einsum(8, 1, ragged_dot("pallas", "tpu"), seed=1)
    warnings = [r.getMessage() for r in caplog.records if r.name == grouped_matmul.__name__]
    assert len(warnings) == 1, warnings
    assert "'pallas'" in warnings[0] and "no tpu lowering" in warnings[0], warnings[0]
    assert grouped_matmul.fallbacks() == {
        "pallas": "forward: NotImplementedError: the pallas grouped matmul has no tpu lowering"
    }


def test_tokamax_kernels_are_pinned_to_the_jax_they_run_with():
    assert grouped_matmul.kernel_unsupported("xla") is None
    assert grouped_matmul.kernel_unsupported("pallas") is None  # no tokamax kernel
    pinned = grouped_matmul.TOKAMAX_PINS["triton"]
    tokamax_version = importlib.metadata.version("tokamax")
    for jax_minor in pinned.get(tokamax_version, ()):
        assert grouped_matmul.kernel_unsupported("triton", f"{jax_minor}.0") is None
    reason = grouped_matmul.kernel_unsupported("triton", "0.9.2")
    assert reason is not None and "pinned to jax" in reason and "not 0.9" in reason
    assert "pinned to jax (none)" in str(grouped_matmul.kernel_unsupported("mosaic_gpu"))


def test_cpu_layer_never_imports_tokamax():
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from moe_jax.moe import CapacityConfig, MoeConfig, MoeLayer\n"
        "from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION\n"
        "config = MoeConfig(num_experts=4, d_ff=8, capacity=CapacityConfig(dropless=True))\n"
        "layer, x = MoeLayer(config), jnp.ones((2, 4, 8))\n"
        "variables = layer.init(jax.random.PRNGKey(0), x)\n"
        "layer.apply(variables, x, mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION])\n"
        "assert 'tokamax' not in sys.modules and 'triton' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_grouped_matmul_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"ExecutionConfig\.grouped_matmul='cutlass'"):
        ExecutionConfig(grouped_matmul="cutlass")
