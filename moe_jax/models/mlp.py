"""The dense T5 feed-forward block: gated-GELU (T5 v1.1) or ReLU (T5 v1.0)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

DType = Any

_ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "linear": lambda x: x}


class MlpBlock(nn.Module):
    """``prod_i act_i(x W_i) W_o``: one input projection per activation, multiplied.

    ``activations=('gelu', 'linear')`` is T5 v1.1's gated GELU (``wi_0``, ``wi_1``);
    ``('relu',)`` is T5 v1.0 (``wi``). Parameters: ``wi*`` ``[embed, mlp]``,
    ``wo`` ``[mlp, embed]``.

    Attributes:
      intermediate_dim: d_ff.
      activations: names from ``gelu``, ``relu``, ``silu``, ``linear``.
      intermediate_dropout_rate: dropout on the hidden activations.
      dtype, param_dtype: activation and parameter dtypes.
    """

    intermediate_dim: int
    activations: Sequence[str] = ("gelu", "linear")
    intermediate_dropout_rate: float = 0.0
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32

    def _kernel(self, name: str, shape: tuple[int, int], axes: tuple[str, str]) -> jnp.ndarray:
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        kernel = self.param(name, nn.with_logical_partitioning(init, axes), shape, self.param_dtype)
        return jnp.asarray(kernel, self.dtype)

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, *, deterministic: bool) -> jnp.ndarray:
        """``[batch, length, d_model] -> [batch, length, d_model]``."""
        unknown = [a for a in self.activations if a not in _ACTIVATIONS]
        if unknown or not self.activations:
            raise ValueError(
                f"MlpBlock.activations={tuple(self.activations)}: unknown "
                f"{unknown}; choose from {sorted(_ACTIVATIONS)}"
            )
        d_model = inputs.shape[-1]
        x = jnp.asarray(inputs, self.dtype)
        hidden = None
        for i, name in enumerate(self.activations):
            wi_name = "wi" if len(self.activations) == 1 else f"wi_{i}"
            kernel = self._kernel(wi_name, (d_model, self.intermediate_dim), ("embed", "mlp"))
            h = _ACTIVATIONS[name](jnp.einsum("bld,dm->blm", x, kernel))
            hidden = h if hidden is None else hidden * h
        hidden = nn.with_logical_constraint(hidden, ("batch", "length", "mlp"))
        hidden = nn.Dropout(self.intermediate_dropout_rate, broadcast_dims=(-2,))(
            hidden, deterministic=deterministic
        )
        wo = self._kernel("wo", (self.intermediate_dim, d_model), ("mlp", "embed"))
        out = jnp.einsum("blm,md->bld", hidden, wo)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))
