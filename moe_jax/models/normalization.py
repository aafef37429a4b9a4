"""RMS layer normalisation as in T5 (scale only, no bias, no mean subtraction)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

DType = Any


class RMSNorm(nn.Module):
    """``x / rms(x) * scale`` over the last axis, computed in float32.

    Attributes:
      epsilon: added to the mean square before the square root.
      dtype: dtype of the output activations.
      param_dtype: dtype of the ``scale`` parameter (logical axes ``('embed',)``).
    """

    epsilon: float = 1e-6
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``[..., d_model] -> [..., d_model]``."""
        features = x.shape[-1]
        x32 = jnp.asarray(x, jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(mean_square + self.epsilon)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            (features,),
            self.param_dtype,
        )
        return jnp.asarray(y * jnp.asarray(scale, jnp.float32), self.dtype)
