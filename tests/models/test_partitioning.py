"""The network under (data, expert, model) meshes on 8 forced CPU devices: same loss and
gradients as one device, parameters placed as the rules ask, bad combinations refused."""

from __future__ import annotations

import functools

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_jax.moe  # noqa: F401  (registers MoeConfig with gin)
from moe_jax import partitioning
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from tests.models.conftest import random_batch, tiny_config

SHAPES = {"encoder_input_tokens": (8, 8), "decoder_input_tokens": (8, 8)}


@pytest.fixture(scope="module")
def moe_model():
    gin.clear_config()
    # eval capacity large enough that no token is dropped whatever the grouping
    gin.parse_config(
        "\n".join(
            [
                "MoeConfig.num_experts = 4",
                "MoeConfig.d_ff = 32",
                "MoeConfig.activation = 'gated_gelu'",
                "CapacityConfig.group_size = 8",
                "CapacityConfig.eval_capacity_factor = 8.0",
            ]
        )
    )
    model = EncoderDecoderModel(
        EncoderDecoder(tiny_config(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)),
        z_loss=1e-4,
    )
    params = model.get_initial_variables(jax.random.key(0), SHAPES)["params"]
    yield model, params
    gin.clear_config()


def _loss_and_grads(model, params, batch):
    return jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0])(params)


@pytest.mark.parametrize(
    "mesh_shape",
    [
        (2, 4, 1),  # data x expert parallel
        pytest.param((2, 2, 2), marks=pytest.mark.slow),  # + tensor parallel
        pytest.param((8, 1, 1), marks=pytest.mark.slow),  # data parallel only
    ],
)
def test_sharded_step_equals_single_device(moe_model, mesh_shape):
    model, params = moe_model
    batch = random_batch(0, 8, 8, 8)
    ref_loss, ref_grads = jax.jit(functools.partial(_loss_and_grads, model))(params, batch)

    mesh = partitioning.make_mesh(mesh_shape)
    rules = partitioning.standard_logical_axis_rules()
    logical = model.param_logical_axes(SHAPES)
    partitioning.check_divisibility(logical, nn.unbox(params), mesh, rules)
    param_shardings = partitioning.tree_shardings(logical, mesh, rules)
    batch_sharding = partitioning.logical_to_sharding(("batch", "length"), mesh, rules)
    unboxed = nn.unbox(params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        sharded_params = jax.device_put(unboxed, param_shardings)
        sharded_batch = jax.device_put(batch, batch_sharding)
        step = jax.jit(
            functools.partial(_loss_and_grads, model),
            in_shardings=(param_shardings, batch_sharding),
            out_shardings=(None, param_shardings),
        )
        loss, grads = step(sharded_params, sharded_batch)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
        grads,
        nn.unbox(ref_grads),
    )
    # each parameter lands where its rules say; expert weights split over 'expert'
    wi = sharded_params["encoder"]["layers_1"]["ffn"]["moe"]["expert"]["wi_0"]
    assert wi.sharding.spec == P("expert", None, "model")
    assert wi.addressable_shards[0].data.shape == (4 // mesh_shape[1], 32, 32 // mesh_shape[2])
    query = sharded_params["decoder"]["layers_0"]["self_attention"]["attention"]["query"]
    assert query.sharding.spec == P(None, "model", None)
    jax.tree.map(
        lambda g, s: g.sharding.is_equivalent_to(s, g.ndim) or pytest.fail(str(g.sharding)),
        grads,
        param_shardings,
    )


def test_bad_combinations_are_refused_by_name(moe_model):
    model, params = moe_model
    logical = model.param_logical_axes(SHAPES)
    rules = partitioning.standard_logical_axis_rules()
    with pytest.raises(
        ValueError, match=r"'expert'.*size 4, not divisible by mesh axes \('expert',\) of size 8"
    ):
        partitioning.check_divisibility(
            logical, nn.unbox(params), partitioning.make_mesh((1, 8, 1)), rules
        )
    three_heads = EncoderDecoderModel(EncoderDecoder(tiny_config(num_heads=3)))
    with pytest.raises(
        ValueError, match=r"'heads'.*size 3, not divisible by mesh axes \('model',\) of size 2"
    ):
        partitioning.check_divisibility(
            three_heads.param_logical_axes(SHAPES),
            jax.eval_shape(
                lambda: nn.unbox(
                    three_heads.get_initial_variables(jax.random.key(0), SHAPES)["params"]
                )
            ),
            partitioning.make_mesh((4, 1, 2)),
            rules,
        )
    bad = jax.tree.map(
        lambda s: P(*("embd" if a == "embed" else a for a in s)),
        logical,
        is_leaf=lambda x: isinstance(x, P),
    )
    with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
        partitioning.check_divisibility(
            bad, nn.unbox(params), partitioning.make_mesh((8, 1, 1)), rules
        )
