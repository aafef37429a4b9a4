"""The train step and the eval step, MaxText-style: one readable function each.

``train_step(state, batch)``: forward + backward (over ``accum_steps`` microbatches),
optimizer update, the model's state collections as updated by the forward pass (averaged
over microbatches; kept as they were where ``freeze.bias_mode`` freezes them), and, when
``skip_nonfinite``, the update is dropped for a step whose loss or gradients are not finite. Jitted
with the state donated (:func:`jit_train_step`).

Batches are dicts of ``int32[batch, length]`` arrays (``encoder_input_tokens``,
``decoder_input_tokens``, ``decoder_target_tokens``, ``decoder_loss_weights``, ...), sharded
over the mesh's batch axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax import hardware, partitioning
from moe_jax.moe import freeze
from moe_jax.runtime.train_state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, Any]


def _split_microbatches(batch: Batch, accum_steps: int) -> Batch:
    """[batch, ...] -> [accum_steps, batch // accum_steps, ...]."""

    def split(x):
        if x.shape[0] % accum_steps:
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by accum_steps={accum_steps}"
            )
        return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

    return jax.tree.map(split, batch)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
    bias_mode: str = "updated",
) -> tuple[TrainState, Metrics]:
    """One optimizer step. Returns the new state and scalar/array metrics (the model's
    ``loss_fn`` metrics averaged over microbatches, plus ``grad_norm``, ``learning_rate``
    and ``skipped``). ``bias_mode``: ``freeze.bias_mode`` of the balancing biases."""
    grad_fn = jax.value_and_grad(model.train_loss_fn, has_aux=True)
    rng = state.dropout_rng()
    if accum_steps == 1:
        (_, (metrics, collections)), grads = grad_fn(state.params, state.collections, batch, rng)
    else:
        micro = _split_microbatches(batch, accum_steps)

        def microbatch_grads(index):
            microbatch = jax.tree.map(lambda x: x[index], micro)
            (_, (m, c)), g = grad_fn(
                state.params, state.collections, microbatch, jax.random.fold_in(rng, index)
            )
            return g, m, c

        def accumulate(total, index):
            return jax.tree.map(jnp.add, total, microbatch_grads(index)), None

        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(microbatch_grads, 0)
        )
        (grads, metrics, collections), _ = jax.lax.scan(accumulate, zeros, jnp.arange(accum_steps))
        num_tokens = metrics.get("num_tokens")
        grads, metrics, collections = jax.tree.map(
            lambda x: x / accum_steps, (grads, metrics, collections)
        )
        if num_tokens is not None:
            metrics["num_tokens"] = num_tokens  # a count: summed, not averaged

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        collections=freeze.updated_collections(state.collections, collections, bias_mode),
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
        new_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            new_state,
            dataclasses.replace(state, step=state.step + 1),
        )
    skipped = (~finite if skip_nonfinite else jnp.zeros((), bool)).astype(jnp.int32)
    metrics = {
        **metrics,
        "grad_norm": grad_norm,
        "learning_rate": learning_rate_fn(state.step),
        "skipped": skipped,
    }
    return new_state, metrics


def jit_train_step(
    model,
    tx,
    learning_rate_fn,
    state_shardings: TrainState,
    mesh: Mesh,
    rules: partitioning.LogicalRules,
    batch_axes: tuple[str, ...] = ("data", "expert"),
    *,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
    bias_mode: str = "updated",
):
    """``train_step`` jitted with the state donated and its shardings pinned, traced under
    ``mesh`` and the logical axis ``rules`` (which give the model's activation constraints
    their mesh axes)."""
    batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes))
    step = functools.partial(
        train_step,
        model=model,
        tx=tx,
        learning_rate_fn=learning_rate_fn,
        accum_steps=accum_steps,
        skip_nonfinite=skip_nonfinite,
        bias_mode=bias_mode,
    )
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
        compiler_options=_compiler_options(mesh),
    )
    return _under_mesh(jitted, mesh, rules)


def jit_eval_step(
    model,
    params_shardings,
    mesh: Mesh,
    rules: partitioning.LogicalRules,
    batch_axes: tuple[str, ...] = ("data", "expert"),
    collections_shardings=None,
    eval_fn=None,
):
    """``(params, batch, collections=None) -> metrics``: ``model.eval_fn`` jitted (eval
    capacity factor); ``collections`` are the state's non-parameter collections; ``eval_fn``
    replaces ``model.eval_fn`` (e.g. wrapped in a Flax method interceptor)."""
    batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes))
    fn = eval_fn or model.eval_fn
    jitted = _under_mesh(
        jax.jit(
            fn,
            in_shardings=(params_shardings, batch_sharding, collections_shardings or {}),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
            compiler_options=_compiler_options(mesh),
        ),
        mesh,
        rules,
    )

    def step(params, batch, collections=None):
        return jitted(params, batch, collections or {})

    # a function attribute, like jax.jit's own .lower
    step.lower = lambda params, batch, collections=None: jitted.lower(  # type: ignore[attr-defined]
        params, batch, collections or {}
    )
    return step


def _compiler_options(mesh: Mesh) -> dict[str, Any]:
    """XLA options for the platform of ``mesh``'s devices (``hardware.compiler_options``)."""
    return hardware.compiler_options(mesh.devices.flat[0].platform)


def _under_mesh(fn, mesh: Mesh, rules: partitioning.LogicalRules):
    """``fn`` called (and, with ``.lower(*abstract_args)``, lowered ahead of time) under
    ``partitioning.activate(mesh, rules)``."""

    @functools.wraps(fn)
    def wrapped(*args):
        with partitioning.activate(mesh, rules):
            return fn(*args)

    def lower(*args):
        with partitioning.activate(mesh, rules):
            return fn.lower(*args)

    wrapped.lower = lower  # type: ignore[attr-defined]  # a function attribute, like jax.jit's
    return wrapped
