"""The training loop: frozen routers, and the paper's qualitative results on small runs."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from moe_jax.synthetic import data, metrics, models, train
from moe_jax.synthetic.experiments import common


def _mixture(k, d, n_train, n_test, seeds=(0, 1), **kw):
    make = functools.partial(data.make_gaussian_mixture, k=k, d=d, **kw)
    return common.seed_datasets(make, data.sample_gaussian_mixture, list(seeds), n_train, n_test)


def test_frozen_router_is_bit_identical_after_training_and_experts_move():
    _, tr, _ = _mixture(4, 6, 256, 16)
    runs, _ = train.grid([0, 1], [256], [4])
    model = models.MoE("linear", "mlp", 4, 6, 10, expert_hidden=8)
    init = train.init_runs(model, runs, tr)
    for optimizer in ("adam", "sgd"):
        cfg = train.TrainConfig(steps=50, chunk=50, batch_size=32, optimizer=optimizer, router_mode="frozen", weight_decay=1e-2)
        out = train.train_runs(model, cfg, runs, tr, init)
        np.testing.assert_array_equal(np.asarray(out["router"]["w"]), np.asarray(init["router"]["w"]))
        assert not np.allclose(out["experts"]["layers"][0]["w"], init["experts"]["layers"][0]["w"])


def test_learned_router_beats_frozen_with_depth3_experts_and_is_sparser_than_shuffled():
    k = 8
    _, tr, te = _mixture(k, 8, 1024, 1024)
    runs, _ = train.grid([0, 1], [1024], [k])
    model = models.MoE("linear", "mlp", k, 8, 10, expert_hidden=32)
    results = {}
    for mode in ("learned", "frozen"):
        cfg = train.TrainConfig(steps=600, chunk=300, batch_size=128, optimizer="sgd", lr_router=1e-1, lr_experts=1e-2, router_mode=mode)
        params = train.train_runs(model, cfg, runs, tr)
        results[mode] = train.evaluate_runs(model, params, runs, te, k)
    assert np.all(results["learned"]["loss"] < results["frozen"]["loss"]), results
    assert np.all(results["learned"]["sparsity"] < 0.75 * results["learned"]["shuffled_sparsity"]), results["learned"]
    assert np.all(results["learned"]["sparsity"] < results["frozen"]["sparsity"])


def test_router_weight_moves_into_the_signal_subspace():
    k, d, ds = 8, 60, 6
    _, tr, _ = _mixture(k, d, 2048, 16, d_signal=ds)
    runs, _ = train.grid([0, 1], [2048], [k])
    model = models.MoE("linear", "constant", k, d, 10)
    init = train.init_runs(model, runs, tr)
    ratio = jax.vmap(lambda p: metrics.subspace_weight_fraction(p["router"]["w"], ds))
    cfg = train.TrainConfig(steps=500, chunk=500, batch_size=128, lr_router=3.2e-3, lr_experts=3.2e-3, weight_decay=1e-3)
    final = train.train_runs(model, cfg, runs, tr, init)
    before, after = np.asarray(ratio(init)), np.asarray(ratio(final))
    assert np.all(before < 0.2)
    assert np.all(after > 0.5) and np.all(after > 3 * before)


def test_sweeps_over_expert_counts_mask_experts():
    model = models.MoE("linear", "constant", 6, 3, 2)
    params = model.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (20, 3))
    _, probs = model.apply(params, x, expert_count=2)
    np.testing.assert_array_equal(probs[:, 2:], 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_dense_baseline_matches_a_parameter_budget_and_bad_options_are_named():
    dense = models.Dense.matching(10_000, 16, 10, 4)
    n = models.count_params(dense.init(jax.random.PRNGKey(0)))
    assert abs(n - 10_000) / 10_000 < 0.05
    with pytest.raises(ValueError, match="router"):
        models.MoE("attention", "mlp", 4, 4, 1)
    with pytest.raises(ValueError, match="optimizer"):
        train.TrainConfig(steps=10, optimizer="rmsprop")


def test_cnn_router_feeds_its_features_to_the_experts():
    model = models.MoE("cnn", "mlp", 5, 3, 1, expert_hidden=8, cnn_channels=(4,), cnn_features=6)
    params = model.init(jax.random.PRNGKey(0))
    images = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 3))
    v = jax.random.normal(jax.random.PRNGKey(2), (2, 3))
    pred, probs = model.apply(params, (images, v), top1=True)
    assert pred.shape == (2, 1) and probs.shape == (2, 5)
    assert params["experts"]["layers"][0]["w"].shape == (5, 3 + 6, 8)
