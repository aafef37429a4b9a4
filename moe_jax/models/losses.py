"""Token-level losses and metrics: cross-entropy with label smoothing and z-loss
(T5X's ``cross_entropy_with_logits``, one pass over the logits), loss normalisation,
token accuracy."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_NORMALIZERS = ("NUM_REAL_TARGET_TOKENS", "NUM_TOTAL_TARGET_TOKENS")


class TokenLosses(NamedTuple):
    """Per-token results of :func:`cross_entropy_with_logits`, each ``[batch, length]``."""

    loss: jax.Array  # cross-entropy + z-loss term (float32)
    z_term: jax.Array  # the z-loss term alone (float32)
    predicted: jax.Array  # the argmax of the logits (int32; first of equal maxima)


def _soft_target_weights(vocab: int, label_smoothing: float) -> tuple[float, float]:
    """(weight of the target id, weight of every other id) of the smoothed targets."""
    return 1.0 - label_smoothing, label_smoothing / (vocab - 1)


def _smoothing_entropy(vocab: int, label_smoothing: float) -> float:
    """The entropy of the smoothed targets, subtracted so that a perfect prediction scores 0."""
    if label_smoothing <= 0.0:
        return 0.0
    confidence, low = _soft_target_weights(vocab, label_smoothing)
    return -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))


def _one_pass_statistics(
    logits: jax.Array, with_sum: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``[..., vocab]`` -> (max, sum of exp(logit - max), argmax, sum of logits or None),
    each ``[...]``, from one variadic reduction over the vocabulary (an online
    log-sum-exp, so that the logits are read once, in their own dtype, and never written
    in float32)."""
    x = logits.astype(jnp.float32)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    operands = [x, jnp.ones_like(x), index] + ([x] if with_sum else [])
    inits = [
        jnp.array(-jnp.inf, jnp.float32),
        jnp.array(0.0, jnp.float32),
        jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32),
    ] + ([jnp.array(0.0, jnp.float32)] if with_sum else [])

    def combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        (m_a, s_a, i_a), (m_b, s_b, i_b) = a[:3], b[:3]
        m = jnp.maximum(m_a, m_b)
        # exp(m_x - m) is 1 where m_x is the maximum (also -inf against -inf: no NaN)
        s = jnp.where(m_a == m, s_a, s_a * jnp.exp(m_a - m)) + jnp.where(
            m_b == m, s_b, s_b * jnp.exp(m_b - m)
        )
        i = jnp.where((m_a > m_b) | ((m_a == m_b) & (i_a < i_b)), i_a, i_b)
        return (m, s, i) + ((a[3] + b[3],) if with_sum else ())

    out = jax.lax.reduce(tuple(operands), tuple(inits), combine, (x.ndim - 1,))
    return out[0], out[1], out[2], out[3] if with_sum else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cross_entropy_with_logits(
    logits: jax.Array,
    targets: jax.Array,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> TokenLosses:
    """Per-token loss, z-loss and prediction, in one pass over the logits.

    ``loss = -sum(soft_targets * log_softmax(logits)) - H(soft_targets) + z_loss * logZ^2``,
    where soft targets put ``1 - label_smoothing`` on the target and spread the rest over
    the other ``vocab - 1`` ids; subtracting their entropy makes a perfect prediction
    score 0 (as in T5X's ``cross_entropy_with_logits``).

    The logits are read once forward (one variadic reduction gives the log-sum-exp, the
    argmax and, with label smoothing, their sum; the target's logit is a gather) and once
    backward, where the gradient ``softmax * (1 + 2 z_loss logZ) - soft_targets`` is
    formed from the logits and logZ and written in the logits' dtype: no
    ``[tokens, vocab]`` array in float32 is ever written (T5-Base: 16k x 32k; Figure 5's
    mT5 vocabulary: 29k x 250k).

    Args:
      logits: ``[batch, length, vocab]``, any float dtype (statistics in float32).
      targets: int ``[batch, length]``.
    Returns:
      :class:`TokenLosses`, each ``[batch, length]``.
    """
    return _cross_entropy_fwd(logits, targets, label_smoothing, z_loss)[0]


def _cross_entropy_fwd(
    logits: jax.Array, targets: jax.Array, label_smoothing: float, z_loss: float
) -> tuple[TokenLosses, tuple[jax.Array, jax.Array, jax.Array]]:
    vocab = logits.shape[-1]
    confidence, low = _soft_target_weights(vocab, label_smoothing)
    maximum, scaled_sum, predicted, total = _one_pass_statistics(logits, label_smoothing > 0.0)
    log_z = maximum + jnp.log(scaled_sum)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    target_logit = target_logit.astype(jnp.float32)
    # sum(soft_targets * logits) = low * sum(logits) + (confidence - low) * logits[target]
    expected = (confidence - low) * target_logit
    if total is not None:
        expected = expected + low * total
    z_term = z_loss * jnp.square(log_z)
    loss = log_z - expected - _smoothing_entropy(vocab, label_smoothing) + z_term
    return TokenLosses(loss, z_term, predicted), (logits, targets, log_z)


def _cross_entropy_bwd(
    label_smoothing: float,
    z_loss: float,
    residuals: tuple[jax.Array, jax.Array, jax.Array],
    cotangents: TokenLosses,
) -> tuple[jax.Array, None]:
    logits, targets, log_z = residuals
    vocab = logits.shape[-1]
    confidence, low = _soft_target_weights(vocab, label_smoothing)
    g_loss, g_z = cotangents.loss, cotangents.z_term
    # d loss / d logits = p (1 + 2 z logZ) - soft_targets; d z_term / d logits = 2 z logZ p
    prob_weight = g_loss * (1.0 + 2.0 * z_loss * log_z) + g_z * (2.0 * z_loss * log_z)
    probs = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
    is_target = targets[..., None] == jnp.arange(vocab, dtype=targets.dtype)
    soft = jnp.where(is_target, confidence, low)
    grad = prob_weight[..., None] * probs - g_loss[..., None] * soft
    return grad.astype(logits.dtype), None


cross_entropy_with_logits.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def normalize_loss(
    total: jnp.ndarray, weights: jnp.ndarray, factor: str | float | None
) -> jnp.ndarray:
    """Divides a summed loss by ``factor``.

    ``'NUM_REAL_TARGET_TOKENS'``: the sum of the loss weights (mean over real tokens);
    ``'NUM_TOTAL_TARGET_TOKENS'``: all target positions, padding included; a number: that
    constant (T5X's fixed normaliser); ``None``: the plain sum.
    """
    if factor is None:
        return total
    if factor == "NUM_REAL_TARGET_TOKENS":
        return total / jnp.maximum(jnp.sum(weights), 1e-8)
    if factor == "NUM_TOTAL_TARGET_TOKENS":
        return total / weights.size
    if isinstance(factor, str):
        raise ValueError(
            f"loss_normalizing_factor={factor!r}: use a number, None or one of {LOSS_NORMALIZERS}"
        )
    return total / factor


def token_accuracy(predicted: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted fraction of positions whose prediction (the argmax of the logits,
    :attr:`TokenLosses.predicted`) equals the target (pre-training accuracy)."""
    correct = (predicted == targets).astype(jnp.float32)
    return jnp.sum(correct * weights) / jnp.maximum(jnp.sum(weights), 1e-8)
