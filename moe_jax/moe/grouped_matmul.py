"""The grouped matmul of the dropless path: ``[rows, k] x [experts, k, n] -> [rows, n]``.

Its three products run through one kernel, each with its own dimension numbers of
``jax.lax.ragged_dot_general``:

* forward: ``y = x @ w[e]`` on each expert's rows ``[m, k] x [experts, k, n] -> [m, n]``;
* input gradient: ``dx = dy @ w[e]^T``, ``[m, n] x [experts, k, n] -> [m, k]``;
* weight gradient, the transposed ragged product: ``dw[e] = x_e^T @ dy_e``,
  ``[m, k] x [m, n] -> [experts, k, n]``, ragged over the contracted rows.

:func:`gathered_ragged_dot` is the same grouped matmul reading its ``[m, k]`` rows from
unsorted ``[tokens, k]`` rows through a ``permute.RowMap``: ``pallas`` gathers them in its
kernels' prologue (forward and weight gradient), so the sorted copy is never written; the
other kernels gather them first. The input gradient of the unsorted rows sums each token's
rows of the sorted input gradient (``permute.gather_sum``: a gather, no scatter-add).

Kernels (``ExecutionConfig.grouped_matmul``, settled by ``execution.resolve_plan``): ``xla``
is ``jax.lax.ragged_dot_general`` (every platform; XLA:TPU lowers it to a Mosaic grouped
matmul, XLA:GPU of jaxlib 0.10.2 to one dense matmul per expert over all rows).
``pallas`` is the project's own Pallas kernel (:mod:`moe_jax.moe.grouped_matmul_pallas`):
Triton on NVIDIA GPUs, Pallas's interpreter on CPU (slow; for tests); ``auto`` never picks
it (not yet measured on a GPU). The others are tokamax's Pallas kernels
(``tokamax.ragged_dot_general``): ``triton`` and ``mosaic_gpu`` (NVIDIA GPUs),
``mosaic_tpu``. tokamax (and through it Triton / Mosaic) is imported only when a kernel is
asked for, so a CPU run never pays for it.

A kernel is tied to the jax it was written against: :data:`TOKAMAX_PINS` lists the jax
versions each tokamax kernel is known to trace and run with, and ``grouped_matmul='auto'``
picks one only there (:func:`kernel_unsupported`). A kernel that raises while tracing one
of the three products (tokamax checks the process's device: "Not supported on cpu";
``pallas`` has no TPU lowering; a Pallas API that moved) leaves that product to ``xla`` and
logs one warning per kernel and process naming the kernel, the product and the error.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.lax import RaggedDotDimensionNumbers

from moe_jax.moe import grouped_matmul_pallas as kernels
from moe_jax.moe.options import GroupedMatmul
from moe_jax.moe.permute import RowMap, gather_sum

Array = jax.Array
# (rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] int32) -> [m, n];
# rows past sum(group_sizes) are zeros with ``xla`` and ``pallas``, anything with tokamax.
RaggedDot = Callable[[Array, Array, Array], Array]
# (rows [tokens, k] unsorted, weights [groups, k, n], group_sizes [groups] int32, RowMap of
# the m sorted rows into them) -> [m, n], as RaggedDot of the gathered rows.
GatheredRaggedDot = Callable[[Array, Array, Array, RowMap], Array]
# One product of ``jax.lax.ragged_dot_general``'s form:
# (lhs, rhs, group_sizes, dimension numbers, output dtype, row index) -> result; with a row
# index ([m] int32; forward and weight gradient) lhs is [tokens, k] and its row r is
# lhs[row_index[r]].
RaggedDotGeneral = Callable[
    [Array, Array, Array, RaggedDotDimensionNumbers, jax.typing.DTypeLike, Array | None], Array
]

_LOG = logging.getLogger(__name__)

# The three products (module docstring), as ragged_dot_general dimension numbers.
FORWARD = RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
INPUT_GRADIENT = RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
WEIGHT_GRADIENT = RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)

# tokamax kernel -> {tokamax version: jax versions ("major.minor") it traced and ran with}.
# tokamax 0.0.12's Triton kernels with jax 0.11.2 on an H100 (forward and both gradients,
# checked against ``xla``; benchmarks/RESULTS.md, "Measured on an accelerator"). Its Mosaic
# GPU kernel did not trace with jax 0.11.2 (``Mesh.__init__() got an unexpected keyword
# argument 'out_shape'``); its Mosaic TPU kernel was never run here.
TOKAMAX_PINS: dict[GroupedMatmul, dict[str, tuple[str, ...]]] = {
    "triton": {"0.0.12": ("0.11",)},
    "mosaic_gpu": {},
    "mosaic_tpu": {},
}

# Kernels that failed to trace in this process (each warned about once): kernel -> what
# failed ("<product>: <error type>: <message>").
_FAILED: dict[str, str] = {}


def fallbacks() -> dict[str, str]:
    """The kernels that failed to trace in this process, each with the product it failed
    on and the error; their products run through ``xla`` since."""
    return dict(_FAILED)


def kernel_unsupported(name: GroupedMatmul, jax_version: str | None = None) -> str | None:
    """Why the tokamax kernel ``name`` is not pinned for this process's jax (or
    ``jax_version``) and installed tokamax: a one-line reason, or None when it is (and for
    ``xla`` and ``pallas``, which are no tokamax kernels)."""
    if name not in TOKAMAX_PINS:
        return None
    try:
        tokamax_version = importlib.metadata.version("tokamax")
    except importlib.metadata.PackageNotFoundError:
        return "tokamax is not installed"
    jax_minor = ".".join((jax_version or jax.__version__).split(".")[:2])
    pinned = TOKAMAX_PINS[name].get(tokamax_version, ())
    if jax_minor not in pinned:
        return (
            f"tokamax {tokamax_version}'s {name} kernel is pinned to jax "
            f"{', '.join(pinned) or '(none)'}, not {jax_minor}"
        )
    return None


def _gathered(lhs: Array, row_index: Array | None) -> Array:
    """``lhs``, or its rows ``row_index`` (for a kernel that cannot gather them itself)."""
    return lhs if row_index is None else jnp.take(lhs, row_index, axis=0)


def _xla(
    lhs: Array,
    rhs: Array,
    sizes: Array,
    dims: RaggedDotDimensionNumbers,
    dtype,
    row_index: Array | None,
) -> Array:
    return jax.lax.ragged_dot_general(
        _gathered(lhs, row_index), rhs, sizes, dims, preferred_element_type=dtype
    ).astype(dtype)


@functools.cache
def _tokamax(name: GroupedMatmul) -> RaggedDotGeneral:
    """tokamax's ``ragged_dot_general`` with kernel ``name``; imports tokamax (heavy)."""
    import tokamax
    from absl import flags

    if name == "triton":
        _restore_pallas_dot()
    # tokamax reads its options from absl flags and, if nobody parsed them, parses
    # sys.argv: the program's own arguments, which absl then refuses. Take the defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

    def product(lhs, rhs, sizes, dims, dtype, row_index):
        return tokamax.ragged_dot_general(
            _gathered(lhs, row_index),
            rhs,
            sizes,
            dims,
            preferred_element_type=dtype,
            implementation=name,
        ).astype(dtype)

    return product


def _pallas(platform: str) -> RaggedDotGeneral:
    """The project's Pallas kernels (:mod:`moe_jax.moe.grouped_matmul_pallas`) for a
    ``platform`` (a ``jax.Device.platform`` name or its family): Triton on GPU, Pallas's
    interpreter on CPU.

    Raises:
      NotImplementedError: another platform (no Triton there), dimension numbers other than
        the three products', or a row index for the input gradient.
    """
    if platform not in ("cpu", "gpu", "cuda", "rocm"):
        raise NotImplementedError(f"the pallas grouped matmul has no {platform} lowering")
    interpret = platform == "cpu"

    def product(lhs, rhs, sizes, dims, dtype, row_index):
        if dims == FORWARD:
            return kernels.forward(lhs, rhs, sizes, dtype, interpret=interpret, row_index=row_index)
        if dims == WEIGHT_GRADIENT:
            return kernels.weight_gradient(
                lhs, rhs, sizes, dtype, interpret=interpret, row_index=row_index
            )
        if dims == INPUT_GRADIENT and row_index is None:
            return kernels.input_gradient(lhs, rhs, sizes, dtype, interpret=interpret)
        raise NotImplementedError(f"the pallas grouped matmul has no product {dims}")

    return product


def _product(name: GroupedMatmul, part: str, platform: str) -> RaggedDotGeneral:
    """The ``part`` product through kernel ``name`` compiled for ``platform``; where the
    kernel (``pallas`` or tokamax's) raises while tracing, through ``xla`` (warned once per
    kernel)."""

    def product(lhs, rhs, sizes, dims, dtype, row_index):
        if name != "xla" and name not in _FAILED:
            try:
                kernel = _pallas(platform) if name == "pallas" else _tokamax(name)
                return kernel(lhs, rhs, sizes, dims, dtype, row_index)
            except Exception as error:  # any trace failure: the result must still come
                message = str(error).splitlines()[0] if str(error) else ""
                _FAILED[name] = f"{part}: {type(error).__name__}: {message}"
                _LOG.warning(
                    "grouped matmul %r failed to trace the %s; using "
                    "jax.lax.ragged_dot_general for it from now on in this process",
                    name,
                    _FAILED[name],
                )
        return _xla(lhs, rhs, sizes, dims, dtype, row_index)

    return product


def ragged_dot(name: GroupedMatmul, platform: str | None = None) -> RaggedDot:
    """The grouped matmul through kernel ``name`` (``options.GROUPED_MATMULS``) for devices
    of ``platform`` (``cpu``, ``gpu``, ``tpu``, ...; None: the default device's): forward,
    input gradient and weight gradient each through it (or, where it fails to trace,
    through ``xla``). ``[m, k] x [experts, k, n] -> [m, n]`` in the inputs' dtype. ``xla``
    is ``jax.lax.ragged_dot`` itself, whose gradients are the same two products."""
    if name == "xla":
        return jax.lax.ragged_dot
    matmul = _grouped(name, platform)
    return lambda lhs, rhs, group_sizes: matmul(lhs, rhs, group_sizes, None)


def gathered_ragged_dot(name: GroupedMatmul, platform: str | None = None) -> GatheredRaggedDot:
    """:func:`ragged_dot` of rows gathered from unsorted ones: ``(x [tokens, k], w
    [experts, k, n], group_sizes [experts], rows: RowMap) -> [m, n]``, row ``r`` being
    ``x[rows.source[r]] @ w[e(r)]`` (``rows.inverse [tokens, r]``: each token's rows).
    ``pallas`` gathers in its kernels (forward and weight gradient), every other kernel
    before its product. ``x``'s gradient sums each token's rows of the input gradient
    (``permute.gather_sum``), so no product of ``m`` rows of ``x`` is ever written."""
    return _grouped(name, platform)


def _grouped(
    name: GroupedMatmul, platform: str | None
) -> Callable[[Array, Array, Array, RowMap | None], Array]:
    """``(lhs, rhs, group_sizes, rows)``: the grouped matmul through kernel ``name`` and its
    gradients, of ``lhs`` itself (``rows`` None: ``[m, k]`` sorted) or of its rows
    ``rows.source`` (:func:`gathered_ragged_dot`)."""
    target = jax.devices()[0].platform if platform is None else platform

    @jax.custom_vjp
    def matmul(lhs: Array, rhs: Array, group_sizes: Array, rows: RowMap | None) -> Array:
        index = None if rows is None else rows.source
        return _product(name, "forward", target)(lhs, rhs, group_sizes, FORWARD, lhs.dtype, index)

    def forward(lhs, rhs, group_sizes, rows):
        return matmul(lhs, rhs, group_sizes, rows), (lhs, rhs, group_sizes, rows)

    def backward(residuals, cotangent):
        lhs, rhs, group_sizes, rows = residuals
        d_lhs = _product(name, "input gradient", target)(
            cotangent, rhs, group_sizes, INPUT_GRADIENT, lhs.dtype, None
        )
        if rows is not None:  # each token's rows, summed
            d_lhs = gather_sum(d_lhs[None], rows.inverse[None], rows.inverse_valid[None])[0]
        d_rhs = _product(name, "weight gradient", target)(
            lhs,
            cotangent,
            group_sizes,
            WEIGHT_GRADIENT,
            rhs.dtype,
            None if rows is None else rows.source,
        )
        return d_lhs, d_rhs, None, None

    matmul.defvjp(forward, backward)
    return matmul


def _restore_pallas_dot() -> None:
    """tokamax 0.0.12's Triton kernels call ``pallas.dot``, which jax 0.11 moved to
    ``pallas.triton.dot`` (jax 0.10 keeps the old name only as a deprecated alias): unless
    the module itself defines it, point the old name at the new one."""
    from jax.experimental import pallas

    if "dot" not in vars(pallas):
        from jax.experimental.pallas import triton

        pallas.dot = triton.dot
