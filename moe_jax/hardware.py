"""Chip facts, the XLA options the steps compile with, and the machine's measured speed.

- :data:`CHIPS`: per accelerator chip, HBM bytes, dense peak bf16 FLOP/s, HBM bandwidth and
  interconnect (ICI / NVLink) bandwidth, as published by the vendor. ``moe-jax compile``
  judges fit and step time with it (its targets: :mod:`moe_jax.compile.targets`); the
  trainer's MFU divides by its peak; :func:`device_facts`: what one device offers.
- :func:`compiler_options` / :func:`init_compiler_options` / :func:`init_program_config`:
  the XLA options and JAX settings the project's programs compile with, per platform.
- :func:`measured_matmul_flops`: the measured matmul rate of this machine's first device.
- :func:`native_output_hidden`: native libraries' output on file descriptor 2 hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published facts of one accelerator chip (per chip, all its cores together).

    ``device_kinds``: the ``jax.Device.device_kind`` prefixes it appears as.
    ``interconnect_bandwidth``: bytes/s over all of the chip's ICI / NVLink links.
    """

    name: str
    platform: str
    device_kinds: tuple[str, ...]
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bandwidth: float
    interconnect_bandwidth: float


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", "tpu", ("TPU v4",), 32 * GiB, 275e12, 1.2e12, 300e9),
        Chip("v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 16 * GiB, 197e12, 819e9, 200e9),
        Chip("v5p", "tpu", ("TPU v5p", "TPU v5"), 95 * GiB, 459e12, 2.765e12, 600e9),
        Chip("v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 32 * GiB, 918e12, 1.64e12, 448e9),
        Chip("a100", "gpu", ("NVIDIA A100",), 85_100_068_864, 312e12, 2.039e12, 600e9),
        Chip("h100", "gpu", ("NVIDIA H100",), 84_942_979_072, 989e12, 3.35e12, 900e9),
        Chip("h200", "gpu", ("NVIDIA H200",), 151_397_597_184, 989e12, 4.8e12, 900e9),
    )
}


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What one device of a target offers (a chip divided by the devices it shows as)."""

    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float | None
    interconnect_bandwidth: float | None


def chip_of_device_kind(device_kind: str) -> Chip | None:
    """The chip a ``jax.Device.device_kind`` names (longest matching prefix), or None."""
    matches = [
        (len(kind), chip)
        for chip in CHIPS.values()
        for kind in chip.device_kinds
        if device_kind.startswith(kind)
    ]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def available_memory_bytes() -> int:
    """This machine's available memory (``MemAvailable`` of /proc/meminfo; total RAM where
    that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_facts(
    devices: Sequence,
    chip: Chip | None = None,
    num_chips: int | None = None,
    *,
    measure: bool = True,
) -> DeviceFacts:
    """Per-device facts of ``devices``: the chip's (from ``chip`` or the devices' kind) divided
    by the devices per chip (libtpu shows a v4 chip as 2 TensorCore devices); on CPU the
    machine's available memory shared by the devices and the measured matmul rate (NaN
    with ``measure`` False, for a caller that reads only the memory: the measurement takes
    a CPU second or two)."""
    chip = chip or chip_of_device_kind(devices[0].device_kind)
    if chip is None:
        return DeviceFacts(
            available_memory_bytes() // len(devices),
            measured_matmul_flops() if measure else float("nan"),
            None,
            None,
        )
    per_chip = max(1, len(devices) // num_chips) if num_chips else 1
    return DeviceFacts(
        chip.hbm_bytes // per_chip,
        chip.peak_bf16_flops / per_chip,
        chip.hbm_bandwidth / per_chip,
        chip.interconnect_bandwidth / per_chip,
    )


# XLA options the project's jitted steps compile with, per device platform. GPU: XLA
# 0.10.2's Triton GEMM emitter aborts on the T5-Base decoder's attention dots ("Couldn't
# find output tile sizes that satisfy hlo: bf16[3648,768] dot", base_learned.gin on
# gpu:h100:8); cuBLAS runs them instead.
_COMPILER_OPTIONS: dict[str, dict[str, Any]] = {"gpu": {"xla_gpu_enable_triton_gemm": False}}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _options_key(platform: str) -> str:
    """The key of ``platform`` (``cuda``, ``rocm``, ``gpu``: ``gpu``) in the option tables."""
    return "gpu" if platform in _GPU_PLATFORMS else platform


def compiler_options(platform: str) -> dict[str, Any]:
    """``jax.jit(..., compiler_options=)`` for steps compiled for ``platform`` devices."""
    return dict(_COMPILER_OPTIONS.get(_options_key(platform), {}))


# The initial state's program is run once and is almost all random-number generation:
# threefry inlined for every parameter (tens of thousands of element-wise instructions for
# T5-Base), which the backend's LLVM optimises for longer than the step takes to compile.
# Without LLVM's optimisations (CPU and GPU; libtpu has no such option) it compiles in a
# fraction of the time and gives the same values.
_INIT_COMPILER_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0},
    "gpu": {"xla_backend_optimization_level": 0},
}


def init_compiler_options(platform: str) -> dict[str, Any]:
    """``compiler_options`` of the program that makes a run's initial state on ``platform``."""
    return compiler_options(platform) | _INIT_COMPILER_OPTIONS.get(_options_key(platform), {})


# JAX settings while that program is traced and lowered. GPU: each threefry call becomes one
# call of jaxlib's CUDA threefry kernel instead of its rounds inlined as element-wise
# instructions (the same function). For T5-Base on one H100, compiled on a 2-core CPU host,
# the program's compile falls from 158 s to 21 s with unrolled layers and from 40 s to 9 s
# scanned (benchmarks/results/init_program.json). Only the initial state: the train
# step's dropout keeps its bits inside the fusions that use them. The kernel makes each
# random array whole on every device (TrainSetup.compile_init checks that it fits).
_INIT_JAX_CONFIG: dict[str, dict[str, Any]] = {"gpu": {"jax_threefry_gpu_kernel_lowering": True}}


def init_jax_settings(platform: str) -> dict[str, Any]:
    """JAX's settings for the initial state's program on ``platform`` devices (none on CPU
    and TPU)."""
    return dict(_INIT_JAX_CONFIG.get(_options_key(platform), {}))


@contextlib.contextmanager
def init_program_config(platform: str) -> Iterator[dict[str, Any]]:
    """While the block runs, JAX's configuration is that of the initial state's program on
    ``platform`` devices (:func:`init_jax_settings`); yields the settings made. The
    settings are part of JAX's jit cache key, so programs traced before or after are
    unaffected."""
    import jax

    settings = init_jax_settings(platform)
    saved = {name: getattr(jax.config, name) for name in settings}
    try:
        for name, value in settings.items():
            jax.config.update(name, value)
        yield settings
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


@contextlib.contextmanager
def native_output_hidden(hidden: bool = True) -> Iterator[TextIO]:
    """While the block runs, sends what is written to file descriptor 2 (libtpu's and the
    CUDA plugin's start-up warnings, XLA and TensorFlow logs, Python warnings) to a file
    that is then discarded; yields a stream on the real stderr for the caller's own
    messages. ``hidden`` False: everything passes through (``--verbose``)."""
    if not hidden:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    stream = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield stream
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
        stream.close()


# ----------------------------------------------------------------------------- measured


@functools.cache
def measured_matmul_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """Median FLOP/s of a jitted ``dtype`` ``[n, n] @ [n, n]`` matmul on the first local device
    (measured once per process and arguments)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), dtype), jax.local_devices()[0])
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))
