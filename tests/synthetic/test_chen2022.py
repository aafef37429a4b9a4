"""Chen et al. 2022's mixture of classification: the data, dispatch entropy, the models and
a small run in which the cubic MoE learns the clusters."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.synthetic import data, metrics, train
from moe_jax.synthetic.experiments import chen2022


def _decompose(task: data.PatchMixture, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coefficients of every patch on the features ``[n, P, K]`` and centres ``[n, P, K]``,
    and the norm of what lies outside their span ``[n, P]``."""
    basis = np.concatenate([np.asarray(task.features), np.asarray(task.centres)])  # [2K, d]
    coef = x @ basis.T
    residual = np.linalg.norm(x - coef @ basis, axis=-1)
    k = task.features.shape[0]
    return coef[..., :k], coef[..., k:], residual


def test_every_example_has_one_signal_one_centre_one_feature_noise_and_gaussian_rest():
    k, d, p, n, scale = 4, 20, 5, 2000, 3.0
    task = data.make_patch_mixture(
        jax.random.PRNGKey(0),
        k,
        d,
        num_patches=p,
        alpha=(0.5, 2.0),
        beta=(1.0, 2.0),
        gamma=(0.5, 3.0),
        sigma_p=1.5,
        scale=scale,
    )
    basis = jnp.concatenate([task.features, task.centres])
    np.testing.assert_allclose(basis @ basis.T, np.eye(2 * k), atol=1e-5)  # orthonormal signals
    batch = data.sample_patch_mixture(task, jax.random.PRNGKey(1), n)
    x, y, cluster = np.asarray(batch.x), np.asarray(batch.y[:, 0]), np.asarray(batch.cluster)
    assert (
        x.shape == (n, p, d)
        and set(np.unique(y)) == {-1.0, 1.0}
        and set(np.unique(cluster)) == set(range(k))
    )
    feat, cent, residual = _decompose(task, x)
    rows = np.arange(n)

    structured = residual < 1e-4  # signal patches lie exactly in the span of the signals
    assert np.all(structured.sum(axis=1) == 3)

    feat, cent = (
        np.where(structured[..., None], feat, 0.0),
        np.where(structured[..., None], cent, 0.0),
    )
    own = np.abs(feat[rows, :, cluster]) > 1e-4  # [n, P]: patches along the example's own v_k
    assert np.all(own.sum(axis=1) == 1)
    signal = feat[rows, own.argmax(axis=1), cluster] / scale  # = alpha * y
    assert np.all(np.sign(signal) == y) and np.all(
        (np.abs(signal) >= 0.5 - 1e-4) & (np.abs(signal) <= 2.0 + 1e-4)
    )

    centre_hits = np.abs(cent) > 1e-4  # [n, P, K]
    assert np.all(centre_hits.sum(axis=(1, 2)) == 1)  # exactly one centre patch ...
    assert np.all(centre_hits[rows, :, cluster].sum(axis=1) == 1)  # ... and it is c_k
    beta = cent[rows, centre_hits[rows, :, cluster].argmax(axis=1), cluster] / scale
    assert np.all((beta >= 1.0 - 1e-4) & (beta <= 2.0 + 1e-4))

    other = np.abs(feat) > 1e-4
    other[rows, :, cluster] = False  # features of other clusters: exactly one, one patch
    assert np.all(other.sum(axis=(1, 2)) == 1)
    patch, k_other = (
        np.nonzero(other.reshape(n, -1))[1] // k,
        np.nonzero(other.reshape(n, -1))[1] % k,
    )
    assert np.all(k_other != cluster)
    gamma_eps = feat[rows, patch, k_other] / scale
    assert np.all((np.abs(gamma_eps) >= 0.5 - 1e-4) & (np.abs(gamma_eps) <= 3.0 + 1e-4))
    assert abs(np.mean(np.sign(gamma_eps) == y) - 0.5) < 0.05  # eps independent of the label
    assert set(np.unique(k_other - cluster) % k) == set(range(1, k))

    noise = x[~structured]  # the P - 3 Gaussian patches: N(0, sigma_p^2 / d I) times scale
    assert noise.shape == (n * (p - 3), d)
    np.testing.assert_allclose(noise.var(), (1.5 * scale) ** 2 / d, rtol=0.05)

    position = own.argmax(axis=1)  # patches are shuffled: the signal is anywhere
    assert np.all(np.bincount(position, minlength=p) > 0.8 * n / p)


def test_patch_mixture_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="d >= 2k"):
        data.make_patch_mixture(jax.random.PRNGKey(0), 8, 10)
    with pytest.raises(ValueError, match="num_patches"):
        data.make_patch_mixture(jax.random.PRNGKey(0), 2, 10, num_patches=2)


def test_dispatch_entropy_hand_cases():
    k, e = 4, 6
    cluster = jnp.repeat(jnp.arange(k), 12)  # 12 examples per cluster
    # expert 1, 4 idle
    pure = metrics.dispatch_entropy(jnp.array([0, 2, 3, 5])[cluster], cluster, e, k)
    assert float(pure) == pytest.approx(0.0, abs=1e-6)
    # clusters 0 and 3 share
    split = jnp.where(jnp.arange(48) % 2 == 0, 2 * cluster, 2 * cluster + 1) % e
    assert float(metrics.dispatch_entropy(split, cluster, e, k)) > 0.0
    uniform = jnp.arange(48) % 3  # each of 3 experts gets 4 examples of every cluster
    assert float(metrics.dispatch_entropy(uniform, cluster, e, k)) == pytest.approx(
        math.log(k), rel=1e-6
    )
    # expert 0: clusters {0, 1} in equal numbers (log 2), expert 1: cluster 2 only (0);
    # weights 24/36, 12/36
    mixed_cluster = jnp.concatenate([jnp.zeros(12, int), jnp.ones(12, int), jnp.full(12, 2)])
    mixed_expert = jnp.concatenate([jnp.zeros(24, int), jnp.ones(12, int)])
    assert float(metrics.dispatch_entropy(mixed_expert, mixed_cluster, 2, 3)) == pytest.approx(
        2 / 3 * math.log(2), rel=1e-6
    )


def test_normalised_gradient_gives_every_expert_a_unit_step_and_leaves_idle_experts_alone():
    grads = {
        "w": jnp.stack([jnp.full((3, 2), 5.0), jnp.zeros((3, 2)), jnp.full((3, 2), -1e-6)]),
        "b": jnp.ones((3, 4)),
    }
    out, _ = train.normalize_per_expert().update(grads, None)
    norms = np.sqrt(
        np.sum(np.asarray(out["w"]).reshape(3, -1) ** 2, axis=1)
        + np.sum(np.asarray(out["b"]) ** 2, axis=1)
    )
    np.testing.assert_allclose(norms[[0, 2]], 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out["w"][1], 0.0)
    np.testing.assert_allclose(out["b"][1], 0.5)  # expert 1's only gradient is its b, norm 2
    assert np.all(np.sign(out["w"][2]) == -1)


def test_single_expert_is_the_cnn_and_linear_cnn_reads_the_sum_of_patches():
    model = chen2022.PatchMoE(1, 6, 5, "linear", init_scale=1.0)
    params = model.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (7, 3, 5))
    out, probs, expert = model.apply(params, x, jax.random.PRNGKey(2))
    np.testing.assert_array_equal(probs, 1.0)
    np.testing.assert_array_equal(expert, 0)
    w = params["experts"]["w"][0]
    # a_j = +1, +1, +1, -1, -1, -1
    expected = x.sum(axis=1) @ (w[:3].sum(axis=0) - w[3:].sum(axis=0))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    cubic = chen2022.PatchMoE(1, 6, 5, "cubic", init_scale=1.0)
    np.testing.assert_allclose(
        cubic.apply(params, -x, jax.random.PRNGKey(2))[0],
        -cubic.apply(params, x, jax.random.PRNGKey(2))[0],
        rtol=1e-4,
    )


def test_zero_router_dispatches_uniformly_through_its_noise():
    model = chen2022.PatchMoE(8, 4, 5)
    params = model.init(jax.random.PRNGKey(0))
    _, probs, expert = model.apply(params, jnp.ones((4000, 3, 5)), jax.random.PRNGKey(1))
    np.testing.assert_allclose(probs, 1 / 8)
    assert np.all(np.abs(np.bincount(np.asarray(expert), minlength=8) - 500) < 100)


def test_load_balancing_adds_its_coefficient_at_a_uniform_router():
    plain = chen2022.PatchMoE(8, 4, 5)
    balanced = chen2022.PatchMoE(8, 4, 5, load_balance=0.3)
    params = plain.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 3, 5))
    batch = data.Batch(x, jnp.sign(x[:, :1, 0]), jnp.zeros(64, int))
    key = jax.random.PRNGKey(2)
    # pi = 1/E everywhere, so E sum_m f_m pi_m = sum_m f_m = 1 whatever the dispatch
    assert float(
        balanced.loss(params, batch, key) - plain.loss(params, batch, key)
    ) == pytest.approx(0.3, rel=1e-5)
    theta = params["router"]["theta"].at[:, 0].set(1.0)  # a router favouring expert 0 pays more
    skewed = {**params, "router": {"theta": theta}}
    x_pos = jnp.abs(x)
    batch_pos = data.Batch(x_pos, batch.y, batch.cluster)
    assert (
        float(balanced.loss(skewed, batch_pos, key) - plain.loss(skewed, batch_pos, key)) > 0.3 * 2
    )


def test_nonlinear_moe_learns_the_clusters_and_beats_the_single_cnn(tmp_path):
    models = ["Single (nonlinear)", "MoE (linear)", "MoE (nonlinear)"]
    cfg = dict(
        chen2022.PRESETS["quick"],
        settings={"setting 1": 1.0},
        models=models,
        n_train=2000,
        n_test=1000,
        moe_steps=200,
        single_steps=50,
    )
    result = chen2022.run(cfg, [0], tmp_path)
    by_model = {e["model"]: e for e in result["summary"]}
    moe, linear, single = (
        by_model["MoE (nonlinear)"],
        by_model["MoE (linear)"],
        by_model["Single (nonlinear)"],
    )
    assert moe["accuracy"] > 0.95 and moe["accuracy"] > single["accuracy"] + 0.2, result["summary"]
    assert moe["dispatch_entropy"] < 0.3 < 0.8 < linear["dispatch_entropy"], result["summary"]
    # one expert: nothing to dispatch
    assert "dispatch_entropy" not in single and len(result["summary"]) == 3
    assert (tmp_path / "chen2022.png").stat().st_size > 0 and (tmp_path / "chen2022.csv").exists()
