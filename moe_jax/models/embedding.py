"""Token embedding; its table can also produce the output logits (tied embeddings)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

DType = Any


class Embed(nn.Module):
    """A ``[vocab, d_model]`` lookup table (logical axes ``('vocab', 'embed')``).

    Attributes:
      num_embeddings: vocabulary size.
      features: d_model.
      dtype: dtype of the returned activations.
      param_dtype: dtype of the table.
      embedding_init: initialiser of the table (T5: standard normal).
    """

    num_embeddings: int
    features: int
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    embedding_init: nn.initializers.Initializer = nn.initializers.normal(stddev=1.0)

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, ("vocab", "embed")),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        """``[batch, length]`` int token ids -> ``[batch, length, d_model]``."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Embed expects integer token ids, got dtype {tokens.dtype}")
        table = jnp.asarray(self.embedding, self.dtype)
        out = jnp.take(table, tokens, axis=0)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))

    def attend(self, query: jnp.ndarray) -> jnp.ndarray:
        """Logits against the table: ``[batch, length, d_model] -> [batch, length, vocab]``."""
        table = jnp.asarray(self.embedding, self.dtype)
        logits = jnp.einsum("bld,vd->blv", jnp.asarray(query, self.dtype), table)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
