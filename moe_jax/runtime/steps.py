"""The train step and the eval step, MaxText-style: one readable function each, and the
jitted step objects a run calls.

``train_step(state, batch)``: forward + backward (over ``accum_steps`` microbatches; the
forward pass reads the parameters' compute copies where the state has them), optimizer
update (writing the master parameters and their compute copies), the model's state
collections as updated by the forward pass (averaged over microbatches; kept as they were
where the bias mode freezes them), and, when
``skip_nonfinite``, the update is dropped for a step whose loss or gradients are not finite.
:func:`jit_train_step` makes a :class:`TrainStep` of it (state donated); :func:`jit_eval_step`
an :class:`EvalStep` of the model's ``eval_fn``. Both run, and lower ahead of time
(``.lower(*abstract_args)``, as ``jax.jit``'s), under the run's mesh and logical axis rules.

Batches are dicts of ``int32[batch, length]`` arrays (``encoder_input_tokens``,
``decoder_input_tokens``, ``decoder_target_tokens``, ``decoder_loss_weights``, ...), sharded
over the mesh's batch axes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax import hardware, partitioning
from moe_jax.moe import freeze
from moe_jax.runtime import compute_copies
from moe_jax.runtime.model_protocol import Batch, Model
from moe_jax.runtime.train_state import PyTree, TrainState

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
    model: Model,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
    bias_mode: str = "updated",
) -> tuple[TrainState, Metrics]:
    """One optimizer step. Returns the new state and scalar/array metrics (the model's
    ``loss_fn`` metrics averaged over microbatches, plus ``grad_norm``, ``learning_rate``
    and ``skipped``). ``bias_mode``: of the balancing biases (``freeze.BIAS_MODES``)."""
    grad_fn = jax.value_and_grad(model.train_loss_fn, has_aux=True)
    rng = state.dropout_rng()
    params = compute_copies.forward_params(state.params, state.compute_params)
    if accum_steps == 1:
        (_, (metrics, collections)), grads = grad_fn(params, state.collections, batch, rng)
    else:
        micro = _split_microbatches(batch, accum_steps)

        def microbatch_grads(index):
            microbatch = jax.tree.map(lambda x: x[index], micro)
            (_, (m, c)), g = grad_fn(
                params, state.collections, microbatch, jax.random.fold_in(rng, index)
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

    # a copied parameter's gradient comes in its copy's dtype
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        params=new_params,
        opt_state=opt_state,
        collections=freeze.updated_collections(state.collections, collections, bias_mode),
        compute_params=compute_copies.copies_of(new_params, state.compute_params),
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


class _UnderMesh:
    """A jitted function called, and lowered ahead of time, under ``mesh`` and the logical
    axis ``rules`` (which give the model's activation constraints their mesh axes)."""

    def __init__(
        self, jitted: jax.stages.Wrapped, mesh: Mesh, rules: partitioning.LogicalRules
    ) -> None:
        self._jitted, self._mesh, self._rules = jitted, mesh, rules

    def _run(self, *args: Any) -> Any:
        with partitioning.activate(self._mesh, self._rules):
            return self._jitted(*args)

    def _lower(self, *args: Any) -> jax.stages.Lowered:
        with partitioning.activate(self._mesh, self._rules):
            return self._jitted.lower(*args)


class TrainStep(_UnderMesh):
    """``(state, batch) -> (state, metrics)``, the state donated (:func:`jit_train_step`)."""

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return self._run(state, batch)

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """The step lowered for ``state`` and ``batch`` (arrays or sharded
        ``ShapeDtypeStruct`` s)."""
        return self._lower(state, batch)


class EvalStep(_UnderMesh):
    """``(params, batch, collections=None) -> metrics`` (:func:`jit_eval_step`);
    ``collections``: the state's non-parameter collections (None: the model has none)."""

    def __call__(self, params: PyTree, batch: Batch, collections: PyTree = None) -> Metrics:
        return self._run(params, batch, collections or {})

    def lower(self, params: PyTree, batch: Batch, collections: PyTree = None) -> jax.stages.Lowered:
        """The step lowered for these arguments (arrays or sharded ``ShapeDtypeStruct`` s)."""
        return self._lower(params, batch, collections or {})


def jit_train_step(
    model: Model,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    state_shardings: TrainState,
    mesh: Mesh,
    rules: partitioning.LogicalRules,
    batch_axes: tuple[str, ...] = partitioning.BATCH_AXES,
    *,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
    bias_mode: str = "updated",
) -> TrainStep:
    """:func:`train_step` jitted with the state donated and its shardings pinned."""
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
    return TrainStep(jitted, mesh, rules)


def jit_eval_step(
    model: Model,
    params_shardings: PyTree,
    mesh: Mesh,
    rules: partitioning.LogicalRules,
    batch_axes: tuple[str, ...] = partitioning.BATCH_AXES,
    collections_shardings: PyTree = None,
    eval_fn: Callable[..., Metrics] | None = None,
) -> EvalStep:
    """``model.eval_fn`` jitted (eval capacity factor); ``eval_fn`` replaces it (e.g. wrapped
    in a Flax method interceptor)."""
    batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes))
    jitted = jax.jit(
        eval_fn or model.eval_fn,
        in_shardings=(params_shardings, batch_sharding, collections_shardings or {}),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
        compiler_options=_compiler_options(mesh),
    )
    return EvalStep(jitted, mesh, rules)


def _compiler_options(mesh: Mesh) -> dict[str, Any]:
    """XLA options for the platform of ``mesh``'s devices (``hardware.compiler_options``)."""
    return hardware.compiler_options(mesh.devices.flat[0].platform)
