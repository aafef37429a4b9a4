"""The grouped matmul of the dropless path: ``[rows, k] x [experts, k, n] -> [rows, n]``.

Its three products run through one kernel, each with its own dimension numbers of
``jax.lax.ragged_dot_general``:

* forward: ``y = x @ w[e]`` on each expert's rows ``[m, k] x [experts, k, n] -> [m, n]``;
* input gradient: ``dx = dy @ w[e]^T``, ``[m, n] x [experts, k, n] -> [m, k]``;
* weight gradient, the transposed ragged product: ``dw[e] = x_e^T @ dy_e``,
  ``[m, k] x [m, n] -> [experts, k, n]``, ragged over the contracted rows.

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
from jax.lax import RaggedDotDimensionNumbers

from moe_jax.moe import grouped_matmul_pallas as kernels
from moe_jax.moe.options import GroupedMatmul

Array = jax.Array
# (rows [m, k] sorted by group, weights [groups, k, n], group_sizes [groups] int32) -> [m, n];
# rows past sum(group_sizes) are zeros with ``xla`` and ``pallas``, anything with tokamax.
RaggedDot = Callable[[Array, Array, Array], Array]
# One product of ``jax.lax.ragged_dot_general``'s form:
# (lhs, rhs, group_sizes, dimension numbers, output dtype) -> result.
RaggedDotGeneral = Callable[
    [Array, Array, Array, RaggedDotDimensionNumbers, jax.typing.DTypeLike], Array
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


def _xla(lhs: Array, rhs: Array, sizes: Array, dims: RaggedDotDimensionNumbers, dtype) -> Array:
    return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=dtype).astype(
        dtype
    )


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

    def product(lhs, rhs, sizes, dims, dtype):
        return tokamax.ragged_dot_general(
            lhs, rhs, sizes, dims, preferred_element_type=dtype, implementation=name
        ).astype(dtype)

    return product


def _pallas(platform: str) -> RaggedDotGeneral:
    """The project's Pallas kernels (:mod:`moe_jax.moe.grouped_matmul_pallas`) for a
    ``platform`` (a ``jax.Device.platform`` name or its family): Triton on GPU, Pallas's
    interpreter on CPU.

    Raises:
      NotImplementedError: another platform (no Triton there), or dimension numbers other
        than the three products'.
    """
    if platform not in ("cpu", "gpu", "cuda", "rocm"):
        raise NotImplementedError(f"the pallas grouped matmul has no {platform} lowering")
    products = (
        (FORWARD, kernels.forward),
        (INPUT_GRADIENT, kernels.input_gradient),
        (WEIGHT_GRADIENT, kernels.weight_gradient),
    )

    def product(lhs, rhs, sizes, dims, dtype):
        for known, kernel in products:
            if dims == known:
                return kernel(lhs, rhs, sizes, dtype, interpret=platform == "cpu")
        raise NotImplementedError(f"the pallas grouped matmul has no product {dims}")

    return product


def _product(name: GroupedMatmul, part: str, platform: str) -> RaggedDotGeneral:
    """The ``part`` product through kernel ``name`` (``pallas`` or tokamax's) compiled for
    ``platform``; where the kernel raises while tracing, through ``xla`` (warned once per
    kernel)."""

    def product(lhs, rhs, sizes, dims, dtype):
        if name not in _FAILED:
            try:
                kernel = _pallas(platform) if name == "pallas" else _tokamax(name)
                return kernel(lhs, rhs, sizes, dims, dtype)
            except Exception as error:  # any trace failure: the result must still come
                message = str(error).splitlines()[0] if str(error) else ""
                _FAILED[name] = f"{part}: {type(error).__name__}: {message}"
                _LOG.warning(
                    "grouped matmul %r failed to trace the %s; using "
                    "jax.lax.ragged_dot_general for it from now on in this process",
                    name,
                    _FAILED[name],
                )
        return _xla(lhs, rhs, sizes, dims, dtype)

    return product


def ragged_dot(name: GroupedMatmul, platform: str | None = None) -> RaggedDot:
    """The grouped matmul through kernel ``name`` (``options.GROUPED_MATMULS``) for devices
    of ``platform`` (``cpu``, ``gpu``, ``tpu``, ...; None: the default device's): forward,
    input gradient and weight gradient each through it (or, where it fails to trace,
    through ``xla``). ``[m, k] x [experts, k, n] -> [m, n]`` in the inputs' dtype. ``xla``
    is ``jax.lax.ragged_dot`` itself, whose gradients are the same two products."""
    if name == "xla":
        return jax.lax.ragged_dot
    target = jax.devices()[0].platform if platform is None else platform

    @jax.custom_vjp
    def matmul(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return _product(name, "forward", target)(lhs, rhs, group_sizes, FORWARD, lhs.dtype)

    def forward(lhs, rhs, group_sizes):
        return matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def backward(residuals, cotangent):
        lhs, rhs, group_sizes = residuals
        d_lhs = _product(name, "input gradient", target)(
            cotangent, rhs, group_sizes, INPUT_GRADIENT, lhs.dtype
        )
        d_rhs = _product(name, "weight gradient", target)(
            lhs, cotangent, group_sizes, WEIGHT_GRADIENT, rhs.dtype
        )
        return d_lhs, d_rhs, None

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
