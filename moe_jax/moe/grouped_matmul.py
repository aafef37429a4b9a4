"""The grouped matmul of the dropless path: ``[rows, k] x [experts, k, n] -> [rows, n]``.

``xla`` is ``jax.lax.ragged_dot`` (every platform; XLA:TPU lowers it to a Mosaic grouped
matmul, XLA:GPU to one dense matmul per expert over all rows). The others are tokamax's
Pallas kernels (``tokamax.ragged_dot``), forward and both gradients: ``triton`` and
``mosaic_gpu`` (NVIDIA GPUs), ``mosaic_tpu``, chosen by name
(``ExecutionConfig.grouped_matmul``; ``auto`` is ``xla``, see ``execution.resolve_plan``).
tokamax (and through it Triton / Mosaic) is imported only when a kernel is asked for, so a
CPU run never pays for it.
tokamax checks that the process's default device has the kernel's hardware, so a layer
with a kernel compiles only where it runs (not for a GPU from a CPU host).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from moe_jax.moe.options import GroupedMatmul

Array = jax.Array
# (rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] int32) -> [m, n];
# rows past sum(group_sizes) are not written (zeros with ``xla``, anything with a kernel).
RaggedDot = Callable[[Array, Array, Array], Array]


def ragged_dot(name: GroupedMatmul) -> RaggedDot:
    """The grouped matmul called ``name`` (``options.GROUPED_MATMULS``)."""
    if name == "xla":
        return jax.lax.ragged_dot
    import tokamax  # heavy (Triton / Mosaic): only when a kernel is asked for
    from absl import flags

    if name == "triton":
        _restore_pallas_dot()

    # tokamax reads its options from absl flags and, if nobody parsed them, parses
    # sys.argv: the program's own arguments, which absl then refuses. Take the defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

    def kernel(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=name)

    return kernel


def _restore_pallas_dot() -> None:
    """tokamax 0.0.12's Triton kernels call ``pallas.dot``, which jax 0.11 moved to
    ``pallas.triton.dot``: where the old name is gone, point it at the new one."""
    from jax.experimental import pallas

    if not hasattr(pallas, "dot"):
        from jax.experimental.pallas import triton

        pallas.dot = triton.dot
