"""The MoeLayer contract the T5 model relies on."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import partitioning
from moe_jax.moe import (
    AuxLossConfig,
    CapacityConfig,
    ExecutionConfig,
    ExpertChoiceRouterConfig,
    HashRouterConfig,
    HierarchicalRouterConfig,
    MoeLayer,
    TopKRouterConfig,
)
from moe_jax.moe import losses as moe_losses
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.moe.config import from_dict
from tests.moe.moe_testlib import SMALL, apply, init_params, make_inputs, metric


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_shape_and_dtype_follow_the_inputs(dtype):
    layer = MoeLayer(SMALL)
    x = make_inputs().astype(dtype)
    params = init_params(layer, x)
    y, _ = apply(layer, params, x)
    assert y.shape == x.shape and y.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


@pytest.mark.parametrize("batch,length", [(3, 1), (1, 1), (5, 7)])
def test_any_token_count_works_including_length_one(batch, length):
    layer = MoeLayer(SMALL)
    x = make_inputs(batch, length)
    params = init_params(layer, make_inputs())  # params do not depend on the shape
    y, state = apply(layer, params, x)
    assert y.shape == x.shape
    np.testing.assert_allclose(float(jnp.sum(metric(state, "expert_load"))), 2.0, rtol=1e-5)


def test_parameters_paths_and_logical_axes():
    layer = MoeLayer(replace(SMALL, activation="gated_gelu"))
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
    losses = AuxLossConfig(
        load_balancing_loss_weight=0.5, router_z_loss_weight=0.25, importance_loss_weight=0.0
    )
    layer = MoeLayer(replace(SMALL, losses=losses))
    x = make_inputs()
    params = init_params(layer, x)
    _, state = apply(layer, params, x)
    aux = state[AUX_LOSS_COLLECTION]
    assert set(aux) == {"load_balancing_loss", "router_z_loss"}  # weight 0 -> not sown
    np.testing.assert_allclose(
        aux["load_balancing_loss"][0], 0.5 * metric(state, "load_balancing_loss")
    )
    np.testing.assert_allclose(aux["router_z_loss"][0], 0.25 * metric(state, "router_z_loss"))
    assert set(state[MOE_METRICS_COLLECTION]) >= {
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
    layer = MoeLayer(replace(SMALL, capacity=replace(SMALL.capacity, dropless=True, group_size=64)))
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
    capacity = replace(SMALL.capacity, train_capacity_factor=0.5, eval_capacity_factor=2.0)
    layer = MoeLayer(replace(SMALL, capacity=capacity))
    x = make_inputs()
    params = init_params(layer, x)
    _, train = apply(layer, params, x, deterministic=False)
    _, evaluation = apply(layer, params, x, deterministic=True)
    # group 16 tokens, E=4: capacity 2 in training (32 assignments, 8 slots), 8 in eval.
    assert float(metric(train, "dropped_fraction")) >= 0.75
    assert float(metric(evaluation, "dropped_fraction")) < float(metric(train, "dropped_fraction"))


def test_dropped_tokens_get_zero_output():
    layer = MoeLayer(
        replace(
            SMALL,
            router=TopKRouterConfig(num_selected_experts=1),
            capacity=replace(SMALL.capacity, eval_capacity_factor=0.25),
        )
    )
    x = make_inputs(1, 16)
    params = init_params(layer, x)
    y, state = apply(layer, params, x)
    zero_rows = int(jnp.sum(jnp.all(y == 0, axis=-1)))
    assert zero_rows == 16 - 4  # capacity round(0.25 * 16 / 4) = 1 per expert
    np.testing.assert_allclose(metric(state, "dropped_fraction"), zero_rows / 16)


def test_expert_dropout_only_in_training():
    capacity = replace(SMALL.capacity, eval_capacity_factor=2.0, train_capacity_factor=2.0)
    layer = MoeLayer(replace(SMALL, expert_dropout_rate=0.5, capacity=capacity))
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
    layer = MoeLayer(replace(SMALL, activation=activation))
    x = make_inputs()
    y, _ = apply(layer, init_params(layer, x), x)
    assert bool(jnp.all(jnp.isfinite(y))) and float(jnp.std(y)) > 0


@pytest.mark.parametrize(
    "build,option",
    [
        (lambda: TopKRouterConfig(num_selected_experts=0), "num_selected_experts"),
        (
            lambda: replace(SMALL, router=TopKRouterConfig(num_selected_experts=5)),
            "num_selected_experts",
        ),
        (lambda: CapacityConfig(train_capacity_factor=0.0), "train_capacity_factor"),
        (lambda: CapacityConfig(eval_capacity_factor=-1.0), "eval_capacity_factor"),
        (lambda: CapacityConfig(capacity_rule="gshard"), "capacity_rule"),
        (lambda: CapacityConfig(capacity_order="by_token"), "capacity_order"),
        (lambda: CapacityConfig(group_size=0), "group_size"),
        (lambda: ExecutionConfig(dispatch="fast"), "dispatch"),
        (lambda: replace(SMALL, activation="swish"), "activation"),
        (
            lambda: replace(
                SMALL,
                router=ExpertChoiceRouterConfig(),
                capacity=replace(SMALL.capacity, dropless=True),
            ),
            "dropless",
        ),
        (lambda: from_dict({**SMALL.to_dict(), "router": {"type": "nope"}}), "router type"),
    ],
)
def test_bad_options_are_refused_by_name_when_the_config_is_built(build, option):
    with pytest.raises(ValueError, match=option):
        build()


@pytest.mark.parametrize(
    "config,causal,option",
    [
        (
            replace(
                SMALL,
                capacity=replace(SMALL.capacity, min_expert_capacity=0, eval_capacity_factor=0.01),
            ),
            False,
            "capacity",
        ),
        (replace(SMALL, router=ExpertChoiceRouterConfig()), True, "accept_causal_leak"),
        (
            replace(SMALL, router=TopKRouterConfig(batch_prioritized_routing=True)),
            True,
            "accept_causal_leak",
        ),
        (
            replace(SMALL, capacity=replace(SMALL.capacity, capacity_order="choice_major")),
            True,
            "accept_causal_leak",
        ),
        (replace(SMALL, router=HashRouterConfig()), False, "token_ids"),
    ],
)
def test_what_the_inputs_or_the_model_decide_is_refused_by_name_when_traced(config, causal, option):
    with pytest.raises(ValueError, match=option):
        MoeLayer(config, causal=causal).init(jax.random.PRNGKey(0), make_inputs())


# Futures of make_inputs(): only the last token of sequence 0 differs (zeroed, scaled, redrawn).
def _futures(x: jax.Array) -> list[jax.Array]:
    return [
        x.at[0, -1].set(v)
        for v in (jnp.zeros_like(x[0, -1]), -50.0 * x[0, -1], *make_inputs(1, 4, seed=7)[0])
    ]


def _earlier_outputs_change(layer: MoeLayer) -> list[bool]:
    """Per future: whether any earlier output of sequence 0 differs at all (bitwise) from
    the layer's output on make_inputs()."""
    x = make_inputs()
    params = init_params(layer, x)
    run = jax.jit(lambda inputs: layer.apply({"params": params}, inputs))  # one compile
    y = run(x)
    return [not np.array_equal(y[0, :-1], run(f)[0, :-1]) for f in _futures(x)]


def test_causal_leak_can_be_accepted_explicitly():
    """Accepted, expert choice lets a later token change earlier tokens' outputs (it takes
    or frees their expert slots); so does top-2 with capacity granted choice-major (T5X's
    order: a later token's first choice evicts an earlier token's second choice)."""
    expert_choice = replace(SMALL, router=ExpertChoiceRouterConfig(), accept_causal_leak=True)
    assert any(_earlier_outputs_change(MoeLayer(expert_choice, causal=True)))
    choice_major = replace(
        SMALL,
        capacity=replace(SMALL.capacity, capacity_order="choice_major"),
        accept_causal_leak=True,
    )
    assert any(_earlier_outputs_change(MoeLayer(choice_major, causal=True)))


@pytest.mark.parametrize("dispatch", ["einsum", "sort"])
@pytest.mark.parametrize(
    "config",
    [
        SMALL,  # top-2 with capacity: token-major capacity by default in a causal layer
        replace(SMALL, router=TopKRouterConfig(num_selected_experts=1)),
        replace(SMALL, capacity=replace(SMALL.capacity, dropless=True)),
        replace(
            SMALL,
            router=HierarchicalRouterConfig(
                num_expert_groups=2, num_selected_groups=2, num_selected_experts=1
            ),
        ),
    ],
    ids=["top_2", "top_1", "dropless", "hierarchical"],
)
def test_causal_layers_never_read_later_tokens(dispatch, config):
    """Earlier outputs are bit-identical whatever the last token is; the same futures do
    change them under choice-major capacity (the first case), so the check can fail."""
    config = replace(config, execution=ExecutionConfig(dispatch=dispatch))
    assert not any(_earlier_outputs_change(MoeLayer(config, causal=True)))


def test_encoder_keeps_t5x_choice_major_capacity():
    """Not causal: T5X's order (every first choice before any second choice, see
    tests/moe/test_dispatch.py for the order itself); causal: token-major. At this tight
    capacity the two orders drop different assignments."""
    x = make_inputs()
    tight = replace(SMALL, capacity=replace(SMALL.capacity, eval_capacity_factor=0.75))
    params = init_params(MoeLayer(tight), x)

    def outputs(capacity_order: str = "auto", causal: bool = False) -> np.ndarray:
        config = replace(tight, capacity=replace(tight.capacity, capacity_order=capacity_order))
        return np.asarray(apply(MoeLayer(config, causal=causal), params, x)[0])

    choice_major, token_major = outputs("choice_major"), outputs("token_major")
    assert not np.array_equal(choice_major, token_major)
    np.testing.assert_array_equal(outputs(), choice_major)
    np.testing.assert_array_equal(outputs(causal=True), token_major)


def test_per_unit_balancing_penalises_units_that_are_each_unbalanced():
    # two groups of 4 tokens: group 0 all on expert 0, group 1 all on expert 1
    probs = jnp.zeros((2, 4, 4)).at[0, :, 0].set(1.0).at[1, :, 1].set(1.0)
    mask = jnp.ones((2, 4))
    # over the batch the load is half and half: E * (0.5 * 0.5 + 0.5 * 0.5) = 2
    np.testing.assert_allclose(moe_losses.load_balancing_loss(probs, probs, mask), 2.0)
    # each group sends everything to one expert: E * 1 * 1 = 4
    np.testing.assert_allclose(moe_losses.load_balancing_loss_per_unit(probs, probs, mask), 4.0)
    # a unit without real tokens is left out of the mean
    empty = jnp.ones((2, 4)).at[1].set(0.0)
    np.testing.assert_allclose(moe_losses.load_balancing_loss_per_unit(probs, probs, empty), 4.0)


@pytest.mark.parametrize("scope", ["batch", "group", "sequence"])
def test_balance_scope_sets_the_tokens_the_balancing_loss_measures(scope):
    from moe_jax.moe.collections import ROUTING_COLLECTION

    layer = MoeLayer(replace(SMALL, losses=AuxLossConfig(balance_scope=scope)))
    x = make_inputs(3, 8)  # 24 tokens: 2 groups of 16 (the second padded), 3 rows of 8
    mask = jnp.ones((3, 8)).at[2, 5:].set(0)
    params = init_params(layer, x)
    fn = jax.jit(
        lambda p, x, m: layer.apply(
            {"params": p}, x, padding_mask=m, mutable=[MOE_METRICS_COLLECTION, ROUTING_COLLECTION]
        )
    )
    _, state = fn(params, x, mask)
    routing = {k: v[0] for k, v in state[ROUTING_COLLECTION].items()}
    probs, index = routing["router_probs"], routing["expert_index"]
    assigned = jax.nn.one_hot(index, 4).sum(-2)  # [3, 8, 4]; padding (index 4) -> none
    if scope == "sequence":  # the rows of the batch
        expected = moe_losses.load_balancing_loss_per_unit(probs, assigned, mask)
    else:  # the layer's 2 groups of 16 tokens (the second: 8 slots of padding)
        grouped = [
            jnp.concatenate([a.reshape(24, *a.shape[2:]), jnp.zeros((8, *a.shape[2:]))]).reshape(
                2, 16, *a.shape[2:]
            )
            for a in (probs, assigned, mask)
        ]
        per_unit = moe_losses.load_balancing_loss_per_unit
        expected = (per_unit if scope == "group" else moe_losses.load_balancing_loss)(*grouped)
    loss = metric(state, "load_balancing_loss")
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    whole = moe_losses.load_balancing_loss(probs, assigned, mask)  # every token at once
    assert np.isclose(loss, whole, rtol=1e-5) == (scope == "batch")


def test_bad_balance_scope_is_refused_by_name():
    with pytest.raises(ValueError, match=r"AuxLossConfig\.balance_scope"):
        AuxLossConfig(balance_scope="tokens")
