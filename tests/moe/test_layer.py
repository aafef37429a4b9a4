"""The MoeLayer contract the T5 model relies on."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from tests.moe.moe_testlib import SMALL, apply, init_params, make_inputs, metric, moe_layer


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_shape_and_dtype_follow_the_inputs(dtype):
    layer = moe_layer(**SMALL)
    x = make_inputs().astype(dtype)
    params = init_params(layer, x)
    y, _ = apply(layer, params, x)
    assert y.shape == x.shape and y.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


@pytest.mark.parametrize("batch,length", [(3, 1), (1, 1), (5, 7)])
def test_any_token_count_works_including_length_one(batch, length):
    layer = moe_layer(**SMALL)
    x = make_inputs(batch, length)
    params = init_params(layer, make_inputs())  # params do not depend on the shape
    y, state = apply(layer, params, x)
    assert y.shape == x.shape
    np.testing.assert_allclose(float(jnp.sum(metric(state, "expert_load"))), 2.0, rtol=1e-5)


def test_parameters_paths_and_logical_axes():
    layer = moe_layer(**dict(SMALL, activation="gated_gelu"))
    boxed = layer.init(jax.random.PRNGKey(0), make_inputs())["params"]
    specs = nn.get_partition_spec(boxed)
    flat = {
        "/".join(str(k.key) for k in path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
        )[0]
    }
    assert flat == {
        "router/weights/w": jax.sharding.PartitionSpec("embed", "unmodeled"),
        "expert/wi_0": jax.sharding.PartitionSpec("expert", "embed", "expert_mlp"),
        "expert/wi_1": jax.sharding.PartitionSpec("expert", "embed", "expert_mlp"),
        "expert/wo": jax.sharding.PartitionSpec("expert", "expert_mlp", "embed"),
    }
    for spec in flat.values():
        partitioning.validate_logical_axes(tuple(spec))
    params = nn.unbox(boxed)
    assert params["expert"]["wi_0"].shape == (4, 8, 16)
    # T5X router init: normal(0, 2e-2), no bias.
    w = params["router"]["weights"]["w"]
    assert 0.01 < float(jnp.std(w)) < 0.03 and set(params["router"]["weights"]) == {"w"}


def test_aux_losses_are_weighted_and_metrics_are_sown():
    layer = moe_layer(
        **dict(
            SMALL,
            load_balancing_loss_weight=0.5,
            router_z_loss_weight=0.25,
            importance_loss_weight=0.0,
        )
    )
    x = make_inputs()
    params = init_params(layer, x)
    _, state = apply(layer, params, x)
    aux = state["aux_loss"]
    assert set(aux) == {"load_balancing_loss", "router_z_loss"}  # weight 0 -> not sown
    np.testing.assert_allclose(
        aux["load_balancing_loss"][0], 0.5 * metric(state, "load_balancing_loss")
    )
    np.testing.assert_allclose(aux["router_z_loss"][0], 0.25 * metric(state, "router_z_loss"))
    assert set(state["moe_metrics"]) >= {
        "expert_load",
        "dropped_fraction",
        "router_confidence",
        "router_entropy",
        "max_router_logit",
        "importance_loss",
        "load_loss",
        "entropy_loss",
    }
    assert metric(state, "expert_load").shape == (4,)
    assert 1 / 4 <= float(metric(state, "router_confidence")) <= 1.0


def test_padding_is_never_routed_nor_counted():
    layer = moe_layer(**dict(SMALL, dropless=True, group_size=64))
    real = make_inputs(1, 6)
    garbage = 100.0 * make_inputs(1, 4, seed=3)
    padded = jnp.concatenate([real, garbage], axis=1)
    mask = jnp.array([[1] * 6 + [0] * 4])
    params = init_params(layer, real)
    y_real, s_real = apply(layer, params, real)
    y_pad, s_pad = apply(layer, params, padded, padding_mask=mask)
    np.testing.assert_allclose(y_pad[:, :6], y_real, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(y_pad[:, 6:]))) == 0.0
    for name in ("expert_load", "router_entropy", "load_balancing_loss", "max_router_logit"):
        np.testing.assert_allclose(metric(s_pad, name), metric(s_real, name), rtol=1e-5)


def test_train_and_eval_capacity_factors_drop_differently():
    layer = moe_layer(**dict(SMALL, train_capacity_factor=0.5, eval_capacity_factor=2.0))
    x = make_inputs()
    params = init_params(layer, x)
    _, train = apply(layer, params, x, deterministic=False)
    _, evaluation = apply(layer, params, x, deterministic=True)
    # group 16 tokens, E=4: capacity 2 in training (32 assignments, 8 slots), 8 in eval.
    assert float(metric(train, "dropped_fraction")) >= 0.75
    assert float(metric(evaluation, "dropped_fraction")) < float(metric(train, "dropped_fraction"))


def test_dropped_tokens_get_zero_output():
    layer = moe_layer(**dict(SMALL, num_selected_experts=1, eval_capacity_factor=0.25))
    x = make_inputs(1, 16)
    params = init_params(layer, x)
    y, state = apply(layer, params, x)
    zero_rows = int(jnp.sum(jnp.all(y == 0, axis=-1)))
    assert zero_rows == 16 - 4  # capacity round(0.25 * 16 / 4) = 1 per expert
    np.testing.assert_allclose(metric(state, "dropped_fraction"), zero_rows / 16)


def test_expert_dropout_only_in_training():
    layer = moe_layer(
        **dict(SMALL, expert_dropout_rate=0.5, eval_capacity_factor=2.0, train_capacity_factor=2.0)
    )
    x = make_inputs()
    params = init_params(layer, x)
    y_eval, _ = apply(layer, params, x)
    y_eval2, _ = apply(layer, params, x)
    rngs = {"dropout": jax.random.PRNGKey(5)}
    y_train, _ = apply(layer, params, x, deterministic=False, rngs=rngs)
    np.testing.assert_array_equal(y_eval, y_eval2)
    assert float(jnp.max(jnp.abs(y_train - y_eval))) > 1e-3


@pytest.mark.parametrize("activation", ["relu", "gelu", "gated_gelu"])
def test_activations_run_and_differ(activation):
    layer = moe_layer(**dict(SMALL, activation=activation))
    x = make_inputs()
    y, _ = apply(layer, init_params(layer, x), x)
    assert bool(jnp.all(jnp.isfinite(y))) and float(jnp.std(y)) > 0


@pytest.mark.parametrize(
    "overrides,option",
    [
        (dict(router_type="nope"), "router_type"),
        (dict(num_selected_experts=5), "num_selected_experts"),
        (dict(train_capacity_factor=0.0), "train_capacity_factor"),
        (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
        (dict(min_expert_capacity=0, eval_capacity_factor=0.01), "capacity"),
        (dict(dispatch="fast"), "dispatch"),
        (dict(activation="swish"), "activation"),
        (dict(capacity_rule="gshard"), "capacity_rule"),
        (dict(router_type="expert_choice", causal=True), "accept_causal_leak"),
        (dict(batch_prioritized_routing=True, causal=True), "accept_causal_leak"),
        (dict(capacity_order="choice_major", causal=True), "accept_causal_leak"),
        (dict(capacity_order="by_token"), "capacity_order"),
        (dict(router_type="hash"), "token_ids"),
        (dict(router_type="expert_choice", dropless=True), "dropless"),
    ],
)
def test_bad_options_are_refused_by_name(overrides, option):
    with pytest.raises(ValueError, match=option):  # building the config, or tracing the layer
        moe_layer(**dict(SMALL, **overrides)).init(jax.random.PRNGKey(0), make_inputs())


# Futures of make_inputs(): only the last token of sequence 0 differs (zeroed, scaled, redrawn).
def _futures(x: jax.Array) -> list[jax.Array]:
    return [
        x.at[0, -1].set(v)
        for v in (jnp.zeros_like(x[0, -1]), -50.0 * x[0, -1], *make_inputs(1, 4, seed=7)[0])
    ]


def _earlier_outputs_change(**options) -> list[bool]:
    """Per future: whether any earlier output of sequence 0 differs at all (bitwise) from
    the layer's output on make_inputs()."""
    x = make_inputs()
    layer = moe_layer(**dict(SMALL, **options))
    params = init_params(layer, x)
    run = jax.jit(lambda inputs: layer.apply({"params": params}, inputs))  # one compile
    y = run(x)
    return [not np.array_equal(y[0, :-1], run(f)[0, :-1]) for f in _futures(x)]


def test_causal_leak_can_be_accepted_explicitly():
    """Accepted, expert choice lets a later token change earlier tokens' outputs (it takes
    or frees their expert slots); so does top-2 with capacity granted choice-major (T5X's
    order: a later token's first choice evicts an earlier token's second choice)."""
    assert any(
        _earlier_outputs_change(router_type="expert_choice", causal=True, accept_causal_leak=True)
    )
    assert any(
        _earlier_outputs_change(causal=True, capacity_order="choice_major", accept_causal_leak=True)
    )


@pytest.mark.parametrize("dispatch", ["einsum", "sort"])
@pytest.mark.parametrize(
    "options",
    [
        dict(),  # top-2 with capacity: token-major capacity by default in a causal layer
        dict(num_selected_experts=1),
        dict(dropless=True),
        dict(
            router_type="hierarchical",
            num_expert_groups=2,
            num_selected_groups=2,
            num_selected_experts=1,
        ),
    ],
)
def test_causal_layers_never_read_later_tokens(dispatch, options):
    """Earlier outputs are bit-identical whatever the last token is; the same futures do
    change them under choice-major capacity (the first case), so the check can fail."""
    assert not any(_earlier_outputs_change(causal=True, dispatch=dispatch, **options))


def test_encoder_keeps_t5x_choice_major_capacity():
    """Not causal: T5X's order (every first choice before any second choice, see
    tests/moe/test_dispatch.py for the order itself); causal: token-major. At this tight
    capacity the two orders drop different assignments."""
    x = make_inputs()
    tight = dict(SMALL, eval_capacity_factor=0.75)
    params = init_params(moe_layer(**tight), x)

    def outputs(**options) -> np.ndarray:
        return np.asarray(apply(moe_layer(**dict(tight, **options)), params, x)[0])

    choice_major, token_major = (
        outputs(capacity_order="choice_major"),
        outputs(capacity_order="token_major"),
    )
    assert not np.array_equal(choice_major, token_major)
    np.testing.assert_array_equal(outputs(), choice_major)
    np.testing.assert_array_equal(outputs(causal=True), token_major)
