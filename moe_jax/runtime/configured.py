"""What gin chooses for a run, read for the commands after they parse gin (as T5X's
binaries bind the partitioner and trainer that ``train()`` takes as arguments): the library
(:func:`~moe_jax.runtime.builders.build_train_setup`, the model configs) reads no gin and
takes these as arguments.

:func:`run_context`: the mesh (``make_mesh`` bindings) over the given devices, the logical
axis rules (``standard_logical_axis_rules`` bindings) and ``run_context.batch_axes``.

:func:`train_setup`: the run's train setup with the gin-configured optimizer
(``create_optimizer``, ``learning_rate_schedule``), router mode (``router_mode.mode``) and
balancing-bias mode (``bias_mode.mode``).

:func:`model`: the model ``configured.model.model`` is bound to (``gin/runs/load.gin``:
``%MODEL``), for code that takes no command's configurable (``moe_jax.load``).
"""

from __future__ import annotations

from collections.abc import Sequence

import gin
import jax

from moe_jax import partitioning
from moe_jax.moe import freeze
from moe_jax.runtime import builders, optimizers
from moe_jax.runtime.model_protocol import Model


@gin.configurable(module="configured")
def model(model: Model = gin.REQUIRED) -> Model:
    """The gin config's model (``configured.model.model = %MODEL``)."""
    return model


@gin.configurable(denylist=["devices"])
def run_context(
    batch_axes: Sequence[str] = partitioning.BATCH_AXES, devices: Sequence[jax.Device] | None = None
) -> builders.RunContext:
    """:meth:`builders.RunContext.checked` with the gin-bound mesh over ``devices``
    (default: all global devices), the gin-bound logical axis rules and ``batch_axes``."""
    return builders.RunContext.checked(
        partitioning.make_mesh(devices=devices),
        partitioning.standard_logical_axis_rules(),
        batch_axes,
    )


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
    tx, learning_rate_fn = optimizers.create_optimizer()
    return builders.build_train_setup(
        model,
        input_shapes,
        ctx,
        tx,
        learning_rate_fn,
        router_mode=freeze.router_mode(),
        bias_mode=freeze.bias_mode(),
        seed=seed,
        accum_steps=accum_steps,
        skip_nonfinite=skip_nonfinite,
    )
