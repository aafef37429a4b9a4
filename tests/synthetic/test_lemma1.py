"""Lemma 1: the weight-sharing MoE's gradient step is a k-means (Lloyd) step."""

from __future__ import annotations

import jax
import numpy as np

from moe_jax.synthetic import data
from moe_jax.synthetic.experiments import lemma1


def test_moe_gradient_is_the_kmeans_gradient_and_gd_tracks_lloyd():
    task = data.make_gaussian_mixture(jax.random.PRNGKey(0), k=4, d=3, c=1.0)
    x = data.sample_gaussian_mixture(task, jax.random.PRNGKey(1), 400).x
    out = lemma1.trajectories(x[:4], x, iterations=5)
    assert float(out["grad_gap"].max()) < 1e-5
    assert float(out["centre_gap"].max()) < 1e-4
    np.testing.assert_allclose(out["loss_gd"], out["loss_lloyd"], rtol=1e-5)
    assert float(out["loss_gd"][-1]) <= float(out["loss_gd"][0])
