"""Row gathers whose gradient is a gather too.

The dispatches move rows between two layouts that are one-to-one on the rows they keep:
tokens to expert-buffer slots and back, assignments to expert-sorted order and back. The
plain gradient of a gather ``src[index]`` is a scatter-add into ``src``; XLA must assume
that indices collide and emits an atomic (GPU) or serialised (TPU) scatter. When the
inverse map is known, the gradient is a gather of the output cotangent through it, with
no scatter. :func:`gather_rows` takes both maps and uses the inverse for its VJP;
:func:`scatter_rows` is the mirror image, for a compiler whose gathers of rows cost more
than its scatters (XLA:TPU's cost model counts a row gather from a tiled ``[n, d]`` array
at about 7x its bytes, a scatter-add of the same rows at about 1x): the forward scatters
each source row to the output rows that read it (through the inverse map), the VJP
scatter-adds the cotangent rows back (through ``index``). :func:`take_rows` chooses
between them and the plain gather (``ExecutionPlan.gather_gradients`` / ``scatter_rows``).
A kernel that gathers its rows itself takes the two maps as a :class:`RowMap` instead;
:func:`gather_sum` is the gradient of either.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class RowMap(NamedTuple):
    """Rows ``[m, d]`` read from source rows ``[n, d]``, as both maps (one group; the
    contract of :func:`gather_rows`, with the rows that no valid entry of ``inverse`` names
    left to the reader: it must ignore them, as a grouped matmul does its rows past
    ``sum(group_sizes)``).

    Attributes:
      source: ``[m]`` int32, the source row each row reads (in range everywhere).
      inverse: ``[n, r]`` int32, for each source row the rows that read it.
      inverse_valid: ``[n, r]`` bool, which entries of ``inverse`` are used.
    """

    source: Array
    inverse: Array
    inverse_valid: Array


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


def gather_sum(rows: Array, inverse: Array, inverse_valid: Array) -> Array:
    """``[groups, n, d]``: for each source row, the sum of the ``rows [groups, m, d]`` that
    read it (``inverse``, ``inverse_valid``: ``[groups, n, r]`` as in :func:`gather_rows`),
    by gathering them: the gradient of a row gather, without a scatter-add."""
    groups, n, r = inverse.shape
    back = _masked_gather(rows, inverse.reshape(groups, n * r), inverse_valid.reshape(groups, -1))
    return jnp.sum(back.reshape(groups, n, r, -1), axis=2, dtype=rows.dtype)


def _gather_rows_bwd(residuals, cotangent):
    return gather_sum(cotangent, *residuals), None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _scatter_add(rows: Array, destination: Array, valid: Array, size: int) -> Array:
    """``[groups, size, d]``: zeros plus ``rows [groups, a, d]`` added at ``destination
    [groups, a, r]`` (each row at up to ``r`` places) where ``valid [groups, a, r]``
    (elsewhere dropped): one scatter-add per place, so ``rows`` is never repeated in memory
    (a ``[groups, a, r, d]`` broadcast was the TPU compiler's costliest operation)."""
    g = jnp.arange(rows.shape[0])[:, None]
    out = jnp.zeros((rows.shape[0], size, rows.shape[-1]), rows.dtype)
    for j in range(destination.shape[-1]):
        where = jnp.where(valid[..., j], destination[..., j], size)  # past the end: dropped
        out = out.at[g, where].add(rows, mode="drop")
    return out


@jax.custom_vjp
def scatter_rows(
    src: Array, index: Array, valid: Array, inverse: Array, inverse_valid: Array
) -> Array:
    """:func:`gather_rows`' result (same arguments and contract), computed by scattering:
    source row ``i`` is added at each valid output row ``inverse[g, i]`` (each output row
    is written by one source row at most, so this equals the gather). Its VJP w.r.t.
    ``src`` scatter-adds the output cotangent rows at ``index``; the index arguments get
    none. ``[groups, n, d]`` -> ``[groups, m, d]``, ``m = index.shape[1]``."""
    return _scatter_add(src, inverse, inverse_valid, index.shape[1])


def _scatter_rows_fwd(src, index, valid, inverse, inverse_valid):
    return scatter_rows(src, index, valid, inverse, inverse_valid), (index, valid, src.shape[1])


def _scatter_rows_bwd(residuals, cotangent):
    index, valid, n = residuals
    return _scatter_add(cotangent, index[..., None], valid[..., None], n), None, None, None, None


scatter_rows.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)


@jax.custom_vjp
def scatter_combine(
    rows: Array, weights: Array, index: Array, valid: Array, inverse: Array, inverse_valid: Array
) -> Array:
    """``out[g, t] = sum_m weights[g, m] * rows[g, m]`` over the rows ``m`` with
    ``index[g, m] == t`` and ``valid[g, m]``: the weighted combine of expert outputs back
    into their tokens as one scatter-add (no ``[tokens, k, d]`` intermediate).

    Args:
      rows: ``[groups, m, d]`` expert outputs (buffer slots or sorted rows).
      weights: ``[groups, m]`` each row's combine weight.
      index: ``[groups, m]`` the token each row belongs to.
      valid: ``[groups, m]`` whether it belongs to one.
      inverse: ``[groups, tokens, r]`` each token's rows (as in :func:`gather_rows`).
      inverse_valid: ``[groups, tokens, r]`` which of those are rows.

    Returns:
      ``[groups, tokens, d]``. Its VJP scatters the output cotangent into the rows
      (through ``inverse``): ``d rows = weights * g``, ``d weights = sum(g * rows)``.
    """
    return _scatter_add(
        weights[..., None] * rows, index[..., None], valid[..., None], inverse.shape[1]
    )


def _scatter_combine_fwd(rows, weights, index, valid, inverse, inverse_valid):
    out = scatter_combine(rows, weights, index, valid, inverse, inverse_valid)
    return out, (rows, weights, inverse, inverse_valid)


def _scatter_combine_bwd(residuals, cotangent):
    rows, weights, inverse, inverse_valid = residuals
    g = _scatter_add(cotangent, inverse, inverse_valid, rows.shape[1])  # [groups, m, d]
    d_weights = jnp.sum(g.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1)
    return weights[..., None] * g, d_weights.astype(weights.dtype), None, None, None, None


scatter_combine.defvjp(_scatter_combine_fwd, _scatter_combine_bwd)


def take_rows(
    src: Array,
    index: Array,
    valid: Array,
    inverse: Array,
    inverse_valid: Array,
    gather_gradient: bool,
    scatter: bool = False,
) -> Array:
    """:func:`scatter_rows` (``scatter``), :func:`gather_rows` (``gather_gradient``) or the
    same gather differentiated by JAX (its gradient a scatter-add into ``src``); same
    arguments and result."""
    if scatter:
        return scatter_rows(src, index, valid, inverse, inverse_valid)
    if gather_gradient:
        return gather_rows(src, index, valid, inverse, inverse_valid)
    return _masked_gather(src, index, valid)
