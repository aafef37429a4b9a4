"""optax optimizers and learning-rate schedules, built from their settings (no gin here:
the gin names below fill ``RunSpec.optimizer``, ``run_spec.OptimizerSpec`` and
``ScheduleSpec``, registered by :mod:`moe_jax.runtime.configured`).

    create_optimizer.name = 'adafactor'          # or 'adam', 'adamw', 'sgd'
    create_optimizer.learning_rate = @learning_rate_schedule()
    learning_rate_schedule.base_learning_rate = 0.01
    learning_rate_schedule.warmup_steps = 1000
    learning_rate_schedule.decay = 'rsqrt'       # or 'cosine', 'constant', 'linear'

Router parameters are frozen *through the optimizer* (their updates are zeroed) when the
MoE gin files say the router is frozen: see :func:`moe_jax.moe.freeze.apply_router_mode`.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import optax

from moe_jax import errors

DECAYS = ("rsqrt", "cosine", "linear", "constant")
OPTIMIZERS = ("adam", "adamw", "adafactor", "sgd")


def learning_rate_schedule(
    base_learning_rate: float = 1e-2,
    warmup_steps: int = 1000,
    decay: str = "rsqrt",
    total_steps: int | None = None,
    final_learning_rate: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from 0 to ``base_learning_rate`` over ``warmup_steps``, then ``decay``.

    ``rsqrt``: ``base * sqrt(warmup / step)`` after warmup (T5's inverse square root);
    ``cosine`` and ``linear``: to ``final_learning_rate`` at ``total_steps``;
    ``constant``: stays at ``base``.
    """
    _check_number("base_learning_rate", base_learning_rate)
    _check_number("final_learning_rate", final_learning_rate)
    _check_number("warmup_steps", warmup_steps)
    if total_steps is not None:
        _check_number("total_steps", total_steps)
    if decay not in DECAYS:
        raise ValueError(f"learning_rate_schedule.decay={decay!r}; expected one of {DECAYS}")
    if decay in ("cosine", "linear") and not total_steps:
        raise ValueError(
            f"learning_rate_schedule.decay={decay!r} needs total_steps "
            "(bind learning_rate_schedule.total_steps = %TRAIN_STEPS)"
        )
    warmup_steps = max(int(warmup_steps), 0)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = base_learning_rate * jnp.minimum(1.0, (step + 1.0) / max(warmup_steps, 1))
        if decay == "rsqrt":
            after = base_learning_rate * jnp.sqrt(
                max(warmup_steps, 1) / jnp.maximum(step + 1.0, 1.0)
            )
        elif decay == "constant":
            after = jnp.asarray(base_learning_rate, jnp.float32)
        else:
            assert total_steps  # refused above for cosine and linear
            frac = jnp.clip((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
            shape = 0.5 * (1.0 + jnp.cos(jnp.pi * frac)) if decay == "cosine" else 1.0 - frac
            after = final_learning_rate + (base_learning_rate - final_learning_rate) * shape
        return jnp.where(step < warmup_steps, warm, after)

    return schedule


def _check_number(name: str, value: object) -> None:
    """Refuses a ``learning_rate_schedule`` setting that is not a real number (a string such
    as ``'fast'`` would fail inside the schedule's arithmetic, far from its binding).

    Raises:
      ConfigError: naming the parameter and its value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise errors.ConfigError(f"learning_rate_schedule.{name} = {value!r}; expected a number")


def create_optimizer(
    name: str = "adafactor",
    learning_rate: float | optax.Schedule | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip_norm: float | None = None,
    momentum: float | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """An optax optimizer by name and its learning-rate schedule (for logging).

    ``learning_rate``: a float or schedule; default :func:`learning_rate_schedule`'s
    defaults.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"create_optimizer.name={name!r}; expected one of {OPTIMIZERS}")
    lr = learning_rate_schedule() if learning_rate is None else learning_rate
    schedule = lr if callable(lr) else optax.constant_schedule(float(lr))
    if name == "adam":
        tx = optax.adam(schedule, b1=b1, b2=b2, eps=eps)
    elif name == "adamw":
        tx = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    elif name == "adafactor":
        tx = optax.adafactor(schedule, momentum=momentum, weight_decay_rate=weight_decay or None)
    else:
        tx = optax.sgd(schedule, momentum=momentum)
    if grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
    return tx, schedule
