"""The one-pass cross-entropy (``losses.cross_entropy_with_logits``): its gradients against
autodiff of the textbook formula, its argmax, and the float32 ``[tokens, vocab]`` arrays
it does not write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models import losses


def _textbook(logits, targets, label_smoothing, z_loss):
    """T5X's formula written plainly (float32 one-hot soft targets, ``logsumexp``)."""
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
    log_z = jax.nn.logsumexp(logits, axis=-1)
    loss = log_z - jnp.sum(soft * logits, axis=-1)
    if label_smoothing > 0.0:
        loss = loss + confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low)
    z_term = z_loss * jnp.square(log_z)
    return loss + z_term, z_term


def _objective(fn, weights):
    """A scalar that weighs the loss and the z-term differently, so that both cotangents
    of the loss reach the logits' gradient."""

    def objective(logits, targets, label_smoothing, z_loss):
        loss, z_term = fn(logits, targets, label_smoothing, z_loss)[:2]
        return jnp.sum(weights * loss) + 0.3 * jnp.sum(z_term)

    return objective


@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-2), (0.0, 1e-4)])
def test_values_and_gradients_match_autodiff_of_the_formula(label_smoothing, z_loss):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0.0, 3.0, (3, 5, 37)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.0, 1.0, (3, 5)), jnp.float32)
    got = losses.cross_entropy_with_logits(logits, targets, label_smoothing, z_loss)
    want = _textbook(logits, targets, label_smoothing, z_loss)
    np.testing.assert_allclose(got.loss, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.z_term, want[1], rtol=1e-5, atol=1e-7)
    args = (targets, label_smoothing, z_loss)
    grad = jax.grad(_objective(losses.cross_entropy_with_logits, weights))(logits, *args)
    grad_want = jax.grad(_objective(_textbook, weights))(logits, *args)
    np.testing.assert_allclose(grad, grad_want, rtol=1e-5, atol=1e-7)


def test_bfloat16_gradients_are_the_float32_ones_rounded():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0.0, 4.0, (4, 6, 300)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 300, (4, 6)), jnp.int32)
    weights = jnp.ones((4, 6), jnp.float32)
    grad = jax.grad(_objective(losses.cross_entropy_with_logits, weights))(
        logits, targets, 0.1, 1e-4
    )
    assert grad.dtype == jnp.bfloat16
    want = jax.grad(_objective(_textbook, weights))(logits.astype(jnp.float32), targets, 0.1, 1e-4)
    # within one bfloat16 rounding of the float32 gradient (2^-8 relative), never more
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, rtol=2.0**-8, atol=1e-6)


def test_prediction_is_the_first_of_equal_maxima():
    logits = jnp.asarray(
        [[[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0], [-3.0, -2.0, -1.0, -1.5]]], jnp.float32
    )
    targets = jnp.zeros((1, 3), jnp.int32)
    predicted = losses.cross_entropy_with_logits(logits, targets).predicted
    np.testing.assert_array_equal(predicted, [[1, 0, 2]])
    np.testing.assert_array_equal(predicted, jnp.argmax(logits, -1))


def test_no_float32_tokens_by_vocab_array_is_written():
    """Forward and backward over bfloat16 logits keep no float32 ``[tokens, vocab]``
    temporary: the compiled program's scratch is far below one such array (the textbook
    formula's needs two)."""
    shape = (8, 64, 4096)
    logits = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    targets = jax.ShapeDtypeStruct(shape[:2], jnp.int32)
    weights = jnp.ones(shape[:2], jnp.float32)
    one_array = np.prod(shape) * 4

    def temp_bytes(fn):
        step = jax.jit(jax.grad(_objective(fn, weights)), static_argnums=(2, 3))
        return step.lower(logits, targets, 0.0, 1e-4).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(_textbook) >= one_array  # the check can fail
    assert temp_bytes(losses.cross_entropy_with_logits) < one_array / 16
