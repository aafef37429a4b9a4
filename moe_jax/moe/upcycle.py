"""Sparse upcycling (Komatsuzaki et al., 2023): MoE parameters from a dense model's.

Every expert of a sparse layer starts as that layer's dense MLP (``.../ffn/mlp/wi_0``
``[embed, mlp]`` -> ``.../ffn/moe/expert/wi_0`` ``[expert, embed, expert_mlp]``, each
expert a copy, optionally plus Gaussian noise of ``noise_std`` times the weight's own
standard deviation); routers (and shared experts, which the dense model does not have)
keep the MoE model's initialisation; every other parameter is copied unchanged. With gates
that sum to 1 and no token dropped, the upcycled layer computes the dense MLP exactly.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.moe.freeze import is_router_param

PyTree = Any
EXPERT_PATH, SHARED_PATH, DENSE_PATH = "/moe/expert/", "/moe/shared_expert/", "/mlp/"


class UpcycleShapeError(ValueError):
    """A dense parameter does not fit the MoE config; the message names it and both shapes."""


def _name(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def dense_source(name: str) -> str | None:
    """The dense parameter an MoE parameter starts from (None: keeps its initialisation)."""
    if SHARED_PATH in f"/{name}/":
        return None
    if EXPERT_PATH in f"/{name}":
        return f"/{name}".replace(EXPERT_PATH, DENSE_PATH)[1:]
    return name


def upcycle_params(dense: dict[str, np.ndarray], moe_init: PyTree, *, noise_std: float = 0.0,
                   rng: jax.Array | None = None) -> PyTree:
    """The MoE parameter tree ``moe_init`` (unboxed arrays) with every parameter that has a
    dense counterpart taken from ``dense`` (``{"encoder/layers_0/ffn/mlp/wi_0": array}``).

    Raises:
      UpcycleShapeError: naming the parameter and both shapes when a dense weight does not
        fit (e.g. another d_model, or expert d_ff != the dense MLP's), or the dense
        checkpoint lacks a parameter the MoE model needs.
    """
    rng = jax.random.PRNGKey(0) if rng is None else rng

    def take(path, leaf):
        name = _name(path)
        source = None if is_router_param(path) else dense_source(name)
        if source is None:
            return leaf
        if source not in dense:
            raise UpcycleShapeError(f"upcycle: MoE parameter {name} {tuple(leaf.shape)} has no dense "
                                    f"counterpart {source} in the checkpoint")
        value = jnp.asarray(dense[source], leaf.dtype)
        if source == name:
            if value.shape != leaf.shape:
                raise UpcycleShapeError(f"upcycle: parameter {name}: dense checkpoint {tuple(value.shape)} "
                                        f"vs MoE config {tuple(leaf.shape)}")
            return value
        if value.shape != leaf.shape[1:]:
            raise UpcycleShapeError(f"upcycle: parameter {name}: dense {source} {tuple(value.shape)} vs "
                                    f"MoE config {tuple(leaf.shape)} (each expert must have the dense "
                                    f"MLP's shape {tuple(leaf.shape[1:])})")
        experts = jnp.broadcast_to(value, leaf.shape)
        if noise_std > 0.0:
            key = jax.random.fold_in(rng, zlib.crc32(name.encode()))
            experts = experts + noise_std * jnp.std(value) * jax.random.normal(key, leaf.shape, leaf.dtype)
        return experts

    return jax.tree_util.tree_map_with_path(take, moe_init)
