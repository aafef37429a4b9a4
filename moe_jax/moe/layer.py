"""The Mixture-of-Experts feed-forward layer (T5X / Flaxformer ``MoeLayer`` conventions).

``inputs [batch, length, d_model]`` -> routing groups ``[groups, tokens_per_group,
d_model]`` -> router -> dispatch into expert buffers -> experts -> combine ->
``[batch, length, d_model]``. Dropped tokens get a zero output: the model's residual
connection carries them through. Auxiliary losses are sown, already weighted, into the
``aux_loss`` collection; statistics and the unweighted losses into ``moe_metrics``; with
``AuxLossConfig.router_losses='hf_stack'`` the load-balancing and z-losses are the stack's
(the model's), and the layer sows its share into ``router_stack`` instead.
Opt-in, only when the caller makes the ``routing`` collection mutable (never in training):
per-token routing for analyses (moe_jax/analysis), see :meth:`MoeLayer._sow_routing`. The
collections' names are the constants of ``collections.py``.
See docs/moe.md.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.moe import capacity as cap
from moe_jax.moe import expert_parallel as ep
from moe_jax.moe import losses
from moe_jax.moe.collections import (
    AUX_LOSS_COLLECTION,
    MOE_METRICS_COLLECTION,
    ROUTER_STACK_COLLECTION,
    ROUTING_COLLECTION,
)
from moe_jax.moe.config import MoeConfig
from moe_jax.moe.dispatch import dispatch_combine, ragged_token_choice
from moe_jax.moe.execution import ExecutionPlan, resolve_plan
from moe_jax.moe.experts import ExpertWeights, expert_ffn, ragged_expert_ffn
from moe_jax.moe.grouped_matmul import gathered_ragged_dot, ragged_dot
from moe_jax.moe.options import CapacityOrder
from moe_jax.moe.permute import RowMap
from moe_jax.moe.routers import ExpertChoiceRouting, RouterOutput, TokenChoiceRouting
from moe_jax.moe.selection import check_group_limit
from moe_jax.moe.shared import SharedExperts

Array = jax.Array


class MoeLayer(nn.Module):
    """Sparse MoE feed-forward layer.

    Attributes:
      config: the layer's :class:`MoeConfig` (router, capacity, execution, losses).
      causal: set by a causal decoder: refuses a config that reads later tokens of a
        routing group (``MoeConfig.check_causal``) and resolves ``capacity_order='auto'``
        to ``token_major``.
      dtype: compute dtype of dispatch and experts (router logits are float32).
      route_padding: route padding tokens like real ones (Hugging Face's Switch
        Transformers; ``T5Config.padding_semantics='hf'``): the router reads every token
        as real, so padding takes expert capacity in its place of the capacity order. The
        losses and statistics the layer sows still read real tokens only
        (``padding_mask``); ``dropped_fraction`` is the real tokens'. False: padding is
        routed nowhere.
    """

    config: MoeConfig
    causal: bool = False
    dtype: Any = jnp.float32
    route_padding: bool = False

    @property
    def resolved_capacity_order(self) -> CapacityOrder:
        """``CapacityConfig.capacity_order`` with ``auto`` resolved: ``token_major`` when causal."""
        return self.config.capacity.resolved_order(self.causal)

    def _group_limit(self, mesh) -> tuple[int, int]:
        """(G, M) of group-limited routing (``TopKRouterConfig``). G: the config's, or the
        ``expert`` mesh axis size; with the mesh's G, an M >= G limits nothing (M = 0: off),
        so a config written for a large mesh also runs on one device."""
        router = self.config.router
        limit = getattr(router, "max_groups_per_token", 0)
        fixed = getattr(router, "num_limited_groups", None)
        if fixed:
            return fixed, limit
        groups = ep.axis_size(mesh, self.config.execution.expert_axis)
        return groups, (limit if limit < groups else 0)

    def _router(self, mesh) -> nn.Module:
        """The router module (``RouterConfig.module``), given every option of the router's
        config."""
        cfg = self.config
        options = cfg.router.module_options()
        options["num_experts"] = cfg.routed_experts
        if not cfg.router.hierarchical:  # k per token, times the granularity
            options["num_selected_experts"] = cfg.choices_per_token
        if "max_groups_per_token" in options:
            options["num_limited_groups"], options["max_groups_per_token"] = self._group_limit(mesh)
        return cfg.router.module(**options, name="router")

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        *,
        token_ids: Array | None = None,
        padding_mask: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """``[batch, length, d_model]`` -> ``[batch, length, d_model]`` (same dtype).

        Args:
          token_ids: ``[batch, length]`` int (the ``hash`` router needs them).
          padding_mask: ``[batch, length]``, 1 = real token, 0 = padding (routed only
            with ``route_padding``).
          deterministic: False in training (train capacity factor, noise, dropout).
        """
        cfg, axes = self.config, self.config.execution
        if self.causal:
            cfg.check_causal()
        batch, length, d_model = inputs.shape
        num_tokens = batch * length
        mesh = ep.current_mesh()
        ep.check_divisible(cfg.routed_experts, mesh, axes.expert_axis)
        check_group_limit(cfg.routed_experts, cfg.choices_per_token, *self._group_limit(mesh))
        shards = ep.group_shards(mesh, axes.data_axis, axes.expert_axis)
        if cfg.capacity.group_by_sequence:
            groups, tokens_per_group = cap.sequence_layout(batch, length, shards)
        else:
            groups, tokens_per_group = cap.group_layout(num_tokens, cfg.capacity.group_size, shards)

        def grouped(a: Array) -> Array:
            return cap.to_groups(a.reshape((num_tokens, *a.shape[2:])), groups, tokens_per_group)

        x = nn.with_logical_constraint(
            grouped(inputs.astype(self.dtype)), ("routing_group", "length", "embed")
        )
        mask = grouped(
            jnp.ones((batch, length), jnp.float32)
            if padding_mask is None
            else (padding_mask > 0).astype(jnp.float32)
        )
        ids = None if token_ids is None else grouped(token_ids)
        if cfg.capacity.dropless:
            capacity = tokens_per_group
        else:
            capacity = cap.expert_capacity(
                tokens_per_group,
                cfg.routed_experts,
                cfg.choices_per_token,
                cfg.capacity.factor(deterministic),
                cfg.capacity.min_expert_capacity,
                cfg.capacity.capacity_rule,
                cfg.capacity.expert_capacity,
            )

        route_mask = jnp.ones_like(mask) if self.route_padding else mask
        router_output = self._router(mesh)(x, route_mask, ids, capacity, deterministic)
        weights = ExpertWeights(
            cfg.routed_experts, cfg.expert_d_ff, cfg.activation, self.dtype, name="expert"
        )(d_model)
        y, kept = self._dispatch_run_combine(
            x, router_output, weights, capacity, mesh, deterministic
        )
        self._sow_routing(router_output, kept, x, num_tokens, (batch, length))
        self._sow_losses_and_metrics(
            router_output, mask, kept, self._balance_units(router_output, mask, batch, length)
        )
        self._sow_stack_sums(router_output.logits, batch, length)
        y = cap.from_groups(y, num_tokens).reshape(batch, length, d_model)
        if cfg.num_shared_experts:
            y = y + SharedExperts(
                cfg.num_shared_experts,
                cfg.shared_d_ff,
                cfg.activation,
                cfg.expert_dropout_rate,
                self.dtype,
                name="shared_expert",
            )(inputs.astype(self.dtype), deterministic)
        y = y.astype(inputs.dtype)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))

    def _dispatch_run_combine(
        self,
        x: Array,
        router_output: RouterOutput,
        weights: dict[str, Array],
        capacity: int,
        mesh,
        deterministic: bool,
    ) -> tuple[Array, Array | None]:
        """Dispatch, expert MLPs and combine as ``execution.resolve_plan`` plans them for the
        mesh: ``[groups, tokens_per_group, d_model]`` -> same, plus the kept mask (token choice)."""
        cfg, axes = self.config, self.config.execution
        plan = resolve_plan(cfg, mesh, self.dtype)
        use_dropout = cfg.expert_dropout_rate > 0 and not deterministic
        rng = self.make_rng("dropout") if use_dropout else jax.random.PRNGKey(0)
        routing = router_output.routing

        def local_fn(x, routing, w, key, exchange: ep.Exchange) -> tuple[Array, ...]:
            """This device's groups and (through ``exchange``) experts."""
            if plan.implementation == "ragged":
                return self._ragged(plan, x, routing, w, key if use_dropout else None, exchange)

            def run_experts(buffers: Array) -> Array:
                return expert_ffn(
                    w,
                    buffers,
                    cfg.activation,
                    cfg.expert_dropout_rate,
                    key if use_dropout else None,
                    plan.per_expert_loop,
                )

            y, kept = dispatch_combine(
                plan.dispatch,
                x,
                routing,
                cfg.routed_experts,
                capacity,
                lambda buffers: exchange.buffers(buffers, run_experts),
                choice_major_combine=plan.choice_major_combine,
                capacity_order=self.resolved_capacity_order,
                gather_gradients=plan.gather_gradients,
                scatter_rows=plan.scatter_rows,
            )
            return (y,) if kept is None else (y, kept)

        num_outputs = 1 if isinstance(routing, ExpertChoiceRouting) else 2
        if plan.exchange == "local":
            outputs = local_fn(x, routing, weights, rng, ep.LocalExchange())
        else:
            outputs = ep.expert_parallel(
                local_fn,
                mesh,
                data_axis=axes.data_axis,
                expert_axis=axes.expert_axis,
                model_axis=axes.model_axis,
            )(x, routing, weights, rng, num_outputs)
        return outputs[0], (outputs[1] if num_outputs == 2 else None)

    def _ragged(
        self,
        plan: ExecutionPlan,
        x: Array,
        routing: TokenChoiceRouting,
        w: dict[str, Array],
        dropout_rng: Array | None,
        exchange: ep.Exchange,
    ) -> tuple[Array, Array]:
        """Dropless token choice (``dispatch.ragged_token_choice``) through ``plan``'s
        grouped matmul, the rows crossing ``exchange``; with ``plan.gather_in_kernel`` (a
        local exchange) the input projections gather the token rows themselves.
        ``[groups, tokens_per_group, d_model]`` -> same, plus the kept mask."""
        cfg = self.config
        assert isinstance(plan.grouped_matmul, str)
        grouped = ragged_dot(plan.grouped_matmul, plan.platform)
        gathered = gathered_ragged_dot(plan.grouped_matmul, plan.platform)

        def ffn(rows: Array, sizes: Array, row_map: RowMap | None = None) -> Array:
            def in_dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
                assert row_map is not None
                return gathered(lhs, rhs, group_sizes, row_map)

            return ragged_expert_ffn(
                w,
                rows,
                sizes,
                cfg.activation,
                cfg.expert_dropout_rate,
                dropout_rng,
                grouped,
                None if row_map is None else in_dot,
            )

        def ragged_fn(rows: Array, sizes: Array, row_map: RowMap | None) -> Array:
            if row_map is not None:  # plan.gather_in_kernel: a local exchange
                return ffn(rows, sizes, row_map)
            # a token sends each expert at most one row
            return exchange.rows(rows, sizes, ffn, x.shape[0] * x.shape[1])

        return ragged_token_choice(
            x,
            routing,
            cfg.routed_experts,
            ragged_fn,
            plan.gather_gradients,
            plan.scatter_rows,
            plan.gather_in_kernel,
        )

    def _sow_routing(
        self,
        router_output: RouterOutput,
        kept: Array | None,
        x: Array,
        num_tokens: int,
        batch_length: tuple[int, int],
    ) -> None:
        """Sows per-token routing into ``routing`` when that collection is mutable (and not
        at init), so training and eval are unaffected. In ``[batch, length, ...]`` layout:

          ``router_inputs [batch, length, d_model]`` what the router reads (after the
            block's pre-norm, in the layer's dtype);
          ``router_probs [batch, length, experts]`` float32 the router's distribution over
            experts (``RouterOutput.probs``);
          ``expert_index [batch, length, k]`` int32 chosen experts, best first, before
            capacity (``num_experts`` = padding, unless ``route_padding``); token-choice
            routers only;
          ``kept [batch, length, k]`` bool whether each choice reached its expert (False:
            dropped by capacity, or padding unless ``route_padding``); expert choice:
            ``[batch, length, 1]`` whether any expert took the token.
        """
        if self.is_initializing() or not self.is_mutable_collection(ROUTING_COLLECTION):
            return

        def ungrouped(a: Array) -> Array:
            return cap.from_groups(a, num_tokens).reshape(batch_length + a.shape[2:])

        self.sow(ROUTING_COLLECTION, "router_inputs", ungrouped(x))
        self.sow(ROUTING_COLLECTION, "router_probs", ungrouped(router_output.probs))
        if not isinstance(router_output.routing, ExpertChoiceRouting):
            self.sow(
                ROUTING_COLLECTION, "expert_index", ungrouped(router_output.routing.expert_index)
            )
        if kept is None:  # expert choice
            kept = jnp.any(router_output.assigned > 0, axis=-1, keepdims=True)
        self.sow(ROUTING_COLLECTION, "kept", ungrouped(kept))

    def _balance_units(
        self, router_output: RouterOutput, mask: Array, batch: int, length: int
    ) -> tuple[Array, Array, Array] | None:
        """``(probs, assigned, mask)`` per unit of ``AuxLossConfig.balance_scope``: the
        routing groups as they are (``group``), the rows of the batch (``sequence``:
        ``[batch, length, experts]``), or None (``batch``: one loss over every token)."""
        scope = self.config.losses.balance_scope
        if scope == "batch":
            return None
        arrays = (router_output.probs, router_output.assigned, mask)
        if scope == "group":
            return arrays
        num_tokens = batch * length
        return tuple(  # type: ignore[return-value]
            cap.from_groups(a, num_tokens).reshape((batch, length, *a.shape[2:])) for a in arrays
        )

    def _sow_stack_sums(self, logits: Array, batch: int, length: int) -> None:
        """With ``AuxLossConfig.router_losses='hf_stack'``: sows this layer's per-sequence
        sums of its router logits, every position included
        (``losses.sequence_router_sums``), into ``router_stack``, from which the model forms
        the stack's losses."""
        if self.config.losses.router_losses != "hf_stack":
            return
        logits = cap.from_groups(logits, batch * length).reshape(batch, length, -1)
        for name, value in losses.sequence_router_sums(logits).items():
            self.sow(ROUTER_STACK_COLLECTION, name, value)

    def _sow_losses_and_metrics(
        self,
        router_output: RouterOutput,
        mask: Array,
        kept: Array | None,
        balance_units: tuple[Array, Array, Array] | None = None,
    ) -> None:
        if kept is None:  # expert choice: tokens no expert took
            untaken = (jnp.sum(router_output.assigned, axis=-1) == 0).astype(jnp.float32)
            dropped = jnp.sum(untaken * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        else:
            assert not isinstance(router_output.routing, ExpertChoiceRouting)
            routed = router_output.routing.expert_index < self.config.routed_experts
            if self.route_padding:  # padding is routed too: count the real tokens'
                real = mask[..., None] > 0
                routed, kept = routed & real, kept & real
            dropped = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(routed), 1)
        weights = self.config.losses.weights()
        if self.config.losses.router_losses == "hf_stack":  # the model adds the stack's
            weights.update(dict.fromkeys(losses.HF_STACK_LOSSES, 0.0))
        for name, value in losses.auxiliary_losses(router_output, mask, balance_units).items():
            if weights[name]:
                self.sow(AUX_LOSS_COLLECTION, name, weights[name] * value)
            self.sow(MOE_METRICS_COLLECTION, name, value)
        for name, value in losses.routing_metrics(router_output, mask, dropped).items():
            self.sow(MOE_METRICS_COLLECTION, name, value)
