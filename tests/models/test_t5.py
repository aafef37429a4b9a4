"""The dense T5 network: layouts, masks (causal, padding, packing), dtypes, parameter counts."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models import accounting
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import (
    EncoderDecoder,
    T5Config,
    decoder_masks,
    encoder_mask,
    sparse_layer_indices,
)
from tests.models.conftest import random_batch, tiny_config


def _init(config: T5Config, enc_len: int = 8, dec_len: int = 6):
    model = EncoderDecoderModel(EncoderDecoder(config))
    shapes = {"encoder_input_tokens": (2, enc_len), "decoder_input_tokens": (2, dec_len)}
    return model, model.get_initial_variables(jax.random.key(0), shapes)["params"]


def _logits(model, params, batch, **kwargs):
    keys = (
        "encoder_input_tokens",
        "decoder_input_tokens",
        "decoder_target_tokens",
        "encoder_segment_ids",
        "decoder_segment_ids",
    )
    return model.module.apply(
        {"params": params}, *(batch.get(k) for k in keys), enable_dropout=False, **kwargs
    )


@pytest.mark.parametrize(
    "layout,expected",
    [("mixed", (3, 7, 11)), ("bottom", (0, 1, 2)), ("top", (9, 10, 11)), ("middle", (5, 6, 7))],
)
def test_sparse_layouts_of_t5x(layout, expected):
    assert sparse_layer_indices(12, 3, layout) == expected


def test_bad_layouts_and_config_values_are_named():
    with pytest.raises(ValueError, match="sparse_layout='diagonal'"):
        sparse_layer_indices(12, 3, "diagonal")
    with pytest.raises(ValueError, match="num_layers=12"):
        sparse_layer_indices(12, 5, "mixed")
    with pytest.raises(ValueError, match="num_sparse_layers=13"):
        sparse_layer_indices(12, 13, "top")
    with pytest.raises(ValueError, match="activation_dtype_name='float16'"):
        tiny_config(activation_dtype_name="float16")
    with pytest.raises(ValueError, match="flop_matched_mlp_dim"):
        tiny_config(num_sparse_encoder_layers=1, sparse_layer_type="dense")
    with pytest.raises(ValueError, match=r"T5Config\.padding_semantics='huggingface'"):
        tiny_config(padding_semantics="huggingface")


def _t5_formula(vocab, d, heads, head_dim, d_ff, n_enc, n_dec, buckets=32, tied=False, n_in=2):
    attn, mlp = 4 * d * heads * head_dim, (n_in + 1) * d * d_ff
    encoder = n_enc * (attn + mlp + 2 * d) + d + heads * buckets
    decoder = n_dec * (2 * attn + mlp + 3 * d) + d + heads * buckets
    return vocab * d * (1 if tied else 2) + encoder + decoder


def test_t5_base_parameter_count_matches_t5_v1_1_base():
    config = T5Config(vocab_size=32128, emb_dim=768, num_heads=12, head_dim=64, mlp_dim=2048)
    model = EncoderDecoderModel(EncoderDecoder(config))
    shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}
    params = jax.eval_shape(
        functools.partial(model.get_initial_variables, input_shapes=shapes), jax.random.key(0)
    )["params"]
    # T5 v1.1 base (untied, 32128 vocab) has 247,577,856 parameters.
    assert model.num_params(params) == 247_577_856
    assert model.num_params(params) == _t5_formula(32128, 768, 12, 64, 2048, 12, 12)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(logits_via_embedding=True),
        dict(mlp_activations=("relu",)),
        dict(
            num_heads=3,
            head_dim=16,
            num_sparse_decoder_layers=1,
            sparse_layer_type="dense",
            flop_matched_mlp_dim=128,
        ),
    ],
)
def test_variants_parameter_counts(overrides):
    config = tiny_config(**overrides)
    model = EncoderDecoderModel(EncoderDecoder(config))
    shapes = {"encoder_input_tokens": (1, 4), "decoder_input_tokens": (1, 4)}
    params = jax.eval_shape(
        functools.partial(model.get_initial_variables, input_shapes=shapes), jax.random.key(0)
    )["params"]
    expected = _t5_formula(
        64,
        32,
        config.num_heads,
        config.head_dim,
        64,
        2,
        2,
        tied=config.logits_via_embedding,
        n_in=len(config.mlp_activations),
    )
    if config.sparse_layer_type == "dense" and config.num_sparse_decoder_layers:
        expected += 3 * 32 * (128 - 64)  # one decoder layer with the wider FLOP-matched MLP
        assert params["decoder"]["layers_1"]["ffn"]["mlp"]["wo"].value.shape == (128, 32)
    assert model.num_params(params) == expected
    assert ("logits_dense" in params["decoder"]) != config.logits_via_embedding


def test_every_parameter_has_known_logical_axes():
    model, _ = _init(tiny_config())
    specs = model.param_logical_axes(
        {"encoder_input_tokens": (2, 8), "decoder_input_tokens": (2, 6)}
    )
    from moe_jax.partitioning import KNOWN_LOGICAL_AXES

    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert leaves and all(isinstance(s, jax.sharding.PartitionSpec) for s in leaves)
    assert all(name in KNOWN_LOGICAL_AXES for s in leaves for name in s)
    assert specs["encoder"]["layers_0"]["self_attention"]["attention"][
        "query"
    ] == jax.sharding.PartitionSpec("embed", "heads", "kv")


def test_decoder_is_causal_and_encoder_is_bidirectional(batch):
    model, params = _init(tiny_config())
    base = _logits(model, params, batch)
    changed = dict(batch, decoder_input_tokens=batch["decoder_input_tokens"].copy())
    changed["decoder_input_tokens"][:, 4] = (changed["decoder_input_tokens"][:, 4] + 7) % 60 + 2
    out = _logits(model, params, changed)
    np.testing.assert_allclose(out[:, :4], base[:, :4], atol=1e-5)
    assert not np.allclose(out[:, 4:], base[:, 4:], atol=1e-3)
    encode = functools.partial(
        model.module.apply, {"params": params}, enable_dropout=False, method=EncoderDecoder.encode
    )
    enc_changed = batch["encoder_input_tokens"].copy()
    enc_changed[:, -1] = (enc_changed[:, -1] + 5) % 60 + 2
    assert not np.allclose(
        encode(enc_changed)[:, 0], encode(batch["encoder_input_tokens"])[:, 0], atol=1e-3
    )


def test_packed_segments_do_not_attend_across():
    """Two examples packed in one row give the logits each gives alone (with padding)."""
    model, params = _init(tiny_config(), enc_len=10, dec_len=8)
    a, b = random_batch(1, 1, 4, 3), random_batch(2, 1, 6, 5)
    packed = {k: np.concatenate([a[k], b[k]], axis=1) for k in a}
    packed["encoder_segment_ids"] = np.array([[1] * 4 + [2] * 6], np.int32)
    packed["decoder_segment_ids"] = np.array([[1] * 3 + [2] * 5], np.int32)
    out = _logits(model, params, packed)

    def alone(x):
        padded = {
            k: np.zeros((1, 10 if k == "encoder_input_tokens" else 8), v.dtype)
            for k, v in x.items()
        }
        for k, v in x.items():
            padded[k][:, : v.shape[1]] = v
        return _logits(model, params, padded)[:, : x["decoder_target_tokens"].shape[1]]

    np.testing.assert_allclose(out[:, :3], alone(a), atol=1e-5)
    np.testing.assert_allclose(out[:, 3:], alone(b), atol=1e-5)
    # sanity: without segment ids the second example would see the first
    unsegmented = _logits(model, params, {k: v for k, v in packed.items() if "segment" not in k})
    assert not np.allclose(unsegmented[:, 3:], out[:, 3:], atol=1e-3)


def test_hf_padding_semantics_mask_padding_keys_only():
    """``padding_semantics='hf'``: every query row attends to the real keys (the encoder's
    padding too), the decoder's self-attention is causal only; ``'mask'`` blocks padding
    rows and columns."""
    tokens, targets = np.array([[5, 6, 1, 0]]), np.array([[7, 1, 0]])
    real_keys = np.broadcast_to(tokens[:, None, None, :] > 0, (1, 1, 4, 4))
    both = real_keys & np.swapaxes(real_keys, -1, -2)
    np.testing.assert_array_equal(encoder_mask(tokens, None, "hf").dense, real_keys)
    np.testing.assert_array_equal(encoder_mask(tokens, None).dense, both)
    decoder_inputs = np.array([[0, 7, 1]])
    self_mask, cross_mask = decoder_masks(tokens, decoder_inputs, targets, None, None, "hf")
    np.testing.assert_array_equal(self_mask.dense[0, 0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(cross_mask.dense, real_keys[:, :, :3])
    self_mask, cross_mask = decoder_masks(tokens, decoder_inputs, targets, None, None)
    assert not self_mask.dense[0, 0, 2].any() and not cross_mask.dense[0, 0, 2].any()


def test_hf_padding_semantics_keep_real_tokens_and_compute_padding_like_them():
    """On a padded batch ``'hf'`` gives the real tokens ``'mask'``'s logits and loss, and
    the padded decoder positions the logits of a batch whose targets mark no padding."""
    batch = random_batch(3)
    batch["encoder_input_tokens"][1, 5:] = 0
    batch["decoder_target_tokens"][1, 3:] = 0
    batch["decoder_input_tokens"][1, 4:] = 0
    batch["decoder_loss_weights"] = (batch["decoder_target_tokens"] > 0).astype(np.float32)
    masked, params = _init(tiny_config())
    hf = EncoderDecoderModel(EncoderDecoder(tiny_config(padding_semantics="hf")))
    out, base = _logits(hf, params, batch), _logits(masked, params, batch)
    real = batch["decoder_target_tokens"] > 0
    np.testing.assert_allclose(out[real], base[real], atol=1e-5)
    assert not np.allclose(out[~real], base[~real], atol=1e-3)
    unmarked = _logits(masked, params, {**batch, "decoder_target_tokens": None})
    np.testing.assert_allclose(out, unmarked, atol=1e-5)
    np.testing.assert_allclose(
        hf.loss_fn(params, batch, None)[0], masked.loss_fn(params, batch, None)[0], rtol=1e-6
    )


def test_bfloat16_activations_keep_float32_params(batch):
    model, params = _init(tiny_config(activation_dtype_name="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(params)))
    logits = _logits(model, params, batch)
    assert logits.dtype == jnp.bfloat16
    loss, _ = model.loss_fn(params, batch, None)
    assert loss.dtype == jnp.float32 and np.isfinite(loss)


def test_dropout_needs_rng_and_changes_outputs(batch):
    model, params = _init(tiny_config(dropout_rate=0.3))
    l0, _ = model.loss_fn(params, batch, None)
    l1, _ = model.loss_fn(params, batch, jax.random.key(1))
    l2, _ = model.loss_fn(params, batch, jax.random.key(2))
    assert len({float(l0), float(l1), float(l2)}) == 3
    np.testing.assert_allclose(model.eval_fn(params, batch)["loss"], l0, rtol=1e-6)


@pytest.mark.slow
def test_analytic_flops_track_xla_cost_analysis(batch):
    """The analytic forward count is within 15% of XLA's count for the same network."""
    config = tiny_config(emb_dim=64, mlp_dim=256, num_heads=4, head_dim=16, vocab_size=256)
    model, params = _init(config, enc_len=16, dec_len=16)
    batch = random_batch(0, 2, 16, 16, vocab=256)
    fwd = jax.jit(lambda p: _logits(model, p, batch))
    xla = fwd.lower(params).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    analytic = 2 * accounting.forward_flops_per_example(config, 16, 16)
    assert abs(xla["flops"] - analytic) / analytic < 0.15, (xla["flops"], analytic)
