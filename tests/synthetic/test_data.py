"""Generators: shapes, determinism from the key, separation, label definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.synthetic import data

KEY = jax.random.PRNGKey(0)


def test_gaussian_mixture_is_c_separated_and_deterministic():
    task = data.make_gaussian_mixture(KEY, k=10, d=12, c=1.5, sigma=0.5)
    dist = np.linalg.norm(task.means[:, None] - task.means[None], axis=-1)[~np.eye(10, dtype=bool)]
    assert dist.min() >= 1.5 * 0.5 * 12**0.5 * (1 - 1e-5)
    a = data.sample_gaussian_mixture(task, jax.random.PRNGKey(1), 64)
    b = data.sample_gaussian_mixture(
        data.make_gaussian_mixture(KEY, k=10, d=12, c=1.5, sigma=0.5), jax.random.PRNGKey(1), 64
    )
    assert a.x.shape == (64, 12) and a.y.shape == (64, 10) and a.cluster.shape == (64,)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    c = data.sample_gaussian_mixture(task, jax.random.PRNGKey(2), 64)
    assert not np.allclose(a.x, c.x)
    np.testing.assert_array_equal(a.y, task.label_vectors[a.cluster])


def test_spurious_dims_are_standard_noise_and_linear_labels_are_centred():
    task = data.make_gaussian_mixture(KEY, k=4, d=20, d_signal=5, labels="linear")
    batch = data.sample_gaussian_mixture(task, jax.random.PRNGKey(3), 20000)
    np.testing.assert_array_equal(task.means[:, 5:], 0.0)
    spurious = np.asarray(batch.x[:, 5:])
    assert abs(spurious.mean()) < 0.02 and abs(spurious.std() - 1) < 0.02
    expected = jnp.sum(
        task.label_vectors[batch.cluster] * (batch.x - task.means[batch.cluster]), axis=-1
    )
    np.testing.assert_allclose(batch.y[:, 0], expected, atol=1e-4)


def test_generators_jit_and_have_documented_shapes():
    sub = data.make_subspace_mixture(KEY, k=3, d=10, t=2, noise=0.1)
    b = jax.jit(data.sample_subspace_mixture, static_argnums=2)(sub, KEY, 32)
    assert b.x.shape == (32, 10) and b.y.shape == (32, 1)
    # the noise-free part of x lies in the cluster's subspace
    proj = jnp.einsum("ndt,nd->nt", sub.bases[b.cluster], b.x)
    assert (
        float(
            jnp.mean(jnp.sum((b.x - jnp.einsum("ndt,nt->nd", sub.bases[b.cluster], proj)) ** 2, -1))
        )
        < 0.1**2 * 10 * 1.5
    )

    tok = data.make_tokenized_mixture(KEY, k=5, d=6, length=4, quadratic=True)
    b = data.sample_tokenized_mixture(tok, KEY, 8)
    assert b.x.shape == (8, 4, 6) and b.cluster.shape == (8, 4) and b.y.shape == (8, 1)
    per_token = jnp.sum(tok.mixture.label_vectors[b.cluster] * b.x, -1) ** 2
    np.testing.assert_allclose(b.y[:, 0], per_token.sum(-1), rtol=1e-5)
    averaged = data.sample_tokenized_mixture(
        data.make_tokenized_mixture(KEY, k=5, d=6, length=4, quadratic=True, label_reduce="mean"),
        KEY,
        8,
    )
    np.testing.assert_allclose(averaged.x, b.x)
    np.testing.assert_allclose(averaged.y[:, 0], per_token.mean(-1), rtol=1e-5)

    dic = data.make_dictionary(KEY, num_atoms=6, d=8)
    b = data.sample_dictionary(dic, KEY, 50)
    assert b.x.shape == (50, 8) and b.cluster.shape == (50, 2)
    assert np.all(b.cluster[:, 0] != b.cluster[:, 1])  # without replacement

    pair = data.make_truncated_pair(KEY, d=5, radius=0.6, sigma=0.5)
    b = data.sample_truncated_pair(pair, KEY, 500)
    centre = (1 - 2 * b.cluster)[:, None] * pair.z
    assert float(jnp.max(jnp.linalg.norm(b.x - centre, axis=-1))) <= 0.6 + 1e-4
    assert abs(float(jnp.linalg.norm(pair.z)) - 1) < 1e-6


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="labels"):
        data.make_gaussian_mixture(KEY, 3, 4, labels="quadratic")
    with pytest.raises(ValueError, match="radius"):
        data.make_truncated_pair(KEY, 3, radius=1.5)
    with pytest.raises(ValueError, match="label_reduce"):
        data.make_tokenized_mixture(KEY, 3, 4, 2, label_reduce="max")
