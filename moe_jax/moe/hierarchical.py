"""Hierarchical MoE routing (Shazeer et al., 2017, Appendix B): two-level gating.

The ``E`` experts form ``G`` expert groups of ``b = E / G`` experts; expert ``(i, j)``
(group ``i``, ``j``-th expert of the group) is expert ``i * b + j`` of the layer. A
*primary* gate picks the top-``k1`` groups of each token; inside every group ``i`` a
*secondary* gate ``G_i`` picks its top-``k2`` experts. The token goes to the ``k1 * k2``
experts ``(i, j)`` with gate ``G_primary(x)_i * G_i(x)_j``:

    y_H = sum_i sum_j G_primary(x)_i * G_i(x)_j * E_{i,j}(x)

The result is an ordinary ``TokenChoiceRouting`` over ``E`` experts, so capacity,
dispatch and expert parallelism of the layer apply unchanged. Choices are ordered by
descending final gate (the first choice gets capacity first).

Utilisation (Appendix B), fed to the layer's importance / load CV^2 losses:

* ``Importance_H(X)_{i,j} = sum_{x in X} G_primary(x)_i * G_i(x)_j``;
* ``Load_H(X)_{i,j} = Load_primary(X)_i * Load_i(X^(i))_j / |X^(i)|``, ``X^(i)`` the
  tokens whose primary gate picks group ``i``. With Shazeer's noisy gating in training
  the two loads are the smooth normal-CDF estimates (differentiable); otherwise they are
  hard counts, and ``Load_H`` is then exactly the number of tokens sent to ``(i, j)``
  (the layer's hard-count load).

Parameters: ``primary/w [embed, unmodeled]`` (``x @ w`` gives the ``G`` primary logits)
and ``secondary/w [embed, unmodeled]`` (``E`` columns; group ``i``'s gating network is
columns ``i * b ... (i + 1) * b - 1``); the noisy variant adds ``primary_noise/w`` and
``secondary_noise/w`` of the same shapes. With ``G = 1`` the primary gate is 1 and the
router equals the flat ``top_k`` (or ``noisy_top_k``) router with ``weights/w =
secondary/w``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.moe.routers import (
    RouterOutput,
    RouterWeights,
    _dense,
    _prob_in_top_k,
    _token_choice,
    top_k,
)

Array = jax.Array


def hierarchical_importance(
    primary_gates: Array, secondary_gates: Array, padding_mask: Array
) -> Array:
    """``Importance_H [G * b]`` (flattened ``(i, j) -> i * b + j``).

    Args:
      primary_gates: ``[groups, tokens_per_group, G]`` sparse primary gates (0 for
        groups not chosen).
      secondary_gates: ``[groups, tokens_per_group, G, b]`` sparse secondary gates of
        every expert group.
      padding_mask: ``[groups, tokens_per_group]``, 1 = real token.
    """
    importance = jnp.einsum(
        "gsi,gsij,gs->ij", primary_gates, secondary_gates, padding_mask.astype(primary_gates.dtype)
    )
    return importance.reshape(-1)


def hierarchical_load(primary_load: Array, secondary_load: Array, group_count: Array) -> Array:
    """``Load_H [G * b] = Load_primary_i * Load_i(X^(i))_j / |X^(i)|`` (0 where ``|X^(i)|``
    is 0, as then ``Load_i(X^(i))`` is 0 too).

    Args:
      primary_load: ``[G]`` load of the primary gate over the batch.
      secondary_load: ``[G, b]`` load of each group's secondary gate over the tokens
        ``X^(i)`` sent to that group.
      group_count: ``[G]`` ``|X^(i)|``, the number of tokens sent to each group.
    """
    scale = jnp.where(group_count > 0, primary_load / jnp.maximum(group_count, 1.0), 0.0)
    return (scale[:, None] * secondary_load).reshape(-1)


class HierarchicalRouter(nn.Module):
    """Two-level top-k gating over ``num_groups`` groups of ``num_experts / num_groups``
    experts (see the module docstring); ``config.HierarchicalRouterConfig`` checks its
    options.

    Attributes:
      num_experts: E, the total number of experts (``G * b``).
      num_selected_experts: k2, experts chosen inside each chosen group (<= b).
      num_groups: G, expert groups (E must be divisible by it).
      num_selected_groups: k1, groups chosen by the primary gate (<= G).
      renormalize_gates: divide the selected gates of each level by their sum.
      noisy: Shazeer noisy top-k gating at both levels (noise in training only); the gates
        are then the softmax over the kept noisy logits of each level and the load is the
        smooth ``Load_H``.
      batch_prioritized: BPR on the top hierarchical probability.
    """

    num_experts: int
    num_selected_experts: int
    num_groups: int = 1
    num_selected_groups: int = 1
    renormalize_gates: bool = False
    noisy: bool = False
    batch_prioritized: bool = False
    init_stddev: float = 2e-2
    min_noise_std: float = 1e-2

    def _gate(
        self, clean: Array, name: str, k: int, deterministic: bool, x: Array
    ) -> tuple[Array, Array, Array | None]:
        """Top-``k`` gating of ``clean [..., n]`` logits.

        Returns ``(index [..., k], gates [..., k], P(x, i) [..., n] or None)``; the last is
        Shazeer's in-top-k probability, given only for noisy gating in training.
        """
        if not self.noisy:
            gates, index = top_k(jax.nn.softmax(clean, axis=-1), k)
            if self.renormalize_gates:
                gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
            return index, gates, None
        noise_logits = RouterWeights(
            self.num_experts if name == "secondary" else self.num_groups,
            self.init_stddev,
            name=f"{name}_noise",
        )(x).reshape(clean.shape)
        noisy, prob = clean, None
        if not deterministic:
            noise_std = jax.nn.softplus(noise_logits) + self.min_noise_std
            noisy = clean + jax.random.normal(self.make_rng("dropout"), clean.shape) * noise_std
            prob = _prob_in_top_k(clean, noisy, noise_std, k)
        top_values, index = top_k(noisy, k)
        return index, jax.nn.softmax(top_values, axis=-1), prob

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        """``x [groups, tokens_per_group, d_model]``, ``padding_mask [groups,
        tokens_per_group]`` -> ``RouterOutput`` with ``k1 * k2`` choices per token."""
        del token_ids, capacity
        n_groups, per_group = self.num_groups, self.num_experts // self.num_groups
        k1, k2 = self.num_selected_groups, self.num_selected_experts
        lead = x.shape[:-1]
        primary = RouterWeights(n_groups, self.init_stddev, name="primary")(x)  # [g, s, G]
        secondary = RouterWeights(self.num_experts, self.init_stddev, name="secondary")(x)
        secondary = secondary.reshape((*lead, n_groups, per_group))  # [g, s, G, b]

        group_index, group_gates, primary_prob = self._gate(
            primary, "primary", k1, deterministic, x
        )
        inner_index, inner_gates, secondary_prob = self._gate(
            secondary, "secondary", k2, deterministic, x
        )

        # Final choices: (chosen group c, secondary choice m) -> expert group * b + inner index.
        chosen_inner = jnp.take_along_axis(
            inner_index, group_index[..., None], axis=-2
        )  # [g, s, k1, k2]
        chosen_gates = jnp.take_along_axis(inner_gates, group_index[..., None], axis=-2)
        expert_index = (group_index[..., None] * per_group + chosen_inner).reshape((*lead, k1 * k2))
        gates = (group_gates[..., None] * chosen_gates).reshape((*lead, k1 * k2))
        gates, order = top_k(gates, k1 * k2)  # descending final gate: capacity order
        expert_index = jnp.take_along_axis(expert_index, order, axis=-1)

        mask = padding_mask.astype(jnp.float32)
        primary_dense = _dense(group_index, group_gates, n_groups)  # [g, s, G]
        secondary_dense = _dense(inner_index, inner_gates, per_group)  # [g, s, G, b]
        importance = hierarchical_importance(primary_dense, secondary_dense, mask)
        smooth_load = None
        if primary_prob is not None:
            in_group = _dense(group_index, jnp.ones_like(group_gates), n_groups) * mask[..., None]
            smooth_load = hierarchical_load(
                jnp.sum(primary_prob * mask[..., None], axis=(0, 1)),
                jnp.einsum("gsi,gsij->ij", in_group, secondary_prob),
                jnp.sum(in_group, axis=(0, 1)),
            )

        probs = (
            jax.nn.softmax(primary, axis=-1)[..., None] * jax.nn.softmax(secondary, axis=-1)
        ).reshape((*lead, self.num_experts))
        return _token_choice(
            secondary.reshape(probs.shape),
            probs,
            expert_index,
            gates,
            padding_mask,
            self.batch_prioritized,
            smooth_load,
            importance=importance,
            primary_logits=primary,
        )


class NoisyHierarchicalRouter(HierarchicalRouter):
    """``HierarchicalRouter`` with Shazeer's noisy top-k gating at both levels (the 2017
    setup): smooth ``Load_H`` in training for the load loss."""

    noisy: bool = True
