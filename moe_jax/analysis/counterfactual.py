"""Counterfactual routers: the same trained weights evaluated with the routers replaced
(`moe-jax eval --router=NAME`; docs/analysis.md).

Each variant is a transform of the parameters and/or a Flax method interceptor on the
routers' ``__call__`` (``flax.linen.intercept_methods``), active while the eval step is
traced, so no model code changes and the experts' weights are never touched:

  ``learned``   the checkpoint as trained (identical to plain evaluation)
  ``init``      router weights replaced by the run's initial ones (``router_init.npz``)
  ``random``    router weights replaced by fresh draws, normal with the init stddev
  ``shuffled``  each router kernel ``[d_model, experts]`` with its input rows permuted
                (the paper's shuffled-router baseline: same entries, alignment broken)
  ``hash``      each token's experts chosen by its token id (``HashRouter``), each choice
                keeping the learned router's gate value of that rank
  ``uniform``   the learned choice of experts, its gate mass split equally over them

``hash`` and ``uniform`` keep each token's total gate mass: with T5X's unnormalised top-k
gates (about 2/E each for a near-uniform router) a gate of 1/k would scale every expert
output by a factor the trained network never saw, which measures the scale, not the routing.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import param_paths, storage
from moe_jax.moe.config import ROUTER_CONFIGS, TopKRouterConfig
from moe_jax.moe.routers import HashRouter, RouterOutput, TokenChoiceRouting
from moe_jax.runtime import router_init
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.run_dir import RunDir
from moe_jax.synthetic.routers import shuffle_columns

ROUTER_VARIANTS = ("learned", "init", "random", "hash", "uniform", "shuffled")
Interceptor = Callable[..., Any]


def check_variants(names: list[str]) -> list[str]:
    """``names`` (default ``["learned"]``), refusing unknown ones with the valid list."""
    unknown = [n for n in names if n not in ROUTER_VARIANTS]
    if unknown:
        raise ValueError(
            f"--router={unknown[0]!r} is unknown; valid routers: {', '.join(ROUTER_VARIANTS)}"
        )
    return list(dict.fromkeys(names)) or ["learned"]


def _map_routers(params: Any, fn: Callable[[str, jax.Array], jax.Array]) -> Any:
    """``params`` (per layer, or a ``{per-layer name: leaf}`` view) with every router leaf
    ``x`` (:func:`moe_jax.param_paths.is_router_param`) replaced by ``fn(name, x)``; all
    other leaves are the same objects."""

    def visit(path, leaf):
        name = param_paths.path_name(path)
        return fn(name, leaf) if param_paths.is_router_param(name) else leaf

    return jax.tree_util.tree_map_with_path(visit, params)


def _with_routers(params: Any, routers: Any) -> Any:
    """``params`` with each leaf that ``routers`` (a subtree in the same layout) holds
    replaced by it, on the replaced leaf's sharding; all other leaves are the same objects."""
    new = param_paths.named_leaves(routers)

    def visit(path, leaf):
        value = new.get(param_paths.path_name(path))
        if value is None:
            return leaf
        return jax.device_put(value, leaf.sharding) if isinstance(leaf, jax.Array) else value

    return jax.tree_util.tree_map_with_path(visit, params)


def _is_kernel(name: str, leaf: Any) -> bool:
    return name.endswith("/w") and np.ndim(leaf) == 2


def shuffle_router_inputs(params: Any, seed: int = 0) -> Any:
    """Every router kernel ``w [d_model, experts]`` of per-layer ``params`` with its input
    rows (the paper's "columns of W", ``W [experts, d_model]``) permuted, one permutation
    per kernel."""
    key = jax.random.PRNGKey(seed)

    def shuffle(name: str, w: jax.Array) -> jax.Array:
        if not _is_kernel(name, w):
            return w
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        shuffled = shuffle_columns("linear", {"w": jnp.asarray(w).T}, k)["w"].T
        return jax.device_put(shuffled, w.sharding) if isinstance(w, jax.Array) else shuffled

    return _map_routers(params, shuffle)


def replace_routers(params: Any, new: dict[str, np.ndarray], what: str) -> Any:
    """Router leaves of per-layer ``params`` replaced by ``new[name]`` (per-layer names); a
    router leaf missing there is refused."""

    def replace(name: str, w: jax.Array) -> jax.Array:
        if name not in new:
            raise ValueError(f"{what} has no weights for {name}")
        value = jnp.asarray(new[name], w.dtype)
        return jax.device_put(value, w.sharding) if isinstance(w, jax.Array) else value

    return _map_routers(params, replace)


DEFAULT_INIT_STDDEV = TopKRouterConfig.init_stddev


def init_stddevs(config: Any) -> dict[str, float]:
    """``{"encoder": s, "decoder": s}``: the init stddev of each stack's routers, read from
    the model's ``T5Config`` (its MoE configs' router configs; routers without one, such as
    hash, and models without MoE layers: :data:`DEFAULT_INIT_STDDEV`)."""
    if not config.has_moe:
        return {"encoder": DEFAULT_INIT_STDDEV, "decoder": DEFAULT_INIT_STDDEV}
    return {
        stack: float(getattr(config.moe_config(stack).router, "init_stddev", DEFAULT_INIT_STDDEV))
        for stack in ("encoder", "decoder")
    }


def random_routers(
    params: Any, seed: int = 0, stddev: float | dict[str, float] = DEFAULT_INIT_STDDEV
) -> Any:
    """Router kernels of per-layer ``params`` replaced by fresh ``normal(0, stddev)`` draws
    (one key per kernel);
    ``stddev`` per stack (``{"encoder": s, "decoder": s}``, :func:`init_stddevs`) or one."""
    key = jax.random.PRNGKey(seed)

    def draw(name: str, w: jax.Array) -> jax.Array:
        if not _is_kernel(name, w):
            return w
        scale = stddev[name.split("/")[0]] if isinstance(stddev, dict) else stddev
        value = scale * jax.random.normal(
            jax.random.fold_in(key, zlib.crc32(name.encode())), w.shape, w.dtype
        )
        return jax.device_put(value, w.sharding) if isinstance(w, jax.Array) else value

    return _map_routers(params, draw)


# ------------------------------------------------------------------------ interceptors


def _router_call(context) -> bool:
    routers = tuple(c.module for c in ROUTER_CONFIGS.values())
    return context.method_name == "__call__" and isinstance(context.module, routers)


def _token_choice(out: RouterOutput) -> TokenChoiceRouting:
    if not isinstance(out.routing, TokenChoiceRouting):
        raise ValueError(
            "--router=hash and --router=uniform need a token-choice router, not expert choice"
        )
    return out.routing


def _with_choices(out: RouterOutput, expert_index: jax.Array, weights: jax.Array) -> RouterOutput:
    """``out`` routing each token to ``expert_index [g, t, k]`` with gates ``weights``."""
    num_experts = out.probs.shape[-1]
    one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)  # [g, t, k, E]
    routing = TokenChoiceRouting(expert_index, weights, _token_choice(out).priority)
    return dataclasses.replace(
        out,
        routing=routing,
        assigned=jnp.sum(one_hot, axis=-2),
        gates=jnp.einsum("gtk,gtke->gte", weights, one_hot),
    )


def uniform_gates(next_fun, args, kwargs, context):
    """Interceptor: the router's own experts, its gate mass split equally over them."""
    out = next_fun(*args, **kwargs)
    if not _router_call(context):
        return out
    routing = _token_choice(out)
    routed = routing.expert_index < out.probs.shape[-1]
    mass = jnp.sum(routing.combine_weights, axis=-1, keepdims=True)
    share = mass / jnp.maximum(jnp.sum(routed, axis=-1, keepdims=True), 1)
    return _with_choices(out, routing.expert_index, jnp.where(routed, share, 0.0))


def hash_routing(seed: int = 0) -> Interceptor:
    """Interceptor: experts by token id (``HashRouter`` with the router's k), the i-th
    choice weighted by the learned router's i-th gate."""

    def intercept(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if not _router_call(context) or isinstance(
            context.module, HashRouter
        ):  # (incl. the one below)
            return out
        learned = _token_choice(out)
        x, mask, token_ids, capacity, deterministic = args
        hashed = HashRouter(
            num_experts=out.probs.shape[-1],
            num_selected_experts=learned.expert_index.shape[-1],
            seed=seed,
            parent=None,
        ).apply({}, x, mask, token_ids, capacity, deterministic)
        hashed_choice = _token_choice(cast(RouterOutput, hashed))  # apply without mutable
        return _with_choices(out, hashed_choice.expert_index, learned.combine_weights)

    return intercept


def variant(
    name: str, model: Model, params: Any, run_dir: RunDir, seed: int = 0
) -> tuple[Any, Interceptor | None]:
    """(parameters, interceptor or None) that evaluate ``params`` (``model``'s, in its
    layout) with router ``name``; the router weights are replaced per layer
    (``model.per_layer``) and put back in the model's layout.

    Raises:
      ValueError: an unknown name (listing the valid ones), or ``init`` for a run without
        ``router_init.npz``.
    """
    check_variants([name])
    if name == "learned":
        return params, None
    if name == "hash":
        return params, hash_routing(seed)
    if name == "uniform":
        return params, uniform_gates
    routers = model.per_layer(param_paths.router_tree(params))
    if name == "init":
        initial = router_init.load(run_dir)
        if not initial:
            raise ValueError(
                f"--router=init: the run {run_dir} saved no initial router "
                f"({run_dir.router_init_file} is missing)"
            )
        new = replace_routers(routers, initial, storage.basename(run_dir.router_init_file))
    elif name == "random":
        new = random_routers(routers, seed, init_stddevs(model.module.config))
    else:
        new = shuffle_router_inputs(routers, seed)
    return _with_routers(params, model.own_layout(new)), None


def intercepted(fn: Callable[..., Any], interceptor: Interceptor | None) -> Callable[..., Any]:
    """``fn`` run (and therefore traced) under ``interceptor``; ``fn`` itself when None."""
    if interceptor is None:
        return fn

    def wrapped(*args, **kwargs):
        with nn.intercept_methods(interceptor):
            return fn(*args, **kwargs)

    return wrapped
