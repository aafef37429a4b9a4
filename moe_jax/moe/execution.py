"""The MoE layer's execution plan: how its expert path runs on the devices it is compiled for.

:func:`resolve_plan` is the one place that holds the platform policy. ``MoeLayer`` traces
exactly the :class:`ExecutionPlan` it returns, and ``moe-jax compile`` reports the same
plan, so the report says what the compiled step does. Every choice gives the same results
(up to float summation order); only speed and memory differ.

The platform is the one of the devices the step is compiled for: the mesh set with
``jax.set_mesh`` carries it (``AbstractMesh.abstract_device``), also when a step for a TPU
slice is compiled on a CPU host. Only without a mesh (or with a mesh that names no
devices) is it the platform of the process's default device, where such a step runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from moe_jax.moe.config import MoeConfig
from moe_jax.moe.expert_parallel import axis_size
from moe_jax.moe.grouped_matmul import kernel_unsupported
from moe_jax.moe.options import Dispatch, DispatchOption, GroupedMatmul, GroupedMatmulOption

# The backend family whose choices apply (``ExecutionPlan.platform``).
Platform = Literal["cpu", "tpu", "gpu"]
# How the tokens reach the experts (``ExecutionPlan.implementation``).
Implementation = Literal["einsum", "sort", "ragged"]
# How expert inputs and outputs cross devices (``ExecutionPlan.exchange``).
ExchangeKind = Literal["local", "all_to_all", "ragged_all_to_all"]

# Platform names as ``jax.Device.platform`` / ``AbstractMesh.abstract_device.platform``
# report them, mapped to their backend family.
_PLATFORM_FAMILY: dict[str, Platform] = {
    "cpu": "cpu",
    "tpu": "tpu",
    "gpu": "gpu",
    "cuda": "gpu",
    "rocm": "gpu",
}


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """What one ``MoeLayer`` traces; fields that do not apply are False.

    Attributes:
      platform: ``cpu``, ``tpu`` or ``gpu``: the family of the target devices.
      implementation: ``einsum`` (one-hot dispatch / combine, the reference), ``sort``
        (sorted gathers into fixed-capacity buffers) or ``ragged`` (dropless: the sorted
        rows into one grouped matmul).
      per_expert_loop: the buffered expert matmuls run one expert at a time (``lax.map``)
        rather than batched over experts.
      choice_major_combine: the ``sort`` combine of token-choice routing gathers expert
        outputs as ``[groups, k, tokens, d_model]`` (else ``[groups, tokens, k, d_model]``).
      exchange: ``local`` (no expert parallelism), ``all_to_all`` (padded buffers
        ``[groups, experts, capacity, d_model]`` all-to-all'd over the ``expert`` mesh
        axis) or ``ragged_all_to_all`` (only the routed rows cross it).
      grouped_matmul: under ``ragged``, the grouped matmul (``options.GroupedMatmul``:
        ``xla`` = ``jax.lax.ragged_dot``, ``pallas`` = the project's kernel, else a
        tokamax kernel).
      gather_gradients: under ``sort`` / ``ragged`` (token choice), the row moves'
        gradients gather through the inverse map rather than scatter-add
        (``permute.take_rows``).
      scatter_rows: under ``sort`` / ``ragged`` (token choice), the row moves and their
        gradients scatter rows rather than gather them (``permute.scatter_rows``).
      gather_in_kernel: under ``ragged`` with the ``pallas`` grouped matmul and a ``local``
        exchange, the input projections read the token rows through the sorted order's
        row index in their kernel (``grouped_matmul.gathered_ragged_dot``): no sorted
        ``[assignments, d_model]`` copy of the tokens; its gradient sums each token's
        rows by a gather whatever ``gather_gradients`` / ``scatter_rows`` say (they still
        decide the combine's move).
    """

    platform: Platform
    implementation: Implementation
    per_expert_loop: bool
    choice_major_combine: bool
    exchange: ExchangeKind
    grouped_matmul: GroupedMatmul | Literal[False] = False
    gather_gradients: bool = False
    scatter_rows: bool = False
    gather_in_kernel: bool = False

    @property
    def dispatch(self) -> Dispatch:
        """``einsum`` or ``sort``: the ``ExecutionConfig.dispatch`` this plan runs
        (``ragged`` is the ``sort`` dispatch's dropless form)."""
        return "einsum" if self.implementation == "einsum" else "sort"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, and ``dispatch``."""
        return {**dataclasses.asdict(self), "dispatch": self.dispatch}


def resolve_plan(config: MoeConfig, target: AbstractMesh | str | None, dtype: Any) -> ExecutionPlan:
    """The plan of a layer of ``config`` with activations of ``dtype``, compiled for
    ``target``: a mesh (its devices' platform; expert parallelism when its ``expert``
    axis has size > 1), a platform name (``cpu``, ``tpu``, ``gpu``/``cuda``/``rocm``; no
    expert parallelism) or None (no mesh: the default device's platform).

    The options left to the platform (``ExecutionConfig.dispatch='auto'``,
    ``per_expert_loop=None``, ``gather_gradients=None``, ``scatter_rows=None``,
    ``grouped_matmul='auto'``) and
    the choices no option names are settled per platform from the compiled executables
    (benchmarks/RESULTS.md, "MoE layer"; "MoE layer on TPU and GPU targets"); each helper
    below says what it chose and why.

    Raises:
      ValueError: an unknown platform.
    """
    platform, expert_parallel = _target(config, target)
    execution = config.execution
    dispatch = _dispatch(execution.dispatch)
    ragged = (
        config.capacity.dropless
        and dispatch == "sort"
        and _dropless_runs_ragged(platform, expert_parallel)
    )
    sort_token_choice = dispatch == "sort" and config.router.token_choice
    exchange: ExchangeKind = "ragged_all_to_all" if ragged else "all_to_all"
    scatter = _scatter_rows(execution.scatter_rows, execution.gather_gradients, platform)
    gather = _gather_gradients(execution.gather_gradients, platform) and not scatter
    grouped_matmul = _grouped_matmul(execution.grouped_matmul, platform) if ragged else False
    return ExecutionPlan(
        platform=platform,
        implementation="ragged" if ragged else dispatch,
        per_expert_loop=_per_expert_loop(execution.per_expert_loop, platform, dtype) and not ragged,
        choice_major_combine=sort_token_choice and not ragged and _choice_major_combine(platform),
        exchange=exchange if expert_parallel else "local",
        grouped_matmul=grouped_matmul,
        gather_gradients=gather and (sort_token_choice or ragged),
        scatter_rows=scatter and (sort_token_choice or ragged),
        gather_in_kernel=_gather_in_kernel(grouped_matmul, platform, expert_parallel),
    )


def _target(config: MoeConfig, target: AbstractMesh | str | None) -> tuple[Platform, bool]:
    """(platform family, expert parallelism) of ``target`` (see :func:`resolve_plan`)."""
    if isinstance(target, str):
        return _family(target), False
    expert_parallel = axis_size(target, config.execution.expert_axis) > 1
    return _family(target_platform(target)), expert_parallel


def _dispatch(option: DispatchOption) -> Dispatch:
    """``ExecutionConfig.dispatch``, ``auto`` settled: ``sort`` on every platform.

    * CPU: measured 2.3-2.7x faster than ``einsum``.
    * TPU: at the T5-Base shape the one-hot ``einsum`` does 2.7x the FLOPs and moves more
      bytes (roofline 2.46x vs 2.98x the dense FFN on v5p at E = 8).
    * GPU (H100): ``einsum`` moves more bytes there too.
    """
    return "sort" if option == "auto" else option


def _per_expert_loop(option: bool | None, platform: Platform, dtype: Any) -> bool:
    """``ExecutionConfig.per_expert_loop``, None settled: one matmul per expert on CPU and
    for float32 on TPU, batched expert matmuls elsewhere.

    * CPU: XLA:CPU runs the batched expert einsum 1.1-1.3x slower.
    * TPU: the batched expert matmuls run expert-major (``experts.expert_ffn``): the
      group-major form made libtpu 0.0.42 abort (``Check failed: ReshapeIsBitcast`` in
      TpuCopyNormalizer) on the backward pass of float32 activations under expert
      parallelism. With float32 activations over a mesh with both data and expert axes
      (smoke config, mesh (2, 2, 1)) libtpu still aborts there, so float32 on TPU runs one
      matmul per expert (the accelerator configs are bfloat16; ``tests/train/test_aot.py``
      compiles the float32 case).
    """
    if option is not None:
        return option
    return platform == "cpu" or (platform == "tpu" and jnp.dtype(dtype) == jnp.float32)


def _choice_major_combine(platform: Platform) -> bool:
    """Whether the ``sort`` combine gathers choice-major: on TPU and GPU (for v5p the TPU
    compiler estimates 0.44x the cycles of the token-major gather fused into the weighted
    sum, fwd+bwd), not on CPU (there the choice-major step measured 1.15x slower)."""
    return platform != "cpu"


def _dropless_runs_ragged(platform: Platform, expert_parallel: bool) -> bool:
    """Whether dropless (``CapacityConfig.dropless``, ``sort`` dispatch) runs ``ragged``:
    always without expert parallelism; under it only where the ragged all-to-all pays, else
    it keeps fixed buffers of capacity = tokens per group (benchmarks/RESULTS.md, "Expert
    parallelism"):

    * TPU: ``ragged_all_to_all``. Only routed rows cross the interconnect, and the forward
      and input-gradient grouped matmuls are Mosaic kernels over the filled rows. At
      E = 32 over 4 v5p chips: 0.41x the padded layout's temporaries, 0.45x its HLO bytes.
    * GPU: padded. XLA:GPU lowers ``ragged_dot`` to one dense matmul per local expert over
      the whole receive buffer: min(k, experts per device) x the padded layout's FLOPs
      (8 x H100, E = 32: 2.0x the FLOPs, 1.5x the temporaries), which outweighs the smaller
      exchange.
    * CPU: padded. XLA:CPU (jaxlib 0.10.2) cannot compile it ("HLO opcode
      `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter").
    """
    return not expert_parallel or platform == "tpu"


def _gather_gradients(option: bool | None, platform: Platform) -> bool:
    """``ExecutionConfig.gather_gradients``, None settled: the ``sort`` and ``ragged`` row
    moves' gradients gather through the inverse map on GPU (compiled for H100: no float
    scatter-add left, 5.5% fewer HLO bytes at E = 8); JAX's scatter-add on TPU (the v5p
    compiler estimates 7-15% more cycles for the gathers at E = 64 / 8) and CPU (the
    gathers measured 1.55x slower at T5-Base, E = 8); docs/moe.md."""
    return platform == "gpu" if option is None else option


def _scatter_rows(option: bool | None, gather_option: bool | None, platform: Platform) -> bool:
    """``ExecutionConfig.scatter_rows``, None settled: on TPU, unless ``gather_gradients``
    asks for gathers. XLA:TPU's cost model counts a row gather from a tiled ``[rows, d_model]``
    array at about 7x the bytes it moves and a scatter-add of the same rows at about 1x;
    compiled for one v5p chip (T5-Base shape, E = 8, bf16, fwd+bwd) the scattering ``sort``
    layer accesses 1.047 GiB instead of 1.325 and the compiler estimates 2.45x the dense
    FFN's cycles instead of 3.08x (docs/moe.md, "The layer on TPU: row moves"). Below
    about 4096 rows of 768 the gathers cost less. Not on CPU or GPU, where scatter-adds
    serialise or go atomic (``permute``)."""
    if option is not None:
        return option
    return platform == "tpu" and not gather_option


def _grouped_matmul(option: GroupedMatmulOption, platform: Platform) -> GroupedMatmul:
    """``ExecutionConfig.grouped_matmul``, ``auto`` settled, in this order of candidates:

    * GPU, a step run on a GPU: tokamax's Triton kernel where it is pinned to the jax at
      hand (``grouped_matmul.TOKAMAX_PINS``). Measured on one H100 (jax 0.11.2) at
      0.42x / 0.36x / 0.30x the FLOP-matched dense FFN at E = 8 / 32 / 64, against
      0.076x / 0.021x / 0.010x for ``jax.lax.ragged_dot``. tokamax checks the process's
      own device, so a GPU step compiled from a host without a GPU (``moe-jax compile``)
      keeps ``xla``.
    * ``xla`` (``jax.lax.ragged_dot``) everywhere else. XLA:TPU lowers it to a Mosaic
      grouped matmul. XLA:GPU's cuDNN ragged-dot fusion would serve on a GPU, but in
      jaxlib 0.10.2 it is off by default (``xla_gpu_experimental_use_ragged_dot_fusion``):
      compiled for an H100 from a CPU host the three products are one dense cuBLAS matmul
      per expert over all rows; with the option on, the same for a cuDNN 9.10 target, and
      the compiler aborts (a failed check on the ``ragged-dot``) for cuDNN 9.22. tokamax's
      Mosaic GPU kernel is pinned to no jax (it did not trace with 0.11.2). The project's
      ``pallas`` kernel compiles for an H100 but is not measured yet: named only.

    docs/moe.md, "Dropless on GPU"."""
    if option != "auto":
        return option
    on_gpu = platform == "gpu" and jax.devices()[0].platform == "gpu"
    return "triton" if on_gpu and kernel_unsupported("triton") is None else "xla"


def _gather_in_kernel(
    grouped_matmul: GroupedMatmul | Literal[False], platform: Platform, expert_parallel: bool
) -> bool:
    """Whether the dropless input projections gather the token rows in their kernel: with
    the ``pallas`` grouped matmul, the one whose kernels take a row index, off TPU (it has
    no TPU lowering) and without expert parallelism (there the rows cross devices sorted).
    Compiled for one H100 it keeps the sorted ``[assignments, d_model]`` tokens out of
    memory (docs/moe.md, "Dropless on GPU")."""
    return grouped_matmul == "pallas" and platform != "tpu" and not expert_parallel


def target_platform(mesh: AbstractMesh | None) -> str:
    """Platform of the devices a step is being compiled for: the platform of ``mesh``'s
    devices (the mesh set with ``jax.set_mesh``, which carries it even when compiling for a
    TPU from a CPU host), else the default device's (no mesh: the step runs there)."""
    device = None if mesh is None else mesh.abstract_device
    return jax.devices()[0].platform if device is None else device.platform


def _family(platform: str) -> Platform:
    """``cpu``, ``tpu`` or ``gpu``: the backend family of a device platform name."""
    family = _PLATFORM_FAMILY.get(platform)
    if family is None:
        raise ValueError(
            f"unknown platform {platform!r}; expected one of {tuple(_PLATFORM_FAMILY)}"
        )
    return family
