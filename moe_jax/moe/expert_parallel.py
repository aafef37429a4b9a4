"""Expert parallelism: experts split over the ``expert`` mesh axis, tokens moved by
all-to-all inside ``jax.shard_map``.

Activation: the layer reads the mesh set by the caller with ``jax.set_mesh(mesh)`` (or
``jax.sharding.use_mesh``) around tracing (``jax.jit(...)`` call / ``.lower``). When that
mesh has an ``expert`` axis of size > 1 the dispatch runs under ``shard_map``:

* groups ``[groups, ...]`` are split over the token axes (``data`` and ``expert``);
* expert weights are split over ``expert`` (and their ``expert_mlp`` axis over ``model``);
* each device dispatches its groups into buffers ``[local_groups, experts, capacity,
  d_model]``, an all-to-all over ``expert`` turns them into ``[local_groups * ep,
  local_experts, capacity, d_model]``, the local experts run (partial sums over ``model``
  are summed with ``psum``), and a second all-to-all sends the outputs back.

Dropless (``MoeLayer(dropless=True)``, ``sort`` dispatch) on TPU exchanges rows rather
than buffers (``ragged_comm``): each device sorts its assignments by expert,
``jax.lax.ragged_all_to_all`` sends each expert's rows to the device owning it, the local
experts run one grouped matmul (``jax.lax.ragged_dot``) over what arrived, and a second
ragged all-to-all sends the outputs back. Only the routed rows cross the interconnect; the
receive buffer has a static worst-case size. XLA:CPU cannot compile ``ragged-all-to-all``
(jaxlib 0.10.2) and XLA:GPU runs ``ragged_dot`` densely, so there dropless keeps fixed
buffers of capacity = tokens per group (``dispatch.ragged_exchange``).

Without a mesh, or with an ``expert`` axis of size 1, the layer runs plain SPMD code.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from moe_jax.moe.routers import ExpertChoiceRouting, TokenChoiceRouting

Array = jax.Array


def current_mesh() -> AbstractMesh | None:
    """The mesh set with ``jax.set_mesh``, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def axis_size(mesh: AbstractMesh | None, axis: str) -> int:
    return 1 if mesh is None or axis not in mesh.axis_names else mesh.shape[axis]


def token_axes(mesh: AbstractMesh | None, data_axis: str, expert_axis: str) -> tuple[str, ...]:
    """Mesh axes the routing groups are split over (present ones of ``data``, ``expert``)."""
    if mesh is None:
        return ()
    return tuple(a for a in (data_axis, expert_axis) if a in mesh.axis_names)


def group_shards(mesh: AbstractMesh | None, data_axis: str, expert_axis: str) -> int:
    """Number of devices the groups are split over; the group count is a multiple of it."""
    if mesh is None:
        return 1
    size = 1
    for axis in token_axes(mesh, data_axis, expert_axis):
        size *= mesh.shape[axis]
    return size


def check_divisible(num_experts: int, mesh: AbstractMesh | None, expert_axis: str) -> None:
    ep = axis_size(mesh, expert_axis)
    if num_experts % ep:
        raise ValueError(
            f"the routed experts (MoeConfig.num_experts x expert_granularity = "
            f"{num_experts}) are not divisible by the size {ep} of the {expert_axis!r} "
            "mesh axis"
        )


# ``jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
# recv_sizes, *, axis_name)`` or a function with its signature and semantics.
RaggedExchange = Callable[..., Array]
# ``compute(rows [rows, d_model] grouped by local expert, group_sizes [local_experts])``.
RaggedCompute = Callable[[Array, Array], Array]
LocalFn = Callable[
    [
        Array,
        TokenChoiceRouting | ExpertChoiceRouting,
        dict[str, Array],
        Array,
        Callable[..., Array],
    ],
    tuple[Array, ...],
]


def expert_parallel(
    local_fn: LocalFn,
    mesh: AbstractMesh,
    *,
    data_axis: str,
    expert_axis: str,
    model_axis: str,
    exchange: RaggedExchange | None = None,
) -> Callable[..., tuple[Array, ...]]:
    """Wraps ``local_fn(x, routing, weights, rng, comm) -> outputs`` in ``shard_map``.

    Without ``exchange``, ``local_fn`` must run its expert computation on buffers
    ``[groups, experts, capacity, d_model]`` through ``comm(buffers, compute)``, which here
    does all-to-all -> compute on the local experts -> psum over ``model`` -> all-to-all
    back. With ``exchange`` (``jax.lax.ragged_all_to_all``), ``comm`` is ``ragged_comm``'s:
    ``comm(rows, group_sizes, compute, rows_per_expert)``. Every output has a leading
    ``groups`` axis.
    """
    tokens = P(token_axes(mesh, data_axis, expert_axis))
    model = model_axis if model_axis in mesh.axis_names else None

    def weight_spec(name: str) -> P:
        return P(expert_axis, model, None) if name == "wo" else P(expert_axis, None, model)

    def buffer_comm(buffers: Array, compute: Callable[[Array], Array]) -> Array:
        local = jax.lax.all_to_all(buffers, expert_axis, split_axis=1, concat_axis=0, tiled=True)
        out = compute(local)
        if model is not None:
            out = jax.lax.psum(out, model)
        return jax.lax.all_to_all(out, expert_axis, split_axis=0, concat_axis=1, tiled=True)

    comm = (
        buffer_comm
        if exchange is None
        else ragged_comm(exchange, expert_axis, mesh.shape[expert_axis], model)
    )

    def body(x, routing, weights, rng):
        for axis in mesh.axis_names:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        return local_fn(x, routing, weights, rng, comm)

    def run(x: Array, routing, weights: dict[str, Array], rng: Array, num_outputs: int):
        weight_specs = {name: weight_spec(name) for name in weights}
        routing_specs = jax.tree.map(lambda _: tokens, routing)
        return shard_map(
            body,
            mesh=mesh,
            in_specs=(tokens, routing_specs, weight_specs, P()),
            out_specs=(tokens,) * num_outputs,
        )(x, routing, weights, rng)

    return run


def local_comm(buffers: Array, compute: Callable[[Array], Array]) -> Array:
    """``comm`` without expert parallelism: compute on all experts in place."""
    return compute(buffers)


def local_ragged_comm(
    rows: Array, group_sizes: Array, compute: RaggedCompute, rows_per_expert: int
) -> Array:
    """``ragged_comm``'s ``comm`` without expert parallelism: one grouped matmul in place."""
    del rows_per_expert
    return compute(rows, group_sizes)


def _exclusive_cumsum(a: Array, axis: int) -> Array:
    return jnp.cumsum(a, axis=axis) - a


def ragged_comm(
    exchange: RaggedExchange, expert_axis: str, shards: int, model_axis: str | None
) -> Callable[[Array, Array, RaggedCompute, int], Array]:
    """Dropless ``comm`` inside ``shard_map``: rows, not buffers, cross the ``expert`` axis.

    The returned ``comm(rows, group_sizes, compute, rows_per_expert)`` takes this device's
    ``rows [n, d_model]`` sorted by expert (the first ``group_sizes[0]`` for expert 0, ...;
    ``group_sizes [experts]`` int32, rows past their sum unused) and returns
    ``[n, d_model]``: row ``i`` replaced by its expert's output (zeros past the sum).

    1. ``all_gather`` of ``group_sizes`` over ``expert``: every device knows the
       ``[shards, experts]`` count matrix ``C`` (``shards * experts`` int32), so every
       offset below is computed locally, with no further exchange of sizes or offsets;
    2. ``exchange`` (``jax.lax.ragged_all_to_all``) with one slice per global expert
       ``e`` (``experts`` slices: ``experts / shards`` per destination, as the primitive
       requires) writes the rows into the owner's receive buffer expert-major: local
       expert 0's rows from device 0, from device 1, ..., then local expert 1's ...; so
       ``compute(received, sizes [local_experts])`` (``ragged_dot``) needs no regrouping;
    3. partial sums over ``model`` are summed (``psum``), and a second ``exchange`` with
       the slices reversed writes each output back where its row came from.

    The receive buffer has a static worst-case size: ``shards * min(n, local_experts *
    rows_per_expert)`` rows, ``rows_per_expert`` bounding the rows one device sends one
    expert (its tokens: a token picks an expert at most once).
    """

    def comm(
        rows: Array, group_sizes: Array, compute: RaggedCompute, rows_per_expert: int
    ) -> Array:
        n, d_model = rows.shape
        experts = group_sizes.shape[0]
        local = experts // shards
        me = jax.lax.axis_index(expert_axis)
        counts = jax.lax.all_gather(
            group_sizes, expert_axis
        )  # [shards, experts]: C[source, expert]
        block = jnp.sum(counts, axis=0).reshape(
            shards, local
        )  # rows each expert receives, by owner
        expert_start = _exclusive_cumsum(block, 1).reshape(
            experts
        )  # its first row in the owner's buffer
        arrival = expert_start + _exclusive_cumsum(
            counts, 0
        )  # [shards, experts]: where C[s, e]'s rows land
        source_start = _exclusive_cumsum(counts, 1)  # [shards, experts]: C[s, e]'s rows on device s

        def mine(a: Array) -> Array:  # [shards, experts] -> [shards * local]: columns of my experts
            return jax.lax.dynamic_slice_in_dim(a, me * local, local, axis=1).reshape(
                shards * local
            )

        received_sizes = mine(counts)  # slice (source s, local expert l)
        # zeros_like keeps rows' varying mesh axes: a plain jnp.zeros buffer is invariant over
        # `expert`, the exchange's result would be typed so, and the backward pass would psum
        # the received rows' gradient over `expert`
        buffer = jnp.zeros_like(rows, shape=(shards * min(n, local * rows_per_expert), d_model))
        received = exchange(
            rows,
            buffer,
            source_start[me],
            group_sizes,
            arrival[me],
            received_sizes,
            axis_name=expert_axis,
        )
        out = compute(received, jax.lax.dynamic_index_in_dim(block, me, keepdims=False))
        if model_axis is not None:
            out = jax.lax.psum(out, model_axis)
        return exchange(
            out,
            jnp.zeros_like(rows),
            mine(arrival),
            received_sizes,
            mine(source_start),
            group_sizes,
            axis_name=expert_axis,
        )

    return comm
