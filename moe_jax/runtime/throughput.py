"""The trainer's throughput meter: steps/s, tokens/s and model FLOPs utilisation (MFU)
against the devices' peak (:func:`peak_flops_per_device`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax

from moe_jax import hardware


def peak_flops_per_device(override: float | None = None) -> float:
    """Peak FLOP/s of one device: ``override`` when given (gin:
    ``peak_flops_per_device.override``), else the chip's dense bf16 peak
    (``moe_jax.hardware.CHIPS``, by device kind), else (CPU) the measured rate of a jitted
    float32 2048x2048 matmul."""
    if override:
        return float(override)
    return hardware.device_facts(jax.devices()).peak_flops


class ThroughputMeter:
    """Steps/s, tokens/s and MFU over the steps since the last :meth:`rates` call.

    ``peak_flops_total``: the devices' peak FLOP/s together, or a function returning it,
    called once, at the first :meth:`rates` (on CPU the peak is a measured matmul: the
    trainer measures it there, not before its first step), its seconds counted in no
    interval.
    """

    def __init__(
        self,
        flops_per_step: float,
        tokens_per_step: int,
        peak_flops_total: float | Callable[[], float],
    ):
        self.flops_per_step = flops_per_step
        self.tokens_per_step = tokens_per_step
        self._peak = peak_flops_total
        self._start, self._steps = time.perf_counter(), 0

    @functools.cached_property
    def peak_flops_total(self) -> float:
        """The devices' peak FLOP/s together (the function given called on first use)."""
        return float(self._peak() if callable(self._peak) else self._peak)

    def tick(self) -> None:
        self._steps += 1

    def rates(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        steps_per_sec = self._steps / elapsed
        peak = self.peak_flops_total
        out = {
            "steps_per_sec": steps_per_sec,
            "step_time_sec": 1 / max(steps_per_sec, 1e-9),
            "tokens_per_sec": steps_per_sec * self.tokens_per_step,
            "mfu": steps_per_sec * self.flops_per_step / peak,
        }
        self._start, self._steps = time.perf_counter(), 0
        return out
