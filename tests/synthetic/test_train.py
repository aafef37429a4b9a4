"""The training loop: frozen routers, and the paper's qualitative results on small runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
        cfg = train.TrainConfig(
            steps=50,
            chunk=50,
            batch_size=32,
            optimizer=optimizer,
            router_mode="frozen",
            weight_decay=1e-2,
        )
        out = train.train_runs(model, cfg, runs, tr, init)
        np.testing.assert_array_equal(
            np.asarray(out["router"]["w"]), np.asarray(init["router"]["w"])
        )
        assert not np.allclose(out["experts"]["layers"][0]["w"], init["experts"]["layers"][0]["w"])


def test_learned_router_beats_frozen_with_depth3_experts_and_is_sparser_than_shuffled():
    k = 8
    _, tr, te = _mixture(k, 8, 1024, 1024)
    runs, _ = train.grid([0, 1], [1024], [k])
    model = models.MoE("linear", "mlp", k, 8, 10, expert_hidden=32)
    results = {}
    for mode in ("learned", "frozen"):
        cfg = train.TrainConfig(
            steps=600,
            chunk=300,
            batch_size=128,
            optimizer="sgd",
            lr_router=1e-1,
            lr_experts=1e-2,
            router_mode=mode,
        )
        params = train.train_runs(model, cfg, runs, tr)
        results[mode] = train.evaluate_runs(model, params, runs, te, k)
    assert np.all(results["learned"]["loss"] < results["frozen"]["loss"]), results
    assert np.all(
        results["learned"]["sparsity"] < 0.75 * results["learned"]["shuffled_sparsity"]
    ), results["learned"]
    assert np.all(results["learned"]["sparsity"] < results["frozen"]["sparsity"])


def test_router_weight_moves_into_the_signal_subspace():
    k, d, ds = 8, 60, 6
    _, tr, _ = _mixture(k, d, 2048, 16, d_signal=ds)
    runs, _ = train.grid([0, 1], [2048], [k])
    model = models.MoE("linear", "constant", k, d, 10)
    init = train.init_runs(model, runs, tr)
    ratio = jax.vmap(lambda p: metrics.subspace_weight_fraction(p["router"]["w"], ds))
    cfg = train.TrainConfig(
        steps=500, chunk=500, batch_size=128, lr_router=3.2e-3, lr_experts=3.2e-3, weight_decay=1e-3
    )
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


def test_convergence_criterion_on_hand_made_histories():
    flat = np.array([[1.0, 0.5, 0.30, 0.30, 0.30, 0.30]])  # last 2 chunks equal the 2 before
    falling = np.array([[1.0, 0.8, 0.6, 0.4, 0.2, 0.1]])
    rising = np.array([[0.1, 0.1, 0.1, 0.1, 0.2, 0.3]])
    assert train.converged(flat, 2, 1e-3).tolist() == [True]
    assert train.converged(falling, 2, 1e-3).tolist() == [False]
    assert train.converged(rising, 2, 1e-3).tolist() == [False]  # a rising loss is a change too
    assert train.converged(flat[:, :3], 2, 1e-3).tolist() == [False]  # needs 2 windows of history
    assert train.converged(falling, 2, 1e-3, atol=0.15).tolist() == [True]  # or a loss floor
    both = train.converged(np.concatenate([flat, falling]), 2, 0.05)
    assert both.tolist() == [True, False]


def test_convergence_stops_a_solved_run_but_not_an_unsolved_one():
    """Linear regression y = x . w* (known optimum w*, zero loss), two runs in one jit: full-batch
    GD at lr 0.1 reaches w* and stops before the step cap; at lr 1e-4 the loss is still
    falling at the cap, and the criterion does not stop it."""
    d = 4
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (2, 64, d))
    w_star = jnp.arange(1.0, d + 1.0)
    tr = data.Batch(x, (x @ w_star)[..., None], jnp.zeros((2, 64), jnp.int32))
    runs, _ = train.grid([0, 1], [64], [1])
    model = models.Dense(d, 1, 1, 1)  # linear: y = x w + b
    cfg = train.TrainConfig(
        steps=2000,
        chunk=50,
        batch_size=None,
        optimizer="sgd",
        momentum=0.0,
        lr_experts=0.1,
        converge_window=100,
        converge_rtol=1e-3,
        converge_atol=1e-8,
    )
    log = train.TrainLog()
    params = train.train_runs(model, cfg, runs, tr, log=log)
    w = np.asarray(params["experts"]["layers"][0]["w"])[..., 0]  # [R, d]
    np.testing.assert_allclose(w, np.broadcast_to(w_star, w.shape), atol=1e-3)  # both solved it
    assert log.converged.all() and (log.steps < 2000).all()

    slow = train.TrainConfig(
        steps=400,
        chunk=50,
        batch_size=None,
        optimizer="sgd",
        momentum=0.0,
        lr_experts=1e-4,
        converge_window=100,
        converge_rtol=1e-3,
    )
    slow_log = train.TrainLog()
    train.train_runs(model, slow, runs, tr, log=slow_log)
    assert not slow_log.converged.any() and (slow_log.steps == 400).all()  # still falling: no stop
    assert np.all(np.diff(slow_log.train_loss, axis=1) < 0)


def test_a_stopped_run_keeps_its_params_while_the_others_train():
    d = 3
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, d))
    # run 0: y = 0 (solved at init)
    y = jnp.stack([jnp.zeros((32, 1)), (x[1] @ jnp.ones(d))[:, None]])
    tr = data.Batch(x, y, jnp.zeros((2, 32), jnp.int32))
    runs, _ = train.grid([0, 1], [32], [1])
    model = models.Dense(d, 1, 1, 1)
    init = jax.tree.map(jnp.zeros_like, train.init_runs(model, runs, tr))
    cfg = train.TrainConfig(
        steps=300,
        chunk=50,
        batch_size=None,
        optimizer="sgd",
        momentum=0.0,
        lr_experts=0.05,
        converge_window=50,
        converge_rtol=1e-3,
        converge_atol=1e-10,
    )
    log = train.TrainLog()
    params = train.train_runs(model, cfg, runs, tr, init, log=log)
    assert log.steps[0] == 50 and log.steps[1] > 50  # run 0 stops at its first chunk (loss 0)
    np.testing.assert_array_equal(np.asarray(params["experts"]["layers"][0]["w"][0]), 0.0)
    assert np.abs(np.asarray(params["experts"]["layers"][0]["w"][1])).min() > 0.5
