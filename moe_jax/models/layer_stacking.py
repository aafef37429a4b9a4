"""Stacking and unstacking the layers of scanned T5 stacks (``T5Config.scan_layers``).

A scanned run of layers keeps one copy of its block of layers, each leaf with a leading
axis of one entry per repeat: ``encoder/scan_0/layers_3_7_11/ffn/...`` holds layers 3, 7
and 11 (entries 0, 1, 2) of the block position they share. Per layer, the same values are
``encoder/layers_3/ffn/...``, ``encoder/layers_7/ffn/...``, ``encoder/layers_11/ffn/...``:
the one layout everything outside the model and the checkpoint boundary sees. Only
:mod:`moe_jax.models` (``EncoderDecoderModel.per_layer`` / ``own_layout``), the checkpoint
boundary (:mod:`moe_jax.runtime.checkpoints`) and the reader of a run's initial routers
(:mod:`moe_jax.runtime.router_init`, whose older files may be stacked) use this module.

The functions here convert any tree whose dictionaries follow module paths: parameters,
optimizer state (whose moments mirror the parameters), variable collections (sown tuples
included) and abstract trees of ``jax.ShapeDtypeStruct`` with their shardings.
A leaf whose leading axis is not the repeats' count is the same in both forms: Adafactor's
``(1,)`` placeholder for the moments a parameter does not keep.

:func:`unstack_layers` gives the per-layer form, :func:`unstack_names` the same for
``{name: leaf}`` views (older stacked files); :func:`stack_layers` gives the scanned form
of a :func:`layout` (of a tree's names, :func:`tree_layout`, or of a network's runs of
layers, :func:`runs_layout`); :func:`checkpoint_target` and :func:`convert` let a
checkpoint saved in one form restore into a tree of the other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import NamedSharding, PartitionSpec

from moe_jax import param_paths

PyTree = Any
# {stack key ("encoder"): ((scan group name, (block position name, ...)), ...)}
Layout = dict[str, tuple[tuple[str, tuple[str, ...]], ...]]

# The logical axis name of a stacked parameter's leading axis (``nn.scan``'s
# ``metadata_params``).
LAYERS_AXIS = "layers"
SCAN_GROUP = re.compile(r"scan_\d+")
_POSITION = re.compile(r"layers_(\d+(?:_\d+)+)")


def scanned_name(indices: Sequence[int]) -> str:
    """``layers_3_7_11``: the block position holding layers 3, 7, 11 (one per repeat)."""
    return "layers_" + "_".join(str(i) for i in indices)


def layer_indices(name: str) -> tuple[int, ...] | None:
    """The layers of a block position name (:func:`scanned_name`); None for other names."""
    match = _POSITION.fullmatch(name)
    return None if match is None else tuple(int(i) for i in match.group(1).split("_"))


def block_positions(start: int, period: int, repeats: int) -> list[tuple[int, ...]]:
    """The layers of each block position of a scanned run of layers (``T5Config.layer_groups``'
    ``(start, period, repeats)``): position ``j`` holds ``start + j``, ``start + j + period``,
    ... (one layer per repeat)."""
    return [tuple(range(start + j, start + period * repeats, period)) for j in range(period)]


def scan_group_name(k: int) -> str:
    """``scan_<k>``: the ``k``-th scanned run of a stack."""
    return f"scan_{k}"


def runs_layout(runs: Mapping[str, Sequence[tuple[int, int, int]]]) -> Layout:
    """The :data:`Layout` of stacks whose layers run as ``runs`` (``{stack: (start, period,
    repeats) runs}``, ``T5Config.layer_groups``): each run with ``repeats > 1`` a scan group
    ``scan_<k>`` of :func:`block_positions`; ``{}`` for a network without scanned runs."""
    out: Layout = {}
    for stack, groups in runs.items():
        scanned = [group for group in groups if group[2] > 1]
        if scanned:
            out[stack] = tuple(
                (scan_group_name(k), tuple(scanned_name(p) for p in block_positions(*group)))
                for k, group in enumerate(scanned)
            )
    return out


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _inner(sharding: Any) -> Any:
    """``sharding`` of a stacked leaf for one of its entries: a ``NamedSharding`` without its
    leading axis; any other as it is."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def _index(x: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)


def _take(leaf: Any, index: int, repeats: int) -> Any:
    """Entry ``index`` of a stacked leaf: a ``ShapeDtypeStruct`` keeps its sharding's other
    axes, an ``nn.Partitioned`` box its other logical axis names, a sharded ``jax.Array``
    is copied by one program per leaf shape (the index an argument) into an array sharded
    as its other axes; a leaf without the repeats' leading axis as it is."""
    if isinstance(leaf, meta.Partitioned):
        if not leaf.names or leaf.names[0] != LAYERS_AXIS:
            return leaf
        taken = leaf.replace(value=_take(leaf.value, index, repeats))
        return taken.remove_axis(0, {nn.PARTITION_NAME: LAYERS_AXIS})
    if not _is_array(leaf) or not leaf.shape or leaf.shape[0] != repeats:
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=_inner(leaf.sharding))
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)
        and isinstance(leaf.sharding, NamedSharding)
    ):
        return jax.jit(_index, out_shardings=_inner(leaf.sharding))(leaf, index)
    return leaf[index]


def _take_tree(tree: PyTree, index: int, repeats: int) -> PyTree:
    """:func:`_take` of every leaf (or box) of ``tree``."""
    return jax.tree.map(
        lambda leaf: _take(leaf, index, repeats),
        tree,
        is_leaf=lambda x: isinstance(x, meta.Partitioned),
    )


def _stack(leaves: list[Any]) -> Any:
    """The leaves of one block position's layers stacked on a new leading axis (a
    ``ShapeDtypeStruct`` gets an unsharded leading axis); a ``(1,)`` placeholder stays one."""
    first = leaves[0]
    if not _is_array(first) or tuple(first.shape) == (1,):
        return first
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *tuple(sharding.spec)))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return (np.stack if isinstance(first, np.ndarray) else jnp.stack)(leaves)


def _map_dicts(fn: Callable[[Mapping], dict], tree: PyTree) -> PyTree:
    """``tree`` with each outermost mapping ``m`` replaced by ``fn(m)`` (other containers,
    e.g. optax states, kept)."""
    return jax.tree.map(
        lambda x: fn(x) if isinstance(x, Mapping) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Mapping),
    )


def unstack_layers(tree: PyTree) -> PyTree:
    """``tree`` with every scan group's block positions replaced by per-layer entries
    ``layers_<i>`` (entry ``r`` of each leaf for the position's ``r``-th layer) in the
    mapping that held the group; a tree without scan groups is returned equal."""

    def visit(mapping: Mapping) -> dict:
        out: dict[str, Any] = {}
        for key, value in mapping.items():
            if not (SCAN_GROUP.fullmatch(str(key)) and isinstance(value, Mapping)):
                out[key] = unstack_layers(value)
                continue
            for position, subtree in value.items():
                indices = layer_indices(position)
                if indices is None:
                    raise ValueError(f"{key}/{position} is not a scanned block position")
                for r, i in enumerate(indices):
                    out[f"layers_{i}"] = _take_tree(subtree, r, len(indices))
        return out

    return _map_dicts(visit, tree)


def _scanned_at(parts: Sequence[str]) -> int | None:
    """Where in a leaf name's parts its scan group is (the position name follows it)."""
    for at in range(len(parts) - 1):
        if SCAN_GROUP.fullmatch(parts[at]) and layer_indices(parts[at + 1]):
            return at
    return None


def layer_names(name: str) -> list[str]:
    """The per-layer names of a ``/``-joined leaf name, one per entry of its leading axis
    (``encoder/scan_0/layers_3_7/x`` -> ``encoder/layers_3/x``, ``encoder/layers_7/x``);
    ``[name]`` for a leaf outside a scan group."""
    parts = name.split("/")
    at = _scanned_at(parts)
    if at is None:
        return [name]
    return [
        "/".join([*parts[:at], f"layers_{i}", *parts[at + 2 :]])
        for i in layer_indices(parts[at + 1]) or ()
    ]


def unstack_names(named: Mapping[str, Any]) -> dict[str, Any]:
    """``{leaf name: leaf}`` with each scanned leaf split into its layers' entries under
    their :func:`layer_names` (a name outside a scan group as it is)."""
    out: dict[str, Any] = {}
    for name, leaf in named.items():
        names = layer_names(name)
        for r, per_layer in enumerate(names):
            out[per_layer] = leaf if len(names) == 1 else _take(leaf, r, len(names))
    return out


def layout(names: Iterable[str]) -> Layout:
    """The scan groups named in ``names`` (``/``-joined leaf paths, as a checkpoint's
    metadata lists its parameters), by the key of the mapping that holds them; block
    positions in layer order."""
    found: dict[str, dict[str, set[str]]] = {}
    for name in names:
        parts = name.split("/")
        at = _scanned_at(parts)
        if at:
            found.setdefault(parts[at - 1], {}).setdefault(parts[at], set()).add(parts[at + 1])
    return {
        stack: tuple(
            (group, tuple(sorted(positions, key=lambda p: layer_indices(p) or ())))
            for group, positions in sorted(groups.items())
        )
        for stack, groups in found.items()
    }


def tree_layout(tree: PyTree) -> Layout:
    """:func:`layout` of the leaf paths of ``tree``."""
    return layout(param_paths.named_leaves(tree))


def stack_layers(tree: PyTree, scan_layout: Layout) -> PyTree:
    """``tree`` (per-layer entries ``layers_<i>``) in the scanned form of ``scan_layout``:
    in each mapping under a key of ``scan_layout``, the layers of each block position
    stacked into ``<scan group>/<position>``. Positions none of whose layers are there
    (collections of only some layers) are left out.

    Raises:
      ValueError: naming the position when only some of its layers are there.
    """

    def restack(stack: Mapping, groups) -> dict:
        out = dict(stack)
        for group, positions in groups:
            stacked = {}
            for position in positions:
                names = [f"layers_{i}" for i in layer_indices(position) or ()]
                present = [n for n in names if n in out]
                if not present:
                    continue
                if len(present) != len(names):
                    raise ValueError(f"{group}/{position}: only {present} are there to stack")
                parts = [out.pop(n) for n in names]
                stacked[position] = jax.tree.map(lambda *leaves: _stack(list(leaves)), *parts)
            if stacked:
                out[group] = stacked
        return out

    def visit(mapping: Mapping) -> dict:
        return {
            key: restack(stack_layers(value, scan_layout), scan_layout[key])
            if key in scan_layout and isinstance(value, Mapping)
            else stack_layers(value, scan_layout)
            for key, value in mapping.items()
        }

    return _map_dicts(visit, tree) if scan_layout else tree


def checkpoint_target(saved_names: Iterable[str], target: PyTree) -> PyTree:
    """The restore target ``target`` (abstract, with shardings) in the layer form of a
    checkpoint whose parameters are ``saved_names``: ``target`` when the forms agree, or
    when the checkpoint's scan groups do not fit ``target``'s layers (another model: the
    caller's compatibility check names the differences)."""
    saved_layout = layout(saved_names)
    if saved_layout == tree_layout(target):
        return target
    try:
        return stack_layers(unstack_layers(target), saved_layout)
    except ValueError:
        return target


def convert(tree: PyTree, target: PyTree) -> PyTree:
    """``tree`` (restored from a checkpoint, in any layer form) in the form of ``target``
    (the abstract state it stands for, with shardings), laid out by those shardings."""
    target_layout = tree_layout(target)
    if tree_layout(tree) == target_layout:
        return tree
    shardings = jax.tree.map(lambda leaf: getattr(leaf, "sharding", None), target)
    return jax.jit(
        lambda t: stack_layers(unstack_layers(t), target_layout), out_shardings=shardings
    )(tree)
