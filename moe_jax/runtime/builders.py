"""What `train`, `eval`, `infer`, `analyze` and `compile` share: one place that builds a run.

- :class:`DatasetConfig`: one dataset of a run and its global input shapes.
- :class:`RunContext` (:meth:`RunContext.checked`): the mesh, the logical axis rules (checked
  against the mesh) and the batch axes; :func:`moe_jax.runtime.configured.run_context`
  makes it from the gin bindings.
- :func:`build_train_setup`: the abstract train state with its shardings and the jitted
  train step (state donated) and eval step, for a model, input shapes, a run context and
  the optimizer (router updates masked for a frozen router). ``compile`` lowers exactly
  these for a target's devices; ``train`` runs them. What gin chooses (the optimizer, the
  router and bias modes) comes in as arguments: :mod:`moe_jax.runtime.configured` reads it
  for the commands.
- :func:`restore_model`: a checkpoint's parameters and state collections on the run's mesh,
  the one restore path of ``eval``, ``infer`` and ``analyze``.
- :func:`global_batch` / :func:`eval_batches`: batches laid out on the run's mesh.
- :func:`build_parser`: the flags every gin-configured command takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from moe_jax import errors, hardware, partitioning
from moe_jax.moe import freeze
from moe_jax.runtime import (
    checkpoints,
    compute_copies,
    distributed,
    gin_flags,
    steps,
    train_state,
)
from moe_jax.runtime.model_protocol import InputShapes, Model

# Token positions and counts are int32 on the device: no feature of a batch holds more.
MAX_BATCH_TOKENS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """One dataset of a run, as T5X's ``utils.DatasetConfig`` (bind with a scope:
    ``train/DatasetConfig.split = 'train'``, ``train_eval/DatasetConfig.split = 'validation'``).

    ``batch_size`` is global (all processes together); ``task_feature_lengths`` e.g.
    ``{"inputs": 512, "targets": 114}``. ``module`` (T5X's ``MIXTURE_OR_TASK_MODULE``): a
    module or ``.py`` file registering the task, imported when the config is built.
    ``shuffle_buffer_size``: examples the training stream shuffles among (``None``: the
    task's, 10 000 for the project's tasks); the first batch waits until it is full.
    """

    mixture_or_task_name: str
    task_feature_lengths: Mapping[str, int]
    split: str = "train"
    batch_size: int = 8
    shuffle: bool = True
    seed: int | None = 0
    use_cached: bool = False
    pack: bool = True
    module: str | None = None
    shuffle_buffer_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise errors.ConfigError(
                f"DatasetConfig.batch_size (BATCH_SIZE) = {self.batch_size!r}; "
                "expected a positive integer"
            )
        _check_feature_lengths(self.task_feature_lengths)
        tokens = self.batch_size * max(self.task_feature_lengths.values())
        if tokens > MAX_BATCH_TOKENS:
            feature = max(self.task_feature_lengths, key=self.task_feature_lengths.__getitem__)
            raise errors.ConfigError(
                f"DatasetConfig.batch_size (BATCH_SIZE) = {self.batch_size!r}: {tokens} "
                f"{feature.rstrip('s')} tokens per batch; at most {MAX_BATCH_TOKENS} "
                "(token positions are int32)"
            )
        if self.module:
            # deferred on purpose: TensorFlow/seqio load only when data is read
            from moe_jax.data import tasks

            tasks.import_task_module(self.module)

    def input_shapes(self) -> dict[str, tuple[int, int]]:
        """Model input shapes of one global batch."""
        return {
            "encoder_input_tokens": (self.batch_size, self.task_feature_lengths["inputs"]),
            "decoder_input_tokens": (self.batch_size, self.task_feature_lengths["targets"]),
        }


def _check_feature_lengths(lengths: Any) -> None:
    """Refuses ``TASK_FEATURE_LENGTHS`` that is not ``{'inputs': I, 'targets': T}`` with
    positive integers (extra features are allowed).

    Raises:
      ConfigError: naming the macro, the value and what is wrong.
    """
    problem = None
    if not isinstance(lengths, Mapping):
        problem = "expected a dict"
    elif missing := [k for k in ("inputs", "targets") if k not in lengths]:
        problem = f"no {' or '.join(repr(k) for k in missing)}"
    elif bad := [
        k for k, v in lengths.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0
    ]:
        problem = f"{', '.join(repr(k) for k in bad)}: expected a positive integer"
    if problem:
        raise errors.ConfigError(
            f"TASK_FEATURE_LENGTHS (DatasetConfig.task_feature_lengths) = {lengths!r}: "
            f"{problem}; e.g. {{'inputs': 512, 'targets': 114}}"
        )


@dataclasses.dataclass
class RunContext:
    """What train/eval/infer/compile share once gin is parsed: mesh, rules, batch axes."""

    mesh: jax.sharding.Mesh
    rules: partitioning.LogicalRules
    batch_axes: tuple[str, ...]

    @classmethod
    def checked(
        cls,
        mesh: jax.sharding.Mesh,
        rules: partitioning.LogicalRules,
        batch_axes: Sequence[str] = partitioning.BATCH_AXES,
    ) -> RunContext:
        """The run's mesh, its logical axis rules (checked against the mesh) and the mesh
        axes the batch is split over (:func:`moe_jax.runtime.configured.run_context` reads
        them from gin for the commands)."""
        partitioning.validate_rules(rules, mesh)
        return cls(mesh=mesh, rules=rules, batch_axes=tuple(batch_axes))


def global_batch(local_batch: dict[str, np.ndarray], ctx: RunContext) -> dict[str, jax.Array]:
    """This process's ``[batch / processes, length]`` arrays as global arrays on ``ctx.mesh``."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import pipeline

    return pipeline.to_global_batch(local_batch, ctx.mesh, batch_axes=ctx.batch_axes)


def eval_batches(cfg: DatasetConfig, num_batches: int):
    """The first ``num_batches`` batches of ``cfg``'s split, unshuffled (the split repeats
    if shorter, so every process runs the same number of steps)."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import pipeline

    ds = pipeline.get_dataset(
        cfg.mixture_or_task_name,
        dict(cfg.task_feature_lengths),
        cfg.split,
        partitioning.per_process_batch_size(cfg.batch_size),
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        shard_info=pipeline.host_shard_info(),
        pack=cfg.pack,
        num_epochs=None,
        use_cached=cfg.use_cached,
    )
    return ds.take(num_batches).as_numpy_iterator()


def first_batch(
    batches: Iterator[dict[str, np.ndarray]], cfg: DatasetConfig
) -> dict[str, np.ndarray]:
    """The first of ``batches`` (an endless stream of ``cfg``, or its first eval batches);
    a stream that ends at once has no data.

    Raises:
      InputFileError: naming the task and split that hold no example.
    """
    try:
        return next(batches)
    except StopIteration:
        raise errors.InputFileError(
            f"MIXTURE_OR_TASK_NAME={cfg.mixture_or_task_name!r}: the {cfg.split} split holds no "
            "example (empty files?)"
        ) from None


def abstract_variables(model: Model, input_shapes: InputShapes) -> dict[str, Any]:
    """``{"params": tree, <state collection>: tree, ...}``: the model's variables as
    ``jax.ShapeDtypeStruct`` leaves (nothing allocated); state collections
    (``models.model.STATE_COLLECTIONS``, e.g. ``router_bias``) only where the model has them."""
    return nn.unbox(model.abstract_variables(input_shapes))


def abstract_params(model: Model, input_shapes: InputShapes) -> Any:
    """The model's parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    return abstract_variables(model, input_shapes)["params"]


def compute_dtypes(
    model: Model, input_shapes: Mapping[str, tuple[int, int]], ctx: RunContext
) -> Any:
    """The parameters the train step keeps compute copies of, with their dtypes:
    :func:`traced_compute_dtypes`, or ``{}`` without that trace (a trace of the network
    before the train step's) when the activations are no narrower than the parameters
    (float32 activations): no parameter is read cast to a narrower dtype then."""
    config = model.module.config
    wide = np.dtype(config.activation_dtype).itemsize >= np.dtype(config.parameter_dtype).itemsize
    return {} if wide else traced_compute_dtypes(model, input_shapes, ctx)


def traced_compute_dtypes(
    model: Model, input_shapes: Mapping[str, tuple[int, int]], ctx: RunContext
) -> Any:
    """:func:`compute_copies.compute_dtypes` of the model's train loss, traced on one
    abstract batch under ``ctx``'s mesh and rules."""
    variables = abstract_variables(model, input_shapes)
    params = variables.pop("params")
    rng = jax.ShapeDtypeStruct((2,), np.uint32)

    def loss(params: Any, collections: Any, batch: Any, rng: jax.Array) -> Any:
        return model.train_loss_fn(params, collections, batch, jax.random.wrap_key_data(rng))

    with partitioning.activate(ctx.mesh, ctx.rules):
        return compute_copies.compute_dtypes(
            loss, params, variables, abstract_batch(ctx, input_shapes, pack=False), rng
        )


def collections_shardings(
    model: Model, input_shapes: InputShapes, ctx: RunContext
) -> dict[str, Any]:
    """``NamedSharding`` of every leaf of the model's state collections on ``ctx.mesh``
    (``{}`` for a model without any)."""
    return partitioning.tree_shardings(model.state_logical_axes(input_shapes), ctx.mesh, ctx.rules)


@dataclasses.dataclass
class RestoredModel:
    """What a forward pass needs of a checkpoint, laid out on the run's mesh.

    ``params``: the parameter tree; ``collections``: ``{collection: tree}`` of the
    non-parameter state collections (``{}`` for models without, e.g. ``router_bias`` for
    the auxiliary-loss-free bias router); ``step``, ``meta``: the checkpoint's step and
    metadata.
    """

    params: Any
    collections: dict[str, Any]
    step: int
    meta: dict[str, Any]

    @property
    def params_shardings(self) -> Any:
        return jax.tree.map(lambda a: a.sharding, self.params)

    @property
    def collections_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self.collections)


def restore_model(
    path: str, model: Model, input_shapes: InputShapes, ctx: RunContext
) -> RestoredModel:
    """The parameters and state collections of the checkpoint at ``path`` (``MODEL_DIR``,
    ``MODEL_DIR/STEP`` or ``MODEL_DIR/checkpoints/STEP``) on ``ctx.mesh``, whatever mesh
    saved them: the restore of `moe-jax eval`, `infer` and `analyze` (through
    :func:`moe_jax.runtime.checkpoints.restore_from`; the optimizer state is not read).

    Raises:
      moe_jax.runtime.checkpoints.MissingCheckpointError: naming the path.
      moe_jax.runtime.checkpoint_checks.CheckpointMismatchError: naming the mismatching
        parameters.
      moe_jax.runtime.checkpoint_checks.UnreadableCheckpointError: naming the file.
    """

    abstract = abstract_variables(model, input_shapes)
    params_target = train_state.abstract_with_shardings(
        abstract.pop("params"),
        train_state.param_shardings(model, input_shapes, ctx.mesh, ctx.rules),
    )
    collections_target = train_state.abstract_with_shardings(
        abstract, collections_shardings(model, input_shapes, ctx)
    )
    params, collections, step, meta = checkpoints.restore_from(
        path, params_target, collections_target
    )
    return RestoredModel(params=params, collections=collections, step=step, meta=meta)


@dataclasses.dataclass
class TrainSetup:
    """A run's state layout and jitted steps on ``ctx.mesh``.

    ``abstract_state``: the ``TrainState`` as ``ShapeDtypeStruct`` leaves carrying their
    shardings (a restore target, or the input of ``jitted_train_step.lower``);
    ``jitted_train_step(state, batch) -> (state, metrics)`` donates ``state``;
    ``jitted_eval_step(params, batch, collections=None) -> metrics`` (``collections``: the
    state's non-parameter collections).
    """

    ctx: RunContext
    input_shapes: dict[str, tuple[int, int]]
    tx: optax.GradientTransformation
    learning_rate_fn: optax.Schedule
    abstract_state: train_state.TrainState
    shardings: train_state.TrainState
    jitted_train_step: steps.TrainStep
    jitted_eval_step: steps.EvalStep
    _init_fn: Callable[[], train_state.TrainState]

    def lower_init(self, kernel_random: bool = True) -> jax.stages.Lowered:
        """The program that makes the initial state, lowered for a quick compile on the
        mesh's platform (``hardware.init_compiler_options``; CPU, GPU: no LLVM
        optimisations).

        ``kernel_random``: with JAX's settings of ``hardware.init_program_config`` (GPU:
        threefry as one kernel call per random array, several times faster to compile, but
        each device makes a sharded array whole before keeping its shard); False: JAX's
        default, each device generating only its shards.
        """
        platform = self.ctx.mesh.devices.flat[0].platform
        with (
            partitioning.activate(self.ctx.mesh, self.ctx.rules),
            hardware.init_program_config(platform) if kernel_random else contextlib.nullcontext(),
        ):
            return jax.jit(
                self._init_fn,
                out_shardings=self.shardings,
                compiler_options=hardware.init_compiler_options(platform),
            ).lower()

    def compile_init(self) -> jax.stages.Compiled:
        """:meth:`lower_init`'s program compiled: with ``kernel_random`` where that changes
        the program (``hardware.init_jax_settings``) and its memory (outputs and
        temporaries) fits each device, as the train step's fit is judged
        (``hardware.device_facts``); else without."""
        compiled = self.lower_init().compile()
        devices = list(self.ctx.mesh.devices.flat)
        if hardware.init_jax_settings(devices[0].platform):
            memory = compiled.memory_analysis()
            if (
                memory is not None
                and memory.output_size_in_bytes + memory.temp_size_in_bytes
                > hardware.device_facts(devices).hbm_bytes
            ):
                compiled = self.lower_init(kernel_random=False).compile()
        return compiled

    def init_state(self) -> train_state.TrainState:
        """A freshly initialised state, each device holding only its shards, from
        :meth:`compile_init`'s program."""
        return self.compile_init()()


def abstract_batch(
    ctx: RunContext, input_shapes: Mapping[str, tuple[int, int]], pack: bool = True
) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch as ``ShapeDtypeStruct`` s sharded over ``ctx``'s batch axes: the
    ``int32[batch, length]`` features of an encoder-decoder batch (with segment ids and
    positions when ``pack``), as the data pipeline yields them."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(ctx.mesh, PartitionSpec(ctx.batch_axes))
    enc, dec = input_shapes["encoder_input_tokens"], input_shapes["decoder_input_tokens"]
    features = {
        "encoder_input_tokens": enc,
        "decoder_input_tokens": dec,
        "decoder_target_tokens": dec,
        "decoder_loss_weights": dec,
    }
    if pack:
        features |= {
            "encoder_segment_ids": enc,
            "encoder_positions": enc,
            "decoder_segment_ids": dec,
            "decoder_positions": dec,
        }
    return {
        name: jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)
        for name, shape in features.items()
    }


def build_train_setup(
    model: Model,
    input_shapes: dict[str, tuple[int, int]],
    ctx: RunContext,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    *,
    router_mode: str = "learned",
    bias_mode: str = "updated",
    seed: int = 0,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
) -> TrainSetup:
    """The abstract sharded state and the jitted steps of ``model`` on ``ctx.mesh`` for
    batches of ``input_shapes``, trained by ``tx`` (its router updates zeroed when
    ``router_mode`` is ``frozen``: ``freeze.apply_router_mode``; ``learning_rate_fn`` is
    ``tx``'s schedule, logged) with the balancing biases ``bias_mode`` (``freeze.BIAS_MODES``).
    """
    tx = freeze.apply_router_mode(tx, mode=router_mode)
    init_fn = functools.partial(
        train_state.init_train_state,
        model,
        tx,
        input_shapes,
        seed,
        compute_dtypes(model, input_shapes, ctx),
    )
    abstract = jax.eval_shape(init_fn)
    shardings = train_state.state_shardings(
        abstract,
        train_state.param_shardings(model, input_shapes, ctx.mesh, ctx.rules),
        ctx.mesh,
        collections_shardings(model, input_shapes, ctx),
    )
    return TrainSetup(
        ctx=ctx,
        input_shapes=dict(input_shapes),
        tx=tx,
        learning_rate_fn=learning_rate_fn,
        abstract_state=train_state.abstract_with_shardings(abstract, shardings),
        shardings=shardings,
        jitted_train_step=steps.jit_train_step(
            model,
            tx,
            learning_rate_fn,
            shardings,
            ctx.mesh,
            ctx.rules,
            ctx.batch_axes,
            accum_steps=accum_steps,
            skip_nonfinite=skip_nonfinite,
            bias_mode=bias_mode,
        ),
        jitted_eval_step=steps.jit_eval_step(
            model, shardings.params, ctx.mesh, ctx.rules, ctx.batch_axes, shardings.collections
        ),
        _init_fn=init_fn,
    )


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every gin-configured command takes (gin files/bindings, distributed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    gin_flags.add_gin_flags(parser)
    distributed.add_distributed_flags(parser)
    return parser
