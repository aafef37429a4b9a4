"""The Mixture-of-Experts feed-forward layer (T5X / Flaxformer ``MoeLayer`` conventions).

``inputs [batch, length, d_model]`` -> routing groups ``[groups, tokens_per_group,
d_model]`` -> router -> dispatch into expert buffers -> experts -> combine ->
``[batch, length, d_model]``. Dropped tokens get a zero output: the model's residual
connection carries them through. Auxiliary losses are sown, already weighted, into the
``aux_loss`` collection; statistics and the unweighted losses into ``moe_metrics``.
Opt-in, only when the caller makes the ``routing`` collection mutable (never in training):
per-token routing for analyses (moe_jax/analysis), see :meth:`MoeLayer._sow_routing`.
See docs/moe.md.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from moe_jax.moe import capacity as cap
from moe_jax.moe import expert_parallel as ep
from moe_jax.moe import losses
from moe_jax.moe.dispatch import (DISPATCH_IMPLS, check_capacity_order, choice_major_combine, dispatch_combine,
                                  layer_choices, ragged_token_choice, target_platform)
from moe_jax.moe.experts import Experts, check_activation, expert_ffn, ragged_expert_ffn
from moe_jax.moe.hierarchical import HIERARCHICAL_ROUTERS, check_hierarchical_options
from moe_jax.moe.routers import ExpertChoiceRouting, RouterOutput
from moe_jax.moe.routers import ROUTERS as _FLAT_ROUTERS
from moe_jax.moe.selection import check_selection_options
from moe_jax.moe.shared import SharedExperts

Array = jax.Array

# Every router by its MoeLayer.router_type name.
ROUTERS: dict[str, type[nn.Module]] = {**_FLAT_ROUTERS, **HIERARCHICAL_ROUTERS}

# Routers that look at the whole routing group (future tokens in a causal decoder).
_GROUP_WIDE_ROUTERS = ("expert_choice",)

# Opt-in collection of per-token routing decisions (see MoeLayer._sow_routing).
ROUTING_COLLECTION = "routing"


@gin.configurable
class MoeLayer(nn.Module):
    """Sparse MoE feed-forward layer.

    Attributes:
      num_experts: E.
      num_selected_experts: k, experts per token (token-choice routers); for expert choice
        the average number of experts per token used in the ``k_scaled`` capacity rule;
        for the hierarchical routers k2, the experts chosen inside each chosen group.
      router_type: one of ``ROUTERS``: ``top_k``, ``noisy_top_k``, ``expert_choice``,
        ``hash``, ``random``, ``hierarchical``, ``noisy_hierarchical``.
      num_expert_groups: G, expert groups of the hierarchical routers (E / G experts each;
        not the routing groups of ``group_size``).
      num_selected_groups: k1, expert groups each token is sent to (hierarchical routers);
        a token then has ``k1 * k2`` assignments.
      d_ff: hidden size of each expert MLP.
      activation: ``relu``, ``gelu`` or ``gated_gelu`` (T5 v1.1).
      expert_dropout_rate: dropout on the experts' hidden activations in training.
      train_capacity_factor / eval_capacity_factor: used when ``deterministic`` is False /
        True (the paper: 1.25 / 2.0).
      min_expert_capacity: lower bound on the capacity.
      capacity_rule: ``t5x`` (factor * tokens_per_group / E) or ``k_scaled`` (times k).
      group_size: maximum tokens per routing group.
      dropless: never drop: capacity = tokens_per_group, or a grouped matmul
        (``ragged_dot``) with the ``sort`` dispatch outside expert parallelism.
      dispatch: ``einsum`` (reference), ``sort`` or ``auto``: per the platform of the
        devices compiled for (the current mesh's, see ``dispatch.layer_choices``).
      per_expert_loop: expert matmuls one expert at a time (``lax.map``) rather than
        batched; None = per platform, as ``dispatch`` (True on CPU, where batched matmuls
        are slow).
      renormalize_gates: top-k gates divided by their sum.
      jitter_noise: Switch multiplicative router-input noise in training.
      batch_prioritized_routing: BPR (encoder only).
      router_init_stddev: router kernel init stddev (T5X: 2e-2).
      router_seed: seed of the ``hash`` and ``random`` routers.
      capacity_order: order in which token-choice assignments get expert buffer slots
        (``dispatch.CAPACITY_ORDERS``): ``choice_major`` (T5X / Flaxformer / GShard: every
        token's first choice before any second choice), ``token_major`` (all choices of
        token 0, then of token 1, ...: whether token t's assignments fit depends only on
        the tokens before it) or ``auto``: ``token_major`` when ``causal``, else
        ``choice_major``. Choice-major in a causal decoder with k > 1 and capacity leaks
        (a later token's first choice can take an earlier token's second-choice slot), so
        it is refused there unless ``accept_causal_leak``.
      accept_causal_leak: allow routing that reads later tokens of a group in a causal
        decoder (expert choice, BPR, ``capacity_order='choice_major'`` with k > 1),
        accepting the leak.
      *_loss_weight: weights of the auxiliary losses sown into ``aux_loss`` (0 = not sown).
      causal: set by a causal decoder.
      dtype: compute dtype of dispatch and experts (router logits are float32).
      data_axis / expert_axis / model_axis: mesh axis names (see expert_parallel.py).
      num_shared_experts: always-active experts added to the routed output (DeepSeekMoE).
      shared_expert_d_ff: hidden size of each shared expert (None: the routed experts').
      expert_granularity: m (DeepSeekMoE fine-grained experts): ``m * num_experts`` routed
        experts of ``d_ff / m``, top-``m * k``: same parameters and FLOPs.
      router_score: ``softmax`` or ``sigmoid`` (DeepSeek-V3; selected gates sum to 1).
      bias_update_rate: u > 0: auxiliary-loss-free balancing bias (selection only),
        updated by ``u * sign(mean load - load_e)`` every training step (DeepSeek-V3).
      num_limited_groups, max_groups_per_token: group-limited routing: each token picks
        its top experts inside its best M of G expert groups (M = 0: off; G = None: the
        ``expert`` mesh axis size, so a token reaches at most M devices; M >= that size
        limits nothing).
    """

    num_experts: int = 8
    num_selected_experts: int = 2
    router_type: str = "top_k"
    num_expert_groups: int = 1
    num_selected_groups: int = 1
    d_ff: int = 2048
    activation: str = "relu"
    expert_dropout_rate: float = 0.0
    train_capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_expert_capacity: int = 4
    capacity_rule: str = "t5x"
    group_size: int = 4096
    dropless: bool = False
    dispatch: str = "auto"
    per_expert_loop: bool | None = None
    renormalize_gates: bool = False
    jitter_noise: float = 0.0
    batch_prioritized_routing: bool = False
    router_init_stddev: float = 2e-2
    router_seed: int = 0
    capacity_order: str = "auto"
    accept_causal_leak: bool = False
    load_balancing_loss_weight: float = 1e-2
    router_z_loss_weight: float = 1e-4
    importance_loss_weight: float = 0.0
    load_loss_weight: float = 0.0
    entropy_loss_weight: float = 0.0
    causal: bool = False
    dtype: Any = jnp.float32
    data_axis: str = "data"
    expert_axis: str = "expert"
    model_axis: str = "model"
    num_shared_experts: int = 0
    shared_expert_d_ff: int | None = None
    expert_granularity: int = 1
    router_score: str = "softmax"
    bias_update_rate: float = 0.0
    num_limited_groups: int | None = None
    max_groups_per_token: int = 0

    def _validate(self) -> None:
        if self.router_type not in ROUTERS:
            raise ValueError(f"MoeLayer.router_type={self.router_type!r} is unknown; "
                             f"choose one of {tuple(ROUTERS)}")
        if not 1 <= self.num_selected_experts <= self.num_experts:
            raise ValueError(f"MoeLayer.num_selected_experts={self.num_selected_experts} must be "
                             f"between 1 and num_experts={self.num_experts}")
        for name in ("train_capacity_factor", "eval_capacity_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MoeLayer.{name}={getattr(self, name)} must be > 0")
        if self.dispatch not in DISPATCH_IMPLS + ("auto",):
            raise ValueError(f"MoeLayer.dispatch={self.dispatch!r} is unknown; "
                             f"choose one of {DISPATCH_IMPLS + ('auto',)}")
        check_activation(self.activation)
        self._validate_modern_options()
        if self.router_type in HIERARCHICAL_ROUTERS:
            check_hierarchical_options(self.num_experts, self.num_selected_experts,
                                       self.num_expert_groups, self.num_selected_groups)
        if self.capacity_order != "auto":
            check_capacity_order(self.capacity_order)
        leak = self._causal_leak()
        if self.causal and leak and not self.accept_causal_leak:
            raise ValueError(f"MoeLayer.{leak}, so in a causal decoder it leaks future tokens; "
                             f"set MoeLayer.accept_causal_leak=True to accept the leak")
        if self.dropless and self.router_type == "expert_choice":
            raise ValueError("MoeLayer.dropless=True needs a token-choice router, "
                             "not router_type='expert_choice'")

    def _causal_leak(self) -> str | None:
        """Why an earlier token's output would depend on later tokens of its group (an
        option and its effect, for the error message), or None."""
        if self.router_type in _GROUP_WIDE_ROUTERS:
            return f"router_type={self.router_type!r} reads every token of a routing group"
        if self.batch_prioritized_routing:
            return "batch_prioritized_routing=True ranks the tokens of a group by their router scores"
        if self.capacity_order == "choice_major" and self.choices_per_token > 1 and not self.dropless:
            return ("capacity_order='choice_major' lets a later token's first choice take the buffer "
                    "slot of an earlier token's second choice")
        return None

    @property
    def resolved_capacity_order(self) -> str:
        """``capacity_order`` with ``auto`` resolved: ``token_major`` when causal."""
        if self.capacity_order != "auto":
            return self.capacity_order
        return "token_major" if self.causal else "choice_major"

    def _validate_modern_options(self) -> None:
        """Shared / fine-grained experts, sigmoid scores, balancing bias, group limits."""
        m = self.expert_granularity
        if m < 1 or self.d_ff % m:
            raise ValueError(f"MoeLayer.expert_granularity={m} must be >= 1 and divide d_ff={self.d_ff}")
        if self.num_shared_experts < 0:
            raise ValueError(f"MoeLayer.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.num_shared_experts and self.router_type == "expert_choice":
            raise ValueError("MoeLayer.num_shared_experts: shared experts are for token-choice routers; "
                             "expert choice already lets experts take any number of tokens, "
                             "not router_type='expert_choice'")
        uses_top_k = self.router_score != "softmax" or self.bias_update_rate > 0 or self.max_groups_per_token
        if uses_top_k and self.router_type != "top_k":
            raise ValueError(f"MoeLayer.router_score / bias_update_rate / max_groups_per_token need "
                             f"router_type='top_k', not {self.router_type!r}")
        if m > 1 and self.router_type in HIERARCHICAL_ROUTERS:
            raise ValueError(f"MoeLayer.expert_granularity={m} is for flat routers, not "
                             f"router_type={self.router_type!r}")

    @property
    def routed_experts(self) -> int:
        """Routed experts: ``num_experts * expert_granularity``."""
        return self.num_experts * self.expert_granularity

    @property
    def expert_d_ff(self) -> int:
        """Hidden size of one routed expert: ``d_ff / expert_granularity``."""
        return self.d_ff // self.expert_granularity

    @property
    def shared_d_ff(self) -> int:
        """Hidden size of one shared expert."""
        return self.shared_expert_d_ff or self.expert_d_ff

    @property
    def choices_per_token(self) -> int:
        """Assignments per token: ``k`` (``m * k`` with granularity m), or ``k1 * k2`` for
        the hierarchical routers."""
        if self.router_type in HIERARCHICAL_ROUTERS:
            return self.num_selected_groups * self.num_selected_experts
        return self.num_selected_experts * self.expert_granularity

    def _group_limit(self, mesh) -> tuple[int, int]:
        """(G, M) of group-limited routing. G: the binding, or the ``expert`` mesh axis size;
        with the mesh's G, an M >= G limits nothing (M = 0: off), so a config written for a
        large mesh also runs on one device."""
        if self.num_limited_groups:
            return self.num_limited_groups, self.max_groups_per_token
        groups = ep.axis_size(mesh, self.expert_axis)
        return groups, (self.max_groups_per_token if self.max_groups_per_token < groups else 0)

    def _router(self, mesh) -> nn.Module:
        cls = ROUTERS[self.router_type]
        k = self.num_selected_experts if self.router_type in HIERARCHICAL_ROUTERS else self.choices_per_token
        options = dict(num_experts=self.routed_experts, num_selected_experts=k,
                       renormalize_gates=self.renormalize_gates, jitter_noise=self.jitter_noise,
                       batch_prioritized=self.batch_prioritized_routing,
                       init_stddev=self.router_init_stddev, seed=self.router_seed,
                       num_groups=self.num_expert_groups, num_selected_groups=self.num_selected_groups,
                       score_function=self.router_score, bias_update_rate=self.bias_update_rate,
                       num_limited_groups=self._group_limit(mesh)[0],
                       max_groups_per_token=self._group_limit(mesh)[1])
        return cls(**{k: v for k, v in options.items() if k in cls.__dataclass_fields__}, name="router")

    @nn.compact
    def __call__(self, inputs: Array, *, token_ids: Array | None = None,
                 padding_mask: Array | None = None, deterministic: bool = True) -> Array:
        """``[batch, length, d_model]`` -> ``[batch, length, d_model]`` (same dtype).

        Args:
          token_ids: ``[batch, length]`` int (the ``hash`` router needs them).
          padding_mask: ``[batch, length]``, 1 = real token, 0 = padding (never routed).
          deterministic: False in training (train capacity factor, noise, dropout).
        """
        self._validate()
        batch, length, d_model = inputs.shape
        num_tokens = batch * length
        mesh = ep.current_mesh()
        ep.check_divisible(self.routed_experts, mesh, self.expert_axis)
        check_selection_options(self.routed_experts, self.choices_per_token, self.router_score,
                                *self._group_limit(mesh))
        groups, tokens_per_group = cap.group_layout(
            num_tokens, self.group_size, ep.group_shards(mesh, self.data_axis, self.expert_axis))

        def grouped(a: Array) -> Array:
            return cap.to_groups(a.reshape((num_tokens,) + a.shape[2:]), groups, tokens_per_group)

        x = nn.with_logical_constraint(grouped(inputs.astype(self.dtype)), ("expert_group", "length", "embed"))
        mask = grouped(jnp.ones((batch, length), jnp.float32) if padding_mask is None
                       else (padding_mask > 0).astype(jnp.float32))
        ids = None if token_ids is None else grouped(token_ids)
        if self.dropless:
            capacity = tokens_per_group
        else:
            factor = self.eval_capacity_factor if deterministic else self.train_capacity_factor
            capacity = cap.expert_capacity(tokens_per_group, self.routed_experts, self.choices_per_token,
                                           factor, self.min_expert_capacity, self.capacity_rule)

        router_output = self._router(mesh)(x, mask, ids, capacity, deterministic)
        self._sow_routing(router_output, x, num_tokens, (batch, length))
        weights = Experts(self.routed_experts, self.expert_d_ff, self.activation, self.dtype, name="expert")(d_model)
        y, kept = self._experts(x, router_output, weights, capacity, mesh, deterministic)
        self._sow_losses_and_metrics(router_output, mask, kept)
        y = cap.from_groups(y, num_tokens).reshape(batch, length, d_model)
        if self.num_shared_experts:
            y = y + SharedExperts(self.num_shared_experts, self.shared_d_ff, self.activation,
                                  self.expert_dropout_rate, self.dtype, name="shared_expert")(
                inputs.astype(self.dtype), deterministic)
        y = y.astype(inputs.dtype)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))

    def _experts(self, x: Array, router_output: RouterOutput, weights: dict[str, Array], capacity: int,
                 mesh, deterministic: bool) -> tuple[Array, Array | None]:
        """Dispatch, expert MLPs, combine: ``[groups, tokens_per_group, d_model]`` -> same,
        plus the kept-assignment mask (token choice)."""
        platform = target_platform(mesh)
        auto_impl, auto_loop = layer_choices(platform, self.dtype)
        impl = auto_impl if self.dispatch == "auto" else self.dispatch
        per_expert_loop = auto_loop if self.per_expert_loop is None else self.per_expert_loop
        use_dropout = self.expert_dropout_rate > 0 and not deterministic
        rng = self.make_rng("dropout") if use_dropout else jax.random.PRNGKey(0)
        routing = router_output.routing
        expert_parallel = ep.axis_size(mesh, self.expert_axis) > 1

        def run_experts(w: dict[str, Array], buffers: Array, key: Array) -> Array:
            return expert_ffn(w, buffers, self.activation, self.expert_dropout_rate,
                              key if use_dropout else None, per_expert_loop)

        if self.dropless and impl == "sort" and not expert_parallel:
            return ragged_token_choice(x, routing, self.routed_experts, lambda rows, sizes: ragged_expert_ffn(
                weights, rows, sizes, self.activation, self.expert_dropout_rate, rng if use_dropout else None))

        def local_fn(x, routing, w, key, comm):
            y, kept = dispatch_combine(impl, x, routing, self.routed_experts, capacity,
                                       lambda buffers: comm(buffers, lambda b: run_experts(w, b, key)),
                                       choice_major_combine(platform), self.resolved_capacity_order)
            return (y,) if kept is None else (y, kept)

        num_outputs = 1 if isinstance(routing, ExpertChoiceRouting) else 2
        if expert_parallel:
            outputs = ep.expert_parallel(local_fn, mesh, data_axis=self.data_axis, expert_axis=self.expert_axis,
                                         model_axis=self.model_axis)(x, routing, weights, rng, num_outputs)
        else:
            outputs = local_fn(x, routing, weights, rng, ep.local_comm)
        return outputs[0], (outputs[1] if num_outputs == 2 else None)

    def _sow_routing(self, router_output: RouterOutput, x: Array, num_tokens: int,
                     batch_length: tuple[int, int]) -> None:
        """Sows per-token routing into ``routing`` when that collection is mutable (and not
        at init), so training and eval are unaffected. In ``[batch, length, ...]`` layout:

          ``router_inputs [batch, length, d_model]`` what the router reads (after the
            block's pre-norm, in the layer's dtype);
          ``router_probs [batch, length, experts]`` float32 softmax of the router logits;
          ``expert_index [batch, length, k]`` int32 chosen experts, best first, before
            capacity (``num_experts`` = padding); token-choice routers only.
        """
        if self.is_initializing() or not self.is_mutable_collection(ROUTING_COLLECTION):
            return

        def ungrouped(a: Array) -> Array:
            return cap.from_groups(a, num_tokens).reshape(batch_length + a.shape[2:])

        self.sow(ROUTING_COLLECTION, "router_inputs", ungrouped(x))
        self.sow(ROUTING_COLLECTION, "router_probs", ungrouped(router_output.probs))
        if not isinstance(router_output.routing, ExpertChoiceRouting):
            self.sow(ROUTING_COLLECTION, "expert_index", ungrouped(router_output.routing.expert_index))

    def _sow_losses_and_metrics(self, router_output: RouterOutput, mask: Array, kept: Array | None) -> None:
        if kept is None:  # expert choice: tokens no expert took
            untaken = (jnp.sum(router_output.assigned, axis=-1) == 0).astype(jnp.float32)
            dropped = jnp.sum(untaken * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        else:
            routed = router_output.routing.expert_index < self.routed_experts
            dropped = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(routed), 1)
        weights = {
            "load_balancing_loss": self.load_balancing_loss_weight,
            "router_z_loss": self.router_z_loss_weight,
            "importance_loss": self.importance_loss_weight,
            "load_loss": self.load_loss_weight,
            "entropy_loss": self.entropy_loss_weight,
        }
        for name, value in losses.auxiliary_losses(router_output, mask).items():
            if weights[name]:
                self.sow("aux_loss", name, weights[name] * value)
            self.sow("moe_metrics", name, value)
        for name, value in losses.routing_metrics(router_output, mask, dropped).items():
            self.sow("moe_metrics", name, value)
