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

Without a mesh, or with an ``expert`` axis of size 1, the layer runs plain SPMD code.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import shard_map
from jax.sharding import AbstractMesh, PartitionSpec as P

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
    size = 1
    for axis in token_axes(mesh, data_axis, expert_axis):
        size *= mesh.shape[axis]
    return size


def check_divisible(num_experts: int, mesh: AbstractMesh | None, expert_axis: str) -> None:
    ep = axis_size(mesh, expert_axis)
    if num_experts % ep:
        raise ValueError(f"MoeLayer.num_experts={num_experts} is not divisible by the size {ep} "
                         f"of the {expert_axis!r} mesh axis")


LocalFn = Callable[[Array, TokenChoiceRouting | ExpertChoiceRouting, dict[str, Array], Array,
                    Callable[[Array], Array]], tuple[Array, ...]]


def expert_parallel(local_fn: LocalFn, mesh: AbstractMesh, *, data_axis: str, expert_axis: str,
                    model_axis: str) -> Callable[..., tuple[Array, ...]]:
    """Wraps ``local_fn(x, routing, weights, rng, comm) -> outputs`` in ``shard_map``.

    ``local_fn`` must run its expert computation on buffers ``[groups, experts, capacity,
    d_model]`` through ``comm(buffers, compute)``, which here does all-to-all -> compute
    on the local experts -> psum over ``model`` -> all-to-all back. Every output has a
    leading ``groups`` axis.
    """
    tokens = P(token_axes(mesh, data_axis, expert_axis))
    model = model_axis if model_axis in mesh.axis_names else None

    def weight_spec(name: str) -> P:
        return P(expert_axis, model, None) if name == "wo" else P(expert_axis, None, model)

    def comm(buffers: Array, compute: Callable[[Array], Array]) -> Array:
        local = jax.lax.all_to_all(buffers, expert_axis, split_axis=1, concat_axis=0, tiled=True)
        out = compute(local)
        if model is not None:
            out = jax.lax.psum(out, model)
        return jax.lax.all_to_all(out, expert_axis, split_axis=0, concat_axis=1, tiled=True)

    def body(x, routing, weights, rng):
        for axis in mesh.axis_names:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        return local_fn(x, routing, weights, rng, comm)

    def run(x: Array, routing, weights: dict[str, Array], rng: Array, num_outputs: int):
        weight_specs = {name: weight_spec(name) for name in weights}
        routing_specs = jax.tree.map(lambda _: tokens, routing)
        return shard_map(body, mesh=mesh, in_specs=(tokens, routing_specs, weight_specs, P()),
                         out_specs=(tokens,) * num_outputs)(x, routing, weights, rng)

    return run


def local_comm(buffers: Array, compute: Callable[[Array], Array]) -> Array:
    """``comm`` without expert parallelism: compute on all experts in place."""
    return compute(buffers)
