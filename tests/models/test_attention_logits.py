"""Float32 attention logits from bfloat16 activations (``attention.logits_in_float32``):
the same logits as the inputs cast to float32, from matmuls that all take bfloat16."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.models.attention import dot_product_attention, logits_in_float32


def _qkv(dtype, batch=2, q_len=8, k_len=8, heads=3, head_dim=16):
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(
        jax.random.normal(key, (batch, length, heads, head_dim)).astype(dtype)
        for key, length in zip(keys, (q_len, k_len, k_len), strict=True)
    )


def _upcast_logits(query, key):
    """The float32 logits of the inputs cast to float32 (what float32 logits meant)."""
    query, key = (jnp.asarray(t, jnp.float32) for t in (query, key))
    return jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=jax.lax.Precision.HIGHEST)


def test_logits_equal_the_upcast_inputs_logits_and_gradients_are_the_cotangent_rounded():
    query, key, _ = _qkv(jnp.bfloat16)
    logits = logits_in_float32(query, key)
    assert logits.dtype == jnp.float32
    # bf16 x bf16 products are exact in float32: only the summation order may differ
    np.testing.assert_allclose(logits, _upcast_logits(query, key), rtol=1e-6, atol=1e-5)

    weights = jax.random.normal(jax.random.key(1), logits.shape)
    grads = jax.grad(lambda q, k: jnp.sum(weights * logits_in_float32(q, k)), argnums=(0, 1))
    got = grads(query, key)
    # the reference: the cotangent rounded to bfloat16, then exact float32 matmuls
    rounded = weights.astype(jnp.bfloat16).astype(jnp.float32)
    ref = jax.grad(lambda q, k: jnp.sum(rounded * _upcast_logits(q, k)), argnums=(0, 1))
    for g, want, name in zip(got, ref(query, key), ("query", "key"), strict=True):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
        )
    # and not the float32 cotangent's gradient (what JAX's own transpose would compute)
    unrounded = jax.grad(lambda q: jnp.sum(weights * _upcast_logits(q, key)))(query)
    exact = jax.grad(lambda q: jnp.sum(rounded * _upcast_logits(q, key)))(query)
    assert not np.allclose(unrounded, exact, rtol=0, atol=1e-6)


def _dot_operand_types(text: str) -> list[str]:
    """The operand element types of every ``dot_general`` of a StableHLO module."""
    operands = r"\(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>"
    return re.findall(r"stablehlo\.dot_general.*?:\s*" + operands, text)


def test_a_bfloat16_attention_multiplies_bfloat16_in_both_passes_and_keeps_float32_softmax():
    query, key, value = _qkv(jnp.bfloat16)

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, dtype=jnp.bfloat16, float32_logits=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(query, key, value).as_text()
    operands = _dot_operand_types(text)
    # forward: q.k and weights.v; backward: d(weights), d(v), d(q), d(k)
    assert len(operands) == 6, operands
    assert all(types == ("bf16", "bf16") for types in operands), operands
    assert re.search(r"stablehlo\.exponential .*tensor<2x3x8x8xf32>", text), "softmax in float32"

    # the same call before: float32 copies of q and k, three float32 matmuls
    def upcast_loss(q, k, v):
        logits = _upcast_logits(q, k)
        weights = jax.nn.softmax(logits).astype(jnp.bfloat16)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(jnp.float32) ** 2)

    before = _dot_operand_types(
        jax.jit(jax.grad(upcast_loss, argnums=(0, 1, 2))).lower(query, key, value).as_text()
    )
    assert sum(types == ("f32", "f32") for types in before) == 3, before
