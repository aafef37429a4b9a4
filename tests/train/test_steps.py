"""The train step itself: gradient accumulation equals one large step; Adafactor and
bfloat16 activations (mixed precision) train with float32 parameters."""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from moe_jax.runtime import (
    builders,
    configured,
    gin_flags,
    gin_utils,
    optimizers,
    steps,
    train_state,
)
from tests.models.conftest import random_batch

SHAPES = {"encoder_input_tokens": (4, 16), "decoder_input_tokens": (4, 8)}


@pytest.fixture
def smoke_gin():
    """The smoke config's tiny MoE model (gin stays live: MoE layers read it when traced)."""

    def parse(*flags: str) -> None:
        args = gin_flags.parse_flags(
            builders.build_parser("test", "test"),
            ["--gin_file=runs/smoke_cpu.gin", "--gin.MODEL_DIR=/tmp/unused", *flags],
        )
        gin_utils.parse_gin(args)

    yield parse
    gin.clear_config()


def _step(model, tx, schedule, state, batch, accum_steps):
    fn = jax.jit(
        lambda s, b: steps.train_step(
            s, b, model=model, tx=tx, learning_rate_fn=schedule, accum_steps=accum_steps
        )
    )
    return fn(state, jax.tree.map(jnp.asarray, batch))


def test_accumulated_microbatches_equal_one_step_on_the_same_examples(smoke_gin):
    smoke_gin()
    model = EncoderDecoderModel(EncoderDecoder())
    tx, schedule = optimizers.create_optimizer(name="sgd", learning_rate=0.1)
    state = train_state.init_train_state(model, tx, SHAPES, seed=0)
    half = random_batch(seed=1, batch=4, enc_len=16, dec_len=8, vocab=500)
    doubled = {k: np.concatenate([v, v]) for k, v in half.items()}

    one, m_one = _step(model, tx, schedule, state, half, accum_steps=1)
    two, m_two = _step(model, tx, schedule, state, doubled, accum_steps=2)
    np.testing.assert_allclose(m_two["loss"], m_one["loss"], rtol=1e-5)
    assert int(m_two["num_tokens"]) == 2 * int(m_one["num_tokens"])
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # and the step really moved the parameters
    moved = [
        np.abs(a - b).max()
        for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(state.params), strict=True)
    ]
    assert max(moved) > 1e-4


def test_uneven_microbatches_are_refused_by_name(smoke_gin):
    smoke_gin()
    model = EncoderDecoderModel(EncoderDecoder())
    tx, schedule = optimizers.create_optimizer(name="sgd", learning_rate=0.1)
    state = train_state.init_train_state(model, tx, SHAPES, seed=0)
    with pytest.raises(ValueError, match="accum_steps=3"):
        _step(
            model, tx, schedule, state, random_batch(batch=4, enc_len=16, dec_len=8, vocab=500), 3
        )


@pytest.mark.slow
def test_adafactor_with_bfloat16_activations_fits_a_batch_and_keeps_float32_params(smoke_gin):
    smoke_gin("--gin.ACTIVATION_DTYPE='bfloat16'")
    model = EncoderDecoderModel(EncoderDecoder())
    tx, schedule = optimizers.create_optimizer(name="adafactor", learning_rate=1e-2)
    state = train_state.init_train_state(model, tx, SHAPES, seed=0)
    batch = jax.tree.map(
        jnp.asarray, random_batch(seed=2, batch=4, enc_len=16, dec_len=8, vocab=500)
    )
    step = jax.jit(
        lambda s, b: steps.train_step(s, b, model=model, tx=tx, learning_rate_fn=schedule)
    )
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.7 * losses[0]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def _two_steps_on_mesh(fsdp: bool):
    """The smoke model's jitted, donated train step (Adam) on the gin mesh: the state after
    two steps on one batch and both steps' losses."""
    with gin.unlock_config():
        gin.bind_parameter("standard_logical_axis_rules.fsdp", fsdp)
    ctx = configured.run_context()
    shapes = {"encoder_input_tokens": (8, 16), "decoder_input_tokens": (8, 8)}
    run = configured.train_setup(EncoderDecoderModel(EncoderDecoder()), shapes, ctx, seed=0)
    batch = builders.global_batch(
        random_batch(seed=3, batch=8, enc_len=16, dec_len=8, vocab=500), ctx
    )
    state = run.init_state()
    losses = []
    for _ in range(2):
        state, metrics = run.jitted_train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.slow
def test_fsdp_shards_parameters_and_adam_state_over_the_batch_axes_with_the_same_losses(smoke_gin):
    smoke_gin("--gin_file=meshes/cpu_8.gin")  # (data 2, expert 4, model 1); Adam
    _, ref_losses = _two_steps_on_mesh(fsdp=False)
    state, losses = _two_steps_on_mesh(fsdp=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # the update is the same too

    # d_model 32 over data x expert (8 devices): each device keeps 4 of the 32 rows
    query = state.params["encoder"]["layers_0"]["self_attention"]["attention"]["query"]
    assert query.sharding.spec[0] == ("data", "expert")
    assert query.addressable_shards[0].data.shape == (4, *query.shape[1:])
    embedding = state.params["token_embedder"]["embedding"]
    assert embedding.addressable_shards[0].data.shape == (embedding.shape[0], 4)
    # expert weights: experts over 'expert' (4 experts, 1 per device), d_model over 'data'
    wi = state.params["encoder"]["layers_1"]["ffn"]["moe"]["expert"]["wi_0"]
    assert wi.sharding.spec[:2] == ("expert", "data")
    assert wi.addressable_shards[0].data.shape == (1, 16, wi.shape[2])
    # Adam's moments follow their parameters
    mu = [s for s in jax.tree.leaves(state.opt_state) if getattr(s, "shape", None) == query.shape]
    assert mu and all(m.sharding.is_equivalent_to(query.sharding, query.ndim) for m in mu)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    total = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert per_device < 0.2 * total, (per_device, total)


def test_init_state_compiles_cheaply_and_gives_the_parameters_of_the_plain_program(smoke_gin):
    """``init_state`` compiles its program without LLVM's optimisations
    (``hardware.init_compiler_options``; the step's own options kept), and the parameters
    are those of the same program compiled with them (XLA's default level 2; the test
    session's default is 0), to rounding, on every mesh shard."""
    from moe_jax import hardware, partitioning

    smoke_gin()
    assert hardware.init_compiler_options("cpu")["xla_backend_optimization_level"] == 0
    gpu = hardware.init_compiler_options("cuda")
    assert gpu.items() >= hardware.compiler_options("gpu").items()
    assert gpu["xla_backend_optimization_level"] == 0
    assert hardware.init_compiler_options("tpu") == hardware.compiler_options("tpu")

    ctx = configured.run_context()
    run = configured.train_setup(EncoderDecoderModel(EncoderDecoder()), SHAPES, ctx, seed=5)
    state = run.init_state()
    with partitioning.activate(ctx.mesh, ctx.rules):
        optimised = {"xla_backend_optimization_level": 2}
        plain = jax.jit(run._init_fn, out_shardings=run.shardings).lower().compile(optimised)()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
