"""The attention kernels compute the same attention: the fused path's arguments (no 1/sqrt(d)
scale, bias, boolean masks) checked through jax's reference implementation on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.attention import (
    MultiHeadDotProductAttention,
    combine_masks,
    dot_product_attention,
    fused_attention,
    make_attention_mask,
    make_causal_mask,
)


def _inputs(batch=2, q_len=6, k_len=6, heads=3, head_dim=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, k_len, heads, head_dim))
    v = jax.random.normal(keys[2], (batch, k_len, heads, head_dim))
    bias = jax.random.normal(keys[3], (1, heads, q_len, k_len))
    return q, k, v, bias


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_arguments_give_the_unscaled_masked_biased_softmax(causal):
    q, k, v, bias = _inputs()
    tokens = jnp.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = make_attention_mask(tokens > 0, tokens > 0)
    if causal:
        mask = combine_masks(mask, make_causal_mask(tokens))

    def loss(fn, q, k, v, bias):
        return jnp.sum(jnp.sin(fn(q, k, v, bias)))

    def reference(q, k, v, bias):
        return dot_product_attention(q, k, v, bias=bias, mask=mask)

    def fused(q, k, v, bias):
        return fused_attention(q, k, v, bias, mask, jnp.float32, implementation="xla")

    np.testing.assert_allclose(fused(q, k, v, bias), reference(q, k, v, bias), atol=1e-5)
    grads = jax.grad(loss, argnums=(1, 2, 3, 4))
    for got, want in zip(grads(fused, q, k, v, bias), grads(reference, q, k, v, bias), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_unknown_kernel_and_dropout_with_cudnn_are_refused_by_name():
    x = jnp.ones((1, 4, 8))
    for kernel, rate, match in [
        ("flash", 0.0, r"T5Config.attention_kernel='flash' is unknown"),
        ("cudnn", 0.1, r"attention_kernel='cudnn' has no attention dropout"),
    ]:
        layer = MultiHeadDotProductAttention(
            num_heads=2, head_dim=4, dropout_rate=rate, kernel=kernel
        )
        with pytest.raises(ValueError, match=match):
            layer.init(
                {"params": jax.random.key(0), "dropout": jax.random.key(1)},
                x,
                x,
                deterministic=False,
            )
