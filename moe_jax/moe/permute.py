"""Row gathers whose gradient is a gather too.

The dispatches move rows between two layouts that are one-to-one on the rows they keep:
tokens to expert-buffer slots and back, assignments to expert-sorted order and back. The
plain gradient of a gather ``src[index]`` is a scatter-add into ``src``; XLA must assume
that indices collide and emits an atomic (GPU) or serialised (TPU) scatter. When the
inverse map is known, the gradient is a gather of the output cotangent through it, with
no scatter. :func:`gather_rows` takes both maps and uses the inverse for its VJP;
:func:`take_rows` chooses between it and the plain gather (``ExecutionPlan.gather_gradients``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _masked_gather(src: Array, index: Array, valid: Array) -> Array:
    """``[groups, n, d]`` rows at ``index [groups, m]`` -> ``[groups, m, d]``, zero where
    ``valid [groups, m]`` is False (``index`` there may be anything in range)."""
    rows = jnp.take_along_axis(src, index[..., None], axis=1, mode="clip")
    return jnp.where(valid[..., None], rows, jnp.zeros((), src.dtype))


@jax.custom_vjp
def gather_rows(
    src: Array, index: Array, valid: Array, inverse: Array, inverse_valid: Array
) -> Array:
    """``out[g, m] = src[g, index[g, m]]`` where ``valid[g, m]``, else 0.

    Args:
      src: ``[groups, n, d]``.
      index: ``[groups, m]`` int, row of ``src`` each output row reads.
      valid: ``[groups, m]`` bool.
      inverse: ``[groups, n, r]`` int: for source row ``i``, the output rows that read it
        (at most ``r``; ``r = 1`` for a permutation, ``k`` for a token's k assignments).
      inverse_valid: ``[groups, n, r]`` bool, which entries of ``inverse`` are used.
        ``(index, valid)`` and ``(inverse, inverse_valid)`` must describe the same pairs
        ``(m, i)``: every valid ``m`` appears exactly once in the valid entries of
        ``inverse[g, index[g, m]]`` and nowhere else.

    Returns:
      ``[groups, m, d]``. Its VJP w.r.t. ``src`` gathers the output cotangent through
      ``inverse`` and sums over ``r`` (no scatter-add); the index arguments get none.
    """
    return _masked_gather(src, index, valid)


def _gather_rows_fwd(src, index, valid, inverse, inverse_valid):
    return _masked_gather(src, index, valid), (inverse, inverse_valid)


def _gather_rows_bwd(residuals, cotangent):
    inverse, inverse_valid = residuals
    groups, n, r = inverse.shape
    back = _masked_gather(
        cotangent, inverse.reshape(groups, n * r), inverse_valid.reshape(groups, -1)
    )
    d_src = jnp.sum(back.reshape(groups, n, r, -1), axis=2, dtype=cotangent.dtype)
    return d_src, None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def take_rows(
    src: Array,
    index: Array,
    valid: Array,
    inverse: Array,
    inverse_valid: Array,
    gather_gradient: bool,
) -> Array:
    """:func:`gather_rows` (``gather_gradient``) or the same gather differentiated by JAX
    (its gradient a scatter-add into ``src``); same arguments and result."""
    if gather_gradient:
        return gather_rows(src, index, valid, inverse, inverse_valid)
    return _masked_gather(src, index, valid)
