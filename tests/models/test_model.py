"""EncoderDecoderModel: losses, metrics, MoE auxiliary losses, KV-cache decoding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models import losses
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from tests.models.conftest import random_batch, tiny_config, tiny_moe

SHAPES = {"encoder_input_tokens": (2, 8), "decoder_input_tokens": (2, 6)}


@functools.cache
def _dense(**kwargs):
    model = EncoderDecoderModel(EncoderDecoder(tiny_config()), **kwargs)
    return model, model.get_initial_variables(jax.random.key(0), SHAPES)["params"]


def test_cross_entropy_with_smoothing_and_z_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    targets = rng.integers(0, 5, (2, 3))
    loss, z, predicted = losses.cross_entropy_with_logits(
        jnp.asarray(logits), jnp.asarray(targets), 0.1, 1e-2
    )
    log_z = np.log(np.exp(logits).sum(-1))
    soft = np.full((2, 3, 5), 0.1 / 4)
    np.put_along_axis(soft, targets[..., None], 0.9, axis=-1)
    expected_ce = -(soft * (logits - log_z[..., None])).sum(-1) + (soft * np.log(soft)).sum(-1)
    np.testing.assert_allclose(z, 1e-2 * log_z**2, rtol=1e-5)
    np.testing.assert_allclose(loss, expected_ce + 1e-2 * log_z**2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(predicted, logits.argmax(-1))


def test_loss_normalization_and_weights():
    batch = random_batch()
    batch["decoder_loss_weights"][0, 3:] = 0.0
    mean_model, params = _dense()
    sum_model, _ = _dense(loss_normalizing_factor=None)
    loss, metrics = mean_model.loss_fn(params, batch, None)
    total, _ = sum_model.loss_fn(params, batch, None)
    assert metrics["num_tokens"] == 9.0
    np.testing.assert_allclose(total, loss * 9.0, rtol=1e-5)
    # a target with weight 0 does not count
    changed = dict(batch, decoder_target_tokens=batch["decoder_target_tokens"].copy())
    changed["decoder_target_tokens"][0, 5] = (changed["decoder_target_tokens"][0, 5] + 1) % 60 + 2
    np.testing.assert_allclose(mean_model.loss_fn(params, changed, None)[0], loss, rtol=1e-6)
    with pytest.raises(ValueError, match="loss_normalizing_factor='TOKENS'"):
        EncoderDecoderModel(EncoderDecoder(tiny_config()), loss_normalizing_factor="TOKENS")
    with pytest.raises(ValueError, match="VOCAB_SIZE"):
        EncoderDecoderModel(EncoderDecoder(tiny_config()), vocabulary=100)


def test_accuracy_is_the_weighted_argmax_hit_rate():
    model, params = _dense()
    batch = random_batch(3)
    _, metrics = model.loss_fn(params, batch, None)
    logits = model.module.apply(
        {"params": params},
        batch["encoder_input_tokens"],
        batch["decoder_input_tokens"],
        batch["decoder_target_tokens"],
        enable_dropout=False,
    )
    hits = np.asarray(jnp.argmax(logits, -1)) == batch["decoder_target_tokens"]
    np.testing.assert_allclose(metrics["accuracy"], hits.mean(), rtol=1e-6)


def _teacher_forced_step_logits(model, params, batch):
    """Decoder logits computed one position at a time through the KV cache."""
    encode = functools.partial(model.module.apply, {"params": params}, enable_dropout=False)
    enc = batch["encoder_input_tokens"]
    encoded = jax.jit(lambda tokens: encode(tokens, method=EncoderDecoder.encode))(enc)
    length = batch["decoder_input_tokens"].shape[1]
    kwargs = dict(
        enable_dropout=False,
        decode=True,
        max_decode_length=length,
        method=EncoderDecoder.decode,
        mutable=["cache"],
    )
    _, state = jax.jit(lambda x, tokens: encode(x, enc, tokens, **kwargs))(
        encoded, jnp.ones_like(batch["decoder_input_tokens"])
    )
    step = jax.jit(
        lambda cache, tokens: model.module.apply(
            {"params": params, "cache": cache}, encoded, enc, tokens, **kwargs
        )
    )
    cache, steps = state["cache"], []
    for i in range(length):
        logits, state = step(cache, batch["decoder_input_tokens"][:, i : i + 1])
        cache = state["cache"]
        steps.append(logits[:, 0])
    return np.stack(steps, axis=1)


def _full_logits(model, params, batch):
    return jax.jit(
        lambda p, enc, dec: model.module.apply({"params": p}, enc, dec, enable_dropout=False)
    )(params, batch["encoder_input_tokens"], batch["decoder_input_tokens"])


def test_kv_cache_decoding_equals_the_full_forward():
    model, params = _dense()
    batch = random_batch(4)
    np.testing.assert_allclose(
        _teacher_forced_step_logits(model, params, batch),
        _full_logits(model, params, batch),
        atol=1e-4,
        rtol=1e-4,
    )


def test_greedy_predict_equals_argmax_of_repeated_full_forwards():
    model, params = _dense()
    batch = random_batch(5)
    predicted = np.asarray(jax.jit(model.predict_batch)(params, batch))
    tokens = np.zeros((2, 6), np.int32)
    done = np.zeros(2, bool)
    for i in range(6):
        inputs = np.concatenate([np.zeros((2, 1), np.int32), tokens[:, :-1]], 1)
        step = np.argmax(
            _full_logits(model, params, dict(batch, decoder_input_tokens=inputs))[:, i], -1
        )
        tokens[:, i] = np.where(done, 0, step)
        done |= tokens[:, i] == model.eos_id
    np.testing.assert_array_equal(predicted, tokens)


def test_temperature_sampling():
    model, params = _dense()
    batch = random_batch(6, batch=4)
    sample = jax.jit(
        functools.partial(model.predict_batch, decode_method="sample", max_decode_length=8),
        static_argnames="temperature",
    )
    greedy = model.predict_batch(params, batch, max_decode_length=8)
    np.testing.assert_array_equal(
        sample(params, batch, jax.random.key(0), temperature=1e-4), greedy
    )
    hot = [np.asarray(sample(params, batch, jax.random.key(s), temperature=5.0)) for s in (1, 2)]
    assert hot[0].shape == (4, 8) and not np.array_equal(hot[0], hot[1])
    assert hot[0].max() < 64
    with pytest.raises(ValueError, match="decode_method='beam'"):
        model.predict_batch(params, batch, decode_method="beam")


def test_moe_model_adds_aux_losses_and_reports_routing_per_layer():
    moe = tiny_moe(
        group_size=16, train_capacity_factor=1.0, eval_capacity_factor=8.0, min_expert_capacity=1
    )
    config = tiny_config(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, moe=moe)
    model = EncoderDecoderModel(EncoderDecoder(config), z_loss=1e-4)
    params = model.get_initial_variables(jax.random.key(0), SHAPES)["params"]
    assert params["encoder"]["layers_1"]["ffn"]["moe"]["expert"]["wo"].value.shape == (4, 32, 32)
    assert "mlp" in params["encoder"]["layers_0"]["ffn"]
    batch = random_batch(7)
    loss, metrics = jax.jit(model.loss_fn)(params, batch, jax.random.key(1))
    aux = metrics["load_balancing_loss"] + metrics["router_z_loss"]
    assert metrics["aux_loss"] > 0
    np.testing.assert_allclose(aux, metrics["aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(loss, metrics["cross_entropy"] + metrics["z_loss"] + aux, rtol=1e-6)
    for stack in ("encoder", "decoder"):
        load = metrics[f"moe/{stack}/layers_1/expert_load"]
        assert load.shape == (4,)
        np.testing.assert_allclose(load.sum(), 2.0, rtol=1e-5)  # top-2: loads sum to k
        for name in ("dropped_fraction", "router_entropy", "router_confidence"):
            assert f"moe/{stack}/layers_1/{name}" in metrics
    # eval uses the larger eval capacity factor: fewer drops than training's factor 1.0
    evaluated = jax.jit(model.eval_fn)(params, batch)
    assert evaluated["moe/encoder/layers_1/dropped_fraction"] == 0.0
    assert metrics["moe/encoder/layers_1/dropped_fraction"] > 0.0
    # gradients reach the router and the experts
    grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, jax.random.key(1))[0]))(params)
    moe_grads = grads["decoder"]["layers_1"]["ffn"]["moe"]
    assert float(jnp.abs(moe_grads["router"]["weights"]["w"].value).sum()) > 0
    assert float(jnp.abs(moe_grads["expert"]["wi_0"].value).sum()) > 0
    # KV-cache decoding through the MoE decoder layer equals the full forward (no drops at eval)
    np.testing.assert_allclose(
        _teacher_forced_step_logits(model, params, batch),
        _full_logits(model, params, batch),
        atol=1e-4,
        rtol=1e-4,
    )
    assert model.flops_per_token(SHAPES) > EncoderDecoderModel(
        EncoderDecoder(tiny_config())
    ).flops_per_token(SHAPES)
