"""Device meshes and logical-to-mesh axis rules, in the style of T5X's partitioning.

Every parameter and activation of the project's Flax modules is annotated with *logical*
axis names (``batch``, ``length``, ``embed``, ``mlp``, ``heads``, ``kv``, ``vocab``,
``expert``, ...). A list of rules maps each logical name to a *mesh* axis (``data``,
``expert``, ``model``) or to ``None`` (replicated). Rules and mesh shape are gin bindings
(``standard_logical_axis_rules.*``; ``make_mesh.*``, which fill ``RunSpec.mesh``:
:mod:`moe_jax.runtime.configured`), so data, expert and tensor parallelism are all chosen
from gin files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax import errors, param_paths

MESH_AXES: tuple[str, str, str] = ("data", "expert", "model")
# The mesh axes a batch is split over: experts' devices do data parallelism outside the
# MoE layers (see ``standard_logical_axis_rules``).
BATCH_AXES: tuple[str, str] = ("data", "expert")

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# Logical axis names the project's modules may use. A name outside this set is a typo.
KNOWN_LOGICAL_AXES: frozenset[str] = frozenset(
    {
        "batch",
        "length",
        "embed",
        "mlp",
        "heads",
        "kv",
        "joined_kv",
        "vocab",
        "relpos_buckets",
        "abspos_buckets",
        "expert",
        "expert_mlp",
        "routing_group",
        "unmodeled",
        "layers",
        "stack",
        "cache_batch",
        "cache_heads",
        "cache_kv",
        "cache_length",
    }
)


def standard_logical_axis_rules(
    expert_parallel: bool = True,
    tensor_parallel: bool = True,
    fsdp: bool = False,
    additional_rules: LogicalRules = (),
) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """T5X-like default rules for a (data, expert, model) mesh.

    Non-MoE activations shard their batch over both ``data`` and ``expert`` (the expert
    devices do data parallelism outside the MoE layers, as in T5X's MoE partitioner);
    expert weights shard their leading ``expert`` axis over ``expert``; ``mlp``, ``heads``,
    ``joined_kv`` and ``vocab`` go over ``model`` (Megatron-style tensor parallelism).
    Rules listed in ``additional_rules`` take precedence (first match wins).

    ``fsdp=True`` (gin: ``standard_logical_axis_rules.fsdp = True``) also shards every
    parameter's ``embed`` dimension over the batch's mesh axes (``data`` x ``expert``;
    for expert weights, whose ``expert`` dimension already holds the ``expert`` axis, over
    ``data`` alone), ZeRO-3 / FSDP style: each device keeps 1/N of the weights and of the
    optimizer state (which follows the parameters, see ``train_state.state_shardings``),
    XLA all-gathers a weight where it is used and reduce-scatters its gradient. Activations
    are unaffected: their ``batch`` rule comes first and takes those mesh axes, so their
    ``embed`` falls through to replicated. ``d_model`` must divide by the axes' size.
    """
    model = "model" if tensor_parallel else None
    batch_axes = BATCH_AXES if expert_parallel else "data"
    rules: list[tuple[str, str | tuple[str, ...] | None]] = list(additional_rules)
    rules += [
        ("batch", batch_axes),
        ("expert", "expert" if expert_parallel else None),
        ("routing_group", batch_axes),
        ("vocab", model),
        ("mlp", model),
        ("expert_mlp", model),
        ("heads", model),
        ("joined_kv", model),
        ("kv", None),
    ]
    if fsdp:  # after "batch" and "expert": a rule whose mesh axes are taken is skipped
        rules += [("embed", batch_axes), ("embed", "data")]
    rules += [
        ("embed", None),
        ("length", None),
        ("relpos_buckets", None),
        ("abspos_buckets", None),
        ("unmodeled", None),
        ("layers", None),
        ("stack", None),
        ("cache_batch", batch_axes),
        ("cache_heads", model),
        ("cache_kv", None),
        ("cache_length", None),
    ]
    return tuple(rules)


def make_mesh(
    mesh_shape: Sequence[int] = (-1, 1, 1),
    axis_names: Sequence[str] = MESH_AXES,
    devices: Sequence[jax.Device] | None = None,
    max_expert_partitions: int | None = None,
) -> Mesh:
    """Builds a global mesh ``[data, expert, model]`` over all (or the given) devices.

    One entry of ``mesh_shape`` may be -1: it takes whatever is left of the device count.
    Axes are ``Auto`` (sharding propagated by XLA), as T5X expects.
    ``max_expert_partitions`` (bound to ``NUM_EXPERTS`` by ``gin/models/t5_moe.gin``, as
    Flaxformer's ``num_expert_partitions``): an ``expert`` axis longer than that gives the
    rest of its length to ``data``, so one mesh file serves every expert count (16 devices:
    (1, 16, 1) for 32 experts, (2, 8, 1) for 8).

    Raises:
      ValueError: naming ``mesh_shape`` when it does not tile the device count, or when
        its expert axis is not a multiple of ``max_expert_partitions``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(mesh_shape)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"mesh_shape={tuple(mesh_shape)} has {len(shape)} entries but "
            f"axis_names={tuple(axis_names)} has {len(axis_names)}"
        )
    if shape.count(-1) > 1:
        raise ValueError(f"mesh_shape={tuple(mesh_shape)}: at most one entry may be -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if known <= 0 or len(devices) % known:
            raise ValueError(
                f"mesh_shape={tuple(mesh_shape)} does not divide the "
                f"{len(devices)} available devices"
            )
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh_shape={tuple(mesh_shape)} needs {int(np.prod(shape))} devices "
            f"but {len(devices)} are available"
        )
    if max_expert_partitions and "expert" in axis_names and "data" in axis_names:
        expert, data = axis_names.index("expert"), axis_names.index("data")
        if shape[expert] > max_expert_partitions:
            if shape[expert] % max_expert_partitions:
                raise ValueError(
                    f"mesh_shape={tuple(mesh_shape)}: its expert axis ({shape[expert]}) is not "
                    f"a multiple of the {max_expert_partitions} experts "
                    "(make_mesh.max_expert_partitions = NUM_EXPERTS)"
                )
            shape[data] *= shape[expert] // max_expert_partitions
            shape[expert] = max_expert_partitions
    try:
        from jax.experimental import mesh_utils

        device_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, tuple(axis_names))


def validate_logical_axes(logical_axes: Sequence[str | None], where: str = "") -> None:
    """Refuses logical axis names the project does not know (typos in gin rules or modules)."""
    for name in logical_axes:
        if name is not None and name not in KNOWN_LOGICAL_AXES:
            raise ValueError(
                f"unknown logical axis {name!r}{' in ' + where if where else ''}; "
                f"known axes: {sorted(KNOWN_LOGICAL_AXES)}"
            )


def validate_rules(rules: LogicalRules, mesh: Mesh) -> None:
    """Refuses rules naming unknown logical axes or mesh axes missing from ``mesh``."""
    for logical, mesh_axes in rules:
        validate_logical_axes([logical], where="logical axis rules")
        targets = (mesh_axes,) if isinstance(mesh_axes, str) or mesh_axes is None else mesh_axes
        for axis in targets:
            if axis is not None and axis not in mesh.axis_names:
                raise ValueError(
                    f"logical axis rule ({logical!r} -> {mesh_axes!r}) names mesh "
                    f"axis {axis!r}, not in the mesh axes {mesh.axis_names}"
                )


def logical_to_sharding(
    logical_axes: Sequence[str | None], mesh: Mesh, rules: LogicalRules
) -> NamedSharding:
    """The ``NamedSharding`` of one array from its logical axis names."""
    import flax.linen as nn

    validate_logical_axes(logical_axes)
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)  # None only for no names
    return NamedSharding(mesh, PartitionSpec(*(spec or ())))


def tree_shardings(logical_spec_tree, mesh: Mesh, rules: LogicalRules):
    """Maps a pytree of logical ``PartitionSpec`` (as from ``nn.get_partition_spec``) to
    ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(
        lambda spec: logical_to_sharding(tuple(spec), mesh, rules),
        logical_spec_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def check_divisibility(tree: Any, shardings: Any) -> None:
    """Refuses a sharding that splits an array dimension into unequal parts, before XLA does.

    ``tree`` (arrays or ``ShapeDtypeStruct`` s) and ``shardings`` (``NamedSharding`` per
    leaf; other leaves are not checked) have the same structure.

    Raises:
      errors.ConfigError: naming the first such array, its dimension and size, the mesh
        axes splitting it and their size, and what to change (e.g. 3 experts on an
        ``expert`` axis of 2).
    """
    jax.tree_util.tree_map_with_path(_check_divides, tree, shardings)


def _check_divides(path: tuple, leaf: Any, sharding: Any) -> None:
    if not isinstance(sharding, NamedSharding):
        return
    name, shape = param_paths.path_name(path), tuple(leaf.shape)
    for dim, (size, entry) in enumerate(zip(shape, sharding.spec, strict=False)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        parts = math.prod(sharding.mesh.shape[axis] for axis in axes)
        if parts > 1 and size % parts:
            hint = (
                "make the number of experts (NUM_EXPERTS) a multiple of the expert axis, or "
                "change the mesh (partitioning.make_mesh.mesh_shape)"
                if "expert" in axes
                else "change the mesh (partitioning.make_mesh.mesh_shape) or that size"
            )
            raise errors.ConfigError(
                f"{name} {list(shape)}: dimension {dim} ({size}) is split over mesh axis "
                f"{'x'.join(axes)} of size {parts}, which does not divide it; {hint}"
            )


def per_process_batch_size(batch_size: int) -> int:
    """This process's share of a global batch of ``batch_size`` examples (every process
    reads as many).

    Raises:
      errors.ConfigError: naming ``BATCH_SIZE`` when the processes do not divide it.
    """
    processes = jax.process_count()
    if batch_size % processes:
        raise errors.ConfigError(
            f"BATCH_SIZE (DatasetConfig.batch_size) = {batch_size} is not divisible by the "
            f"{processes} processes"
        )
    return batch_size // processes


@contextlib.contextmanager
def activate(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Trace (and run) under ``mesh`` and the logical axis ``rules``: MoE layers read the
    mesh (expert parallelism, the platform's layer choices), and the model's
    ``nn.with_logical_constraint`` calls map their logical axes through the rules (without
    rules they are no-ops, and XLA alone decides how activations are laid out)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
