"""The dropless path's grouped matmul on CPU: the ragged dispatch with the
``jax.lax.ragged_dot`` fallback gives the einsum reference's outputs and gradients (empty
experts, unrouted assignments); a CPU run never imports tokamax. tokamax's kernels need a
GPU (Pallas's interpreter cannot lower their block masks here): benchmarks/moe_layer.py
checks the layer with them against the einsum reference on the device it times."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.moe import ExecutionConfig
from moe_jax.moe.dispatch import einsum_token_choice, ragged_token_choice
from moe_jax.moe.experts import expert_ffn, ragged_expert_ffn
from moe_jax.moe.grouped_matmul import RaggedDot, ragged_dot
from moe_jax.moe.routers import TokenChoiceRouting

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


def _check_against_einsum(experts: int, k: int, matmul: RaggedDot, seed: int = 0) -> None:
    routing = _routing(experts, k, seed)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    x = jax.random.normal(keys[0], (GROUPS, TOKENS, D_MODEL))
    weights = {
        "wi": jax.random.normal(keys[1], (experts, D_MODEL, D_FF)) * 0.3,
        "wo": jax.random.normal(keys[2], (experts, D_FF, D_MODEL)) * 0.3,
    }

    def reference(x, w, cw):
        r = dataclasses.replace(routing, combine_weights=cw)
        return einsum_token_choice(x, r, experts, TOKENS, lambda b: expert_ffn(w, b, "relu"))[0]

    def ragged(x, w, cw):
        r = dataclasses.replace(routing, combine_weights=cw)
        ffn = lambda rows, sizes: ragged_expert_ffn(w, rows, sizes, "relu", ragged_dot=matmul)  # noqa: E731
        return ragged_token_choice(x, r, experts, ffn)[0]

    (_, y_ref), g_ref = _loss_and_grads(reference, x, weights, routing.combine_weights)
    (_, y), g = _loss_and_grads(ragged, x, weights, routing.combine_weights)
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
