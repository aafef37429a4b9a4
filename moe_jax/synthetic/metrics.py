"""Metrics of Section 2.1 and Appendix C.1, as pure jit-able functions.

Sparsity: the paper defines "average sparsity per cluster" as E_i H(E_{x in C_i} R(x)).
We return both the entropy in nats and exp(entropy), the *effective number of experts*.
The paper's figures and Table 2 plot exp(entropy): its frozen router over 32 experts
scores 28.52 (Table 2), above the maximum entropy log 32 = 3.47 nats (or 5 bits), and
Figure 2(c) "tends to 1" as each cluster maps to one expert (entropy would tend to 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def mse(pred: Array, y: Array) -> Array:
    """Mean squared error over examples and output dims: ``[n, out]`` x2 -> scalar."""
    return jnp.mean((pred - y) ** 2)


def normalised_loss(pred: Array, y: Array) -> Array:
    """MSE divided by the MSE of predicting the mean label: 1 = trivial, 0 = perfect."""
    return mse(pred, y) / mse(jnp.mean(y, axis=0, keepdims=True), y)


def entropy(p: Array) -> Array:
    """Entropy in nats of distributions ``[..., E]`` (0 log 0 = 0) -> ``[...]``."""
    return -jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1)


def cluster_mean_routing(probs: Array, cluster: Array, num_clusters: int) -> Array:
    """Routing distribution averaged within each cluster: probs ``[n, E]``, cluster ``[n]``
    -> ``[k, E]`` (rows of empty clusters are zero)."""
    totals = jax.ops.segment_sum(probs, cluster, num_segments=num_clusters)
    counts = jax.ops.segment_sum(jnp.ones(cluster.shape), cluster, num_segments=num_clusters)
    return totals / jnp.maximum(counts, 1.0)[:, None]


def sparsity(probs: Array, cluster: Array, num_clusters: int) -> dict[str, Array]:
    """Average sparsity per cluster E_i H(E_{x in C_i} R(x)) over the non-empty clusters.

    Returns ``{"nats": mean entropy, "effective": mean exp(entropy)}``. One-hot routing of
    each cluster gives 0 nats / 1 expert; uniform routing gives log E / E.
    """
    mean = cluster_mean_routing(probs, cluster, num_clusters)
    present = jnp.sum(mean, axis=-1) > 0
    h = entropy(mean)
    count = jnp.maximum(jnp.sum(present), 1)
    return {
        "nats": jnp.sum(jnp.where(present, h, 0.0)) / count,
        "effective": jnp.sum(jnp.where(present, jnp.exp(h), 0.0)) / count,
    }


def subspace_weight_fraction(w: Array, d_signal: int) -> Array:
    """sum_i ||w_i'||^2 / sum_i ||w_i||^2 for router rows w ``[E, d]``, w_i' = first
    ``d_signal`` coordinates (the non-spurious subspace V, Section 3.1 / Theorem 1)."""
    return jnp.sum(w[:, :d_signal] ** 2) / jnp.sum(w**2)


def off_subspace_norm(w: Array, d_signal: int) -> Array:
    """Mean over router rows w ``[E, d]`` of ||Proj_{V^perp}(w_i)||, V = the first
    ``d_signal`` coordinates (Theorem 1: 0 at any regularised local minimum)."""
    return jnp.mean(jnp.linalg.norm(w[:, d_signal:], axis=-1))


def norm_uniformity(w: Array) -> Array:
    """E||M_i||^2 / (E||M_i||)^2 for the weights M_i ``[E, ...]`` feeding expert i
    (Appendix C.1): 1 if all norms are equal, E if only one is non-zero."""
    norms = jnp.linalg.norm(w.reshape(w.shape[0], -1), axis=-1)
    return jnp.mean(norms**2) / jnp.mean(norms) ** 2


def purity(probs: Array, cluster: Array, num_clusters: int) -> Array:
    """Cluster-to-expert purity: the fraction of examples whose top-1 expert is their
    cluster's most frequent top-1 expert. probs ``[n, E]``, cluster ``[n]`` -> scalar."""
    top1 = jax.nn.one_hot(jnp.argmax(probs, axis=-1), probs.shape[-1])
    counts = jax.ops.segment_sum(top1, cluster, num_segments=num_clusters)  # [k, E]
    return jnp.sum(jnp.max(counts, axis=-1)) / cluster.shape[0]


def cluster_coverage(
    probs: Array, cluster: Array, num_clusters: int, threshold: float = 0.9
) -> Array:
    """Fraction of clusters served by specialists (Theorem 2).

    Expert j is a specialist of cluster c when >= ``threshold`` of the routing mass j
    receives comes from c; cluster c is covered when >= ``threshold`` of its own routing
    mass goes to its specialists. probs ``[n, E]``, cluster ``[n]`` -> scalar in [0, 1].
    """
    mass = jax.ops.segment_sum(probs, cluster, num_segments=num_clusters)  # [k, E]
    share = mass / jnp.maximum(jnp.sum(mass, axis=0, keepdims=True), 1e-12)
    specialist = share >= threshold
    served = jnp.sum(jnp.where(specialist, mass, 0.0), axis=1) / jnp.maximum(
        jnp.sum(mass, axis=1), 1e-12
    )
    present = jnp.sum(mass, axis=1) > 0
    return jnp.sum((served >= threshold) & present) / jnp.maximum(jnp.sum(present), 1)


def dispatch_entropy(expert: Array, cluster: Array, num_experts: int, num_clusters: int) -> Array:
    """Chen et al. (2022) eq. 6.1: sum_m (n_m / n) H(cluster | dispatched to expert m).

    expert ``[n]`` (each example's top-1 expert), cluster ``[n]`` -> scalar in nats. With
    n_{k,m} examples of cluster k sent to expert m: 0 when every expert receives at most
    one cluster; log k when every expert receives the clusters in equal numbers.
    """
    counts = jnp.zeros((num_clusters, num_experts)).at[cluster, expert].add(1.0)  # n_{k,m}
    per_expert = jnp.sum(counts, axis=0)  # n_m
    share = counts / jnp.maximum(per_expert, 1.0)
    return jnp.sum(per_expert * entropy(share.T)) / jnp.sum(per_expert)
