"""Metrics on hand-computed cases."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import metrics, routers


def test_one_hot_routing_is_zero_nats_and_one_expert():
    cluster = jnp.array([0, 0, 1, 1, 2])
    probs = jax.nn.one_hot(jnp.array([3, 3, 0, 0, 5]), 8)
    s = metrics.sparsity(probs, cluster, 4)  # cluster 3 is empty and ignored
    assert float(s["nats"]) == 0.0 and float(s["effective"]) == 1.0
    assert float(metrics.purity(probs, cluster, 4)) == 1.0


def test_uniform_routing_is_log_e_nats_and_e_experts():
    probs = jnp.full((6, 8), 1 / 8)
    s = metrics.sparsity(probs, jnp.array([0, 1, 2, 0, 1, 2]), 3)
    np.testing.assert_allclose(s["nats"], math.log(8), rtol=1e-6)
    np.testing.assert_allclose(s["effective"], 8.0, rtol=1e-6)


def test_cluster_mean_is_taken_before_the_entropy():
    # two points of one cluster, each one-hot on a different expert: mean (1/2, 1/2)
    s = metrics.sparsity(jax.nn.one_hot(jnp.array([0, 1]), 4), jnp.array([0, 0]), 1)
    np.testing.assert_allclose(s["nats"], math.log(2), rtol=1e-6)
    np.testing.assert_allclose(s["effective"], 2.0, rtol=1e-6)


def test_normalised_loss_is_one_for_the_mean_and_zero_when_perfect():
    y = jnp.array([[1.0], [2.0], [6.0]])
    assert float(metrics.normalised_loss(jnp.full_like(y, 3.0), y)) == 1.0
    assert float(metrics.normalised_loss(y, y)) == 0.0


def test_subspace_fraction_and_norm_uniformity():
    w = jnp.array([[3.0, 4.0, 0.0], [0.0, 0.0, 5.0]])
    np.testing.assert_allclose(metrics.subspace_weight_fraction(w, 2), 25 / 50)
    np.testing.assert_allclose(metrics.off_subspace_norm(w, 2), 2.5)  # rows' off-V norms 0 and 5
    np.testing.assert_allclose(metrics.norm_uniformity(w), 1.0)
    np.testing.assert_allclose(
        metrics.norm_uniformity(jnp.array([[1.0], [0.0], [0.0], [0.0]])), 4.0
    )


def test_coverage_counts_clusters_with_a_specialist():
    cluster = jnp.array([0, 0, 1, 1])
    assert (
        float(metrics.cluster_coverage(jax.nn.one_hot(jnp.array([2, 3, 1, 1]), 4), cluster, 2))
        == 1.0
    )
    assert (
        float(metrics.cluster_coverage(jax.nn.one_hot(jnp.array([1, 1, 1, 1]), 4), cluster, 2))
        == 0.0
    )


def test_shuffled_router_permutes_columns_only():
    w = jnp.arange(12.0).reshape(3, 4)
    shuffled = routers.shuffle_columns("linear", {"w": w}, jax.random.PRNGKey(0))["w"]
    np.testing.assert_array_equal(jnp.sort(shuffled, axis=1), w)  # each row keeps its entries
    assert not np.array_equal(shuffled, w)
