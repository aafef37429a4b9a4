"""The options that place and route MoE layers as Hugging Face's Switch Transformers do:
the ``switch`` layout and explicit sparse layer lists, the router bias, a fixed expert
capacity per sequence."""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.t5 import T5Config, sparse_layer_indices
from moe_jax.moe import MoeLayer, TopKRouterConfig
from moe_jax.moe.config import CapacityConfig

from .moe_testlib import SMALL, apply, init_params, make_inputs


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
