"""Gin at the commands' front door: every name gin files bind is registered here, and what
gin chooses for a run is read here once (as T5X's binaries bind the partitioner and trainer
that ``train()`` takes as arguments). The library (``moe_jax.moe``, ``moe_jax.models``,
``moe_jax.data``, ``moe_jax.partitioning``, the runtime's library modules) imports no gin
and takes these as arguments.

The registry: the library's classes (``MoeConfig`` and its parts, the router configs,
``T5Config``, ``EncoderDecoder``, ``EncoderDecoderModel``, ``utils.DatasetConfig``,
``WandbSettings``) are registered in place under the module they have always had, so gin
builds the library's own class; its functions (``sources.make_source``,
``vocab.get_vocabulary``, ``pipeline.get_dataset``, ``freeze.router_mode`` /
``bias_mode``, ``partitioning.standard_logical_axis_rules``, ``peak_flops_per_device``)
are registered as the gin wrappers this module holds under the same names. The data's tasks
read the source and vocabulary these wrappers give (``sources.select_settings``,
``vocab.select_vocabulary``).

:func:`train_spec` (gin: ``train_script.train``): the run as a
:class:`~moe_jax.runtime.run_spec.RunSpec` and its ``MODEL_DIR``; each of its gin parameters
fills the spec field named in its docstring, and the rest of the spec comes from
:func:`model_spec` (the model ``%MODEL`` built), :func:`mesh_spec` (``make_mesh.*``,
``standard_logical_axis_rules.*``, ``run_context.batch_axes``), :func:`optimizer_spec`
(``create_optimizer.*``, ``learning_rate_schedule.*``), ``make_source.*`` (the data source)
and ``router_mode.mode`` / ``bias_mode.mode``. The spec's ``OptimizerSpec``,
``ScheduleSpec`` and ``MeshSpec`` are registered here as the configurables
``create_optimizer``, ``learning_rate_schedule`` and ``make_mesh``.

:func:`run_context`: the mesh and rules of :func:`mesh_spec` over the given devices.

:func:`train_setup`: the run's train setup with the gin-configured optimizer, router mode
and balancing-bias mode (for code that builds a step without a spec: ``compile``, tests).

:func:`model`: the model ``configured.model.model`` is bound to (``gin/runs/load.gin``:
``%MODEL``), for code that takes no command's configurable (``moe_jax.load``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import gin
import jax

from moe_jax import errors, partitioning
from moe_jax.data import pipeline, sources, vocab
from moe_jax.models import t5
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.moe import config as moe_config
from moe_jax.moe import freeze
from moe_jax.runtime import builders, gin_utils, profiling, throughput, wandb_logger
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.run_spec import (
    CheckpointSettings,
    DataSpec,
    EvalSettings,
    LoopSpec,
    MeshSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    ScheduleSpec,
    VocabularySpec,
)


# Every configurable name the gin files, run directories and users bind, registered here
# under the module and name it has always had (``MoeConfig``, ``T5Config``,
# ``utils.DatasetConfig``, ``sources.make_source``, ...): the library modules import no gin.
# Classes are registered in place (``gin.configurable`` wraps their ``__init__``), so the
# class gin builds is the library's own; a function's gin wrapper is kept here, and the
# library is given what it returns.
def _register(obj: Any, module: str | None = None, name: str | None = None) -> Any:
    """``obj`` registered with gin as ``module.name`` (default: its own)."""
    return gin.configurable(name or obj.__name__, module=module or obj.__module__)(obj)


for _cls in (
    moe_config.TopKRouterConfig,
    moe_config.NoisyTopKRouterConfig,
    moe_config.ExpertChoiceRouterConfig,
    moe_config.HashRouterConfig,
    moe_config.RandomRouterConfig,
    moe_config.HierarchicalRouterConfig,
    moe_config.NoisyHierarchicalRouterConfig,
    moe_config.CapacityConfig,
    moe_config.ExecutionConfig,
    moe_config.AuxLossConfig,
    moe_config.MoeConfig,
    t5.T5Config,
    t5.EncoderDecoder,
    EncoderDecoderModel,
    wandb_logger.WandbSettings,
):
    _register(_cls)
_register(builders.DatasetConfig, module="utils")

get_dataset = _register(pipeline.get_dataset)
get_vocabulary = _register(vocab.get_vocabulary)
make_source = _register(sources.source_settings, module=sources.__name__, name="make_source")
router_mode = _register(freeze.router_mode)
bias_mode = _register(freeze.bias_mode)
standard_logical_axis_rules = _register(partitioning.standard_logical_axis_rules)
peak_flops_per_device = _register(throughput.peak_flops_per_device)

# What the data's tasks read until a command selects a recorded run's: gin's bindings.
sources.select_settings(make_source)
vocab.select_vocabulary(get_vocabulary)


@gin.configurable(module="configured")
def model(model: Model = gin.REQUIRED) -> Model:
    """The gin config's model (``configured.model.model = %MODEL``)."""
    return model


@gin.configurable("train", module="train_script")
def train_spec(
    *,
    model: Model = gin.REQUIRED,
    train_dataset_cfg: builders.DatasetConfig = gin.REQUIRED,
    train_eval_dataset_cfg: builders.DatasetConfig | None = None,
    model_dir: str = gin.REQUIRED,
    total_steps: int = gin.REQUIRED,
    random_seed: int = 0,
    checkpoint_period: int = 1000,
    keep_checkpoints: int | None = 3,
    async_checkpointing: bool = True,
    log_period: int = 100,
    eval_period: int = 0,
    eval_steps: int = 10,
    accum_steps: int = 1,
    on_nonfinite: str = "stop",
    sync_every_step: bool = False,
    routing_churn: bool = True,
    profile_steps: tuple[int, int] | None = None,
) -> tuple[RunSpec, str]:
    """The run ``train_script.train``'s bindings describe, and its ``MODEL_DIR``
    (``model_dir``). Each parameter fills one field: ``model`` -> ``model``
    (:func:`model_spec`), ``train_dataset_cfg`` / ``train_eval_dataset_cfg`` ->
    ``data.train`` / ``data.eval``, ``random_seed`` -> ``seed``, ``total_steps``,
    ``accum_steps``, ``log_period``, ``on_nonfinite``, ``sync_every_step``,
    ``profile_steps`` -> ``loop.*`` of the same names, ``checkpoint_period`` /
    ``keep_checkpoints`` / ``async_checkpointing`` -> ``loop.checkpoint.period`` / ``keep`` /
    ``async_save``, ``eval_period`` / ``eval_steps`` / ``routing_churn`` ->
    ``loop.eval.period`` / ``steps`` / ``routing_churn``.

    Raises:
      ConfigError: naming ``train.profile_steps`` when it is not two integers >= 1, or the
        model's vocabulary when a run cannot record it.
    """
    loop = LoopSpec(
        total_steps=total_steps,
        accum_steps=accum_steps,
        log_period=log_period,
        on_nonfinite=on_nonfinite,
        sync_every_step=sync_every_step,
        profile_steps=profiling.check_profile_steps(profile_steps),
        checkpoint=CheckpointSettings(checkpoint_period, keep_checkpoints, async_checkpointing),
        eval=EvalSettings(eval_period, eval_steps, routing_churn),
    )
    data = DataSpec(train_dataset_cfg, train_eval_dataset_cfg, data_source())
    spec = RunSpec(
        model=model_spec(model),
        data=data,
        loop=loop,
        mesh=mesh_spec(),
        optimizer=optimizer_spec(),
        router_mode=router_mode(),
        bias_mode=bias_mode(),
        seed=random_seed,
    )
    return spec, model_dir


def model_spec(model: Model) -> ModelSpec:
    """The spec of a gin-built ``EncoderDecoderModel``: its network config, loss settings
    and vocabulary (``@vocab.get_vocabulary`` as gin binds its arguments, or a size).

    Raises:
      ConfigError: another model type, or a vocabulary that is neither.
    """
    if not isinstance(model, EncoderDecoderModel):
        raise errors.ConfigError(
            f"MODEL = {model!r}: a run records an EncoderDecoderModel (gin/models/t5_dense.gin)"
        )
    source = model.vocabulary_source
    if source is get_vocabulary:
        vocabulary: VocabularySpec | int = VocabularySpec(
            **gin_utils.bound_arguments(get_vocabulary)
        )
    elif isinstance(source, int) and not isinstance(source, bool):
        vocabulary = source
    else:
        raise errors.ConfigError(
            f"EncoderDecoderModel.vocabulary = {source!r}: a run records "
            "@vocab.get_vocabulary (its kind, path and extra ids) or a vocabulary size"
        )
    return ModelSpec(
        network=model.module.config,
        vocabulary=vocabulary,
        label_smoothing=model.label_smoothing,
        z_loss=model.z_loss,
        loss_normalizing_factor=model.loss_normalizing_factor,
    )


def data_source() -> dict[str, Any]:
    """``make_source``'s settings as gin binds them, as JSON values (lists for tuples)."""
    return json.loads(json.dumps(make_source()))


# The gin names of the optimizer and the mesh's shape are the spec's own classes, registered
# here under the names the gin files bind (the library's functions of those names,
# ``optimizers.create_optimizer`` and ``partitioning.make_mesh``, read no gin): gin builds
# them, and lists their bindings in the operative config, as it does ``T5Config``.
gin.configurable("learning_rate_schedule", module="moe_jax.runtime.optimizers")(ScheduleSpec)
gin.configurable("create_optimizer", module="moe_jax.runtime.optimizers")(OptimizerSpec)
gin.configurable(
    "make_mesh",
    module="moe_jax.partitioning",
    allowlist=["mesh_shape", "axis_names", "max_expert_partitions"],
)(MeshSpec)


@gin.configurable("run_context")  # its gin name from before: run_context.batch_axes
def mesh_spec(batch_axes: Sequence[str] = partitioning.BATCH_AXES) -> MeshSpec:
    """The mesh gin binds: its shape (``make_mesh.*``), the logical axis rules
    (``standard_logical_axis_rules.*``) and the batch axes (``run_context.batch_axes``)."""
    return MeshSpec(rules=_tuples(standard_logical_axis_rules()), batch_axes=tuple(batch_axes))


def _tuples(value: Any) -> Any:
    """``value`` with every list or tuple inside made a tuple (as a spec holds them)."""
    return tuple(map(_tuples, value)) if isinstance(value, (list, tuple)) else value


def optimizer_spec() -> OptimizerSpec:
    """The optimizer gin binds (``create_optimizer.*``), its learning rate a number or the
    schedule it is bound to (default: ``learning_rate_schedule.*``'s).

    Raises:
      ConfigError: ``create_optimizer.learning_rate`` bound to anything else.
    """
    spec = OptimizerSpec()
    rate = spec.learning_rate
    if rate is None:
        return dataclasses.replace(spec, learning_rate=ScheduleSpec())
    if isinstance(rate, bool) or not isinstance(rate, (ScheduleSpec, int, float)):
        raise errors.ConfigError(
            f"create_optimizer.learning_rate = {rate!r}: a run records a number or "
            "@learning_rate_schedule()"
        )
    return spec


def run_context(devices: Sequence[jax.Device] | None = None) -> builders.RunContext:
    """:meth:`MeshSpec.context <moe_jax.runtime.run_spec.MeshSpec.context>` of
    :func:`mesh_spec` over ``devices`` (default: all global devices)."""
    return mesh_spec().context(devices)


def train_setup(
    model: Model,
    input_shapes: dict[str, tuple[int, int]],
    ctx: builders.RunContext,
    *,
    seed: int = 0,
    accum_steps: int = 1,
    skip_nonfinite: bool = False,
) -> builders.TrainSetup:
    """:func:`builders.build_train_setup` with the optimizer, router mode and bias mode that
    gin binds."""
    tx, learning_rate_fn = optimizer_spec().build()
    return builders.build_train_setup(
        model,
        input_shapes,
        ctx,
        tx,
        learning_rate_fn,
        router_mode=router_mode(),
        bias_mode=bias_mode(),
        seed=seed,
        accum_steps=accum_steps,
        skip_nonfinite=skip_nonfinite,
    )
