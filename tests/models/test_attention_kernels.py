"""The attention kernels compute the same attention: the fused path's arguments (no 1/sqrt(d)
scale, the batch-shared bias, padding as sequence lengths, causality as a flag, the dense
mask only for packed rows) checked through jax's reference implementation on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.attention import (
    AttentionMask,
    MultiHeadDotProductAttention,
    dot_product_attention,
    fused_attention,
)


def _inputs(batch=2, q_len=6, k_len=6, heads=3, head_dim=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, k_len, heads, head_dim))
    v = jax.random.normal(keys[2], (batch, k_len, heads, head_dim))
    bias = jax.random.normal(keys[3], (1, heads, q_len, k_len))
    return q, k, v, bias


def _check_fused_against_xla(mask, q, k, v, bias):
    """Outputs and gradients (q, k, v and the batch-shared bias) of the fused call agree
    with the XLA path's on the real query rows (padding rows are never read)."""
    real = np.asarray(jnp.any(mask.dense[:, 0], axis=-1))  # [batch, q_len]
    weights = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(fn, q, k, v, bias):
        return jnp.sum(jnp.sin(fn(q, k, v, bias)) * weights)

    def reference(q, k, v, bias):
        return dot_product_attention(q, k, v, bias=bias, mask=mask.dense)

    def fused(q, k, v, bias):
        return fused_attention(q, k, v, bias, mask, jnp.float32, implementation="xla")

    np.testing.assert_allclose(
        fused(q, k, v, bias)[real], reference(q, k, v, bias)[real], atol=1e-5
    )
    grads = jax.grad(loss, argnums=(1, 2, 3, 4))
    for got, want in zip(grads(fused, q, k, v, bias), grads(reference, q, k, v, bias), strict=True):
        assert got.shape == want.shape  # the bias gradient stays [1, heads, q, k]
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_with_lengths_gives_the_unscaled_masked_biased_softmax(causal):
    q, k, v, bias = _inputs()
    valid = jnp.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]]) > 0
    mask = AttentionMask.from_padding(valid, valid, causal=causal)
    np.testing.assert_array_equal(mask.query_lengths, [3, 6])
    _check_fused_against_xla(mask, q, k, v, bias)


def test_fused_cross_attention_with_other_key_lengths():
    q, k, v, bias = _inputs(q_len=4, k_len=7)
    query_valid = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]]) > 0
    key_valid = jnp.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]]) > 0
    mask = AttentionMask.from_padding(query_valid, key_valid)
    np.testing.assert_array_equal(mask.key_lengths, [5, 2])
    _check_fused_against_xla(mask, q, k, v, bias)


def test_packed_rows_keep_the_dense_mask():
    q, k, v, bias = _inputs()
    segments = jnp.array([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 3, 3]])
    mask = AttentionMask.from_padding(
        segments > 0, segments > 0, causal=True, segments=(segments, segments)
    )
    assert mask.query_lengths is None and mask.key_lengths is None
    # lengths would let segment 1 see segment 2: only the dense mask keeps them apart
    assert not mask.dense[0, 0, 2, 1] and not mask.dense[1, 0, 1, 0]
    _check_fused_against_xla(mask, q, k, v, bias)


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
