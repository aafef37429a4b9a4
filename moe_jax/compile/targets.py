"""Compile targets: what ``--target`` names, and the devices it gives.

- :func:`parse_target`: ``tpu:v5e:4x4``, ``tpu:v5p:2x2x4``, ``tpu:v5p-32`` (a Cloud TPU
  accelerator type), ``gpu:h100:8``, ``cpu:8``, ... -> :class:`Target`, its chip from
  :data:`moe_jax.hardware.CHIPS`.
- :func:`target_devices`: that target's devices, from the TPU or GPU compiler (no such
  device needed: ``jax.experimental.topologies``; a GPU's description is
  ``gpu_specs/<chip>.txtpb`` beside this module), or this process's CPU devices.

The compilers are found only when a TPU or GPU target is asked for: ``libtpu`` and the CUDA
PJRT plugin live outside the import path (``$MOE_JAX_COMPILERS``, default
``<venv>/compilers/{tpu,gpu}``, installed by ``make compilers``), so plain runs never load
them and never probe for a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from moe_jax.errors import UserError
from moe_jax.hardware import CHIPS, Chip

GPU_SPECS_DIR = Path(__file__).parent / "gpu_specs"

# TPU slice topologies libtpu describes here (chips per side; one host holds 2x2 chips, so a
# slice is at least 2x2 and a single chip is not one): 2-D tori for v5e / v6e, 3-D for v4 / v5p.
TPU_TOPOLOGIES = {
    "v5e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": (
        "2x2x1",
        "2x2x2",
        "2x2x4",
        "2x4x4",
        "4x4x4",
        "4x4x8",
        "4x8x8",
        "8x8x8",
        "8x8x16",
        "8x16x16",
    ),
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16"),
}

KNOWN_TARGETS = (
    "tpu:{v4,v5e,v5p,v6e}:TOPOLOGY (e.g. tpu:v5e:4x4, tpu:v5p:2x2x4, tpu:v4:2x2x2)",
    "tpu:ACCELERATOR_TYPE, Cloud TPU's name (e.g. tpu:v5p-32, tpu:v5litepod-16, tpu:v4-32)",
    "gpu:{a100,h100,h200}:COUNT (e.g. gpu:h100:8; multiples of 8 for several nodes)",
    "cpu:COUNT (e.g. cpu:8)",
)


class TargetError(UserError, ValueError):
    """An unknown target, or a compiler the target needs is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A set of devices to compile for: ``platform`` ``tpu``/``gpu``/``cpu``; ``chip`` None
    for CPU; ``topology``: ``"4x4"`` (TPU), the GPU count or the CPU device count."""

    spec: str
    platform: str
    chip: Chip | None
    topology: str

    @property
    def num_chips(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x"))


# Cloud TPU accelerator types (`gcloud compute tpus tpu-vm create --accelerator-type`):
# the number counts TensorCores for v4 and v5p (two per chip, one JAX device per chip) and
# chips for v5e (v5litepod) and v6e.
_ACCELERATOR_TYPE = re.compile(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)")
_CORES_PER_CHIP = {"v4": 2, "v5p": 2}


def accelerator_topology(accelerator_type: str) -> tuple[str, str]:
    """``(chip, topology)`` to compile for a Cloud TPU accelerator type, e.g. ``v5p-32`` ->
    ``("v5p", "2x2x4")`` (16 chips), ``v5litepod-16`` -> ``("v5e", "4x4")``. For v4, whose
    chips libtpu describes as two TensorCore devices each, the topology of half the chips,
    so that the compiled devices are as many as JAX shows on the slice (one per chip)."""
    match = _ACCELERATOR_TYPE.fullmatch(accelerator_type)
    if match is None:
        raise TargetError(
            f"--target=tpu:{accelerator_type}: not a Cloud TPU accelerator type "
            "(v4-N, v5p-N, v5litepod-N, v6e-N)"
        )
    family, count = match.group(1), int(match.group(2))
    chip = "v5e" if family == "v5litepod" else family
    chips = count // _CORES_PER_CHIP.get(family, 1) // (2 if family == "v4" else 1)
    if family in ("v4", "v5p"):  # 3-D torus, from 2x2x1: double the last of the smallest sides
        dims = [2, 2, 1]
        while math.prod(dims) < chips:
            dims[max(i for i, d in enumerate(dims) if d == min(dims))] *= 2
    else:  # 2-D: the squarest power-of-two rectangle
        dims = [1, 1]
        while math.prod(dims) < chips:
            dims[0 if dims[0] < dims[1] else 1] *= 2
        dims.sort()
    if math.prod(dims) != chips or count % _CORES_PER_CHIP.get(family, 1):
        raise TargetError(
            f"--target=tpu:{accelerator_type}: no {chip} topology of that size known here; "
            f"name one as tpu:{chip}:TOPOLOGY; known: " + ", ".join(KNOWN_TARGETS)
        )
    return chip, "x".join(map(str, dims))


def parse_target(spec: str) -> Target:
    """``tpu:v5e:4x4`` / ``tpu:v5p-32`` (a Cloud TPU accelerator type) / ``gpu:h100:8`` /
    ``cpu:8`` -> :class:`Target`.

    Raises:
      TargetError: naming the bad part and listing the known targets.
    """
    parts = spec.strip().lower().split(":")
    known = "; known: " + ", ".join(KNOWN_TARGETS)
    if parts[0] == "cpu" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
        return Target(spec, "cpu", None, parts[1])
    if parts[0] == "tpu" and len(parts) == 2 and _ACCELERATOR_TYPE.fullmatch(parts[1]):
        parts = ["tpu", *accelerator_topology(parts[1])]
    if len(parts) != 3 or parts[0] not in ("tpu", "gpu"):
        raise TargetError(f"--target={spec!r} is not PLATFORM:CHIP:TOPOLOGY" + known)
    platform, chip_name, topology = parts
    chip = CHIPS.get(chip_name)
    if chip is None or chip.platform != platform:
        names = sorted(c.name for c in CHIPS.values() if c.platform == platform)
        raise TargetError(
            f"--target={spec!r}: unknown {platform.upper()} {chip_name!r} "
            f"(known: {', '.join(names)})" + known
        )
    if platform == "tpu":
        check_tpu_topology(spec, chip.name, topology)
    elif not re.fullmatch(r"\d+", topology) or int(topology) == 0:
        raise TargetError(f"--target={spec!r}: {topology!r} is not a GPU count like 8" + known)
    return Target(spec, platform, chip, topology)


def check_tpu_topology(spec: str, chip: str, topology: str) -> None:
    """Refuses a ``chip`` slice topology libtpu cannot describe here, listing the valid ones:
    the shape of :data:`TPU_TOPOLOGIES` (2-D for v5e / v6e, 3-D for v4 / v5p), each of the
    first two sides a power of two of at least 2 (a host's 2x2 chips; a single chip is not a
    slice), the third a power of two."""
    valid = TPU_TOPOLOGIES[chip]
    dims = topology.split("x")
    ok = (
        len(dims) == len(valid[0].split("x"))
        and all(d.isdigit() and int(d) > 0 for d in dims)
        and all(int(d) & (int(d) - 1) == 0 for d in dims)
        and all(int(d) >= 2 for d in dims[:2])
    )
    if not ok:
        raise TargetError(
            f"--target={spec!r}: {topology!r} is not a {chip} slice topology compiled for here "
            f"(a single chip or an odd shape is not); valid: {', '.join(valid)} "
            f"(e.g. --target=tpu:{chip}:{valid[0]}), or a Cloud TPU accelerator type "
            "such as tpu:v5litepod-16 or tpu:v5p-32"
        )


# ----------------------------------------------------------------------------- compilers


def compilers_dir() -> Path:
    """Where ``make compilers`` puts the TPU/GPU compilers: ``$MOE_JAX_COMPILERS`` or
    ``<sys.prefix>/compilers``."""
    return Path(os.environ.get("MOE_JAX_COMPILERS") or Path(sys.prefix) / "compilers")


def _use_compiler(platform: str) -> None:
    """Makes the ``platform`` compiler importable for this process only.

    Raises:
      TargetError: naming the extra to install when it is nowhere to be found.
    """
    module = "libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12"
    directory = compilers_dir() / platform
    if directory.is_dir() and str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
        if platform == "gpu":  # jax_plugins is a namespace package: extend it
            import jax_plugins

            jax_plugins.__path__.append(str(directory / "jax_plugins"))
    if platform == "tpu":
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server here
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compiles may run
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        extra = f"compile-{platform}"
        raise TargetError(
            f"no {platform.upper()} compiler: run `make compilers` (installs the "
            f"`{extra}` extra of pyproject.toml into {directory}) or `pip install "
            f"--target {directory} <the {extra} packages>`"
        )


def target_devices(target: Target) -> list:
    """The devices of ``target``, for compiling (TPU/GPU) or running (CPU).

    Call before anything initialises JAX's backends: it pins ``jax_platforms`` to ``cpu``
    (the accelerators are only described, never opened) and, for ``cpu:N``, sets the CPU
    device count.
    """
    import jax

    if target.platform == "cpu":
        count = int(target.topology)
        forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
        if not forced and not _backends_started():
            jax.config.update("jax_num_cpu_devices", count)
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise TargetError(
                f"--target={target.spec}: this process has {len(devices)} CPU "
                f"devices (start it with --target before anything else runs)"
            )
        return devices[:count]
    if not _backends_started():
        jax.config.update("jax_platforms", "cpu")
    _use_compiler(target.platform)
    if target.platform == "gpu":
        _register_cuda_kernels()
    from jax.experimental import topologies

    chip = target.chip
    assert chip is not None, target  # only CPU targets have none
    if target.platform == "tpu":
        try:
            return list(
                topologies.get_topology_desc(
                    platform="tpu", topology_name=f"{chip.name}:{target.topology}"
                ).devices
            )
        except Exception as err:  # libtpu's own message names the bad topology
            raise TargetError(f"--target={target.spec}: {str(err).splitlines()[0]}") from None
    count = int(target.topology)
    hosts, per_host = (count // 8, 8) if count > 8 and count % 8 == 0 else (1, count)
    config = (GPU_SPECS_DIR / f"{chip.name}.txtpb").read_text()
    return list(
        topologies.get_topology_desc(
            platform="cuda",
            topology_name=chip.name,
            topology=f"1x{hosts}x{per_host}",
            target_config=config,
        ).devices
    )


@functools.cache
def _register_cuda_kernels() -> None:
    """Registers the CUDA plugin's threefry kernel with JAX. jaxlib registers the kernels of
    the plugins importable when it is imported; the plugin of ``make compilers`` becomes
    importable later, and the initial state's program calls the kernel on GPUs
    (:func:`moe_jax.hardware.init_program_config`)."""
    import jax

    prng = importlib.import_module("jax_cuda12_plugin._prng")
    for name, target in prng.registrations().items():
        api_version = int(name.endswith("_ffi"))
        jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=api_version)


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)  # pylint: disable=protected-access
