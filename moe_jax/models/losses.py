"""Token-level losses and metrics: cross-entropy with label smoothing and z-loss
(T5X's ``cross_entropy_with_logits``), loss normalisation, token accuracy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_NORMALIZERS = ("NUM_REAL_TARGET_TOKENS", "NUM_TOTAL_TARGET_TOKENS")


def cross_entropy_with_logits(
    logits: jnp.ndarray,
    targets: jnp.ndarray,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token loss and z-loss.

    ``loss = -sum(soft_targets * log_softmax(logits)) - H(soft_targets) + z_loss * logZ^2``,
    where soft targets put ``1 - label_smoothing`` on the target and spread the rest over
    the other ``vocab - 1`` ids; subtracting their entropy makes a perfect prediction
    score 0 (as in T5X).

    Args:
      logits: ``[batch, length, vocab]`` (computed in float32).
      targets: int ``[batch, length]``.
    Returns:
      (total per-token loss including the z-loss term, the z-loss term), both ``[batch, length]``.
    """
    vocab = logits.shape[-1]
    logits = jnp.asarray(logits, jnp.float32)
    confidence = 1.0 - label_smoothing
    low_confidence = label_smoothing / (vocab - 1)
    one_hot = jax.nn.one_hot(targets, vocab, dtype=jnp.float32)
    soft_targets = one_hot * (confidence - low_confidence) + low_confidence
    log_z = jax.nn.logsumexp(logits, axis=-1)
    loss = log_z - jnp.sum(soft_targets * logits, axis=-1)
    if label_smoothing > 0.0:
        entropy = -(
            confidence * jnp.log(confidence)
            + (vocab - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
        )
        loss = loss - entropy
    z_term = z_loss * jnp.square(log_z)
    return loss + z_term, z_term


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


def token_accuracy(logits: jnp.ndarray, targets: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """Weighted fraction of positions whose argmax equals the target (pre-training accuracy)."""
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(correct * weights) / jnp.maximum(jnp.sum(weights), 1e-8)
