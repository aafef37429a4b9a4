"""Activation checkpointing (``T5Config.remat_policy``): same loss, metrics and gradients as
no remat, dropout included, with unrolled and with scanned layers; less memory kept for the
backward pass; refused by name when unknown."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import REMAT_POLICIES, EncoderDecoder
from tests.models.conftest import random_batch, tiny_config, tiny_moe

SHAPES = {"encoder_input_tokens": (4, 8), "decoder_input_tokens": (4, 6)}


# 4 + 4 layers scanned as (dense, MoE) x 2 per stack
SCANNED = dict(num_encoder_layers=4, num_decoder_layers=4, scan_layers=True, scan_min_layers=2)


def _model(policy: str, scan: bool = False, **overrides) -> EncoderDecoderModel:
    sparse = 2 if scan else 1
    config = tiny_config(
        num_sparse_encoder_layers=sparse,
        num_sparse_decoder_layers=sparse,
        dropout_rate=0.1,
        remat_policy=policy,
        moe=tiny_moe(expert_dropout_rate=0.1, group_size=8),
        **(SCANNED if scan else {}),
        **overrides,
    )
    assert (config.layer_groups("encoder") == ((0, 2, 2),)) == scan
    return EncoderDecoderModel(EncoderDecoder(config), z_loss=1e-4)


def _grad_fn(model):
    return jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True))


@functools.cache
def _reference(scan: bool = False):
    model = _model("none", scan)
    params = nn.unbox(model.get_initial_variables(jax.random.key(0), SHAPES)["params"])
    batch = random_batch(0, 4, 8, 6)
    return params, batch, _grad_fn(model)(params, batch, jax.random.key(3))


@pytest.mark.parametrize(
    "policy,scan",
    [
        pytest.param("full", False, marks=pytest.mark.slow),
        ("minimal", False),
        pytest.param("dots", False, marks=pytest.mark.slow),
        pytest.param("full", True, marks=pytest.mark.slow),
        pytest.param("minimal", True, marks=pytest.mark.slow),
    ],
)
def test_remat_gives_the_same_loss_metrics_and_gradients(policy, scan):
    params, batch, ((ref_loss, ref_metrics), ref_grads) = _reference(scan)
    model = _model(policy, scan)
    # same parameter tree (names and shapes) as without remat: checkpoints stay compatible
    fresh = nn.unbox(model.get_initial_variables(jax.random.key(0), SHAPES)["params"])
    assert jax.tree.structure(fresh) == jax.tree.structure(params)
    (loss, metrics), grads = _grad_fn(model)(params, batch, jax.random.key(3))  # dropout on
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), metrics, ref_metrics
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, ref_grads
    )


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_each_policy_keeps_less_for_the_backward_pass(scan):
    """Bytes of the residuals the backward pass keeps (the leaves of ``jax.vjp``'s
    function): full < minimal (projections) < dots (every matmul) < none."""
    params, batch, _ = _reference(scan)

    def residual_bytes(policy: str) -> int:
        model = _model(policy, scan)
        loss = lambda p: model.loss_fn(p, batch, jax.random.key(3))[0]  # noqa: E731
        vjp_fn = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp_fn))

    kept = {policy: residual_bytes(policy) for policy in ("none", "full", "minimal", "dots")}
    assert kept["full"] < kept["minimal"] < kept["dots"] < kept["none"], kept


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match=r"remat_policy='some'.*'minimal'"):
        tiny_config(remat_policy="some")
    assert set(REMAT_POLICIES) == {"none", "full", "minimal", "dots"}
