"""Autoregressive decoding over a KV cache: greedy and temperature sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# (one step of tokens [batch, 1], cache) -> (logits [batch, vocab], new cache)
StepFn = Callable[[jnp.ndarray, Any], tuple[jnp.ndarray, Any]]
DECODE_METHODS = ("greedy", "sample")


def decode_tokens(
    step_fn: StepFn,
    cache: Any,
    batch_size: int,
    max_length: int,
    eos_id: int,
    rng: jax.Array | None = None,
    decode_method: str = "greedy",
    temperature: float = 1.0,
    bos_id: int = 0,
) -> jnp.ndarray:
    """Generates up to ``max_length`` tokens per row, feeding each choice back in.

    Decoding starts from ``bos_id`` (T5: the pad id 0). A row stops at ``eos_id`` (kept
    in the output); later positions are 0. The loop ends early when every row is done.

    Args:
      step_fn: runs the decoder for one position and returns its logits.
      cache: the initial (empty) KV cache.
      decode_method: ``'greedy'`` (argmax) or ``'sample'`` (from softmax(logits / temperature)).
      temperature: > 0; only used by ``'sample'``.
    Returns:
      int32 ``[batch, max_length]``.
    """
    if decode_method not in DECODE_METHODS:
        raise ValueError(f"decode_method={decode_method!r} is not one of {DECODE_METHODS}")
    if decode_method == "sample" and not temperature > 0.0:
        raise ValueError(f"temperature={temperature} must be > 0 for decode_method='sample'")
    if decode_method == "sample" and rng is None:
        raise ValueError("decode_method='sample' needs an rng")
    rng = jax.random.key(0) if rng is None else rng
    tokens = jnp.zeros((batch_size, max_length + 1), jnp.int32).at[:, 0].set(bos_id)

    def cond(state):
        i, _, _, _, finished = state
        return jnp.logical_and(i < max_length, jnp.logical_not(jnp.all(finished)))

    def body(state):
        i, tokens, cache, rng, finished = state
        current = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
        logits, cache = step_fn(current, cache)
        rng, step_rng = jax.random.split(rng)
        if decode_method == "greedy":
            chosen = jnp.argmax(logits, axis=-1)
        else:
            chosen = jax.random.categorical(
                step_rng, logits.astype(jnp.float32) / temperature, axis=-1
            )
        chosen = jnp.where(finished, 0, chosen).astype(jnp.int32)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, chosen[:, None], i + 1, axis=1)
        return i + 1, tokens, cache, rng, jnp.logical_or(finished, chosen == eos_id)

    state = (jnp.array(0, jnp.int32), tokens, cache, rng, jnp.zeros((batch_size,), bool))
    _, tokens, _, _, _ = jax.lax.while_loop(cond, body, state)
    return tokens[:, 1:]
