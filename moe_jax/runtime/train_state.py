"""The train state pytree and its shardings on a mesh.

``TrainState`` holds everything a resumed run needs besides the data-iterator position:
the step, the parameters, the optimizer state, the RNG key (raw ``uint32[2]`` key
data, so that orbax saves it as a plain array) and the model's non-parameter state
collections (``EncoderDecoderModel.STATE_COLLECTIONS``, e.g. MoE balancing biases), which the
train step's forward pass updates and the optimizer never sees. Dropout keys are
``fold_in(rng, step)``: a resumed run draws the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax import partitioning
from moe_jax.runtime import compute_copies
from moe_jax.runtime.model_protocol import InputShapes, Model

PyTree = Any


@flax.struct.dataclass
class TrainState:
    """step: int32[]; params: the model's parameter tree; opt_state: optax state;
    rng: uint32[2] raw key data of the run's base key; collections: ``{name: tree}`` of
    non-parameter state collections (empty for most models); compute_params: the
    parameters the forward pass reads in a lower precision, cast (a pruned parameter
    tree, :mod:`~moe_jax.runtime.compute_copies`; empty with float32 activations)."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    collections: PyTree = flax.struct.field(default_factory=dict)
    compute_params: PyTree = flax.struct.field(default_factory=dict)

    def dropout_rng(self) -> jax.Array:
        """The dropout key of the current step (a typed key)."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def init_train_state(
    model: Model,
    tx: optax.GradientTransformation,
    input_shapes: InputShapes,
    seed: int,
    compute_dtypes: PyTree = None,
) -> TrainState:
    """A fresh state: parameters from ``model.get_initial_variables(PRNGKey(seed), ...)``,
    with compute copies of those ``compute_dtypes`` names
    (:func:`compute_copies.compute_dtypes`; None: none).

    Run under ``jax.jit`` with ``out_shardings`` from :func:`state_shardings` so that each
    device only materialises its shards.
    """
    init_key, run_key = jax.random.split(jax.random.PRNGKey(seed))
    variables = nn.unbox(model.get_initial_variables(init_key, input_shapes))
    params = variables.pop("params")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=run_key,
        collections=variables,
        compute_params=compute_copies.copies_of(params, compute_dtypes or {}),
    )


def with_compute_copies(state: TrainState, like: PyTree) -> TrainState:
    """``state`` (restored or converted, its own copies ignored) with the compute copies of
    its parameters that ``like`` names, laid out by ``like``'s leaves' shardings (the
    ``compute_params`` of the abstract state a run trains)."""
    if not like:
        return dataclasses.replace(state, compute_params={})
    shardings = jax.tree.map(lambda leaf: leaf.sharding, like)
    copies = jax.jit(
        lambda params: compute_copies.copies_of(params, like), out_shardings=shardings
    )(state.params)
    return dataclasses.replace(state, compute_params=copies)


def param_shardings(
    model: Model, input_shapes: InputShapes, mesh: Mesh, rules: partitioning.LogicalRules
) -> PyTree:
    """``NamedSharding`` of every parameter from the model's logical axis names."""
    return partitioning.tree_shardings(model.param_logical_axes(input_shapes), mesh, rules)


def state_shardings(
    abstract_state: TrainState,
    params_sharding: PyTree,
    mesh: Mesh,
    collections_sharding: PyTree | None = None,
) -> TrainState:
    """Shardings for a whole state: parameters by their rules; an optimizer-state leaf or
    compute copy whose tree path ends with a parameter's path and has its shape (Adam's
    moments) follows that parameter; other leaves (Adafactor's factored moments, counts),
    step and rng are replicated; state collections by their rules
    (``collections_sharding``; replicated when None)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = {
        path: (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_flatten_with_path(abstract_state.params)[0],
            jax.tree.leaves(params_sharding),
            strict=True,
        )
    }

    def follow_param(path, leaf):
        for start in range(len(path)):
            shape, sharding = by_path.get(tuple(path[start:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated

    opt_shardings = jax.tree_util.tree_map_with_path(follow_param, abstract_state.opt_state)
    copy_shardings = jax.tree_util.tree_map_with_path(follow_param, abstract_state.compute_params)
    if collections_sharding is None:
        collections_sharding = jax.tree.map(lambda _: replicated, abstract_state.collections)
    return TrainState(
        step=replicated,  # type: ignore[arg-type]  # the state's tree of shardings
        params=params_sharding,
        opt_state=opt_shardings,
        rng=replicated,  # type: ignore[arg-type]  # the state's tree of shardings
        collections=collections_sharding,
        compute_params=copy_shardings,
    )


def abstract_with_shardings(abstract: PyTree, shardings: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` leaves carrying their sharding (orbax restore targets).

    Raises:
      errors.ConfigError: naming the first array whose dimension a mesh axis does not divide
        (``partitioning.check_divisibility``), instead of JAX's sharding text.
    """
    partitioning.check_divisibility(abstract, shardings)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
