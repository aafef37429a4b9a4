"""Float32 attention logits from bfloat16 activations (``attention.logits_in_float32``):
the same logits as the inputs cast to float32, from matmuls that all take bfloat16."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.models.attention import dot_product_attention, logits_in_float32, softmax_attention


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


def _plain_attention(query, key, value, bias, mask, dtype):
    """The formula, differentiated by JAX: float32 logits, bias, mask, softmax in float32."""
    logits = logits_in_float32(query, key) + bias
    logits = jnp.where(mask, logits, -1e10)
    weights = jax.nn.softmax(logits).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value.astype(dtype))


def _masked_inputs(dtype):
    query, key, value = _qkv(dtype)
    bias = jax.random.normal(jax.random.key(2), (1, 3, 8, 8))
    valid = jnp.arange(8)[None, :] < jnp.array([[5], [8]])  # row 0: 3 padding positions
    mask = (valid[:, None, :, None] & valid[:, None, None, :]) & jnp.tril(jnp.ones((8, 8), bool))
    return query, key, value, bias, mask


def _gradients(fn, dtype, *inputs):
    weights = jax.random.normal(jax.random.key(3), inputs[0].shape)

    def loss(q, k, v, bias):
        out = fn(q, k, v, bias, inputs[4], dtype).astype(jnp.float32)
        return jnp.sum(jnp.sin(out) * weights)

    return jax.grad(loss, argnums=(0, 1, 2, 3))(*inputs[:4])


def test_softmax_attention_gradients_equal_autodiff_of_the_formula():
    """Float32: the probabilities-only backward (row term from the output, fully masked
    padding rows included) gives autodiff's gradients, the shared bias's summed over the
    batch in its own shape."""
    inputs = _masked_inputs(jnp.float32)
    np.testing.assert_allclose(
        softmax_attention(*inputs, jnp.float32), _plain_attention(*inputs, jnp.float32), atol=1e-6
    )
    got = _gradients(softmax_attention, jnp.float32, *inputs)
    want = _gradients(_plain_attention, jnp.float32, *inputs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_softmax_attention_in_bfloat16_stays_within_its_rounding():
    inputs = _masked_inputs(jnp.bfloat16)
    got = _gradients(softmax_attention, jnp.bfloat16, *inputs)
    exact = _gradients(_plain_attention, jnp.float32, *(jnp.asarray(x) for x in inputs))
    for g, w in zip(got, exact, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=0.03 * scale)


def test_the_backward_pass_keeps_the_probabilities_not_the_float32_logits():
    """What the forward pass saves for the backward: no float32 ``[batch, heads, q, k]``
    array (JAX's own softmax gradient saves the float32 logits or probabilities), the
    probabilities in bfloat16."""
    query, key, value, bias, mask = _masked_inputs(jnp.bfloat16)
    scores = (2, 3, 8, 8)

    def saved(fn):
        _, backward = jax.vjp(
            lambda q, k, v, b: fn(q, k, v, b, mask, jnp.bfloat16), query, key, value, bias
        )
        return [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(backward)]

    assert (scores, jnp.float32) in saved(_plain_attention)  # the check can fail
    kept = saved(softmax_attention)
    assert (scores, jnp.float32) not in kept
    assert (scores, jnp.bfloat16) in kept
