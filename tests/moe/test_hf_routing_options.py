"""The options that place and route MoE layers as Hugging Face's Switch Transformers do:
the ``switch`` layout and explicit sparse layer lists, the router bias, a fixed expert
capacity per sequence, transformers' router losses (``router_losses='hf_stack'``)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.t5 import T5Config, sparse_layer_indices
from moe_jax.moe import MoeLayer, TopKRouterConfig
from moe_jax.moe import losses as moe_losses
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTER_STACK_COLLECTION,
)
from moe_jax.moe.config import AuxLossConfig, CapacityConfig, MoeConfig

from .moe_testlib import SMALL, apply, init_params, make_inputs, metric


def test_switch_layout_puts_sparse_layers_where_layer_mod_step_is_one():
    assert sparse_layer_indices(12, 6, "switch") == (1, 3, 5, 7, 9, 11)
    assert sparse_layer_indices(12, 3, "switch") == (1, 5, 9)
    assert sparse_layer_indices(12, 3, "mixed") == (3, 7, 11)
    assert sparse_layer_indices(4, 4, "switch") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="sparse_layout='switch' with num_layers=10"):
        sparse_layer_indices(10, 4, "switch")


def test_explicit_sparse_layers_set_the_count_and_survive_to_dict():
    config = T5Config(num_encoder_layers=6, num_decoder_layers=4, sparse_encoder_layers=[4, 1])
    assert config.sparse_layers("encoder") == (1, 4) and config.num_sparse_encoder_layers == 2
    assert config.sparse_layers("decoder") == () and config.has_moe
    assert T5Config.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"T5Config.sparse_decoder_layers=\[1, 4\] must be"):
        T5Config(num_decoder_layers=4, sparse_decoder_layers=(1, 4))
    with pytest.raises(ValueError, match="has 1 layers but num_sparse_encoder_layers=2"):
        T5Config(num_sparse_encoder_layers=2, sparse_encoder_layers=(1,))


def _favouring_expert(params: dict, expert: int) -> dict:
    """``params`` with the router kernel zeroed and its bias pointing at ``expert``."""
    router = params["router"]["weights"]
    bias = np.zeros_like(router["b"])
    bias[expert] = 10.0
    return {
        **params,
        "router": {"weights": {"w": jnp.zeros_like(router["w"]), "b": jnp.asarray(bias)}},
    }


def _top1(capacity: CapacityConfig) -> MoeLayer:
    return MoeLayer(
        replace(
            SMALL,
            router=TopKRouterConfig(num_selected_experts=1, router_bias=True),
            capacity=capacity,
        )
    )


def test_router_bias_is_a_parameter_that_moves_the_choice():
    layer = _top1(replace(SMALL.capacity, dropless=True))
    x = make_inputs(batch=2, length=4)
    params = init_params(layer, x)
    assert params["router"]["weights"]["b"].shape == (4,)
    assert not np.any(np.asarray(params["router"]["weights"]["b"]))  # zeros at init
    y, _ = apply(layer, _favouring_expert(params, 2), x)
    # every token through expert 2 alone: the same as a model whose other experts are zero
    others_zero = {
        **params,
        "expert": {k: v.at[np.array([0, 1, 3])].set(0.0) for k, v in params["expert"].items()},
    }
    y_alone, _ = apply(layer, _favouring_expert(others_zero, 2), x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_alone), rtol=1e-6)
    assert np.all(np.abs(np.asarray(y)).sum(-1) > 0)


@pytest.mark.parametrize("by_sequence", [True, False])
def test_fixed_capacity_fills_each_sequence_in_token_order(by_sequence):
    capacity = CapacityConfig(
        group_size=16, min_expert_capacity=1, expert_capacity=3, group_by_sequence=by_sequence
    )
    layer = _top1(capacity)
    x = make_inputs(batch=2, length=8)
    params = _favouring_expert(init_params(layer, x), 1)
    y, _ = apply(layer, params, x)
    served = np.abs(np.asarray(y)).sum(-1) > 0  # [batch, length]: dropped tokens give zeros
    expected = np.zeros((2, 8), bool)
    if by_sequence:  # three tokens of each sequence
        expected[:, :3] = True
    else:  # one group of 16 tokens: the first three of the batch
        expected[0, :3] = True
    np.testing.assert_array_equal(served, expected)


def test_expert_capacity_must_be_positive():
    with pytest.raises(ValueError, match=r"CapacityConfig\.expert_capacity=0 must be >= 1"):
        CapacityConfig(expert_capacity=0)


def _hf_reference(layer_logits: list[np.ndarray]) -> tuple[float, float]:
    """transformers' ``router_z_loss_func`` and ``load_balancing_loss_func`` (of the
    softmax and the argmax experts) on the layers' logits concatenated along the length
    (``_unpack_router_logits``), transcribed in float64 NumPy."""
    logits = np.concatenate(layer_logits, axis=1).astype(np.float64)  # [batch, n, experts]
    num_groups, tokens_per_group, num_experts = logits.shape
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    z_loss = np.sum(log_z**2) / (num_groups * tokens_per_group)
    probs = np.exp(logits - log_z[..., None])
    expert_mask = np.eye(num_experts)[logits.argmax(-1)]
    tokens_per_group_and_expert = expert_mask.mean(-2)
    router_prob_per_group_and_expert = probs.mean(-2)
    aux = np.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert) * num_experts**2
    return float(z_loss), float(aux)


def test_hf_stack_losses_are_transformers_definitions():
    rng = np.random.default_rng(0)
    layers = [rng.normal(0, 2, (3, 7, 4)).astype(np.float32) for _ in range(3)]
    out = moe_losses.hf_stack_losses(
        [moe_losses.sequence_router_sums(jnp.asarray(x)) for x in layers]
    )
    z_loss, aux = _hf_reference(layers)
    np.testing.assert_allclose(float(out["router_z_loss"]), z_loss, rtol=1e-6)
    np.testing.assert_allclose(float(out["load_balancing_loss"]), aux, rtol=1e-6)
    # one stack of 3 layers is not the mean of the 3 layers' own losses
    alone = [_hf_reference([x])[1] for x in layers]
    assert not np.isclose(aux, np.mean(alone), rtol=1e-3)


def _hf_stack_layer() -> MoeLayer:
    return MoeLayer(
        replace(
            SMALL,
            router=TopKRouterConfig(num_selected_experts=1, router_bias=True),
            capacity=CapacityConfig(expert_capacity=2, group_by_sequence=True),
            losses=AuxLossConfig(router_losses="hf_stack"),
        )
    )


def test_hf_stack_layer_sows_sums_of_every_position_instead_of_its_two_losses():
    layer = _hf_stack_layer()
    x = make_inputs(batch=3, length=5)
    mask = jnp.ones((3, 5)).at[1, 3:].set(0).at[2, 1:].set(0)
    params = init_params(layer, x, padding_mask=mask)
    collections = [AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION, ROUTER_STACK_COLLECTION]
    _, state = jax.jit(
        lambda p: layer.apply({"params": p}, x, padding_mask=mask, mutable=collections)
    )(params)
    assert AUX_LOSS_COLLECTION not in state  # the other losses weigh 0
    assert {"load_balancing_loss", "router_z_loss"} <= set(state[MOE_METRICS_COLLECTION])
    router = params["router"]["weights"]
    logits = jnp.einsum("bld,de->ble", x, router["w"]) + router["b"]  # padding included
    expected = moe_losses.sequence_router_sums(logits)
    sown = {k: v[0] for k, v in state[ROUTER_STACK_COLLECTION].items()}
    assert set(sown) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(sown[name], value, rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(sown["top1_count"].sum(-1), [5, 5, 5])


def test_hf_stack_needs_top1_softmax_routing():
    with pytest.raises(ValueError, match=r"router_losses='hf_stack' is Switch Transformers'"):
        MoeConfig(losses=AuxLossConfig(router_losses="hf_stack"))  # top-2 by default
    with pytest.raises(ValueError, match=r"AuxLossConfig\.router_losses"):
        AuxLossConfig(router_losses="hf")
    assert AuxLossConfig().router_losses == "per_layer"


def test_routed_padding_takes_capacity_after_the_real_tokens_of_its_sequence():
    """``route_padding`` (``T5Config.padding_semantics='hf'``): padding goes to its expert
    like a real token and fills the capacity left after its sequence's real tokens; the
    real tokens' outputs and statistics do not change."""
    capacity = CapacityConfig(expert_capacity=3, group_by_sequence=True)
    x = make_inputs(batch=2, length=6)
    mask = jnp.ones((2, 6)).at[0, 2:].set(0).at[1, 5:].set(0)  # 2 and 5 real tokens
    params = _favouring_expert(init_params(_top1(capacity), x, padding_mask=mask), 1)
    runs = {}
    for route_padding in (False, True):
        layer = MoeLayer(_top1(capacity).config, route_padding=route_padding)
        y, state = apply(layer, params, x, padding_mask=mask)
        served = np.abs(np.asarray(y)).sum(-1) > 0  # dropped or unrouted tokens give zeros
        runs[route_padding] = (np.asarray(y), served, state)
    real, first_three = np.asarray(mask) > 0, np.broadcast_to(np.arange(6) < 3, (2, 6))
    np.testing.assert_array_equal(runs[False][1], real & first_three)
    # row 0: its 2 real tokens, then 1 padding token fill the 3 places; row 1: 3 real tokens
    np.testing.assert_array_equal(runs[True][1], first_three)
    np.testing.assert_array_equal(runs[True][0][real], runs[False][0][real])
    for name in ("dropped_fraction", "expert_load", "load_balancing_loss"):
        np.testing.assert_allclose(metric(runs[True][2], name), metric(runs[False][2], name))
    np.testing.assert_allclose(metric(runs[True][2], "dropped_fraction"), 2 / 7)  # row 1's 2
