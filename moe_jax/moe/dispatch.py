"""Dispatch tokens to expert buffers and combine expert outputs back.

Two implementations with identical results (up to float summation order):

* ``einsum``: the GShard / Flaxformer reference. Capacity positions from a cumulative
  sum of one-hot expert masks; dispatch and combine are one-hot tensors
  ``[groups, tokens_per_group, experts, capacity]`` contracted with einsums. Its cost grows
  as ``tokens_per_group * experts * capacity * d_model``.
* ``sort``: assignments sorted by (expert, priority); each buffer slot gathers its token
  and each token gathers its expert outputs back. The default on every platform
  (``execution.resolve_plan``). Cost ``O(assignments * d_model)`` plus
  a sort. In dropless mode it feeds a grouped matmul (``jax.lax.ragged_dot``) instead of
  fixed-capacity buffers (``ragged_token_choice``; under expert parallelism on TPU only).

Which one runs, and how, is the layer's ``execution.ExecutionPlan``; this module holds
only the algorithms.

Capacity is granted in the same order by both, one ``options.CapacityOrder`` over the
tokens ranked by ``TokenChoiceRouting.priority``:

* ``choice_major`` (T5X / Flaxformer ``TokensChooseMaskedRouter``, GShard, Mesh
  TensorFlow's top-2 gating): every token's first choice before any second choice. For an
  encoder: a token's best expert is never pushed out by another token's second choice.
* ``token_major`` (MaxText's ``generate_masks``: a cumulative sum over
  ``length * k`` assignments): all choices of the first token, then all of the second...
  Whether token ``t``'s assignments fit then depends only on the tokens ranked before it,
  so in a causal decoder (priority = token order) it never depends on later tokens.
  Choice-major order there leaks: a later token's first choice can take the slot an
  earlier token's second choice would have had. ``CapacityConfig.capacity_order`` picks it for
  causal layers by default.

Assignments that do not fit are dropped: they contribute nothing, and a token whose
every choice is dropped gets a zero output (the residual connection around the layer
carries it).

``expert_fn`` maps buffers ``[groups, experts, capacity, d_model]`` to expert outputs of
the same shape; under expert parallelism it contains the all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax.moe.options import CapacityOrder, Dispatch
from moe_jax.moe.permute import RowMap, scatter_combine, take_rows
from moe_jax.moe.routers import ExpertChoiceRouting, TokenChoiceRouting

Array = jax.Array
ExpertFn = Callable[[Array], Array]
# (rows, group_sizes [experts], row map) -> [assignments, d_model] (``ragged_token_choice``).
RaggedFn = Callable[[Array, Array, RowMap | None], Array]


def _assignment_order(routing: TokenChoiceRouting, capacity_order: CapacityOrder) -> Array:
    """``[groups, tokens_per_group, k]`` rank of each assignment for capacity (a
    permutation of ``0 .. tokens_per_group * k - 1`` per group)."""
    k = routing.expert_index.shape[-1]
    tokens = routing.priority.shape[-1]
    choice = jnp.arange(k, dtype=jnp.int32)
    if capacity_order == "token_major":
        return routing.priority[..., None] * k + choice
    return choice * tokens + routing.priority[..., None]


def _groups_index(groups: int) -> Array:
    return jnp.arange(groups)[:, None]


# ----------------------------------------------------------------------------- einsum


def _onehot_positions(
    routing: TokenChoiceRouting, num_experts: int, capacity_order: CapacityOrder
) -> Array:
    """``[groups, tokens_per_group, k]`` position of each assignment in its expert buffer,
    by a cumulative sum of one-hot masks taken in ``capacity_order`` over the tokens in
    priority order."""
    groups, tokens, k = routing.expert_index.shape
    choices_first = capacity_order == "choice_major"  # the cumulative sum runs over [K, S]
    mask = jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.int32)  # [G, S, K, E]
    by_rank = jnp.argsort(routing.priority, axis=-1)  # token at each rank
    mask = jnp.take_along_axis(mask, by_rank[:, :, None, None], axis=1)
    if choices_first:
        mask = jnp.swapaxes(mask, 1, 2)  # [G, K, S, E]
    mask = mask.reshape(groups, k * tokens, num_experts)
    positions = jnp.sum((jnp.cumsum(mask, axis=1) - 1) * mask, axis=-1)
    if choices_first:
        positions = jnp.swapaxes(positions.reshape(groups, k, tokens), 1, 2)
    positions = positions.reshape(groups, tokens, k)
    return jnp.take_along_axis(positions, routing.priority[:, :, None], axis=1)


def einsum_token_choice(
    x: Array,
    routing: TokenChoiceRouting,
    num_experts: int,
    capacity: int,
    expert_fn: ExpertFn,
    capacity_order: CapacityOrder = "choice_major",
) -> tuple[Array, Array]:
    """One-hot dispatch/combine (reference).

    Args:
      x: ``[groups, tokens_per_group, d_model]``.
      capacity_order: the order assignments get buffer slots in (module docstring).

    Returns:
      ``[groups, tokens_per_group, d_model]`` outputs and ``[groups, tokens_per_group, k]``
      bool: the assignment was processed (not dropped, not padding).
    """
    positions = _onehot_positions(routing, num_experts, capacity_order)
    expert_mask = jax.nn.one_hot(routing.expert_index, num_experts, dtype=x.dtype)  # [G, S, K, E]
    slot_mask = jax.nn.one_hot(positions, capacity, dtype=x.dtype)  # [G, S, K, C]; 0 past C
    dispatch = jnp.einsum("gske,gskc->gsec", expert_mask, slot_mask)
    combine = jnp.einsum(
        "gsk,gske,gskc->gsec", routing.combine_weights.astype(x.dtype), expert_mask, slot_mask
    )
    buffers = jnp.einsum("gsec,gsd->gecd", dispatch, x)
    outputs = jnp.einsum("gsec,gecd->gsd", combine, expert_fn(buffers))
    kept = (positions < capacity) & (routing.expert_index < num_experts)
    return outputs, kept


def einsum_expert_choice(
    x: Array, routing: ExpertChoiceRouting, num_experts: int, expert_fn: ExpertFn
) -> Array:
    """One-hot dispatch/combine of an expert-choice decision (reference).
    ``[groups, tokens_per_group, d_model]`` -> same."""
    dispatch = jax.nn.one_hot(routing.token_index, x.shape[1], dtype=x.dtype)  # [G, E, C, S]
    buffers = jnp.einsum("gecs,gsd->gecd", dispatch, x)
    return jnp.einsum(
        "gecs,gec,gecd->gsd", dispatch, routing.combine_weights.astype(x.dtype), expert_fn(buffers)
    )


# ----------------------------------------------------------------------------- sort


def sort_token_choice(
    x: Array,
    routing: TokenChoiceRouting,
    num_experts: int,
    capacity: int,
    expert_fn: ExpertFn,
    choice_major_combine: bool = False,
    capacity_order: CapacityOrder = "choice_major",
    gather_gradients: bool = True,
    scatter_rows: bool = False,
) -> tuple[Array, Array]:
    """Sort/gather dispatch, same contract as ``einsum_token_choice``.

    Both moves are ``permute.take_rows``: tokens into buffer slots and expert outputs back
    to assignments. With ``gather_gradients`` their gradients gather (each token's k
    slots; each slot's one assignment), else they scatter-add rows (JAX's gradient of a
    gather); see ``ExecutionPlan.gather_gradients``. With ``scatter_rows`` both moves and
    their gradients scatter instead (``permute.scatter_rows``;
    ``ExecutionPlan.scatter_rows``), and so does the map from buffer slots to the
    assignments they hold.

    Two independent choices: ``capacity_order`` decides which assignments get buffer
    slots (the result); ``choice_major_combine`` only the memory layout of the combine,
    which gathers expert outputs as ``[groups, k, tokens, d_model]`` (k gathers of
    ``tokens`` rows) rather than ``[groups, tokens, k, d_model]``, with the same result
    (``ExecutionPlan.choice_major_combine``).
    """
    groups, tokens, k = routing.expert_index.shape
    d_model = x.shape[-1]
    n = tokens * k
    flat_slot, kept, filled, assignment = _buffer_slots(
        routing, num_experts, capacity, capacity_order, scatter_rows
    )
    buffers = take_rows(x, assignment // k, filled, flat_slot, kept, gather_gradients, scatter_rows)
    outputs = expert_fn(buffers.reshape(groups, num_experts, capacity, d_model))
    outputs = outputs.reshape(groups, num_experts * capacity, d_model)
    weights = jnp.where(kept, routing.combine_weights, 0).astype(x.dtype)
    if scatter_rows:  # each slot's output, weighted, scatter-added into its token
        slot_weights = jnp.take_along_axis(weights.reshape(groups, n), assignment, axis=-1)
        y = scatter_combine(outputs, slot_weights, assignment // k, filled, flat_slot, kept)
        return y, kept
    if choice_major_combine:  # k gathers of `tokens` rows each: row j * tokens + t
        order = (assignment % k) * tokens + assignment // k
        gathered = take_rows(
            outputs,
            jnp.swapaxes(flat_slot, 1, 2).reshape(groups, n),
            jnp.swapaxes(kept, 1, 2).reshape(groups, n),
            order[..., None],
            filled[..., None],
            gather_gradients,
            scatter_rows,
        ).reshape(groups, k, tokens, d_model)
        return jnp.einsum("gks,gksd->gsd", jnp.swapaxes(weights, 1, 2), gathered), kept
    gathered = take_rows(
        outputs,
        flat_slot.reshape(groups, n),
        kept.reshape(groups, n),
        assignment[..., None],
        filled[..., None],
        gather_gradients,
        scatter_rows,
    ).reshape(groups, tokens, k, d_model)
    return jnp.einsum("gsk,gskd->gsd", weights, gathered), kept


def _buffer_slots(
    routing: TokenChoiceRouting,
    num_experts: int,
    capacity: int,
    capacity_order: CapacityOrder,
    scatter_rows: bool,
) -> tuple[Array, Array, Array, Array]:
    """Where :func:`sort_token_choice` puts each assignment: ``(flat_slot [G, S, K]`` its
    buffer slot ``e * capacity + c``, ``kept [G, S, K]``, ``filled [G, E * C]`` which slots
    hold one, ``assignment [G, E * C]`` the assignment ``t * k + j`` each slot holds``)``,
    assignments sorted by (expert, ``capacity_order``); with ``scatter_rows`` the slot map
    is scattered rather than gathered."""
    groups, tokens, k = routing.expert_index.shape
    n = tokens * k
    expert_flat = routing.expert_index.reshape(groups, n)
    key = expert_flat * n + _assignment_order(routing, capacity_order).reshape(groups, n)
    perm = jnp.argsort(key, axis=-1)  # assignments sorted by (expert, order); keys are unique
    counts = jnp.sum(jax.nn.one_hot(expert_flat, num_experts, dtype=jnp.int32), axis=1)  # [G, E]
    starts = jnp.cumsum(counts, axis=-1) - counts
    # Rank of each assignment in the sorted list, minus its expert's start: its position.
    rank = _inverse_permutation(perm)
    starts_or_end = jnp.concatenate([starts, jnp.full((groups, 1), n, starts.dtype)], axis=-1)
    positions = (rank - jnp.take_along_axis(starts_or_end, expert_flat, axis=-1)).reshape(
        groups, tokens, k
    )
    kept = (positions < capacity) & (routing.expert_index < num_experts)  # [G, S, K]
    flat_slot = jnp.where(kept, routing.expert_index * capacity + positions, 0)  # [G, S, K]
    # Buffer slot (e, c) holds sorted assignment starts[e] + c when c < counts[e].
    slot = jnp.arange(capacity)
    filled = (slot < counts[..., None]).reshape(groups, num_experts * capacity)
    if scatter_rows:  # the same map scattered: XLA:TPU counts a gathered int32 at a tile
        assignment = _slot_assignments(flat_slot, kept, num_experts * capacity)
    else:
        source = jnp.minimum(starts[..., None] + slot, n - 1).reshape(
            groups, num_experts * capacity
        )
        assignment = jnp.take_along_axis(perm, source, axis=-1)  # [G, E * C]: t * k + j
    return flat_slot, kept, filled, assignment


def _slot_assignments(flat_slot: Array, kept: Array, slots: int) -> Array:
    """``[groups, slots]`` the assignment ``t * k + j`` each buffer slot holds (0 where the
    slot is empty), by scattering each kept assignment's index to its slot ``flat_slot``
    (``[groups, tokens, k]``, ``kept`` the same shape)."""
    groups, tokens, k = flat_slot.shape
    n = tokens * k
    where = jnp.where(kept, flat_slot, slots).reshape(groups, n)  # past the end: dropped
    into = jnp.zeros((groups, slots), jnp.int32)
    return into.at[_groups_index(groups), where].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def _inverse_permutation(perm: Array) -> Array:
    """``[groups, n]`` inverse of each row's permutation ``perm [groups, n]``."""
    groups, n = perm.shape
    g = _groups_index(groups)
    return jnp.zeros_like(perm).at[g, perm].set(jnp.arange(n, dtype=perm.dtype))


def gather_expert_choice(
    x: Array, routing: ExpertChoiceRouting, num_experts: int, expert_fn: ExpertFn
) -> Array:
    """Gather/scatter-add form of ``einsum_expert_choice``."""
    groups = x.shape[0]
    g = _groups_index(groups)[:, :, None]
    outputs = expert_fn(x[g, routing.token_index])  # [G, E, C, d]
    weighted = routing.combine_weights[..., None].astype(x.dtype) * outputs
    return jnp.zeros_like(x).at[g, routing.token_index].add(weighted)


def ragged_token_choice(
    x: Array,
    routing: TokenChoiceRouting,
    num_experts: int,
    ragged_fn: RaggedFn,
    gather_gradients: bool = True,
    scatter_rows: bool = False,
    gather_in_kernel: bool = False,
) -> tuple[Array, Array]:
    """Dropless token choice through a grouped matmul over all groups' assignments.

    ``ragged_fn(rows [assignments, d_model] sorted by expert, group_sizes [experts], None)``
    returns ``[assignments, d_model]``; rows past ``sum(group_sizes)`` (unrouted
    assignments) are zeros going in and are ignored coming out, so a kernel may leave them
    unwritten. Both moves (tokens into sorted rows, rows back to assignments) are
    ``permute.take_rows`` (``gather_gradients``, ``scatter_rows`` as in
    ``sort_token_choice``). With ``gather_in_kernel`` the first move is left to
    ``ragged_fn``: it gets the tokens ``[groups * tokens_per_group, d_model]`` and the
    ``permute.RowMap`` of the sorted rows into them (rows past ``sum(group_sizes)`` read
    some token), never a sorted copy. Same contract as ``einsum_token_choice``.
    """
    groups, tokens, k = routing.expert_index.shape
    d_model = x.shape[-1]
    n = groups * tokens * k
    expert_flat = routing.expert_index.reshape(1, n)
    perm = jnp.argsort(expert_flat, axis=-1, stable=True)  # [1, n]
    rank = _inverse_permutation(perm)  # [1, n]
    counts = jnp.sum(jax.nn.one_hot(expert_flat[0], num_experts, dtype=jnp.int32), axis=0)
    routed = expert_flat < num_experts  # [1, n], by assignment
    routed_sorted = jnp.arange(n)[None] < jnp.sum(counts)  # [1, n], by sorted row
    token = perm // k  # [1, n], the token each sorted row reads
    token_rows = rank.reshape(1, groups * tokens, k)  # each token's sorted rows
    token_routed = routed.reshape(1, groups * tokens, k)
    x = x.reshape(1, groups * tokens, d_model)
    if gather_in_kernel:
        row_map = RowMap(token[0], token_rows[0], token_routed[0])
        outputs = ragged_fn(x[0], counts, row_map)[None]
    else:
        rows = take_rows(
            x, token, routed_sorted, token_rows, token_routed, gather_gradients, scatter_rows
        )
        outputs = ragged_fn(rows[0], counts, None)[None]
    outputs = take_rows(
        outputs,
        rank,
        routed,
        perm[..., None],
        routed_sorted[..., None],
        gather_gradients,
        scatter_rows,
    )
    kept = routing.expert_index < num_experts
    weights = jnp.where(kept, routing.combine_weights, 0).astype(x.dtype)
    outputs = outputs.reshape(groups, tokens, k, d_model)
    return jnp.einsum("gsk,gskd->gsd", weights, outputs), kept


def dispatch_combine(
    impl: Dispatch,
    x: Array,
    routing: TokenChoiceRouting | ExpertChoiceRouting,
    num_experts: int,
    capacity: int,
    expert_fn: ExpertFn,
    *,
    choice_major_combine: bool = False,
    capacity_order: CapacityOrder = "choice_major",
    gather_gradients: bool = True,
    scatter_rows: bool = False,
) -> tuple[Array, Array | None]:
    """Runs ``expert_fn`` on the tokens ``routing`` sends to each expert.

    Args:
      impl: ``einsum`` or ``sort``.
      x: ``[groups, tokens_per_group, d_model]``.
      capacity: buffer size per expert and group (token choice; expert choice carries
        its own in ``routing.token_index``).
      choice_major_combine: layout of the ``sort`` combine gather (``sort_token_choice``).
      capacity_order: order in which token-choice assignments get buffer slots (module
        docstring).
      gather_gradients: the ``sort`` moves' gradients gather rather than scatter-add
        (``sort_token_choice``).
      scatter_rows: the ``sort`` moves and their gradients scatter (``sort_token_choice``).

    Returns:
      ``[groups, tokens_per_group, d_model]`` and, for token choice, the
      ``[groups, tokens_per_group, k]`` kept-assignment mask (None for expert choice).
    """
    if isinstance(routing, ExpertChoiceRouting):
        fn = einsum_expert_choice if impl == "einsum" else gather_expert_choice
        return fn(x, routing, num_experts, expert_fn), None
    if impl == "einsum":
        return einsum_token_choice(x, routing, num_experts, capacity, expert_fn, capacity_order)
    return sort_token_choice(
        x,
        routing,
        num_experts,
        capacity,
        expert_fn,
        choice_major_combine,
        capacity_order,
        gather_gradients,
        scatter_rows,
    )
