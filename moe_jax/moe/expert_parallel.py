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

Both go through one :class:`Exchange`: :class:`LocalExchange` without expert parallelism,
:class:`ExpertParallelExchange` inside ``shard_map``, each with a method for padded buffers
and one for ragged rows.

Dropless (``CapacityConfig.dropless``, ``sort`` dispatch) on TPU exchanges rows rather
than buffers (``ExpertParallelExchange.rows``): each device sorts its assignments by expert,
``jax.lax.ragged_all_to_all`` sends each expert's rows to the device owning it, the local
experts run one grouped matmul (``jax.lax.ragged_dot``) over what arrived, and a second
ragged all-to-all sends the outputs back. Only the routed rows cross the interconnect; the
receive buffer has a static worst-case size. XLA:CPU cannot compile ``ragged-all-to-all``
(jaxlib 0.10.2) and XLA:GPU runs ``ragged_dot`` densely, so there dropless keeps fixed
buffers of capacity = tokens per group (``execution.resolve_plan``).

Without a mesh, or with an ``expert`` axis of size 1, the layer runs plain SPMD code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, Protocol

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


# ``compute(buffers [groups, experts, capacity, d_model])`` -> same shape.
BufferCompute = Callable[[Array], Array]
# ``compute(rows [rows, d_model] grouped by expert, group_sizes [experts])`` -> same rows.
RaggedCompute = Callable[[Array, Array], Array]
# ``jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
# recv_sizes, *, axis_name)`` or a function with its signature and semantics.
RaggedAllToAll = Callable[..., Array]


class Exchange(Protocol):
    """How expert inputs reach the experts and their outputs come back: the layer's only
    way to run its experts (``ExecutionPlan.exchange`` picks the implementation, its
    ``implementation`` which method the layer calls)."""

    def buffers(self, buffers: Array, compute: BufferCompute) -> Array:
        """Padded buffers ``[groups, experts, capacity, d_model]`` (this device's groups,
        every expert) -> ``compute``'s outputs for them, same shape and place."""
        ...

    def rows(
        self, rows: Array, group_sizes: Array, compute: RaggedCompute, rows_per_expert: int
    ) -> Array:
        """Ragged rows ``[n, d_model]`` sorted by expert (the first ``group_sizes[0]`` for
        expert 0, ...; ``group_sizes [experts]`` int32, rows past their sum unused) ->
        ``[n, d_model]``: row ``i`` replaced by its expert's output (zeros past the sum).
        ``rows_per_expert`` bounds the rows this device sends one expert."""
        ...


class LocalExchange:
    """No expert parallelism: every expert is here; ``compute`` runs in place."""

    def buffers(self, buffers: Array, compute: BufferCompute) -> Array:
        return compute(buffers)

    def rows(
        self, rows: Array, group_sizes: Array, compute: RaggedCompute, rows_per_expert: int
    ) -> Array:
        del rows_per_expert
        return compute(rows, group_sizes)


@dataclasses.dataclass(frozen=True)
class ExpertParallelExchange:
    """Inside ``shard_map``: experts split over ``expert_axis`` (``shards`` devices), their
    ``expert_mlp`` axis over ``model_axis`` (None: not split; partial sums are ``psum``med).

    ``buffers``: all-to-all over ``expert`` -> ``[groups * shards, local_experts, capacity,
    d_model]`` -> compute on the local experts -> all-to-all back.

    ``rows`` (dropless): rows, not buffers, cross the ``expert`` axis.

    1. ``all_gather`` of ``group_sizes`` over ``expert``: every device knows the
       ``[shards, experts]`` count matrix ``C`` (``shards * experts`` int32), so every
       offset below is computed locally, with no further exchange of sizes or offsets;
    2. :attr:`ragged_all_to_all` with one slice per global expert ``e`` (``experts``
       slices: ``experts / shards`` per destination, as the primitive requires) writes the
       rows into the owner's receive buffer expert-major: local expert 0's rows from device
       0, from device 1, ..., then local expert 1's ...; so ``compute(received, sizes
       [local_experts])`` (``ragged_dot``) needs no regrouping;
    3. partial sums over ``model`` are summed (``psum``), and a second ragged all-to-all
       with the slices reversed writes each output back where its row came from.

    The receive buffer has a static worst-case size: ``shards * min(n, local_experts *
    rows_per_expert)`` rows (a token picks an expert at most once).
    """

    expert_axis: str
    shards: int
    model_axis: str | None
    # The primitive the rows cross with; XLA:CPU cannot compile it, so the CPU tests put
    # an emulation in its place.
    ragged_all_to_all: ClassVar[RaggedAllToAll] = staticmethod(jax.lax.ragged_all_to_all)

    def buffers(self, buffers: Array, compute: BufferCompute) -> Array:
        axis = self.expert_axis
        local = jax.lax.all_to_all(buffers, axis, split_axis=1, concat_axis=0, tiled=True)
        return jax.lax.all_to_all(
            self._sum_partials(compute(local)), axis, split_axis=0, concat_axis=1, tiled=True
        )

    def rows(
        self, rows: Array, group_sizes: Array, compute: RaggedCompute, rows_per_expert: int
    ) -> Array:
        n, d_model = rows.shape
        shards, experts = self.shards, group_sizes.shape[0]
        local = experts // shards
        me = jax.lax.axis_index(self.expert_axis)
        counts = jax.lax.all_gather(group_sizes, self.expert_axis)  # [shards, experts]: C[s, e]
        block = jnp.sum(counts, axis=0).reshape(shards, local)  # rows each expert receives
        expert_start = _exclusive_cumsum(block, 1).reshape(experts)  # first row at its owner
        arrival = expert_start + _exclusive_cumsum(counts, 0)  # where C[s, e]'s rows land
        source_start = _exclusive_cumsum(counts, 1)  # where C[s, e]'s rows are on device s

        def mine(a: Array) -> Array:  # [shards, experts] -> [shards * local]: my experts
            return jax.lax.dynamic_slice_in_dim(a, me * local, local, axis=1).reshape(
                shards * local
            )

        received_sizes = mine(counts)  # slice (source s, local expert l)
        # zeros_like keeps rows' varying mesh axes: a plain jnp.zeros buffer is invariant over
        # `expert`, the exchange's result would be typed so, and the backward pass would psum
        # the received rows' gradient over `expert`
        buffer = jnp.zeros_like(rows, shape=(shards * min(n, local * rows_per_expert), d_model))
        received = self.ragged_all_to_all(
            rows,
            buffer,
            source_start[me],
            group_sizes,
            arrival[me],
            received_sizes,
            axis_name=self.expert_axis,
        )
        out = compute(received, jax.lax.dynamic_index_in_dim(block, me, keepdims=False))
        return self.ragged_all_to_all(
            self._sum_partials(out),
            jnp.zeros_like(rows),
            mine(arrival),
            received_sizes,
            mine(source_start),
            group_sizes,
            axis_name=self.expert_axis,
        )

    def _sum_partials(self, out: Array) -> Array:
        return out if self.model_axis is None else jax.lax.psum(out, self.model_axis)


def _exclusive_cumsum(a: Array, axis: int) -> Array:
    return jnp.cumsum(a, axis=axis) - a


LocalFn = Callable[
    [Array, TokenChoiceRouting | ExpertChoiceRouting, dict[str, Array], Array, Exchange],
    tuple[Array, ...],
]


def expert_parallel(
    local_fn: LocalFn, mesh: AbstractMesh, *, data_axis: str, expert_axis: str, model_axis: str
) -> Callable[..., tuple[Array, ...]]:
    """Wraps ``local_fn(x, routing, weights, rng, exchange) -> outputs`` in ``shard_map``
    over ``mesh``, ``exchange`` an :class:`ExpertParallelExchange`: ``local_fn`` sees this
    device's groups and experts and runs the experts only through ``exchange``. Every
    output has a leading ``groups`` axis."""
    tokens = P(token_axes(mesh, data_axis, expert_axis))
    model = model_axis if model_axis in mesh.axis_names else None
    exchange = ExpertParallelExchange(expert_axis, mesh.shape[expert_axis], model)

    def weight_spec(name: str) -> P:
        return P(expert_axis, model, None) if name == "wo" else P(expert_axis, None, model)

    def body(x, routing, weights, rng):
        for axis in mesh.axis_names:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        return local_fn(x, routing, weights, rng, exchange)

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
