"""Sparse upcycling: MoE parameters from a dense model's.

Coarse experts (Komatsuzaki et al., 2023, "Sparse Upcycling: Training Mixture-of-Experts
from Dense Checkpoints", ICLR): every expert of a sparse layer starts as that layer's dense
MLP (``.../ffn/mlp/wi_0`` ``[embed, mlp]`` -> ``.../ffn/moe/expert/wi_0`` ``[expert, embed,
expert_mlp]``, each expert a copy).

Fine-grained experts (granularity ``m``, DeepSeekMoE: Dai et al., 2024, arXiv:2401.06066;
routers/fine_grained.gin): the dense MLP's ``d_ff`` hidden units are split into ``m``
contiguous segments of ``d_ff / m`` (the FFN partitioning of LLaMA-MoE, Zhu et al., 2024,
arXiv:2406.16554; exact, since the activation acts on each hidden unit alone), and the
``m * E`` routed experts form ``E`` *virtual groups* of ``m``: expert ``e * m + j`` is
segment ``j`` (He et al., 2024, "Upcycling Large Language Models into Mixture of Experts",
arXiv:2410.07524, virtual-group initialisation). The router's columns are tied inside each
group (every column of group ``e`` is the MoE initialisation's column ``e * m``), so a
token's top-``m k`` experts are all ``m`` segments of its top-``k`` groups, and each
segment's ``wo`` is scaled by ``m``: with gates renormalised to sum to 1, each selected
segment's gate is ``1/m`` of its group's, so ``sum_e g_e * sum_j m * (g/m) segment_j(x)``
is the dense MLP. (He et al. scale by a factor fitted to softmax-then-top-k gates that do
not sum to 1; ``m`` is the exact one for the gates moe-jax normalises.) The groups keep
expert ``e``'s segments on one ``expert``-axis shard whenever ``m`` divides the experts
per shard.

Noise: ``noise_std`` adds Gaussian noise of that fraction of each (scaled) dense weight's
standard deviation to every expert (breaks the symmetry of the copies; the router stays tied).
Routers (beyond the tying) and shared experts, which the dense model does not have, keep the
MoE model's initialisation; every other parameter is copied unchanged.

When the upcycled model's outputs equal the dense model's at step 0 (to float rounding):
no token is dropped (``dropless``, or capacity for every assignment), no shared experts, no
noise (``noise_std = 0``), and for each token the gates of its selected experts holding
segment ``j`` sum to ``1/m`` for every ``j`` (all experts of a segment index are equal at
step 0; with ``m = 1``: the selected gates sum to 1). That holds for a router that selects by the
tied scores with gates summing to 1 (``top_k`` with ``TopKRouterConfig.renormalize_gates=True``
or sigmoid scores, ``noisy_top_k`` in eval, the bias router, whose bias starts at 0: whole
virtual groups are selected), and for ``hash`` (``m k`` consecutive experts, gates
``1/(m k)``: each segment index ``k`` times); with ``m = 1``, also for ``random`` with
renormalised gates. It does not hold for ``random`` with ``m > 1`` (its own untied matrix
picks segments unevenly), for ``expert_choice`` (each expert picks tokens; a token's segments
need not all be picked), nor for group-limited routing whose limited groups split a virtual
group (``m`` must divide the experts per limited group).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import param_paths

PyTree = Any
EXPERT_PATH, SHARED_PATH, DENSE_PATH = "/moe/expert/", "/moe/shared_expert/", "/mlp/"
OUTPUT_KERNEL = "wo"  # [mlp, embed]; the input kernels wi / wi_0 / wi_1 are [embed, mlp]


class UpcycleShapeError(ValueError):
    """A dense parameter does not fit the MoE config; the message names it and both shapes."""


def dense_source(name: str) -> str | None:
    """The dense parameter an MoE parameter starts from (None: keeps its initialisation)."""
    if SHARED_PATH in f"/{name}/":
        return None
    if EXPERT_PATH in f"/{name}":
        return f"/{name}".replace(EXPERT_PATH, DENSE_PATH)[1:]
    return name


def dense_segments(kernel: jax.Array, granularity: int, output: bool) -> jax.Array:
    """The ``m = granularity`` segments of a dense MLP kernel over its hidden units:
    ``[embed, d_ff]`` -> ``[m, embed, d_ff / m]`` (input kernels) or ``[d_ff, embed]`` ->
    ``[m, d_ff / m, embed]`` (``output``: ``wo``, scaled by ``m``; see the module docstring).
    ``granularity`` 1 gives the kernel itself with a leading axis of 1."""
    m = granularity
    if output:
        return m * kernel.reshape(m, kernel.shape[0] // m, kernel.shape[1])
    return kernel.reshape(kernel.shape[0], m, kernel.shape[1] // m).transpose(1, 0, 2)


def tie_router_columns(kernel: jax.Array, granularity: int) -> jax.Array:
    """``[..., m * E]`` -> the same shape with every column of virtual group ``e`` (columns
    ``e * m .. e * m + m - 1``) equal to column ``e * m``."""
    m = granularity
    groups = kernel.reshape((*kernel.shape[:-1], kernel.shape[-1] // m, m))
    return jnp.broadcast_to(groups[..., :1], groups.shape).reshape(kernel.shape)


def upcycle_params(
    dense: dict[str, np.ndarray],
    moe_init: PyTree,
    *,
    granularity: int = 1,
    noise_std: float = 0.0,
    rng: jax.Array | None = None,
) -> PyTree:
    """The MoE parameter tree ``moe_init`` (unboxed arrays) with every parameter that has a
    dense counterpart taken from ``dense`` (``{"encoder/layers_0/ffn/mlp/wi_0": array}``);
    ``granularity``: ``MoeConfig.expert_granularity`` m (experts are virtual groups of m
    segments of the dense MLP and the routers' columns are tied per group; module docstring).

    Raises:
      UpcycleShapeError: naming the parameter and both shapes when a dense weight does not
        fit (e.g. another d_model, or m * expert d_ff != the dense MLP's d_ff), or the dense
        checkpoint lacks a parameter the MoE model needs.
    """
    rng = jax.random.PRNGKey(0) if rng is None else rng
    m = granularity

    def take(path, leaf):
        name = param_paths.path_name(path)
        if param_paths.is_router_param(path):
            return tie_router_columns(leaf, m) if m > 1 else leaf
        source = dense_source(name)
        if source is None:
            return leaf
        if source not in dense:
            raise UpcycleShapeError(
                f"upcycle: MoE parameter {name} {tuple(leaf.shape)} has no dense "
                f"counterpart {source} in the checkpoint"
            )
        value = jnp.asarray(dense[source], leaf.dtype)
        if source == name:
            if value.shape != leaf.shape:
                raise UpcycleShapeError(
                    f"upcycle: parameter {name}: dense checkpoint {tuple(value.shape)} "
                    f"vs MoE config {tuple(leaf.shape)}"
                )
            return value
        output = name.rsplit("/", 1)[-1] == OUTPUT_KERNEL
        hidden = 0 if output else -1
        segment = list(value.shape)
        segment[hidden] //= m
        if (
            value.ndim != 2
            or value.shape[hidden] % m
            or tuple(segment) != leaf.shape[1:]
            or leaf.shape[0] % m
        ):
            what = (
                f"each expert must have the dense MLP's shape {tuple(leaf.shape[1:])}"
                if m == 1
                else f"with MoeConfig.expert_granularity={m} each expert must be 1/{m} of the "
                f"dense MLP's hidden units, {tuple(leaf.shape[1:])}, and the experts a multiple "
                f"of {m}"
            )
            raise UpcycleShapeError(
                f"upcycle: parameter {name}: dense {source} {tuple(value.shape)} vs "
                f"MoE config {tuple(leaf.shape)} ({what})"
            )
        segments = dense_segments(value, m, output)
        experts = jnp.tile(segments, (leaf.shape[0] // m, 1, 1))  # expert e * m + j = segment j
        if noise_std > 0.0:
            key = jax.random.fold_in(rng, zlib.crc32(name.encode()))
            experts = experts + noise_std * jnp.std(segments) * jax.random.normal(
                key, leaf.shape, leaf.dtype
            )
        return experts

    return jax.tree_util.tree_map_with_path(take, moe_init)
