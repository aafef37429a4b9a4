"""Names of parameters: a ``jax.tree_util`` key path as ``encoder/layers_0/mlp/router/weights/w``,
and what a router parameter is.

Every place that names a parameter (checkpoint compatibility checks, export, upcycling,
parameter accounting, router freezing, counterfactual routers) uses these, so the names in
an error message, an export and a metrics file are the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

ROUTER = "router"  # the name of every MoE layer's router submodule


def key_name(key: Any) -> str:
    """One element of a key path: a dict key, attribute name or sequence index as text."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...], *, skip_indices: bool = False) -> str:
    """``/``-joined names of a key path; ``skip_indices`` leaves out sequence indices (the
    entries of sown tuples)."""
    return "/".join(
        key_name(k) for k in path if not (skip_indices and isinstance(k, jax.tree_util.SequenceKey))
    )


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{path_name: leaf}`` of a pytree, in flattening order."""
    return {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def is_router_param(path: tuple[Any, ...] | str) -> bool:
    """True for a parameter of a router: ``path`` (a key path or a ``path_name``) has an
    element named ``router``."""
    names = path.split("/") if isinstance(path, str) else [key_name(k) for k in path]
    return ROUTER in names


def router_params(tree: Any) -> dict[str, Any]:
    """``{path_name: leaf}`` of the router parameters of ``tree``."""
    return {name: leaf for name, leaf in named_leaves(tree).items() if is_router_param(name)}


def router_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The branches of a tree of nested mappings (parameters) that hold router parameters:
    every subtree under a ``router`` key, inside the mappings that lead to it (the rest
    left out)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == ROUTER:
            out[key] = value
        elif isinstance(value, Mapping) and (branch := router_tree(value)):
            out[key] = branch
    return out
