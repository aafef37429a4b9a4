"""Compute copies: with bfloat16 activations the train step keeps a bfloat16 copy of each
parameter the loss only reads cast, writes it with the update, and trains as the step that
casts every time; checkpoints hold no copies and a restore makes them again."""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from moe_jax.runtime import (
    builders,
    checkpoints,
    compute_copies,
    configured,
    gin_flags,
    gin_utils,
    steps,
)
from moe_jax.runtime.run_dir import RunDir
from tests.models.conftest import random_batch

SHAPES = {"encoder_input_tokens": (8, 16), "decoder_input_tokens": (8, 8)}


def _setup(*flags: str) -> tuple[builders.TrainSetup, EncoderDecoderModel, builders.RunContext]:
    """The smoke config's tiny MoE model (Adam) on one CPU device."""
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", "--gin.MODEL_DIR=/tmp/unused", *flags],
    )
    gin_utils.parse_gin(args)
    ctx = configured.run_context()
    model = EncoderDecoderModel(EncoderDecoder())
    return configured.train_setup(model, SHAPES, ctx, seed=0), model, ctx


@pytest.fixture
def bf16():
    yield _setup("--gin.ACTIVATION_DTYPE='bfloat16'")
    gin.clear_config()


def _batch(ctx, seed: int):
    return builders.global_batch(
        random_batch(seed=seed, batch=8, enc_len=16, dec_len=8, vocab=500), ctx
    )


def _names(tree) -> set[str]:
    return {"/".join(path) for path in traverse_util.flatten_dict(tree)}


def test_weights_read_cast_get_copies_and_routers_and_norms_do_not(bf16):
    run, _, _ = bf16
    copies = traverse_util.flatten_dict(run.abstract_state.compute_params)
    names = _names(run.abstract_state.compute_params)
    assert {leaf.dtype for leaf in copies.values()} == {jnp.dtype(jnp.bfloat16)}
    assert "encoder/layers_1/ffn/moe/expert/wi_0" in names  # expert weights
    assert "encoder/layers_0/self_attention/attention/query" in names
    assert "token_embedder/embedding" in names
    # read in float32 (the router) or not cast (norm scales, the float32 attention bias)
    params = _names(run.abstract_state.params)
    kept = params - names
    assert any("router" in n for n in kept) and not any("router" in n for n in names)
    assert any(n.endswith("pre_norm/scale") for n in kept)
    assert not any("relpos_bias" in n or n.endswith("scale") for n in names)
    # each copy has its parameter's shape and sharding
    flat = traverse_util.flatten_dict(run.abstract_state.params)
    for path, copy in copies.items():
        assert copy.shape == flat[path].shape and copy.sharding == flat[path].sharding


def test_float32_activations_keep_no_copies():
    try:
        run, _, _ = _setup()
        assert run.abstract_state.compute_params == {}
    finally:
        gin.clear_config()


def test_steps_with_copies_train_as_steps_that_cast(bf16):
    """Three Adam steps reading the copies against three steps on the same state without
    copies (the model casts the float32 weights at every use): the same losses, the same
    parameters to float32 rounding of a bfloat16-rounded gradient; after each step the
    copies are the new parameters cast."""
    run, model, ctx = bf16
    with_copies = run.init_state()
    assert with_copies.compute_params
    casting = dataclasses.replace(with_copies, compute_params={})
    casting = jax.tree.map(jnp.copy, casting)  # the jitted step donates its state
    plain_step = steps.jit_train_step(
        model,
        run.tx,
        run.learning_rate_fn,
        dataclasses.replace(run.shardings, compute_params={}),
        ctx.mesh,
        ctx.rules,
        ctx.batch_axes,
    )
    for seed in range(3):
        batch = _batch(ctx, seed)
        with_copies, m_copies = run.jitted_train_step(with_copies, batch)
        casting, m_cast = plain_step(casting, batch)
        assert float(m_copies["loss"]) == float(m_cast["loss"])
        assert float(m_copies["grad_norm"]) == pytest.approx(float(m_cast["grad_norm"]), 1e-3)
    leaves = zip(jax.tree.leaves(with_copies.params), jax.tree.leaves(casting.params), strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    params = traverse_util.flatten_dict(with_copies.params)
    for path, copy in traverse_util.flatten_dict(with_copies.compute_params).items():
        assert copy.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(params[path].astype(copy.dtype)))


def test_checkpoints_hold_no_copies_and_restore_makes_them(bf16, tmp_path):
    run, _, ctx = bf16
    state, _ = run.jitted_train_step(run.init_state(), _batch(ctx, 0))
    saver = checkpoints.Checkpointer(RunDir(tmp_path), async_save=False)
    saver.save(state, {})
    saver.close()
    saved = {p.name for p in (tmp_path / "checkpoints" / "1").rglob("*")}
    assert not any("compute_params" in name for name in saved)

    reader = checkpoints.Checkpointer(RunDir(tmp_path), read_only=True)
    restored, _ = reader.restore(1, run.abstract_state)
    assert _names(restored.compute_params) == _names(run.abstract_state.compute_params)
    expected = traverse_util.flatten_dict(state.compute_params)
    for path, copy in traverse_util.flatten_dict(restored.compute_params).items():
        assert copy.sharding == expected[path].sharding
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(expected[path]))
    # and the restored state trains on as the one that was saved
    batch = _batch(ctx, 1)
    _, m_restored = run.jitted_train_step(restored, batch)
    _, m_saved = run.jitted_train_step(state, batch)
    assert float(m_restored["loss"]) == float(m_saved["loss"])


def test_read_as_copies_casts_what_is_only_read_cast_and_keeps_the_rest():
    """A weight read cast to bfloat16 twice gets a copy; one also read in float32, one
    never cast and an integer table do not."""

    def fn(p, x):
        y = x @ p["w"].astype(jnp.bfloat16) + x @ p["w"].astype(jnp.bfloat16)
        mixed = x.astype(jnp.float32) @ p["mixed"] + (x @ p["mixed"].astype(x.dtype))
        return y.astype(jnp.float32) + mixed + p["bias"] + p["ids"].astype(jnp.float32)

    params = {
        "w": jnp.ones((4, 4)),
        "mixed": jnp.ones((4, 4)),
        "bias": jnp.ones((4,)),
        "ids": jnp.ones((4,), jnp.int32),
    }
    x = jnp.ones((2, 4), jnp.bfloat16)
    assert compute_copies.compute_dtypes(fn, params, x) == {"w": jnp.dtype(jnp.bfloat16)}
    read = compute_copies.read_as_copies(fn, params, x)
    assert {k: v.dtype for k, v in read.items()} == {
        "w": jnp.bfloat16,
        "mixed": jnp.float32,
        "bias": jnp.float32,
        "ids": jnp.int32,
    }
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    assert compute_copies.read_as_copies(fn, abstract, x)["w"].dtype == jnp.bfloat16
