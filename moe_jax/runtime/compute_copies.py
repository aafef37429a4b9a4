"""Low-precision compute copies of the parameters, written by the optimizer update.

A model with float32 parameters and bfloat16 activations casts most weights to bfloat16
at every use: each step reads the float32 weights and writes bfloat16 ones again, in the
forward and again in the backward pass. Here the train step keeps a bfloat16 copy of
every parameter the loss only ever reads cast to one lower-precision dtype (the compute
dtype), written by the optimizer update in the same pass that writes the float32 master
weights; the forward pass reads the copy and the model's cast becomes a no-op.

Which parameters get a copy is read from the loss's jaxpr (:func:`compute_dtypes`), so it
is exact for any model: a weight the model uses in float32 anywhere (a router, a norm
scale, a float32 attention bias) keeps no copy and is read as it is. The loss is the same
to the bit; a weight's gradient is the bfloat16 cotangent of its cast as before (summed
over its uses in bfloat16 where a weight is cast more than once, e.g. an embedding shared
by encoder and decoder). Checkpoints hold the float32 parameters only: the copies are
rebuilt from them on restore (:func:`copies_of`).

Trees of copies (``TrainState.compute_params``) are parameter trees pruned to the copied
leaves: ``{'encoder': {'layers_0': {'mlp': {'wi': {'kernel': bf16[...]}}}}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from jax.extend import core as jax_core

PyTree = Any
Path = tuple[str, ...]

# A leaf's uses: the dtypes it is cast to, or None for a use in its own dtype.
_Uses = dict[Any, set[Any]]


def compute_dtypes(loss_fn: Callable[..., Any], params: PyTree, *args: Any) -> PyTree:
    """The compute dtype of every parameter that ``loss_fn(params, *args)`` only reads cast
    to one narrower floating dtype, as a pruned parameter tree of ``np.dtype`` leaves (``{}``
    when there are none, as with float32 activations). ``params`` and ``args`` may be
    ``jax.ShapeDtypeStruct`` s; the loss is traced, not run."""
    closed = jax.make_jaxpr(loss_fn)(params, *args)
    paths = _flatten_order(params)
    param_vars = closed.jaxpr.invars[: len(paths)]
    uses: _Uses = {var: set() for var in param_vars}
    _record_uses(closed.jaxpr, {var: var for var in param_vars}, uses)
    flat = traverse_util.flatten_dict(params)
    chosen = {}
    for path, var in zip(paths, param_vars, strict=True):
        if len(uses[var]) == 1 and None not in uses[var]:
            (target,) = uses[var]
            if _narrower(target, np.dtype(flat[path].dtype)):
                chosen[path] = target
    return traverse_util.unflatten_dict(chosen)


def copies_of(params: PyTree, like: PyTree) -> PyTree:
    """The compute copies of ``params``: a pruned tree like ``like``, each of its
    parameters cast to the dtype of ``like``'s leaf there (a ``np.dtype``, an array or a
    ``jax.ShapeDtypeStruct``)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {path: flat[path].astype(_dtype(leaf)) for path, leaf in _items(like)}
    )


def forward_params(params: PyTree, copies: PyTree) -> PyTree:
    """``params`` with each copied parameter replaced by its copy: what the forward pass
    reads."""
    if not copies:
        return params
    flat = traverse_util.flatten_dict(params)
    flat.update(traverse_util.flatten_dict(copies))
    return traverse_util.unflatten_dict(flat)


def read_as_copies(loss_fn: Callable[..., Any], params: PyTree, *args: Any) -> PyTree:
    """``params`` as a train step with compute copies passes them to ``loss_fn``: each
    parameter of :func:`compute_dtypes` in its compute dtype (arrays cast, shape structs
    retyped), the others as they are. For benchmarks of one layer or function."""
    dtypes = traverse_util.flatten_dict(compute_dtypes(loss_fn, params, *args))
    flat = traverse_util.flatten_dict(params)
    for path, dtype in dtypes.items():
        leaf = flat[path]
        flat[path] = (
            jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
            if isinstance(leaf, jax.ShapeDtypeStruct)
            else leaf.astype(dtype)
        )
    return traverse_util.unflatten_dict(flat)


def _dtype(leaf: Any) -> np.dtype:
    """The dtype a leaf of a copies-like tree names (a dtype, an array, a shape struct)."""
    return np.dtype(getattr(leaf, "dtype", leaf))


def _items(tree: PyTree) -> Iterator[tuple[Path, Any]]:
    """``(path, leaf)`` of a nested dict whose leaves are not dicts."""
    yield from traverse_util.flatten_dict(tree).items() if tree else ()


def _flatten_order(params: PyTree) -> list[Path]:
    """The parameters' paths in ``jax.tree`` flattening order (the jaxpr's invars')."""
    paths, _ = jax.tree_util.tree_flatten_with_path(params)
    return [tuple(str(getattr(k, "key", k)) for k in path) for path, _ in paths]


def _narrower(target: np.dtype, dtype: np.dtype) -> bool:
    """True when ``target`` is a floating dtype of fewer bytes than floating ``dtype``."""
    floating = jax.numpy.issubdtype(target, np.floating) and jax.numpy.issubdtype(
        dtype, np.floating
    )
    return bool(floating and target.itemsize < dtype.itemsize)


def _record_uses(jaxpr: jax_core.Jaxpr, origin: dict[Any, Any], uses: _Uses) -> None:
    """Adds to ``uses[param]`` how each equation of ``jaxpr`` reads a variable that is
    (``origin``) a parameter: a cast records its dtype; an equation with inner jaxprs whose
    inputs match its operands one to one (``jit``, ``scan``, remat, custom VJPs) is
    followed inside; anything else, and a parameter returned as an output, is a use in the
    parameter's own dtype."""
    for outvar in jaxpr.outvars:
        if isinstance(outvar, jax_core.Var) and outvar in origin:
            uses[origin[outvar]].add(None)
    for eqn in jaxpr.eqns:
        read = [
            (i, origin[v])
            for i, v in enumerate(eqn.invars)
            if isinstance(v, jax_core.Var) and v in origin
        ]
        if not read:
            continue
        if eqn.primitive.name == "convert_element_type":
            for _, param in read:
                uses[param].add(np.dtype(eqn.params["new_dtype"]))
            continue
        inner = [
            sub
            for sub in jax_core.jaxprs_in_params(eqn.params)
            if len(sub.invars) == len(eqn.invars)
        ]
        if not inner:
            for _, param in read:
                uses[param].add(None)
            continue
        for sub in inner:
            _record_uses(sub, {sub.invars[i]: param for i, param in read}, uses)
