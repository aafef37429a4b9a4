"""Task generators for the synthetic laboratory.

Every task is split in two pure functions so that train and test sets share one
ground truth:

* ``make_<task>(key, ...) -> <Task>``: draws the task itself (cluster means, label vectors),
* ``sample_<task>(task, key, n) -> Batch``: draws ``n`` labelled examples from it.

Both are deterministic functions of their PRNG key and jit-able (sizes are static
Python ints). A ``Batch`` always carries ``x`` (model input), ``y`` (target) and
``cluster`` (the latent cluster id, used only by the metrics).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class Batch(NamedTuple):
    """Labelled examples.

    x: ``[n, d]`` (or ``[n, s, d]`` for tokenized inputs, or the pair (images
    ``[n, 32, 32, 3]``, v ``[n, dim_v]``) for the CNN router); y: ``[n, out]``;
    cluster: ``[n]`` int32 (``[n, s]`` for tokenized inputs; ``[n, 2]`` atoms for the
    dictionary task).
    """

    x: Any  # an array, or the CNN router's (images, v) pair of arrays
    y: Array
    cluster: Array


def take(batch: Batch, index: Array) -> Batch:
    """Rows ``index`` (``[m]`` int) of every leaf of ``batch`` (``x`` may be a tuple)."""
    return jax.tree.map(lambda leaf: leaf[index], batch)


# ---------------------------------------------------------------------------------------
# Mixture of spherical Gaussians (Sections 3.1, 3.2; Theorems 1, 2)
# ---------------------------------------------------------------------------------------


class GaussianMixture(NamedTuple):
    """k spherical Gaussians N(mu_c, sigma^2 I) in the first ``d_signal`` of ``d`` dims.

    means: ``[k, d]`` (zero beyond ``d_signal``: the other dims are iid N(0, 1) noise for
    every cluster, i.e. spurious); label_vectors: ``[k, out]`` (constant labels) or
    ``[k, d]`` (linear labels w_c); sigma: scalar.
    """

    means: Array
    label_vectors: Array
    sigma: Array
    d_signal: int
    linear_labels: bool


def separated_means(key: Array, k: int, d: int, separation: float) -> Array:
    """``[k, d]`` random means rescaled so that min_{i != j} ||mu_i - mu_j|| == separation."""
    means = jax.random.normal(key, (k, d))
    dist = jnp.linalg.norm(means[:, None, :] - means[None, :, :], axis=-1)
    min_dist = jnp.min(jnp.where(jnp.eye(k, dtype=bool), jnp.inf, dist))
    return means * (separation / min_dist)


def make_gaussian_mixture(
    key: Array,
    k: int,
    d: int,
    *,
    d_signal: int | None = None,
    c: float = 2.0,
    sigma: float = 1.0,
    labels: str = "constant",
    out_dim: int = 10,
) -> GaussianMixture:
    """A c-separated mixture: ||mu_i - mu_j|| >= c * sigma * sqrt(d_signal) for i != j.

    ``labels``: "constant" (a random N(0, I_out) vector per cluster, Section 3.1) or
    "linear" (y = w_c^T (x - mu_c), w_c ~ N(0, I_d / d), Section 3.2; out_dim is 1).
    """
    if labels not in ("constant", "linear"):
        raise ValueError(f"labels must be 'constant' or 'linear', got {labels!r}")
    d_signal = d if d_signal is None else d_signal
    if not 0 < d_signal <= d:
        raise ValueError(f"d_signal must be in (0, d={d}], got {d_signal}")
    k_means, k_labels = jax.random.split(key)
    means = separated_means(k_means, k, d_signal, c * sigma * d_signal**0.5)
    means = jnp.pad(means, ((0, 0), (0, d - d_signal)))
    if labels == "constant":
        label_vectors = jax.random.normal(k_labels, (k, out_dim))
    else:
        label_vectors = jax.random.normal(k_labels, (k, d)) / d**0.5
    return GaussianMixture(means, label_vectors, jnp.asarray(sigma), d_signal, labels == "linear")


def sample_gaussian_mixture(task: GaussianMixture, key: Array, n: int) -> Batch:
    """``n`` examples, clusters uniform: x = mu_c + noise (sigma in signal dims, 1 elsewhere)."""
    k, d = task.means.shape
    k_c, k_x = jax.random.split(key)
    cluster = jax.random.randint(k_c, (n,), 0, k)
    scale = jnp.where(jnp.arange(d) < task.d_signal, task.sigma, 1.0)
    noise = jax.random.normal(k_x, (n, d)) * scale
    x = task.means[cluster] + noise
    if task.linear_labels:
        y = jnp.sum(task.label_vectors[cluster] * noise, axis=-1, keepdims=True)
    else:
        y = task.label_vectors[cluster]
    return Batch(x, y, cluster.astype(jnp.int32))


# ---------------------------------------------------------------------------------------
# Mixture of subspaces (Section 3.3, Appendix C.1)
# ---------------------------------------------------------------------------------------


class SubspaceMixture(NamedTuple):
    """k random rank-t subspaces of R^d.

    bases: ``[k, d, t]`` orthonormal columns; label_vectors: ``[k, d]``; noise: scalar std
    of the isotropic noise eps (the signal has unit variance per subspace direction).
    """

    bases: Array
    label_vectors: Array
    noise: Array


def make_subspace_mixture(
    key: Array, k: int, d: int, t: int, *, noise: float = 0.25
) -> SubspaceMixture:
    """k random rank-``t`` subspaces; ``noise`` < sqrt(t/d) keeps ||eps|| below ||x||."""
    if not 0 < t <= d:
        raise ValueError(f"rank t must be in (0, d={d}], got {t}")
    k_b, k_w = jax.random.split(key)
    bases, _ = jnp.linalg.qr(jax.random.normal(k_b, (k, d, t)))
    label_vectors = jax.random.normal(k_w, (k, d))
    return SubspaceMixture(bases, label_vectors, jnp.asarray(noise))


def sample_subspace_mixture(task: SubspaceMixture, key: Array, n: int) -> Batch:
    """x = U_c z + eps, z ~ N(0, I_t), eps ~ N(0, noise^2 I_d); y = w_c^T eps (``[n, 1]``)."""
    k, d, t = task.bases.shape
    k_c, k_z, k_e = jax.random.split(key, 3)
    cluster = jax.random.randint(k_c, (n,), 0, k)
    z = jax.random.normal(k_z, (n, t))
    eps = jax.random.normal(k_e, (n, d)) * task.noise
    x = jnp.einsum("ndt,nt->nd", task.bases[cluster], z) + eps
    y = jnp.sum(task.label_vectors[cluster] * eps, axis=-1, keepdims=True)
    return Batch(x, y, cluster.astype(jnp.int32))


# ---------------------------------------------------------------------------------------
# Tokenized mixture of Gaussians (Section 3.5, Appendix C.2)
# ---------------------------------------------------------------------------------------


class TokenizedMixture(NamedTuple):
    """Sequences of ``length`` tokens, each an independent draw from ``mixture``.

    mixture.label_vectors are the per-cluster w_g (``[k, d]``); quadratic selects
    y = sum_i (w_{g_i}^T x_i)^2 instead of y = sum_i w_{g_i}^T x_i; label_reduce "mean" divides
    either by the length (App. C.2 writes the sum).
    """

    mixture: GaussianMixture
    length: int
    quadratic: bool
    label_reduce: str = "sum"


def make_tokenized_mixture(
    key: Array,
    k: int,
    d: int,
    length: int,
    *,
    c: float = 2.0,
    quadratic: bool = False,
    label_reduce: str = "sum",
) -> TokenizedMixture:
    """k c-separated Gaussians in R^d, per-cluster w_g ~ N(0, I_d / d); labels summed over
    the tokens (``label_reduce="sum"``, App. C.2's formula) or averaged (``"mean"``)."""
    if label_reduce not in ("sum", "mean"):
        raise ValueError(f"label_reduce must be 'sum' or 'mean', got {label_reduce!r}")
    mixture = make_gaussian_mixture(key, k, d, c=c, labels="linear")
    return TokenizedMixture(mixture, length, quadratic, label_reduce)


def sample_tokenized_mixture(task: TokenizedMixture, key: Array, n: int) -> Batch:
    """x: ``[n, s, d]``, cluster: ``[n, s]``, y: ``[n, 1]`` (linear or quadratic, App. C.2)."""
    flat = sample_gaussian_mixture(task.mixture, key, n * task.length)
    w = task.mixture.label_vectors[flat.cluster]
    per_token = jnp.sum(w * flat.x, axis=-1)
    if task.quadratic:
        per_token = per_token**2
    d = flat.x.shape[-1]
    y = per_token.reshape(n, task.length).sum(axis=1, keepdims=True)
    if task.label_reduce == "mean":
        y = y / task.length
    return Batch(flat.x.reshape(n, task.length, d), y, flat.cluster.reshape(n, task.length))


# ---------------------------------------------------------------------------------------
# Dictionary learning (Section 3.6, Appendix C.3)
# ---------------------------------------------------------------------------------------


class Dictionary(NamedTuple):
    """c atoms (cluster centres) ``[c, d]``, atom label vectors w_i ``[c, d]``, noise sigma."""

    atoms: Array
    label_vectors: Array
    sigma: Array
    rank: int


def make_dictionary(
    key: Array, num_atoms: int, d: int, *, rank: int = 2, c: float = 2.0, sigma: float = 1.0
) -> Dictionary:
    """c-separated atoms; w_i ~ N(0, I_d / d); each input mixes ``rank`` distinct atoms."""
    if not 0 < rank <= num_atoms:
        raise ValueError(f"rank must be in (0, num_atoms={num_atoms}], got {rank}")
    k_a, k_w = jax.random.split(key)
    atoms = separated_means(k_a, num_atoms, d, c * sigma * d**0.5)
    label_vectors = jax.random.normal(k_w, (num_atoms, d)) / d**0.5
    return Dictionary(atoms, label_vectors, jnp.asarray(sigma), rank)


def sample_dictionary(task: Dictionary, key: Array, n: int) -> Batch:
    """x = sum_{a in A} (mu_a + sigma * g_a), |A| = rank without replacement;
    y = (sum_{a in A} w_a)^T x (``[n, 1]``); cluster: the atoms ``[n, rank]``."""
    c, d = task.atoms.shape
    k_a, k_x = jax.random.split(key)
    # `rank` distinct atoms per example: the first entries of a random permutation.
    atoms = jnp.argsort(jax.random.uniform(k_a, (n, c)), axis=1)[:, : task.rank]
    noise = jax.random.normal(k_x, (n, task.rank, d)) * task.sigma
    x = jnp.sum(task.atoms[atoms] + noise, axis=1)
    w = jnp.sum(task.label_vectors[atoms], axis=1)
    y = jnp.sum(w * x, axis=-1, keepdims=True)
    return Batch(x, y, atoms.astype(jnp.int32))


# ---------------------------------------------------------------------------------------
# Two truncated Gaussians (Appendix F, Theorem 4)
# ---------------------------------------------------------------------------------------


class TruncatedPair(NamedTuple):
    """Balanced mixture of N(+-z, sigma^2 I) truncated to the ball of radius r around +-z.

    z: ``[d]`` with ||z|| = 1; v: ``[out]`` (labels are +v and -v); sigma, radius: scalars.
    """

    z: Array
    v: Array
    sigma: Array
    radius: Array


def make_truncated_pair(
    key: Array, d: int, *, out_dim: int = 1, sigma: float = 0.3, radius: float = 0.8
) -> TruncatedPair:
    """Random unit z and label v ~ N(0, I_out); requires radius < 1 (so clusters stay apart)."""
    if not 0 < radius < 1:
        raise ValueError(f"radius must be in (0, 1), got {radius}")
    k_z, k_v = jax.random.split(key)
    z = jax.random.normal(k_z, (d,))
    return TruncatedPair(
        z / jnp.linalg.norm(z),
        jax.random.normal(k_v, (out_dim,)),
        jnp.asarray(sigma),
        jnp.asarray(radius),
    )


def _truncated_radii(key: Array, n: int, d: int, max_radius: Array, iters: int = 40) -> Array:
    """``[n]`` radii of N(0, I_d) conditioned on norm <= max_radius (inverse CDF by bisection).

    The CDF of ||g||, g ~ N(0, I_d), is P(d/2, rho^2/2) (regularised lower gamma).
    """
    u = jax.random.uniform(key, (n,)) * jax.scipy.special.gammainc(d / 2, max_radius**2 / 2)

    def bisect(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        below = jax.scipy.special.gammainc(d / 2, mid**2 / 2) < u
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iters, bisect, (jnp.zeros(n), jnp.full((n,), max_radius)))
    return (lo + hi) / 2


def sample_truncated_pair(task: TruncatedPair, key: Array, n: int) -> Batch:
    """x = s z + g, s = +-1 uniform, g ~ N(0, sigma^2 I) conditioned on ||g|| <= radius;
    y = s v (``[n, out]``); cluster = (1 - s) / 2 (0 for +z, 1 for -z)."""
    (d,) = task.z.shape
    k_s, k_dir, k_r = jax.random.split(key, 3)
    cluster = jax.random.bernoulli(k_s, 0.5, (n,)).astype(jnp.int32)
    sign = 1.0 - 2.0 * cluster
    direction = jax.random.normal(k_dir, (n, d))
    direction /= jnp.linalg.norm(direction, axis=-1, keepdims=True)
    radii = task.sigma * _truncated_radii(k_r, n, d, task.radius / task.sigma)
    x = sign[:, None] * task.z + direction * radii[:, None]
    return Batch(x, sign[:, None] * task.v, cluster)


# ---------------------------------------------------------------------------------------
# Mixture of classification (Chen et al. 2022, Definition 3.1)
# ---------------------------------------------------------------------------------------


class PatchMixture(NamedTuple):
    """K clusters, each with a feature (label) signal v_k and a centre signal c_k.

    features, centres: ``[K, d]`` (all 2K rows orthonormal); alpha, beta, gamma: the
    (low, high) ranges of the uniform signal strengths; sigma_p: the random-noise patches
    are N(0, sigma_p^2 / d I_d); num_patches: P >= 3; scale multiplies every patch (the
    authors' code multiplies inputs by 10).
    """

    features: Array
    centres: Array
    alpha: tuple[float, float]
    beta: tuple[float, float]
    gamma: tuple[float, float]
    sigma_p: float
    num_patches: int
    scale: float


def make_patch_mixture(
    key: Array,
    k: int,
    d: int,
    *,
    num_patches: int = 4,
    alpha: tuple[float, float] = (0.5, 2.0),
    beta: tuple[float, float] = (1.0, 2.0),
    gamma: tuple[float, float] = (0.5, 3.0),
    sigma_p: float = 1.0,
    scale: float = 1.0,
) -> PatchMixture:
    """2K random orthonormal signals in R^d (needs 2K <= d); defaults are Table 1's setting 1."""
    if 2 * k > d:
        raise ValueError(f"2k orthogonal signals need d >= 2k, got k={k}, d={d}")
    if num_patches < 3:
        raise ValueError(
            f"num_patches must be >= 3 (signal, centre, feature noise), got {num_patches}"
        )
    q, _ = jnp.linalg.qr(jax.random.normal(key, (d, 2 * k)))  # [d, 2k] orthonormal columns
    # (lo, hi) pairs as tuples: a preset read back from JSON gives lists
    (a_lo, a_hi), (b_lo, b_hi), (g_lo, g_hi) = alpha, beta, gamma
    return PatchMixture(
        q[:, :k].T,
        q[:, k:].T,
        (a_lo, a_hi),
        (b_lo, b_hi),
        (g_lo, g_hi),
        sigma_p,
        num_patches,
        scale,
    )


def sample_patch_mixture(task: PatchMixture, key: Array, n: int) -> Batch:
    """``n`` examples of Definition 3.1: x ``[n, P, d]``, y ``[n, 1]`` in {-1, +1}, cluster ``[n]``.

    Cluster k uniform, feature-noise cluster k' uniform among the others, y and eps
    Rademacher, alpha / beta / gamma uniform in their ranges. Patches before shuffling:
    alpha y v_k (feature signal), beta c_k (cluster centre), gamma eps v_k' (feature
    noise), then P - 3 patches of N(0, sigma_p^2 / d I); their order is a fresh uniform
    permutation per example.
    """
    k, d = task.features.shape
    keys = jax.random.split(key, 9)
    cluster = jax.random.randint(keys[0], (n,), 0, k)
    other = (cluster + jax.random.randint(keys[1], (n,), 1, k)) % k
    y = jax.random.rademacher(keys[2], (n,)).astype(jnp.float32)
    eps = jax.random.rademacher(keys[3], (n,)).astype(jnp.float32)
    alpha, beta, gamma = (
        jax.random.uniform(kk, (n, 1), minval=lo, maxval=hi)
        for kk, (lo, hi) in zip(keys[4:7], (task.alpha, task.beta, task.gamma), strict=True)
    )
    signal = alpha * y[:, None] * task.features[cluster]
    centre = beta * task.centres[cluster]
    feature_noise = gamma * eps[:, None] * task.features[other]
    noise = jax.random.normal(keys[7], (n, task.num_patches - 3, d)) * task.sigma_p / d**0.5
    patches = jnp.concatenate([jnp.stack([signal, centre, feature_noise], axis=1), noise], axis=1)
    order = jnp.argsort(jax.random.uniform(keys[8], (n, task.num_patches)), axis=1)
    x = jnp.take_along_axis(patches, order[:, :, None], axis=1) * task.scale
    return Batch(x, y[:, None], cluster.astype(jnp.int32))
