"""T5 attention as one fused (flash) Pallas kernel for NVIDIA GPUs (Pallas's Triton backend).

``softmax(q k^T + bias, masked) v`` without the ``1/sqrt(d)`` scale, given what it needs
and no more:

* q, k, v as the projections store them, ``[batch, length, heads, head_dim]`` (each
  program reads its head's rows with a stride: no transposes around the kernel);
* the mask as segment ids ``[batch, q_len]`` / ``[batch, k_len]`` (``0`` = padding) and a
  causal flag: query ``i`` sees key ``j`` when their segments are equal and non-zero (and
  ``j <= i`` when causal). Padding, packed segments and the cross-attention of packed
  rows are all this one rule (:meth:`AttentionMask.from_padding` fills the ids);
* the relative-position bias at ``[1, heads, q_len, k_len]``, shared over the batch; its
  gradient is reduced over the batch inside a kernel of its own, so no
  ``[batch, heads, q_len, k_len]`` array is ever written.

Forward: one program per (batch, head, block of queries) runs the online softmax over
blocks of keys and writes the output and each row's log-sum-exp. Backward
(FlashAttention-2): one program per (batch, head, block of keys) forms dK and dV over the
query blocks, one per (batch, head, block of queries) forms dQ over the key blocks, and,
when there is a bias, one per (head, query block, key block) sums ``dS`` over the batch.
Each recomputes ``P = exp(S - lse)`` from q, k and the bias: the scores never leave the
chip. Lengths that are not a multiple of the block are padded (as padding segments).

The kernels use only ``pallas_call``, ``BlockSpec``, ref indexing and ``jax.lax``
primitives inside them (no Triton-specific load/store or ``dot`` helpers), so they trace
with the jax versions the project supports; ``interpret=True`` runs them on any platform
through Pallas's interpreter (the CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

# Masked scores: finite, so a fully masked row gives exp(0) * 0 rather than NaN.
_MASKED = -1e30

# The kernels by name (``pallas_call(name=...)``, seen in the compiled program's op names)
# -> the ``[q_len, k_len] x head_dim`` matmuls each runs per (batch, head): the forward
# ``q k^T`` and ``P v``; dK/dV recompute ``S`` and ``dP`` and form dV and dK; dQ recomputes
# both and forms dQ; the bias gradient recomputes both. ``moe_jax.compile.hlo_costs``
# counts their FLOPs from this (a compiled Triton call carries none); a causal kernel skips
# the tiles above the diagonal, about half of these.
KERNEL_MATMULS = {
    "t5_flash_attention_forward": 2,
    "t5_flash_attention_dkv": 4,
    "t5_flash_attention_dq": 3,
    "t5_flash_attention_dbias": 2,
}


def _segments_mask(
    q_seg: Array, k_seg: Array, q_start: Array, k_start: Array, causal: bool
) -> Array:
    """``[block_q]`` x ``[block_k]`` segment ids (tiles starting at ``q_start`` / ``k_start``)
    -> boolean ``[block_q, block_k]``, True where the query sees the key."""
    mask = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] != 0)
    if causal:
        q_pos = q_start + jnp.arange(q_seg.shape[0])
        k_pos = k_start + jnp.arange(k_seg.shape[0])
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    return mask


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """2-D matmul contracting axis ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``,
    accumulated in float32."""
    return jax.lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32
    )


def _scores(q: Array, k: Array, bias_ref: Any, q_slice: Any, k_slice: Any) -> Array:
    """``q [block_q, d] k^T [block_k, d]`` (+ the bias tile) -> float32 ``[block_q, block_k]``."""
    s = _dot(q, k, (1, 1))
    if bias_ref is not None:
        s = s + bias_ref[q_slice, k_slice].astype(jnp.float32)
    return s


def _forward_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bias_ref: Any,
    q_seg_ref: Any,
    k_seg_ref: Any,
    o_ref: Any,
    lse_ref: Any,
    *,
    block_q: int,
    block_k: int,
    causal: bool,
) -> None:
    """One (batch, head, query block): ``o_ref [block_q, d]``, ``lse_ref [block_q]``.

    Refs: ``q_ref [block_q, d]``, ``k_ref``/``v_ref [k_len, d]``, ``bias_ref [q_len, k_len]``
    or None, ``q_seg_ref [block_q]``, ``k_seg_ref [k_len]``.
    """
    i = pl.program_id(2)
    q = q_ref[...]
    q_seg = q_seg_ref[...]
    q_slice = pl.ds(i * block_q, block_q)

    def body(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        acc, m, total = carry
        k_slice = pl.ds(j * block_k, block_k)
        s = _scores(q, k_ref[k_slice, :], bias_ref, q_slice, k_slice)
        mask = _segments_mask(q_seg, k_seg_ref[k_slice], i * block_q, j * block_k, causal)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        scale = jnp.exp(m - m_new)
        v = v_ref[k_slice, :]
        acc = acc * scale[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
        return acc, m_new, total * scale + jnp.sum(p, axis=1)

    num_k = k_ref.shape[0] // block_k
    upper = jnp.minimum(num_k, ((i + 1) * block_q + block_k - 1) // block_k) if causal else num_k
    init = (
        jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),
        jnp.full((block_q,), _MASKED, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, total = jax.lax.fori_loop(0, upper, body, init)
    seen = total > 0.0  # rows with no key to attend to (padding) give zeros
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None], 0.0).astype(
        o_ref.dtype
    )
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)


def _probs_and_ds(
    q: Array,
    k: Array,
    v: Array,
    d_out: Array,
    lse: Array,
    delta: Array,
    mask: Array,
    bias_ref: Any,
    q_slice: Any,
    k_slice: Any,
) -> tuple[Array, Array]:
    """The recomputed probabilities and the scores' gradient of one tile, both float32
    ``[block_q, block_k]``: ``P = exp(S - lse)`` and ``dS = P * (dO v^T - delta)``."""
    s = _scores(q, k, bias_ref, q_slice, k_slice)
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dp = _dot(d_out, v, (1, 1))
    return p, p * (dp - delta[:, None])


def _dkv_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bias_ref: Any,
    q_seg_ref: Any,
    k_seg_ref: Any,
    d_out_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    *,
    block_q: int,
    block_k: int,
    causal: bool,
) -> None:
    """One (batch, head, key block): ``dk_ref``/``dv_ref [block_k, d]``, over the query
    blocks. Refs: ``q_ref``/``d_out_ref [q_len, d]``, ``k_ref``/``v_ref [block_k, d]``,
    ``lse_ref``/``delta_ref``/``q_seg_ref [q_len]``, ``k_seg_ref [block_k]``."""
    j = pl.program_id(2)
    k, v, k_seg = k_ref[...], v_ref[...], k_seg_ref[...]
    k_slice = pl.ds(j * block_k, block_k)

    def body(i: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        dk, dv = carry
        q_slice = pl.ds(i * block_q, block_q)
        q, d_out = q_ref[q_slice, :], d_out_ref[q_slice, :]
        mask = _segments_mask(q_seg_ref[q_slice], k_seg, i * block_q, j * block_k, causal)
        p, ds = _probs_and_ds(
            q, k, v, d_out, lse_ref[q_slice], delta_ref[q_slice], mask, bias_ref, q_slice, k_slice
        )
        dv = dv + _dot(p.astype(d_out.dtype), d_out, (0, 0))
        dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
        return dk, dv

    num_q = q_ref.shape[0] // block_q
    lower = (j * block_k) // block_q if causal else 0
    zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
    dk, dv = jax.lax.fori_loop(lower, num_q, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bias_ref: Any,
    q_seg_ref: Any,
    k_seg_ref: Any,
    d_out_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    dq_ref: Any,
    *,
    block_q: int,
    block_k: int,
    causal: bool,
) -> None:
    """One (batch, head, query block): ``dq_ref [block_q, d]``, over the key blocks. Refs as
    :func:`_forward_kernel`'s, with ``d_out_ref [block_q, d]``, ``lse_ref``/``delta_ref
    [block_q]``."""
    i = pl.program_id(2)
    q, d_out, q_seg = q_ref[...], d_out_ref[...], q_seg_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_slice = pl.ds(i * block_q, block_q)

    def body(j: Array, dq: Array) -> Array:
        k_slice = pl.ds(j * block_k, block_k)
        k = k_ref[k_slice, :]
        mask = _segments_mask(q_seg, k_seg_ref[k_slice], i * block_q, j * block_k, causal)
        _, ds = _probs_and_ds(
            q, k, v_ref[k_slice, :], d_out, lse, delta, mask, bias_ref, q_slice, k_slice
        )
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    num_k = k_ref.shape[0] // block_k
    upper = jnp.minimum(num_k, ((i + 1) * block_q + block_k - 1) // block_k) if causal else num_k
    dq = jax.lax.fori_loop(0, upper, body, jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dbias_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bias_ref: Any,
    q_seg_ref: Any,
    k_seg_ref: Any,
    d_out_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    dbias_ref: Any,
    *,
    block_q: int,
    block_k: int,
    causal: bool,
) -> None:
    """One (head, query block, key block): ``dbias_ref [block_q, block_k]`` = ``dS`` summed
    over the batch. Refs: ``q_ref``/``d_out_ref [batch, block_q, d]``, ``k_ref``/``v_ref
    [batch, block_k, d]``, ``bias_ref [q_len, k_len]``, ``lse_ref``/``delta_ref``/
    ``q_seg_ref [batch, block_q]``, ``k_seg_ref [batch, block_k]``."""
    i, j = pl.program_id(1), pl.program_id(2)
    q_slice, k_slice = pl.ds(i * block_q, block_q), pl.ds(j * block_k, block_k)

    def body(b: Array, acc: Array) -> Array:
        mask = _segments_mask(q_seg_ref[b, :], k_seg_ref[b, :], i * block_q, j * block_k, causal)
        _, ds = _probs_and_ds(
            q_ref[b, :, :],
            k_ref[b, :, :],
            v_ref[b, :, :],
            d_out_ref[b, :, :],
            lse_ref[b, :],
            delta_ref[b, :],
            mask,
            bias_ref,
            q_slice,
            k_slice,
        )
        return acc + ds

    acc = jax.lax.fori_loop(0, q_ref.shape[0], body, jnp.zeros((block_q, block_k), jnp.float32))
    dbias_ref[...] = acc.astype(dbias_ref.dtype)


def _pad_to(x: Array, axis: int, multiple: int) -> Array:
    """``x`` zero-padded along ``axis`` to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """How the kernels tile the scores: rows of q and k per tile, causality, Triton's warps
    per program, and whether they run in Pallas's interpreter."""

    block_q: int
    block_k: int
    causal: bool
    num_warps: int
    interpret: bool

    def kernel(self, body: Any) -> Any:
        """``body`` with the tiling bound."""
        return functools.partial(
            body, block_q=self.block_q, block_k=self.block_k, causal=self.causal
        )

    @property
    def params(self) -> Any:
        """The Triton backend's options (None in the interpreter; the Triton module is
        imported only when a kernel is built)."""
        if self.interpret:
            return None
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=self.num_warps, num_stages=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    q_segments: Array,
    k_segments: Array,
    tiles: _Tiles,
) -> Array:
    return _flash_forward(query, key, value, bias, q_segments, k_segments, tiles)[0]


def _flash_forward(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    q_segments: Array,
    k_segments: Array,
    tiles: _Tiles,
) -> tuple[Array, tuple[Any, ...]]:
    block_q = tiles.block_q
    batch, q_len, heads, dim = query.shape
    k_len = key.shape[1]
    row = pl.BlockSpec((None, block_q, None, dim), lambda b, h, i: (b, i, h, 0))
    keys = pl.BlockSpec((None, k_len, None, dim), lambda b, h, i: (b, 0, h, 0))
    out, lse = pl.pallas_call(
        tiles.kernel(_forward_kernel),
        out_shape=(
            jax.ShapeDtypeStruct(query.shape, query.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
        ),
        grid=(batch, heads, q_len // block_q),
        in_specs=[
            row,
            keys,
            keys,
            None if bias is None else _bias_spec(q_len, k_len),
            pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, k_len), lambda b, h, i: (b, 0)),
        ],
        out_specs=(row, pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))),
        compiler_params=tiles.params,
        interpret=tiles.interpret,
        name="t5_flash_attention_forward",
    )(query, key, value, bias, q_segments, k_segments)
    return out, (query, key, value, bias, q_segments, k_segments, out, lse)


def _bias_spec(q_len: int, k_len: int, head_axis: int = 1) -> pl.BlockSpec:
    """The bias ``[1, heads, q_len, k_len]`` as one head's ``[q_len, k_len]``, the head
    being grid axis ``head_axis``."""
    return pl.BlockSpec((None, None, q_len, k_len), lambda *grid: (0, grid[head_axis], 0, 0))


def _flash_backward(
    tiles: _Tiles, residuals: tuple[Any, ...], d_out: Array
) -> tuple[Array, Array, Array, Array | None, None, None]:
    query, key, value, bias, q_segments, k_segments, out, lse = residuals
    d_out = d_out.astype(query.dtype)
    # delta = sum_d dO * O = sum_k P dP, per row: [batch, heads, q_len]
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out, preferred_element_type=jnp.float32)
    inputs = (query, key, value, bias, q_segments, k_segments, d_out, lse, delta)
    dk, dv = _dkv_call(inputs, tiles)
    dq = _dq_call(inputs, tiles)
    d_bias = None if bias is None else _dbias_call(inputs, tiles).astype(bias.dtype)
    return dq, dk, dv, d_bias, None, None


# The backward kernels' inputs: q, k, v, bias, q / k segment ids, dO, lse, delta.
_BackwardInputs = tuple[Array, Array, Array, Any, Array, Array, Array, Array, Array]


def _dkv_call(inputs: _BackwardInputs, tiles: _Tiles) -> tuple[Array, Array]:
    """dK and dV ``[batch, k_len, heads, head_dim]``: one program per (batch, head, key tile)."""
    query, key, value, bias = inputs[:4]
    q_len, k_len, dim = query.shape[1], key.shape[1], query.shape[-1]
    all_q = pl.BlockSpec((None, q_len, None, dim), lambda b, h, j: (b, 0, h, 0))
    k_rows = pl.BlockSpec((None, tiles.block_k, None, dim), lambda b, h, j: (b, j, h, 0))
    all_q_stats = pl.BlockSpec((None, None, q_len), lambda b, h, j: (b, h, 0))
    return pl.pallas_call(
        tiles.kernel(_dkv_kernel),
        out_shape=(
            jax.ShapeDtypeStruct(key.shape, key.dtype),
            jax.ShapeDtypeStruct(value.shape, value.dtype),
        ),
        grid=(key.shape[0], key.shape[2], k_len // tiles.block_k),
        in_specs=[
            all_q,
            k_rows,
            k_rows,
            None if bias is None else _bias_spec(q_len, k_len),
            pl.BlockSpec((None, q_len), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, tiles.block_k), lambda b, h, j: (b, j)),
            all_q,
            all_q_stats,
            all_q_stats,
        ],
        out_specs=(k_rows, k_rows),
        compiler_params=tiles.params,
        interpret=tiles.interpret,
        name="t5_flash_attention_dkv",
    )(*inputs)


def _dq_call(inputs: _BackwardInputs, tiles: _Tiles) -> Array:
    """dQ ``[batch, q_len, heads, head_dim]``: one program per (batch, head, query tile)."""
    query, key, _, bias = inputs[:4]
    q_len, k_len, dim = query.shape[1], key.shape[1], query.shape[-1]
    all_k = pl.BlockSpec((None, k_len, None, dim), lambda b, h, i: (b, 0, h, 0))
    q_rows = pl.BlockSpec((None, tiles.block_q, None, dim), lambda b, h, i: (b, i, h, 0))
    q_stats = pl.BlockSpec((None, None, tiles.block_q), lambda b, h, i: (b, h, i))
    return pl.pallas_call(
        tiles.kernel(_dq_kernel),
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        grid=(query.shape[0], query.shape[2], q_len // tiles.block_q),
        in_specs=[
            q_rows,
            all_k,
            all_k,
            None if bias is None else _bias_spec(q_len, k_len),
            pl.BlockSpec((None, tiles.block_q), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, k_len), lambda b, h, i: (b, 0)),
            q_rows,
            q_stats,
            q_stats,
        ],
        out_specs=q_rows,
        compiler_params=tiles.params,
        interpret=tiles.interpret,
        name="t5_flash_attention_dq",
    )(*inputs)


def _dbias_call(inputs: _BackwardInputs, tiles: _Tiles) -> Array:
    """The bias gradient, float32 ``[1, heads, q_len, k_len]``: one program per (head,
    query tile, key tile), summing over the batch."""
    query, key, _, bias = inputs[:4]
    batch, q_len, heads, dim = query.shape
    k_len, bq, bk = key.shape[1], tiles.block_q, tiles.block_k
    batch_q = pl.BlockSpec((batch, bq, None, dim), lambda h, i, j: (0, i, h, 0))
    batch_k = pl.BlockSpec((batch, bk, None, dim), lambda h, i, j: (0, j, h, 0))
    batch_q_stats = pl.BlockSpec((batch, None, bq), lambda h, i, j: (0, h, i))
    return pl.pallas_call(
        tiles.kernel(_dbias_kernel),
        out_shape=jax.ShapeDtypeStruct(bias.shape, jnp.float32),
        grid=(heads, q_len // bq, k_len // bk),
        in_specs=[
            batch_q,
            batch_k,
            batch_k,
            _bias_spec(q_len, k_len, head_axis=0),
            pl.BlockSpec((batch, bq), lambda h, i, j: (0, i)),
            pl.BlockSpec((batch, bk), lambda h, i, j: (0, j)),
            batch_q,
            batch_q_stats,
            batch_q_stats,
        ],
        out_specs=pl.BlockSpec((None, None, bq, bk), lambda h, i, j: (0, h, i, j)),
        compiler_params=tiles.params,
        interpret=tiles.interpret,
        name="t5_flash_attention_dbias",
    )(*inputs)


_flash.defvjp(_flash_forward, _flash_backward)


def flash_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    q_segments: Array,
    k_segments: Array,
    *,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> Array:
    """Unscaled ``softmax(q k^T + bias, masked) v`` in one kernel (module docstring).

    Args:
      query: ``[batch, q_len, heads, head_dim]`` (bfloat16 on a GPU).
      key: ``[batch, k_len, heads, head_dim]``.
      value: ``[batch, k_len, heads, head_dim]``.
      bias: ``[1, heads, q_len, k_len]`` shared over the batch, or None.
      q_segments: int32 ``[batch, q_len]``; 0 = padding.
      k_segments: int32 ``[batch, k_len]``; 0 = padding. Query ``i`` sees key ``j`` when
        ``q_segments[i] == k_segments[j] != 0``.
      causal: and only keys ``j <= i``.
      block_q: rows of q per tile (a power of two; the length is padded to it).
      block_k: rows of k per tile (the same).
      num_warps: Triton warps per program.
      interpret: run through Pallas's interpreter (any platform); None: the Triton kernel
        where the program is lowered for an NVIDIA GPU, the interpreter elsewhere (the
        choice follows the devices compiled for, not the host).
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``query``'s dtype; rows with no key to attend
      to are zeros.
    Raises:
      ValueError: a bias that is not shared over the batch.
    """
    q_len, k_len = query.shape[1], key.shape[1]
    if bias is not None and bias.shape != (1, query.shape[2], q_len, k_len):
        raise ValueError(
            f"flash_attention takes a bias of [1, heads, q_len, k_len] = "
            f"{(1, query.shape[2], q_len, k_len)} (shared over the batch); got {bias.shape}"
        )
    if causal and q_len != k_len:
        raise ValueError(f"causal flash_attention needs q_len == k_len; got {q_len}, {k_len}")
    key, value = (jnp.asarray(t, query.dtype) for t in (key, value))
    query, q_segments = (
        _pad_to(query, 1, block_q),
        _pad_to(q_segments.astype(jnp.int32), 1, block_q),
    )
    key, value = _pad_to(key, 1, block_k), _pad_to(value, 1, block_k)
    k_segments = _pad_to(k_segments.astype(jnp.int32), 1, block_k)
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 2, block_q), 3, block_k)

    def run(interpreted: bool) -> Array:
        tiles = _Tiles(block_q, block_k, causal, num_warps, interpreted)
        return _flash(query, key, value, bias, q_segments, k_segments, tiles)

    if interpret is None:
        out = jax.lax.platform_dependent(cuda=lambda: run(False), default=lambda: run(True))
    else:
        out = run(interpret)
    return out[:, :q_len]
