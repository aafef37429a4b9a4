"""Learned vs frozen routers, on the optimizer side; data-initialised routers.

A frozen router keeps its random initial weights for the whole run: the trainer wraps
its optimizer with ``apply_router_mode``, which gives every router leaf
``optax.set_to_zero()`` (no update, no weight decay, no optimizer state) through
``optax.multi_transform``. Router leaves are those whose path has a ``router`` key (the
layer's router submodule is named ``router``).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import optax

from moe_jax import param_paths
from moe_jax.moe.collections import BIAS_COLLECTION

ROUTER_MODES: tuple[str, ...] = ("learned", "frozen")
BIAS_MODES: tuple[str, ...] = ("updated", "frozen")
_ROUTER, _OTHER = "router", "other"


def router_labels(params: Any) -> Any:
    """The pytree of ``"router"`` / ``"other"`` labels of ``params``."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: _ROUTER if param_paths.is_router_param(p) else _OTHER, params
    )


def router_mode(mode: str = "learned") -> str:
    """``mode`` checked as a router mode: ``learned`` (trained like the rest) or ``frozen``
    (gin: ``router_mode.mode``)."""
    if mode not in ROUTER_MODES:
        raise ValueError(f"router_mode.mode={mode!r} is unknown; choose one of {ROUTER_MODES}")
    return mode


def bias_mode(mode: str = "updated") -> str:
    """``mode`` checked as a bias mode (gin: ``bias_mode.mode``): whether the
    auxiliary-loss-free balancing biases (``TopKRouterConfig.bias_update_rate``) keep
    updating (``updated``, default; with a frozen router: "frozen + balanced") or stay at
    their current value (``frozen``; from initialisation: zero, no balancing)."""
    if mode not in BIAS_MODES:
        raise ValueError(f"bias_mode.mode={mode!r} is unknown; choose one of {BIAS_MODES}")
    return mode


def updated_collections(old: Any, new: Any, mode: str) -> Any:
    """The state collections after a train step: ``new`` (as the forward pass updated
    them), or ``old`` for the balancing biases when ``mode`` (a :func:`bias_mode`, read
    when the train step is built, not while it is traced) is ``frozen``."""
    if bias_mode(mode) == "updated":
        return new
    return {name: old[name] if name == BIAS_COLLECTION else value for name, value in new.items()}


def apply_router_mode(
    tx: optax.GradientTransformation, params: Any = None, *, mode: str
) -> optax.GradientTransformation:
    """``tx`` for ``learned``; for ``frozen``, ``tx`` on every non-router leaf and
    ``optax.set_to_zero()`` on router leaves.

    Args:
      tx: the full optimizer (weight decay included).
      params: unused (labels are computed from the tree ``tx.init`` receives); accepted
        so callers can pass it.
      mode: a :func:`router_mode`.
    """
    del params
    mode = router_mode(mode)
    if mode == "learned":
        return tx
    return optax.multi_transform({_OTHER: tx, _ROUTER: optax.set_to_zero()}, router_labels)


def data_initialized_router(
    params: Any, samples: jax.Array, rng: jax.Array, path_contains: str = "", scale: float = 1.0
) -> Any:
    """Router rows set to sampled token representations (the paper's Theorem 2).

    Every router kernel ``.../router/weights/w [d_model, experts]`` whose path contains
    ``path_contains`` gets column ``i`` = ``scale * samples[j_i]`` for ``experts``
    distinct random rows ``j_i`` of ``samples [n, d_model]`` (``n >= experts``). Use one
    call per MoE layer with that layer's input representations to give layers their own.
    """

    def replace(path, leaf):
        name = param_paths.path_name(path)
        if not (
            param_paths.is_router_param(path)
            and name.endswith("weights/w")
            and path_contains in name
        ):
            return leaf
        d_model, experts = leaf.shape
        if samples.shape[-1] != d_model or samples.shape[0] < experts:
            raise ValueError(
                f"data_initialized_router: samples {samples.shape} must be [n >= {experts}, "
                f"{d_model}] for router kernel {name} {leaf.shape}"
            )
        key = jax.random.fold_in(rng, zlib.crc32(name.encode()))
        rows = jax.random.choice(key, samples.shape[0], (experts,), replace=False)
        return (scale * samples[rows].T).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(replace, params)


__all__ = [
    "BIAS_MODES",
    "ROUTER_MODES",
    "apply_router_mode",
    "bias_mode",
    "data_initialized_router",
    "router_labels",
    "router_mode",
    "updated_collections",
]
