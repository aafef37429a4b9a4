"""T5 relative position buckets and the learned per-head bias they index.

The bias of a query/key pair depends only on the offset ``key - query``, so it is built
per offset (``query_length + key_length - 1`` of them) and then laid out as a Toeplitz
matrix by reshaping, not gathered from the ``[heads, buckets]`` table per pair. A gather's
gradient is a scatter-add of ``heads x query x key`` updates into the table's few hundred
entries: thousands of contended atomic adds per entry on a GPU (seconds per step at 512
positions). Here the gradient is a small one-hot contraction and a sum over the layout's
copies, on every platform.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

DType = Any


def relative_position_bucket(
    relative_position: np.ndarray,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
    """T5's bucketing of ``memory_position - query_position`` (Raffel et al., Mesh TF).

    Half the buckets (or all, if ``bidirectional`` is false) cover exact small offsets;
    the rest grow logarithmically up to ``max_distance``, beyond which offsets share the
    last bucket. With ``bidirectional=False`` positive offsets (the future) map to bucket 0.

    Args:
      relative_position: int array of any shape.
    Returns:
      int32 array of the same shape with values in ``[0, num_buckets)``.
    """
    ret = np.zeros_like(relative_position, dtype=np.int32)
    n = -np.asarray(relative_position)
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).astype(np.int32) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    with np.errstate(divide="ignore"):
        val_if_large = max_exact + (
            np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
            / np.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype(np.int32)
    val_if_large = np.minimum(val_if_large, num_buckets - 1)
    return ret + np.where(is_small, n, val_if_large).astype(np.int32)


def toeplitz(per_offset: jnp.ndarray, query_length: int, key_length: int) -> jnp.ndarray:
    """``[..., query_length, key_length]`` with ``out[..., q, k] = per_offset[..., k - q +
    query_length - 1]``, from ``per_offset [..., query_length + key_length - 1]`` (offsets
    ``k - q`` from ``-(query_length - 1)`` to ``key_length - 1``), without a gather.

    Row ``q`` is ``per_offset`` shifted left by ``q``: the offsets padded with one element
    to ``P = query_length + key_length``, repeated ``query_length`` times and read back in
    rows of ``P - 1`` make each row start one element later than the one above it. Its
    transpose is a pad, a reshape and a sum over the repeats: no scatter.
    """
    width = query_length + key_length  # P
    padded = jnp.pad(per_offset, [(0, 0)] * (per_offset.ndim - 1) + [(0, 1)])
    repeated = jnp.tile(padded, (1,) * (per_offset.ndim - 1) + (query_length,))
    rows = repeated[..., : query_length * (width - 1)].reshape(
        *per_offset.shape[:-1], query_length, width - 1
    )
    return rows[..., query_length - 1 :]


class RelativePositionBiases(nn.Module):
    """Learned attention bias per (head, relative-position bucket); one per stack in T5.

    Attributes:
      num_heads: attention heads.
      num_buckets: relative position buckets (T5: 32).
      max_distance: offsets beyond this share the last bucket (T5: 128).
      dtype: dtype of the returned bias.
      param_dtype: dtype of the ``rel_embedding`` table ``[heads, buckets]``.
    """

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, query_length: int, key_length: int, bidirectional: bool) -> jnp.ndarray:
        """Bias ``[1, heads, query_length, key_length]`` for queries/keys at 0, 1, 2, ...

        Positions are implicit (``arange``): with packed sequences each segment is a
        contiguous run, so within-segment offsets are the same, and the segment mask
        removes cross-segment pairs.
        """
        offsets = np.arange(-(query_length - 1), key_length, dtype=np.int32)  # key - query
        buckets = relative_position_bucket(
            offsets, bidirectional, self.num_buckets, self.max_distance
        )
        # [buckets, offsets]: 1 where the offset falls in the bucket
        one_hot = (buckets[None] == np.arange(self.num_buckets)[:, None]).astype(np.float32)
        table = self.param(
            "rel_embedding",
            nn.with_logical_partitioning(
                nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                ("heads", "relpos_buckets"),
            ),
            (self.num_heads, self.num_buckets),
            self.param_dtype,
        )
        # [heads, offsets]: each entry exactly one table entry (float32, full precision)
        per_offset = jnp.einsum(
            "hb,bo->ho",
            jnp.asarray(table, jnp.float32),
            one_hot,
            precision=jax.lax.Precision.HIGHEST,
        )
        return toeplitz(per_offset, query_length, key_length).astype(self.dtype)[None]
