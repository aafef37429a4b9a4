"""Every gin file of gin/routers parses, builds a working layer, and does what its comment
says: each file is checked for its own effect on the routing (experts per token, gates
that sum to 1, routing by token id, noise only in training, shared experts, a balancing
bias that moves, frozen routers). A router file without a check here fails."""

from __future__ import annotations

import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.models.t5 import T5Config
from moe_jax.moe import MoeConfig, MoeLayer
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    BIAS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTING_COLLECTION,
)
from moe_jax.runtime import configured
from tests.moe.moe_testlib import MODEL_FILE_REFERENCES, make_inputs

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin" / "routers"
IDS = jnp.arange(32).reshape(4, 8)


def _layer(path: pathlib.Path) -> tuple[MoeLayer, dict[str, str]]:
    """The layer ``path`` configures (4 experts; groups of 16 tokens, capacity for all of
    them, so no check depends on dropped tokens) and the router and bias modes it sets."""
    gin.clear_config()
    try:
        gin.add_config_file_search_path(str(GIN_DIR.parents[1]))  # files that include others
        # the references the model files bind (T5Config.moe, MoeConfig's parts)
        gin.parse_config([f"{name} = {ref}" for name, ref in MODEL_FILE_REFERENCES.items()])
        gin.parse_config_file(str(path))
        modes = {"router": configured.router_mode(), "bias": configured.bias_mode()}
        for name, value in (
            ("MoeConfig.num_experts", 4),
            ("MoeConfig.d_ff", 16),
            ("CapacityConfig.group_size", 16),
            ("CapacityConfig.min_expert_capacity", 16),
        ):
            gin.bind_parameter(name, value)
        # the decoder's MoE config of a model with these bindings (the encoder's unless the
        # file gives the decoder its own)
        modes["decoder"] = T5Config(
            num_encoder_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1
        ).moe_config("decoder")
        return MoeLayer(MoeConfig()), modes
    finally:
        gin.clear_config()


def _apply(layer: MoeLayer, variables, x, *, train: bool = False, seed: int = 0, ids=IDS):
    """``(y, mutated collections)`` with the per-token routing sown."""
    collections = [c for c in variables if c != "params"]
    return layer.apply(
        variables,
        x,
        token_ids=ids,
        deterministic=not train,
        rngs={"dropout": jax.random.PRNGKey(seed)},
        mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION, ROUTING_COLLECTION, *collections],
    )


def _routing(state) -> np.ndarray:
    return np.asarray(state[ROUTING_COLLECTION]["expert_index"][0])


def _with(variables, name: str, fn):
    """``variables`` with every parameter whose path holds ``name`` replaced by ``fn(leaf)``."""

    def replace(path, leaf):
        return fn(leaf) if name in jax.tree_util.keystr(path) else leaf

    return {**variables, "params": jax.tree_util.tree_map_with_path(replace, variables["params"])}


def experts_per_token(expected: int):
    def check(layer, variables, x):
        assert _routing(_apply(layer, variables, x)[1]).shape[-1] == expected

    return check


def gates_sum_to_one(layer, variables, x):
    """With every expert the same MLP, a token's output is (sum of its gates) x that MLP: it
    does not depend on the router when the gates sum to 1."""
    same = _with(variables, "expert", lambda w: jnp.broadcast_to(w[:1], w.shape))
    y1 = _apply(layer, same, x)[0]
    y2 = _apply(
        layer,
        _with(same, "router", lambda w: w + jax.random.normal(jax.random.PRNGKey(7), w.shape)),
        x,
    )[0]
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)


def gates_do_not_sum_to_one(layer, variables, x):
    """The contrast: plain top-k softmax gates sum to less than 1, so the same identical
    experts give outputs that move with the router."""
    with pytest.raises(AssertionError):
        gates_sum_to_one(layer, variables, x)


def routes_by_token_id(layer, variables, x):
    other = make_inputs(seed=5)
    assert np.array_equal(
        _routing(_apply(layer, variables, x)[1]), _routing(_apply(layer, variables, other)[1])
    )
    assert not np.array_equal(
        _routing(_apply(layer, variables, x)[1]),
        _routing(_apply(layer, variables, x, ids=IDS + 1)[1]),
    )


def noise_only_in_training(layer, variables, x):
    a, b = (_routing(_apply(layer, variables, x, train=True, seed=s)[1]) for s in (0, 1))
    assert not np.array_equal(a, b)
    assert np.array_equal(
        _routing(_apply(layer, variables, x)[1]), _routing(_apply(layer, variables, x, seed=1)[1])
    )


def each_expert_takes_its_capacity(layer, variables, x):
    """Expert choice: every expert picks the same number of tokens."""
    load = np.asarray(_apply(layer, variables, x)[1][MOE_METRICS_COLLECTION]["expert_load"][0])
    np.testing.assert_allclose(load, load[0], rtol=1e-6)


def shared_expert_adds_to_the_output(layer, variables, x):
    assert any(
        "shared_expert" in jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(variables["params"])
    )
    y = _apply(layer, variables, x)[0]
    assert not np.allclose(
        y, _apply(layer, _with(variables, "shared_expert", jnp.zeros_like), x)[0]
    )


def bias_moves_in_training(layer, variables, x):
    before = variables[BIAS_COLLECTION]
    after = _apply(layer, variables, x, train=True)[1][BIAS_COLLECTION]
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )


def expert_count(count: int):
    def check(layer, variables, x):
        shapes = [
            leaf.shape[0]
            for p, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
            if "'expert'" in jax.tree_util.keystr(p)
        ]
        assert shapes and set(shapes) == {count}

    return check


def modes(**expected: str):
    """The freeze modes the file sets (``router``: learned / frozen; ``bias``: updated / frozen)."""

    def check(layer, variables, x, actual=None):
        assert {k: actual[k] for k in expected} == expected

    check.wants_mode = True
    return check


def decoder_routes_by_token_id(layer, variables, x, actual=None):
    """The encoder keeps its top-2 router; the decoder's layers route by hash, top-1."""
    decoder = MoeLayer(actual["decoder"], causal=True)
    assert (layer.config.router_type, decoder.config.router_type) == ("top_k", "hash")
    decoder_variables = nn.unbox(decoder.init(jax.random.PRNGKey(1), x, token_ids=IDS))
    experts_per_token(1)(decoder, decoder_variables, x)
    routes_by_token_id(decoder, decoder_variables, x)


decoder_routes_by_token_id.wants_mode = True


CHECKS = {
    "top2.gin": [experts_per_token(2), gates_do_not_sum_to_one],
    "switch.gin": [experts_per_token(1)],
    "renormalized.gin": [gates_sum_to_one],
    "sigmoid.gin": [gates_sum_to_one],
    "mixtral.gin": [experts_per_token(2), gates_sum_to_one],
    "hash.gin": [experts_per_token(1), routes_by_token_id],
    "hash_decoder.gin": [experts_per_token(2), decoder_routes_by_token_id],
    "random.gin": [experts_per_token(2)],
    "noisy_topk.gin": [experts_per_token(2), noise_only_in_training],
    "expert_choice.gin": [each_expert_takes_its_capacity],
    "hierarchical.gin": [experts_per_token(2)],
    "fine_grained.gin": [expert_count(16), experts_per_token(8)],
    "shared_experts.gin": [experts_per_token(1), shared_expert_adds_to_the_output],
    "aux_free_bias.gin": [bias_moves_in_training],
    "group_limited.gin": [experts_per_token(2)],
    "deepseek_v3.gin": [
        experts_per_token(2),
        shared_expert_adds_to_the_output,
        bias_moves_in_training,
    ],
    "learned.gin": [modes(router="learned", bias="updated")],
    "frozen.gin": [modes(router="frozen", bias="updated")],
    "frozen_bias.gin": [modes(router="learned", bias="frozen")],
}


def test_every_router_file_has_a_check():
    assert sorted(CHECKS) == sorted(p.name for p in GIN_DIR.glob("*.gin"))


@pytest.mark.parametrize("path", sorted(GIN_DIR.glob("*.gin")), ids=lambda p: p.name)
def test_gin_file_builds_a_layer_that_does_what_it_says(path):
    layer, mode = _layer(path)
    x = make_inputs()
    variables = nn.unbox(layer.init(jax.random.PRNGKey(1), x, token_ids=IDS))
    y, state = _apply(layer, variables, x, train=True)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    assert "expert_load" in state[MOE_METRICS_COLLECTION]
    for check in CHECKS[path.name]:
        if getattr(check, "wants_mode", False):
            check(layer, variables, x, actual=mode)
        else:
            check(layer, variables, x)
