"""Measured speed of the machine: the reference rate that benchmarks and MFU quote against."""

from __future__ import annotations

import time

import jax
import numpy as np


def measured_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of a jitted float32 ``[n, n] @ [n, n]`` matmul on the first local device."""
    a = jax.device_put(np.ones((n, n), np.float32), jax.local_devices()[0])
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))
