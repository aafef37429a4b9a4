"""Routers: from token representations to routing decisions.

Every router maps ``x [groups, tokens_per_group, d_model]`` (with a padding mask
``[groups, tokens_per_group]``, 1 = real token) to a ``RouterOutput``:

* token-choice routers (``top_k``, ``noisy_top_k``, ``hash``, ``random``,
  ``hierarchical``, ``noisy_hierarchical``) give each token ``k`` experts
  (``TokenChoiceRouting``); capacity is enforced later by the dispatcher, in priority
  order;
* the expert-choice router (``expert_choice``) gives each expert its top-``C`` tokens
  (``ExpertChoiceRouting``); it looks at the whole group, so it leaks future tokens in a
  causal decoder (the layer refuses it there unless the leak is accepted).

Learned routers hold a kernel ``w [embed, unmodeled]`` initialised as in T5X (normal,
stddev 2e-2, no bias) and compute logits in float32. Randomness (jitter, gating noise)
uses the ``dropout`` RNG stream and is applied only when ``deterministic=False``.
"""

from __future__ import annotations

import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.scipy.stats import norm

from moe_jax.moe import selection
from moe_jax.moe.collections import BIAS_COLLECTION
from moe_jax.moe.options import ScoreFunction

Array = jax.Array


@struct.dataclass
class TokenChoiceRouting:
    """Each token picks ``k`` experts.

    Attributes:
      expert_index: ``[groups, tokens_per_group, k]`` int32; ``num_experts`` = not routed.
      combine_weights: ``[groups, tokens_per_group, k]`` float32 gate of each choice.
      priority: ``[groups, tokens_per_group]`` int32 rank of each token when experts fill
        up (0 is served first): token order, or by router score with BPR. The dispatcher
        grants capacity over the tokens in this order, choice-major or token-major
        (``options.CapacityOrder``).
    """

    expert_index: Array
    combine_weights: Array
    priority: Array


@struct.dataclass
class ExpertChoiceRouting:
    """Each expert picks ``capacity`` tokens.

    Attributes:
      token_index: ``[groups, experts, capacity]`` int32 chosen tokens.
      combine_weights: ``[groups, experts, capacity]`` float32 (0 for padding tokens).
    """

    token_index: Array
    combine_weights: Array


@struct.dataclass
class RouterOutput:
    """A routing decision and what the losses and statistics need.

    Attributes:
      routing: ``TokenChoiceRouting`` or ``ExpertChoiceRouting``.
      logits: ``[groups, tokens_per_group, experts]`` float32 router logits (zeros for the
        hash router, which has none).
      probs: ``[groups, tokens_per_group, experts]`` float32 the router's distribution over
        experts, every token's row non-negative and summing to 1 (what the load-balancing
        loss, the entropy and confidence statistics and the sown ``router_probs`` read):
        the softmax of ``logits`` (top-k with softmax scores, noisy top-k's clean logits,
        random, expert choice); the sigmoid scores divided by their sum (top-k with sigmoid
        scores); the primary softmax times each group's secondary softmax (hierarchical);
        the hash router's fixed gates, ``1 / k`` on each of its ``k`` experts.
      assigned: ``[groups, tokens_per_group, experts]`` 1 where a token is sent to an
        expert before capacity is applied.
      gates: ``[groups, tokens_per_group, experts]`` dense combine weights (importance).
      smooth_load: ``[experts]`` differentiable expected load (noisy top-k in training;
        ``Load_H`` of the noisy hierarchical router in training), or None (hard counts).
      importance: ``[experts]`` importance (summed gates over real tokens) when the router
        defines its own (hierarchical: ``Importance_H``), or None (sum of ``gates``).
      primary_logits: ``[groups, tokens_per_group, expert_groups]`` float32 logits of a
        hierarchical router's primary gate (``logits`` are then the secondary ones, group
        ``i``'s experts in columns ``i * b ... (i + 1) * b - 1``), or None.
    """

    routing: TokenChoiceRouting | ExpertChoiceRouting
    logits: Array
    probs: Array
    assigned: Array
    gates: Array
    smooth_load: Array | None = None
    importance: Array | None = None
    primary_logits: Array | None = None


class RouterWeights(nn.Module):
    """``logits = x @ w (+ b)``: the routing matrix, one column per expert, and with
    ``use_bias`` a bias ``b [experts]`` (zeros at init; Hugging Face's ``router_bias``)."""

    num_experts: int
    init_stddev: float = 2e-2
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """``[groups, tokens_per_group, d_model]`` -> float32 ``[groups, tokens_per_group,
        experts]``."""
        init = nn.with_logical_partitioning(
            nn.initializers.normal(self.init_stddev), ("embed", "unmodeled")
        )
        w = self.param("w", init, (x.shape[-1], self.num_experts), jnp.float32)
        logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), w)
        if not self.use_bias:
            return logits
        b_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("unmodeled",))
        b = self.param("b", b_init, (self.num_experts,), jnp.float32)
        return logits + jnp.asarray(b)


def top_k(values: Array, k: int, select: Array | None = None) -> tuple[Array, Array]:
    """``jax.lax.top_k`` over the last axis, ``[..., n]`` -> ``([..., k], [..., k] int32)``
    (the indices of the top ``k`` of ``select``, default ``values``; the values of ``values``
    there),
    whose values are read back through a one-hot mask rather than indexed: the gradient
    is then a masked product, not the scatter into ``[..., n]`` that ``top_k``'s own
    gradient is. Same values and gradients; on TPU v5p XLA offloads that scatter to the
    SparseCore, and cost analysis counts it as about 4 GiB of traffic for a 4096 x 8 router
    (benchmarks/RESULTS.md, "MoE layer on TPU and GPU targets")."""
    _, index = jax.lax.top_k(jax.lax.stop_gradient(values if select is None else select), k)
    chosen = jax.nn.one_hot(index, values.shape[-1], dtype=values.dtype)  # [..., k, n]
    return jnp.sum(values[..., None, :] * chosen, axis=-1), index


def _dense(index: Array, values: Array, num_experts: int) -> Array:
    """Scatters ``values [..., k]`` at ``index [..., k]`` into ``[..., experts]``."""
    return jnp.einsum(
        "...k,...ke->...e", values, jax.nn.one_hot(index, num_experts, dtype=values.dtype)
    )


def _priority(probs: Array, padding_mask: Array, batch_prioritized: bool) -> Array:
    """``[groups, tokens]`` ranks: token order, or descending top-1 probability (BPR)."""
    groups, tokens = padding_mask.shape
    if not batch_prioritized:
        return jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (groups, tokens))
    score = jnp.where(padding_mask > 0, jnp.max(probs, axis=-1), -1.0)
    order = jnp.argsort(-score, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1).astype(jnp.int32)


def _token_choice(
    logits: Array,
    probs: Array,
    expert_index: Array,
    gates: Array,
    padding_mask: Array,
    batch_prioritized: bool,
    smooth_load: Array | None = None,
    **extra: Array | None,
) -> RouterOutput:
    """Packs a token-choice decision; padding tokens are routed nowhere."""
    num_experts = logits.shape[-1]
    real = padding_mask[..., None] > 0
    expert_index = jnp.where(real, expert_index, num_experts).astype(jnp.int32)
    gates = jnp.where(real, gates, 0.0).astype(jnp.float32)
    routing = TokenChoiceRouting(
        expert_index, gates, _priority(probs, padding_mask, batch_prioritized)
    )
    return RouterOutput(
        routing=routing,
        logits=logits,
        probs=probs,
        assigned=_dense(expert_index, jnp.ones_like(gates), num_experts),
        gates=_dense(expert_index, gates, num_experts),
        smooth_load=smooth_load,
        **extra,
    )


def _prob_in_top_k(clean: Array, noisy: Array, noise_std: Array, k: int) -> Array:
    """Shazeer's ``P(x, i)`` ``[..., n]``: probability that entry ``i`` of ``noisy [..., n]``
    is in the top ``k`` when its own noise is redrawn and the others' kept:
    ``Phi((clean_i - kth_excluding(noisy, k, i)) / noise_std_i)``."""
    if k >= clean.shape[-1]:
        return jnp.ones_like(clean)
    top, _ = top_k(noisy, k + 1)
    in_top_k = noisy >= top[..., k - 1 : k]
    # Threshold for entry i with the other noises fixed: the k-th largest of the others.
    threshold = jnp.where(in_top_k, top[..., k : k + 1], top[..., k - 1 : k])
    return norm.cdf((clean - threshold) / noise_std)


class TopKRouter(nn.Module):
    """Token-choice router, each token to its top-``k`` experts (k=1 Switch, k=2
    GShard/Mixtral), with the DeepSeek-V3 options of ``selection.py``.

    Attributes:
      renormalize_gates: divide the selected gates by their sum (Mixtral); otherwise the
        raw softmax probabilities are the combine weights (T5X/GShard without renorm).
        Sigmoid scores are always renormalised.
      jitter_noise: training-time multiplicative noise on the router inputs, uniform in
        ``[1 - eps, 1 + eps]`` (Switch).
      batch_prioritized: batch-prioritised routing: tokens with a confident top-1 choice
        get capacity first (encoder only; it reads the whole group).
      score_function: ``softmax`` or ``sigmoid`` (DeepSeek-V3).
      bias_update_rate: > 0 adds the auxiliary-loss-free balancing bias ``[experts]``
        (``router_bias`` collection) to the scores for selection, and, in training when that
        collection is mutable, moves it by this rate ``u`` toward under-loaded experts.
      num_limited_groups, max_groups_per_token: group-limited routing (G, M; M = 0: off).
      router_bias: the router's logits have a learned bias (``RouterWeights.use_bias``).
    """

    num_experts: int
    num_selected_experts: int
    renormalize_gates: bool = False
    jitter_noise: float = 0.0
    batch_prioritized: bool = False
    init_stddev: float = 2e-2
    score_function: ScoreFunction = "softmax"
    bias_update_rate: float = 0.0
    num_limited_groups: int = 1
    max_groups_per_token: int = 0
    router_bias: bool = False

    def _logits(self, x: Array, deterministic: bool) -> Array:
        if self.jitter_noise > 0.0 and not deterministic:
            x = x * jax.random.uniform(
                self.make_rng("dropout"),
                x.shape,
                x.dtype,
                1.0 - self.jitter_noise,
                1.0 + self.jitter_noise,
            )
        return RouterWeights(
            self.num_experts, self.init_stddev, use_bias=self.router_bias, name="weights"
        )(x)

    def _bias(self) -> nn.Variable | None:
        """The balancing bias ``[experts]`` (float32, zeros at init), or None when off."""
        if self.bias_update_rate <= 0.0:
            return None
        if not (
            self.has_variable(BIAS_COLLECTION, "bias")
            or self.is_mutable_collection(BIAS_COLLECTION)
        ):
            raise ValueError(
                f"TopKRouterConfig.bias_update_rate={self.bias_update_rate} needs the "
                f"{BIAS_COLLECTION!r} variable collection: pass it with the "
                f"params (train state's collections)"
            )
        init = nn.with_logical_partitioning(
            lambda: jnp.zeros((self.num_experts,), jnp.float32), ("unmodeled",)
        )
        return self.variable(BIAS_COLLECTION, "bias", init)

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        del token_ids, capacity
        logits = self._logits(x, deterministic)
        scores, probs = selection.scores(logits, self.score_function)
        bias = self._bias()
        select = scores if bias is None else scores + bias.value
        if self.max_groups_per_token:
            select = selection.group_limited(
                select, self.num_limited_groups, self.max_groups_per_token
            )
        gates, expert_index = top_k(scores, self.num_selected_experts, select)
        if self.renormalize_gates or self.score_function == "sigmoid":
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        output = _token_choice(
            logits, probs, expert_index, gates, padding_mask, self.batch_prioritized
        )
        if (
            bias is not None
            and not deterministic
            and not self.is_initializing()
            and self.is_mutable_collection(BIAS_COLLECTION)
        ):
            assert isinstance(output.routing, TokenChoiceRouting)
            load = selection.expert_counts(output.routing.expert_index, self.num_experts)
            bias.value = selection.bias_update(bias.value, load, self.bias_update_rate)
        return output


class NoisyTopKRouter(nn.Module):
    """Shazeer et al. (2017) noisy top-k gating.

    ``H(x) = x W_g + N(0, 1) * softplus(x W_noise)`` in training (``x W_g`` in eval); the
    top-``k`` entries of ``H`` are kept and soft-maxed among themselves. In training it
    also returns Shazeer's smooth load estimate ``sum_x Phi((x W_g - kth_excluding(H, k,
    i)) / softplus(x W_noise))`` for the load loss.
    """

    num_experts: int
    num_selected_experts: int
    batch_prioritized: bool = False
    init_stddev: float = 2e-2
    min_noise_std: float = 1e-2

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        del token_ids, capacity
        k = self.num_selected_experts
        clean = RouterWeights(self.num_experts, self.init_stddev, name="weights")(x)
        noise_logits = RouterWeights(self.num_experts, self.init_stddev, name="noise")(x)
        smooth_load = None
        noisy = clean
        if not deterministic:
            noise_std = jax.nn.softplus(noise_logits) + self.min_noise_std
            noisy = clean + jax.random.normal(self.make_rng("dropout"), clean.shape) * noise_std
            smooth_load = self._smooth_load(clean, noisy, noise_std, padding_mask)
        top_values, expert_index = top_k(noisy, k)
        gates = jax.nn.softmax(top_values, axis=-1)
        return _token_choice(
            clean,
            jax.nn.softmax(clean, axis=-1),
            expert_index,
            gates,
            padding_mask,
            self.batch_prioritized,
            smooth_load,
        )

    def _smooth_load(
        self, clean: Array, noisy: Array, noise_std: Array, padding_mask: Array
    ) -> Array:
        """``[experts]``: expected number of tokens routed to each expert (normal CDF)."""
        prob = _prob_in_top_k(clean, noisy, noise_std, self.num_selected_experts)
        return jnp.sum(prob * padding_mask[..., None], axis=(0, 1))


class HashRouter(nn.Module):
    """Fixed assignment by token id (Roller et al., 2021): no parameters, no gradient.

    Choice ``j`` of token ``t`` is expert ``(hash(t) + j) % E`` with a multiplicative
    hash salted by ``seed``; each selected expert gets weight ``1 / k``.
    """

    num_experts: int
    num_selected_experts: int
    seed: int = 0

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        del capacity, deterministic
        if token_ids is None:
            raise ValueError("HashRouterConfig: the hash router needs token_ids [batch, length]")
        k = self.num_selected_experts
        mixed = (token_ids.astype(jnp.uint32) + jnp.uint32(self.seed)) * jnp.uint32(2654435761)
        base = ((mixed >> 16) % jnp.uint32(self.num_experts)).astype(jnp.int32)
        expert_index = (base[..., None] + jnp.arange(k, dtype=jnp.int32)) % self.num_experts
        gates = jnp.full(expert_index.shape, 1.0 / k, jnp.float32)
        logits = jnp.zeros((*x.shape[:-1], self.num_experts), jnp.float32)
        probs = _dense(expert_index, gates, self.num_experts)  # k distinct experts: sums to 1
        return _token_choice(logits, probs, expert_index, gates, padding_mask, False)


class RandomRouter(nn.Module):
    """A fixed random routing matrix that is not a parameter (a data-independent baseline).

    The matrix is drawn from ``seed`` and the module's path (so each layer differs) at
    every call; it has no parameters, so nothing can train or decay it. Top-k of the
    softmax as in ``TopKRouter``.
    """

    num_experts: int
    num_selected_experts: int
    renormalize_gates: bool = False
    init_stddev: float = 2e-2
    seed: int = 0

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        del token_ids, capacity, deterministic
        assert self.scope is not None  # bound: the module is being applied
        salt = zlib.crc32("/".join(self.scope.path).encode())
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), salt)
        w = self.init_stddev * jax.random.normal(key, (x.shape[-1], self.num_experts), jnp.float32)
        logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), w)
        probs = jax.nn.softmax(logits, axis=-1)
        gates, expert_index = jax.lax.top_k(probs, self.num_selected_experts)
        if self.renormalize_gates:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        return _token_choice(logits, probs, expert_index, gates, padding_mask, False)


class ExpertChoiceRouter(nn.Module):
    """Zhou et al. (2022): each expert takes the ``capacity`` tokens of the group with the
    highest router probability; a token may be taken by several experts or by none."""

    num_experts: int
    num_selected_experts: int
    init_stddev: float = 2e-2

    @nn.compact
    def __call__(
        self,
        x: Array,
        padding_mask: Array,
        token_ids: Array | None,
        capacity: int,
        deterministic: bool,
    ) -> RouterOutput:
        del token_ids, deterministic
        logits = RouterWeights(self.num_experts, self.init_stddev, name="weights")(x)
        probs = jax.nn.softmax(logits, axis=-1)
        real = padding_mask > 0
        scores = jnp.where(real[..., None], probs, -1.0)  # padding is chosen last
        values, token_index = jax.lax.top_k(jnp.swapaxes(scores, 1, 2), capacity)  # [G, E, C]
        chosen_real = jnp.take_along_axis(real[:, None, :], token_index, axis=-1)
        gates = jnp.where(chosen_real, values, 0.0)
        groups, tokens = padding_mask.shape
        g = jnp.arange(groups)[:, None, None]
        e = jnp.arange(self.num_experts)[None, :, None]
        assigned = jnp.zeros((groups, tokens, self.num_experts), jnp.float32)
        assigned = assigned.at[g, token_index, e].add(chosen_real.astype(jnp.float32))
        dense_gates = jnp.zeros_like(assigned).at[g, token_index, e].add(gates)
        return RouterOutput(
            ExpertChoiceRouting(token_index.astype(jnp.int32), gates),
            logits,
            probs,
            assigned,
            dense_gates,
        )
