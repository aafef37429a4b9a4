"""The relative-position bias: equal to indexing the table per (query, key) pair, with a
gradient that holds no scatter (a gather's gradient is a contended scatter-add)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.compile import aot, contention
from moe_jax.models.relative_position import (
    RelativePositionBiases,
    relative_position_bucket,
)


def _buckets(query_length: int, key_length: int, bidirectional: bool) -> np.ndarray:
    """``[query, key]`` bucket of every pair, as T5 defines it."""
    offsets = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    return relative_position_bucket(offsets, bidirectional)


def _table_and_module(dtype=jnp.float32):
    module = RelativePositionBiases(num_heads=3, dtype=dtype)
    variables = nn.unbox(module.init(jax.random.key(0), 4, 4, True))
    return module, variables["params"]["rel_embedding"]


def test_the_program_embeds_the_pairs_buckets_and_no_one_hot_constant():
    """The one-hot ``[buckets, query, key]`` is made in the program from the ``[query,
    key]`` buckets and an iota: at 512 positions a constant one-hot would put 8 million
    floats into every program that holds the bias."""
    module, table = _table_and_module()

    def loss(t):
        return jnp.sum(module.apply({"params": {"rel_embedding": t}}, 512, 512, True) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(table).as_text()
    constants = re.findall(r"stablehlo\.constant dense<.*?> : tensor<([\dx]+)x?\w+>", hlo)
    sizes = [int(np.prod([int(d) for d in shape.split("x") if d])) for shape in constants]
    assert max(sizes) == 512 * 512, constants


@pytest.mark.parametrize("lengths", [(7, 7), (5, 9), (9, 4), (1, 6), (130, 130)])
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_is_the_table_entry_of_each_pairs_bucket(lengths, bidirectional, dtype):
    module, table = _table_and_module(dtype)
    bias = module.apply({"params": {"rel_embedding": table}}, *lengths, bidirectional)
    expected = jnp.asarray(table, dtype)[:, _buckets(*lengths, bidirectional)][None]
    assert bias.dtype == dtype and bias.shape == (1, 3, *lengths)
    np.testing.assert_array_equal(np.asarray(bias, np.float32), np.asarray(expected, np.float32))


def test_gradient_sums_each_buckets_pairs_accurately():
    module, table = _table_and_module()
    weights = jax.random.normal(jax.random.key(1), (3, 512, 512))

    def loss(t):
        bias = module.apply({"params": {"rel_embedding": t}}, 512, 512, True)
        return jnp.sum(bias[0] * weights)

    grad = np.asarray(jax.grad(loss)(table), np.float64)
    one_hot = np.eye(table.shape[1])[_buckets(512, 512, True)]  # [q, k, buckets]
    expected = np.einsum("hqk,qkb->hb", np.asarray(weights, np.float64), one_hot)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _contended(fn, *args) -> list[contention.Scatter]:
    with aot.source_keyed_cache():  # this program's source lines, not a cached one's
        return contention.contended_scatters(jax.jit(fn).lower(*args).compile().as_text())


def test_the_guard_flags_a_gathers_gradient_and_not_the_bias():
    """At T5's 512 positions a per-pair gather from the table (how the bias was built
    before) has a scatter-add of 12 x 512 x 512 updates into 384 elements in its gradient:
    ``contended_scatters`` names it with its source line. The bias has none."""
    table = jax.random.normal(jax.random.key(0), (12, 32))
    weights = jax.random.normal(jax.random.key(1), (12, 512, 512))
    buckets = jnp.asarray(_buckets(512, 512, True))

    def gathered(t):
        return jnp.sum(jnp.take(t, buckets, axis=1) ** 2 * weights)

    (flagged,) = _contended(jax.grad(gathered), table)
    assert (flagged.updates, flagged.written) == (12 * 512 * 512, 12 * 32)
    assert flagged.contention == 8192 and "scatter" in flagged.source
    assert flagged.location == f"{__file__}:{gathered.__code__.co_firstlineno + 1}"
    assert flagged.describe().startswith(f"{flagged.name} at {flagged.location} (")

    module = RelativePositionBiases(num_heads=12)

    def biased(t):
        bias = module.apply({"params": {"rel_embedding": t}}, 512, 512, True)
        return jnp.sum(bias[0] ** 2 * weights)

    assert _contended(jax.grad(biased), table) == []


@pytest.mark.parametrize("float32_logits", [True, False])
def test_a_bfloat16_model_makes_its_bias_in_the_logits_dtype(float32_logits):
    """With bfloat16 activations and float32 attention logits (the default), each stack's
    bias is made in float32, the dtype each layer adds it in: its gradient, summed over the
    layers, stays float32 (in bfloat16 every layer's contribution and every partial sum was
    rounded to 8 bits). With bfloat16 logits it is made in bfloat16."""
    from moe_jax.models.t5 import EncoderDecoder
    from tests.models.conftest import random_batch, tiny_config

    config = tiny_config(activation_dtype_name="bfloat16", float32_attention_logits=float32_logits)
    batch = random_batch()
    inputs = (batch["encoder_input_tokens"], batch["decoder_input_tokens"])
    model = EncoderDecoder(config)
    variables = model.init(jax.random.key(0), *inputs, enable_dropout=False)
    _, state = model.apply(
        variables,
        *inputs,
        enable_dropout=False,
        capture_intermediates=lambda module, name: isinstance(module, RelativePositionBiases),
    )
    expected = jnp.float32 if float32_logits else jnp.bfloat16
    for stack in ("encoder", "decoder"):
        (bias,) = state["intermediates"][stack]["relpos_bias"]["__call__"]
        assert bias.dtype == expected and bias.shape[:2] == (1, config.num_heads)
