"""Shared tiny configurations and batches for the model tests."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.models.t5 import T5Config
from moe_jax.moe import CapacityConfig, MoeConfig, TopKRouterConfig


def tiny_config(**overrides) -> T5Config:
    """2+2 layers, d_model 32, 4 heads x 8, d_ff 64, vocab 64."""
    kwargs = dict(
        vocab_size=64,
        emb_dim=32,
        num_heads=4,
        head_dim=8,
        mlp_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
    )
    kwargs.update(overrides)
    return T5Config(**kwargs)


def tiny_moe(expert_dropout_rate: float = 0.0, **capacity) -> MoeConfig:
    """4 experts of d_ff 32 (gated GELU), top-2; ``capacity``: ``CapacityConfig`` options."""
    return MoeConfig(
        num_experts=4,
        d_ff=32,
        activation="gated_gelu",
        expert_dropout_rate=expert_dropout_rate,
        router=TopKRouterConfig(num_selected_experts=2),
        capacity=CapacityConfig(**capacity),
    )


def random_batch(
    seed: int = 0, batch: int = 2, enc_len: int = 8, dec_len: int = 6, vocab: int = 64
) -> dict:
    """Unpacked EncDecFeatureConverter-style features without padding."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(2, vocab, (batch, dec_len)).astype(np.int32)
    return {
        "encoder_input_tokens": rng.integers(2, vocab, (batch, enc_len)).astype(np.int32),
        "decoder_target_tokens": targets,
        "decoder_input_tokens": np.concatenate(
            [np.zeros((batch, 1), np.int32), targets[:, :-1]], 1
        ),
        "decoder_loss_weights": np.ones((batch, dec_len), np.float32),
    }


@pytest.fixture
def batch() -> dict:
    return random_batch()
