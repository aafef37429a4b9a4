"""A grouped matmul of the project's own: Pallas kernels for NVIDIA GPUs (Triton backend).

The three products of the dropless path (``grouped_matmul``), rows sorted by group and
``group_sizes [experts] int32`` giving each expert's row count:

* :func:`forward`: ``y[r] = x[r] @ w[e(r)]``, ``[m, k] x [experts, k, n] -> [m, n]``;
* :func:`input_gradient`: ``dx[r] = dy[r] @ w[e(r)]^T``, ``[m, n] x [experts, k, n] -> [m, k]``;
* :func:`weight_gradient`: ``dw[e] = x_e^T @ dy_e``, ``[m, k] x [m, n] -> [experts, k, n]``,
  ragged over the contracted rows (an empty expert gets zeros).

Rows past ``sum(group_sizes)`` may hold anything (even NaN): they come out as zeros and
add nothing to the weight gradient.

Gathered rows. Given ``row_index [m] int32``, :func:`forward` and :func:`weight_gradient`
read their ``lhs`` rows through it: ``lhs`` is then ``[tokens, k]`` (unsorted) and product
row ``r`` reads ``lhs[row_index[r]]``, a gather-load in the kernel's prologue (per tile, the
``block_m`` or ``block_k`` row indices, then those rows), so the sorted ``[m, k]`` copy is
never written. Entries of ``row_index`` past ``sum(group_sizes)`` must be in range; their
rows are not used.

Tiling. :func:`forward` and :func:`input_gradient` give each program one output tile
``[block_m rows, block_n columns]``; the row tiles are aligned, so one may hold the
boundary between experts. Per tile, the range of experts whose rows it holds is computed
outside the kernel with jnp ops (:func:`_tile_groups`); the program loops over them, each
expert's product over the whole tile (``block_k`` of the contraction at a time) kept only
on that expert's rows, and writes the tile once: no two programs write the same rows, so
no masked stores are needed. An empty expert costs nothing. :func:`weight_gradient` gives
each program one ``[block_m, block_n]`` tile of one expert's ``[k, n]`` and loops over that
expert's rows ``block_k`` at a time, rows of other experts masked to zero.

Inputs whose dimensions are not multiples of the blocks are zero-padded (only then); blocks
shrink to the next power of two of a smaller dimension (at least 16, Triton's smallest
dot). bf16 inputs are multiplied with float32 accumulation; the result is cast to the
requested dtype. The kernels use only ``pl.pallas_call``, ``pl.BlockSpec``,
``pl.program_id``, ``pl.ds``, ref indexing, ``jax.lax`` loops and ``jax.lax.dot_general``:
no Triton-specific primitive, nothing jax 0.10.2 deprecates (``pl.dot``) or has moved
(``pl.load`` / ``pl.store``); of the Triton module only its ``CompilerParams``.
``interpret=True`` runs them in Pallas's interpreter (CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

Array = jax.Array

# Triton's smallest dot operand side.
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: each program writes one ``[m, n]`` output tile, contracting ``k`` at a
    time (the weight gradient's ``[m, n]`` tile is one of an expert's ``[k, n]``, its
    contraction the rows); Triton's ``num_warps`` and ``num_stages`` (pipelining)."""

    m: int = 128
    n: int = 128
    k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def forward(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dtype: jax.typing.DTypeLike,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool = False,
    row_index: Array | None = None,
) -> Array:
    """``[m, k] x [experts, k, n] -> [m, n]``: each row times its expert's ``[k, n]``; with
    ``row_index [m]``, ``lhs`` is ``[tokens, k]`` and row ``r`` is ``lhs[row_index[r]]``
    (gathered in the kernel)."""
    return _row_tiled(lhs, rhs, group_sizes, dtype, blocks, interpret, False, row_index)


def input_gradient(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dtype: jax.typing.DTypeLike,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool = False,
) -> Array:
    """``[m, n] x [experts, k, n] -> [m, k]``: each row times its expert's ``[k, n]^T``."""
    return _row_tiled(lhs, rhs, group_sizes, dtype, blocks, interpret, True, None)


def weight_gradient(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dtype: jax.typing.DTypeLike,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool = False,
    row_index: Array | None = None,
) -> Array:
    """``[m, k] x [m, n] -> [experts, k, n]``: ``lhs_e^T @ rhs_e`` over each expert's rows;
    zeros for an empty expert. With ``row_index [m]``, ``lhs`` is ``[tokens, k]`` and row
    ``r`` is ``lhs[row_index[r]]`` (gathered in the kernel)."""
    (rows, n), k = rhs.shape, lhs.shape[1]
    experts = group_sizes.shape[0]
    bm, bn, bk = _block(blocks.m, k), _block(blocks.n, n), _block(blocks.k, rows)
    lhs, rhs = _common_dtype(lhs, rhs)
    lhs, index = _rows_operand(lhs, row_index, bk, bm)
    rhs = _pad(_pad(rhs, 0, bk), 1, bn)
    starts, ends = _group_bounds(group_sizes)
    out = pl.pallas_call(
        functools.partial(_weight_gradient_kernel, block_k=bk),
        out_shape=jax.ShapeDtypeStruct((experts, lhs.shape[1], rhs.shape[1]), dtype),
        grid=(experts, lhs.shape[1] // bm, rhs.shape[1] // bn),
        out_specs=pl.BlockSpec((None, bm, bn), lambda e, i, j: (e, i, j)),
        compiler_params=_triton(blocks),
        interpret=interpret,
        name="grouped_matmul_weight_gradient",
    )(starts, ends, lhs, rhs, *index)
    return out[:, :k, :n]


def _row_tiled(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dtype: jax.typing.DTypeLike,
    blocks: BlockSizes,
    interpret: bool,
    transpose_rhs: bool,
    row_index: Array | None,
) -> Array:
    """``lhs [m, c]`` (or its rows ``row_index [m]`` of ``lhs [tokens, c]``) times each
    row's expert of ``rhs`` (``[experts, c, n]``, or ``[experts, n, c]`` with
    ``transpose_rhs``) -> ``[m, n]``."""
    rows, contract = lhs.shape[0] if row_index is None else row_index.shape[0], lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = _block(blocks.m, rows), _block(blocks.n, n), _block(blocks.k, contract)
    lhs, rhs = _common_dtype(lhs, rhs)
    lhs, index = _rows_operand(lhs, row_index, bm, bk)
    rhs = _pad(_pad(rhs, 2 if transpose_rhs else 1, bk), 1 if transpose_rhs else 2, bn)
    tiles, cols = -(-rows // bm), rhs.shape[1 if transpose_rhs else 2]
    starts, ends = _group_bounds(group_sizes)
    first, last = _tile_groups(ends, tiles, bm)
    out = pl.pallas_call(
        functools.partial(_row_tile_kernel, block_k=bk, transpose_rhs=transpose_rhs),
        out_shape=jax.ShapeDtypeStruct((tiles * bm, cols), dtype),
        grid=(tiles, cols // bn),
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        compiler_params=_triton(blocks),
        interpret=interpret,
        name="grouped_matmul_transposed" if transpose_rhs else "grouped_matmul",
    )(starts, ends, first, last, lhs, rhs, *index)
    return out[:rows, :n]


def _row_tile_kernel(
    starts_ref, ends_ref, first_ref, last_ref, lhs_ref, rhs_ref, *refs, block_k, transpose_rhs
) -> None:
    """One ``[bm, bn]`` output tile: the sum over the experts of the tile's rows
    (``first_ref[t]`` to ``last_ref[t]``) of their product, kept on their rows. ``refs``:
    the output, after the row index when ``lhs`` rows are gathered."""
    *index_ref, out_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    bm, bn = out_ref.shape
    rows = tile * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = pl.ds(col * bn, bn)
    source = _source_rows(index_ref, pl.ds(tile * bm, bm))
    steps = lhs_ref.shape[1] // block_k
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def expert(group, out):
        start, end = starts_ref[group], ends_ref[group]

        def step(i, acc):
            depth = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x = lhs_ref[source, depth]
            w = rhs_ref[group, cols, depth] if transpose_rhs else rhs_ref[group, depth, cols]
            return acc + jax.lax.dot_general(
                x, w, (contract, ((), ())), preferred_element_type=jnp.float32
            )

        stop = steps * (end > start).astype(jnp.int32)
        acc = jax.lax.fori_loop(jnp.int32(0), stop, step, jnp.zeros((bm, bn), jnp.float32))
        return jnp.where(((rows >= start) & (rows < end))[:, None], acc, out)

    out = jax.lax.fori_loop(
        first_ref[tile], last_ref[tile] + 1, expert, jnp.zeros((bm, bn), jnp.float32)
    )
    out_ref[...] = out.astype(out_ref.dtype)


def _weight_gradient_kernel(starts_ref, ends_ref, lhs_ref, rhs_ref, *refs, block_k) -> None:
    """One ``[bm, bn]`` tile of expert ``e``'s ``[k, n]``: ``lhs^T @ rhs`` over its rows,
    ``block_k`` rows at a time (rows of other experts masked to zero). ``refs``: the
    output, after the row index when ``lhs`` rows are gathered."""
    *index_ref, out_ref = refs
    group, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn = out_ref.shape
    start, end = starts_ref[group], ends_ref[group]
    first = start // block_k
    stop = jnp.where(end > start, (end + block_k - 1) // block_k, first)

    def step(chunk, acc):
        rows = chunk * block_k + jnp.arange(block_k, dtype=jnp.int32)
        in_group = ((rows >= start) & (rows < end))[:, None]
        window = pl.ds(pl.multiple_of(chunk * block_k, block_k), block_k)
        x = jnp.where(in_group, lhs_ref[_source_rows(index_ref, window), pl.ds(i * bm, bm)], 0)
        dy = jnp.where(in_group, rhs_ref[window, pl.ds(j * bn, bn)], 0)
        return acc + jax.lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(first, stop, step, jnp.zeros((bm, bn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _rows_operand(
    lhs: Array, row_index: Array | None, row_multiple: int, col_multiple: int
) -> tuple[Array, tuple[Array, ...]]:
    """``lhs`` zero-padded for its tiles, and the extra kernel operands: none for sorted
    rows (``lhs`` padded to ``row_multiple`` rows too), else ``row_index`` as int32 padded
    with row 0 to ``row_multiple`` entries (``lhs`` keeps its rows)."""
    if row_index is None:
        return _pad(_pad(lhs, 0, row_multiple), 1, col_multiple), ()
    return _pad(lhs, 1, col_multiple), (_pad(row_index.astype(jnp.int32), 0, row_multiple),)


def _source_rows(index_ref: list, window: slice | pl.Slice) -> slice | pl.Slice | Array:
    """What indexes ``lhs``' rows for the product rows ``window``: the window itself, or
    the row indices ``index_ref[0][window]`` (a gather-load of those rows)."""
    return index_ref[0][window] if index_ref else window


def _group_bounds(group_sizes: Array) -> tuple[Array, Array]:
    """``[experts]`` first row and one past the last row of each expert (int32)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return ends - group_sizes.astype(jnp.int32), ends


def _tile_groups(ends: Array, tiles: int, block_m: int) -> tuple[Array, Array]:
    """``[tiles]`` first and last expert whose rows row tile ``t`` (rows ``t * block_m`` to
    ``(t + 1) * block_m - 1``) may hold; first > last for a tile past all experts' rows."""
    top = jnp.arange(tiles, dtype=jnp.int32) * block_m
    first = jnp.searchsorted(ends, top, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, top + block_m - 1, side="right").astype(jnp.int32)
    return first, jnp.minimum(last, ends.shape[0] - 1)


def _block(block: int, dim: int) -> int:
    """``block``, or the next power of two of a smaller ``dim`` (at least 16)."""
    return min(block, max(_MIN_BLOCK, pl.next_power_of_2(dim)))


def _pad(x: Array, axis: int, multiple: int) -> Array:
    """``x`` zero-padded along ``axis`` to a multiple of ``multiple`` (itself if it is one)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def _common_dtype(lhs: Array, rhs: Array) -> tuple[Array, Array]:
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype)


def _triton(blocks: BlockSizes) -> pl_triton.CompilerParams:
    """The Triton backend (not Mosaic GPU, which jax may pick by default) with ``blocks``'
    warps and stages."""
    return pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
