"""The network under (data, expert, model) meshes on 8 forced CPU devices: same loss and
gradients as one device, parameters placed as the rules ask, bad combinations refused."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_jax import errors, partitioning
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from tests.models.conftest import random_batch, tiny_config, tiny_moe

SHAPES = {"encoder_input_tokens": (8, 8), "decoder_input_tokens": (8, 8)}


@pytest.fixture(scope="module")
def moe_model():
    # eval capacity large enough that no token is dropped whatever the grouping
    moe = tiny_moe(group_size=8, eval_capacity_factor=8.0)
    model = EncoderDecoderModel(
        EncoderDecoder(
            tiny_config(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, moe=moe)
        ),
        z_loss=1e-4,
    )
    return model, model.get_initial_variables(jax.random.key(0), SHAPES)["params"]


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
    param_shardings = partitioning.tree_shardings(model.param_logical_axes(SHAPES), mesh, rules)
    unboxed = nn.unbox(params)
    partitioning.check_divisibility(unboxed, param_shardings)
    batch_sharding = partitioning.logical_to_sharding(("batch", "length"), mesh, rules)
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
    model, _ = moe_model
    rules = partitioning.standard_logical_axis_rules()

    def check(model, mesh_shape):
        partitioning.check_divisibility(
            nn.unbox(model.abstract_variables(SHAPES))["params"],
            partitioning.tree_shardings(
                model.param_logical_axes(SHAPES), partitioning.make_mesh(mesh_shape), rules
            ),
        )

    with pytest.raises(
        errors.ConfigError,
        match=r"^decoder/layers_1/ffn/moe/expert/wi_0 \[4, 32, 32\]: dimension 0 \(4\) is split "
        r"over mesh axis expert of size 8, which does not divide it; make the number of experts",
    ):
        check(model, (1, 8, 1))
    three_heads = EncoderDecoderModel(EncoderDecoder(tiny_config(num_heads=3)))
    with pytest.raises(
        errors.ConfigError, match=r"dimension 1 \(3\) is split over mesh axis model of size 2"
    ):
        check(three_heads, (4, 1, 2))
    bad = jax.tree.map(
        lambda s: P(*("embd" if a == "embed" else a for a in s)),
        model.param_logical_axes(SHAPES),
        is_leaf=lambda x: isinstance(x, P),
    )
    with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
        partitioning.tree_shardings(bad, partitioning.make_mesh((8, 1, 1)), rules)
