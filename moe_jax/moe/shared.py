"""Shared experts (DeepSeekMoE, Dai et al., 2024): experts every token uses.

``num_shared`` always-active experts of width ``d_ff`` each are, summed, one MLP of width
``num_shared * d_ff`` (the sum of MLPs on the same input is the MLP of their concatenated
hidden units), so they are stored as one: ``wi`` (``wi_0``/``wi_1`` for gated GELU)
``[embed, mlp]`` and ``wo [mlp, embed]``, with the dense MLP's logical axes: sharded like
the dense feed-forward block (``mlp`` over ``model``), never over ``expert``.
"""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.moe.experts import activate, dropout
from moe_jax.moe.options import Activation

# The dense T5 MLP's kernel init (models/mlp.py).
_KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class SharedExperts(nn.Module):
    """``num_shared`` always-active expert MLPs, added to the routed experts' output.

    Attributes:
      num_shared: number of shared experts.
      d_ff: hidden size of each shared expert.
      activation: as the routed experts (``relu``, ``gelu``, ``gated_gelu``).
      dropout_rate: dropout on the hidden activations in training.
      dtype: compute dtype.
    """

    num_shared: int
    d_ff: int
    activation: Activation = "relu"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        """``[batch, length, d_model]`` -> ``[batch, length, d_model]``."""
        d_model, width = x.shape[-1], self.num_shared * self.d_ff
        names_in = ("wi_0", "wi_1") if self.activation == "gated_gelu" else ("wi",)
        init_in = nn.with_logical_partitioning(_KERNEL_INIT, ("embed", "mlp"))
        # self.param returns the unboxed array of a logically partitioned init
        weights = {
            n: cast(jax.Array, self.param(n, init_in, (d_model, width), jnp.float32)).astype(
                self.dtype
            )
            for n in names_in
        }
        init_out = nn.with_logical_partitioning(_KERNEL_INIT, ("mlp", "embed"))
        wo = cast(jax.Array, self.param("wo", init_out, (width, d_model), jnp.float32))
        weights["wo"] = wo.astype(self.dtype)
        h = activate(weights, lambda w: jnp.einsum("bld,dm->blm", x, w), self.activation)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        use_dropout = self.dropout_rate > 0.0 and not deterministic
        h = dropout(h, self.dropout_rate, self.make_rng("dropout") if use_dropout else None)
        return jnp.einsum("blm,md->bld", h, weights["wo"])
