"""Expert feed-forward networks: weights with a leading ``expert`` logical axis.

The weights live in a Flax module (``ExpertWeights``, the layer's ``expert`` submodule); the
computation is a pure function (``expert_ffn``) so that the same code runs on the full
set of experts or, inside ``shard_map``, on one device's slice of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.moe.grouped_matmul import RaggedDot
from moe_jax.moe.options import Activation

# T5X's MLP kernel init, with fan-in over the `embed`/`mlp` axis and `expert` as a batch axis.
default_kernel_init = nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)


class ExpertWeights(nn.Module):
    """Creates and returns the parameters of ``num_experts`` MLPs (it computes nothing:
    ``expert_ffn`` / ``ragged_expert_ffn`` apply them).

    Returns a dict of weights: ``wi`` (or ``wi_0``/``wi_1`` for gated GELU)
    ``[expert, embed, expert_mlp]`` and ``wo`` ``[expert, expert_mlp, embed]``.
    """

    num_experts: int
    d_ff: int
    activation: Activation = "relu"
    dtype: jnp.dtype = jnp.float32
    kernel_init: Callable = default_kernel_init

    @nn.compact
    def __call__(self, d_model: int) -> dict[str, jax.Array]:
        names_in = ("wi_0", "wi_1") if self.activation == "gated_gelu" else ("wi",)
        init_in = nn.with_logical_partitioning(self.kernel_init, ("expert", "embed", "expert_mlp"))
        init_out = nn.with_logical_partitioning(self.kernel_init, ("expert", "expert_mlp", "embed"))
        weights = {
            name: self.param(name, init_in, (self.num_experts, d_model, self.d_ff), jnp.float32)
            for name in names_in
        }
        weights["wo"] = self.param(
            "wo", init_out, (self.num_experts, self.d_ff, d_model), jnp.float32
        )
        # self.param returns the unboxed array of a logically partitioned init
        return {k: cast(jax.Array, v).astype(self.dtype) for k, v in weights.items()}


def activate(
    weights: dict[str, jax.Array], h_in: Callable[[jax.Array], jax.Array], activation: Activation
) -> jax.Array:
    if activation == "gated_gelu":
        return nn.gelu(h_in(weights["wi_0"]), approximate=True) * h_in(weights["wi_1"])
    h = h_in(weights["wi"])
    return nn.relu(h) if activation == "relu" else nn.gelu(h, approximate=True)


def dropout(h: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    if rate <= 0.0 or rng is None:
        return h
    keep = jax.random.bernoulli(rng, 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0.0).astype(h.dtype)


def expert_ffn(
    weights: dict[str, jax.Array],
    x: jax.Array,
    activation: Activation,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    per_expert_loop: bool = False,
) -> jax.Array:
    """Applies expert ``e`` to ``x[:, e]``.

    Args:
      weights: from ``ExpertWeights`` (possibly one device's slice of experts / of ``expert_mlp``).
      x: ``[groups, experts, capacity, d_model]`` expert buffers.
      dropout_rng: when given, dropout at ``dropout_rate`` on the hidden activations.
      per_expert_loop: one plain matmul per expert inside ``lax.map`` instead of one
        batched einsum over experts (XLA:CPU ran the batched einsum 1.1-1.3x slower than
        the same work as plain matmuls; see benchmarks/RESULTS.md).

    Returns:
      ``[groups, experts, capacity, d_model]`` (partial sums if ``expert_mlp`` is sharded).
    """
    groups, experts, capacity, d_model = x.shape
    rows = jnp.swapaxes(x, 0, 1).reshape(experts, groups * capacity, d_model)
    if not per_expert_loop:
        h = activate(weights, lambda w: jnp.einsum("end,edf->enf", rows, w), activation)
        h = dropout(h, dropout_rate, dropout_rng)
        out = jnp.einsum("enf,efd->end", h, weights["wo"])
        return jnp.swapaxes(out.reshape(experts, groups, capacity, -1), 0, 1)
    keys = None if dropout_rng is None else jax.random.split(dropout_rng, experts)

    def one_expert(args):
        w, xe, key = args
        h = dropout(activate(w, lambda wk: xe @ wk, activation), dropout_rate, key)
        return h @ w["wo"]

    out = jax.lax.map(one_expert, (weights, rows, keys))
    return jnp.swapaxes(out.reshape(experts, groups, capacity, -1), 0, 1)


def ragged_expert_ffn(
    weights: dict[str, jax.Array],
    x: jax.Array,
    group_sizes: jax.Array,
    activation: Activation,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    ragged_dot: RaggedDot = jax.lax.ragged_dot,
    in_dot: RaggedDot | None = None,
) -> jax.Array:
    """Grouped-matmul form of ``expert_ffn`` (dropless): rows of ``x`` sorted by expert.

    Args:
      x: ``[assignments, d_model]``, the first ``group_sizes[0]`` rows for expert 0, etc.;
        or whatever ``in_dot`` reads its rows from.
      group_sizes: ``[experts]`` int32; rows past ``sum(group_sizes)`` are not computed.
      ragged_dot: the grouped matmul (``grouped_matmul.ragged_dot``).
      in_dot: the input projections' grouped matmul (None: ``ragged_dot``); one that
        gathers its rows itself (``grouped_matmul.gathered_ragged_dot`` bound to a
        ``permute.RowMap``) takes ``x`` as the unsorted ``[tokens, d_model]``.

    Returns:
      ``[assignments, d_model]``; rows past ``sum(group_sizes)`` undefined (zeros with
      ``jax.lax.ragged_dot``; a kernel may leave them unwritten).
    """
    first = ragged_dot if in_dot is None else in_dot
    h = activate(weights, lambda w: first(x, w, group_sizes), activation)
    h = dropout(h, dropout_rate, dropout_rng)
    return ragged_dot(h, weights["wo"], group_sizes)
