"""Counterfactual routers (`moe-jax eval --router`) on one MoE layer, and the sown gate margin."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.analysis import counterfactual
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder
from moe_jax.moe import MoeLayer
from moe_jax.moe.collections import MOE_METRICS_COLLECTION, ROUTING_COLLECTION
from moe_jax.moe.routers import HashRouter, TopKRouter
from moe_jax.runtime.run_dir import RunDir
from tests.models.conftest import tiny_config
from tests.moe.moe_testlib import SMALL, init_params, make_inputs


def _routing(layer, params, x, interceptor=None, **kwargs):
    fn = counterfactual.intercepted(
        lambda p, x: layer.apply(
            {"params": p}, x, mutable=[MOE_METRICS_COLLECTION, ROUTING_COLLECTION], **kwargs
        ),
        interceptor,
    )
    return jax.jit(fn)(params, x)


def test_shuffled_changes_router_outputs_but_not_expert_weights():
    layer = MoeLayer(SMALL)
    x = make_inputs(2, 8)
    params = init_params(layer, x)
    shuffled = counterfactual.shuffle_router_inputs(params, seed=3)
    w, w_shuffled = params["router"]["weights"]["w"], shuffled["router"]["weights"]["w"]
    assert not np.array_equal(w, w_shuffled)
    # the same entries, each input row moved whole: a permutation of the rows
    np.testing.assert_array_equal(np.sort(np.asarray(w), 0), np.sort(np.asarray(w_shuffled), 0))
    assert sorted(map(tuple, np.asarray(w).tolist())) == sorted(
        map(tuple, np.asarray(w_shuffled).tolist())
    )
    for a, b in zip(
        jax.tree.leaves(params["expert"]), jax.tree.leaves(shuffled["expert"]), strict=True
    ):
        assert a is b
    (_, plain), (_, other) = _routing(layer, params, x), _routing(layer, shuffled, x)
    assert not np.allclose(
        plain[ROUTING_COLLECTION]["router_probs"][0], other[ROUTING_COLLECTION]["router_probs"][0]
    )


def test_random_and_init_replace_only_router_weights(tmp_path):
    layer = MoeLayer(SMALL)
    x = make_inputs(2, 8)
    params = init_params(layer, x)
    fresh = counterfactual.random_routers(params, seed=1, stddev=0.5)
    assert np.std(np.asarray(fresh["router"]["weights"]["w"])) > 0.2  # drawn with the given stddev
    assert fresh["expert"] is not params["expert"] or all(
        a is b
        for a, b in zip(
            jax.tree.leaves(params["expert"]), jax.tree.leaves(fresh["expert"]), strict=True
        )
    )
    model = EncoderDecoderModel(EncoderDecoder(tiny_config()))  # unrolled: params as they are
    with pytest.raises(ValueError, match="saved no initial router"):
        counterfactual.variant("init", model, params, RunDir(tmp_path))
    with pytest.raises(
        ValueError, match="valid routers: learned, init, random, hash, uniform, shuffled"
    ):
        counterfactual.variant("best", model, params, RunDir(tmp_path))
    same, interceptor = counterfactual.variant("learned", model, params, RunDir(tmp_path))
    assert same is params and interceptor is None


def _router_outputs(interceptor):
    router = TopKRouter(num_experts=4, num_selected_experts=2)
    x = make_inputs(2, 8)
    mask = jnp.ones((2, 8)).at[1, 6:].set(0)
    ids = jnp.arange(16).reshape(2, 8) * 7
    params = router.init(jax.random.PRNGKey(0), x, mask, ids, 8, True)
    learned = router.apply(params, x, mask, ids, 8, True)
    with nn.intercept_methods(interceptor):
        replaced = router.apply(params, x, mask, ids, 8, True)
    return learned, replaced, (x, mask, ids)


def test_uniform_splits_the_gate_mass_equally_over_the_same_experts():
    learned, uniform, (_, mask, _) = _router_outputs(counterfactual.uniform_gates)
    np.testing.assert_array_equal(uniform.routing.expert_index, learned.routing.expert_index)
    w = np.asarray(uniform.routing.combine_weights)
    np.testing.assert_allclose(w[..., 0], w[..., 1])
    np.testing.assert_allclose(
        w.sum(-1), np.asarray(learned.routing.combine_weights).sum(-1), rtol=1e-6
    )
    assert (w[np.asarray(mask) == 0] == 0).all()
    np.testing.assert_allclose(np.asarray(uniform.gates).sum(-1), w.sum(-1), rtol=1e-6)


def test_hash_routes_by_token_id_with_the_learned_gates():
    learned, hashed, (x, mask, ids) = _router_outputs(counterfactual.hash_routing(seed=0))
    reference = HashRouter(num_experts=4, num_selected_experts=2).apply({}, x, mask, ids, 8, True)
    np.testing.assert_array_equal(hashed.routing.expert_index, reference.routing.expert_index)
    np.testing.assert_array_equal(hashed.routing.combine_weights, learned.routing.combine_weights)
    assert not np.array_equal(hashed.routing.expert_index, learned.routing.expert_index)


def test_gate_margin_is_top1_minus_top2_probability():
    layer = MoeLayer(SMALL)
    x = make_inputs(2, 8) * 10.0
    params = init_params(layer, x)
    mask = jnp.ones((2, 8)).at[1, 5:].set(0)
    _, state = _routing(layer, params, x, padding_mask=mask)
    probs = np.sort(np.asarray(state[ROUTING_COLLECTION]["router_probs"][0]), -1)
    real = np.asarray(mask) > 0
    expected = (probs[..., -1] - probs[..., -2])[real].mean()
    np.testing.assert_allclose(state[MOE_METRICS_COLLECTION]["gate_margin"][0], expected, rtol=1e-5)


def test_seed_table_averages_a_familys_seeds_per_router():
    """``FAMILY_seedN:ROUTER`` results: mean and sample std over the seeds, the change from
    the same seed's learned router, dead experts summed over layers; a family with one seed
    gets no row."""
    from moe_jax.commands.evaluate import seed_table

    def result(entropy, dead):
        routing = {
            "encoder/layers_1": {"dead_experts": dead, "dropped_fraction": 0.1},
            "decoder/layers_1": {"dead_experts": 1, "dropped_fraction": 0.3},
        }
        return {"metrics": {"cross_entropy": entropy, "accuracy": 0.5}, "routing": routing}

    results = {
        "learned_seed0:learned": result(5.0, 0),
        "learned_seed0:init": result(5.1, 4),
        "learned_seed1:learned": result(6.0, 0),
        "learned_seed1:init": result(6.3, 8),
        "frozen_seed0:learned": result(5.5, 2),
    }
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): line
        for line in seed_table(results).splitlines()[2:]
    }
    assert set(rows) == {("learned", "learned"), ("learned", "init")}
    # cross-entropy 5.1 / 6.3 -> 5.7 +- 0.8485; change from learned 0.1 / 0.3 -> 0.2 +- 0.1414
    assert "5.7000 +- 0.8485 | 0.2000 +- 0.1414" in rows[("learned", "init")]
    # (4+1, 8+1) dead; dropped
    assert "| 7.0000 +- 2.8284 | 0.2000 +- 0.0000 |" in rows[("learned", "init")]
    assert seed_table({"learned_seed0": result(5.0, 0)}) == ""
