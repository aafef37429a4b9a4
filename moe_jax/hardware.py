"""Chip facts, compile targets and the machine's measured speed: one place.

- :data:`CHIPS`: per accelerator chip, HBM bytes, dense peak bf16 FLOP/s, HBM bandwidth and
  interconnect (ICI / NVLink) bandwidth, as published by the vendor. ``moe-jax compile``
  judges fit and step time with it; the trainer's MFU divides by its peak.
- :func:`parse_target`: ``tpu:v5e:4x4``, ``tpu:v5p:2x2x4``, ``gpu:h100:8``, ``cpu:8``, ... ->
  :class:`Target`; :func:`target_devices`: that target's devices, from the TPU or GPU
  compiler (no such device needed: ``jax.experimental.topologies``).
- :func:`measured_matmul_flops`: the measured matmul rate of this machine's first device.

The compilers are found only when a TPU or GPU target is asked for: ``libtpu`` and the CUDA
PJRT plugin live outside the import path (``$MOE_JAX_COMPILERS``, default
``<venv>/compilers/{tpu,gpu}``, installed by ``make compilers``), so plain runs never load
them and never probe for a TPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from moe_jax.errors import UserError

GiB = 2**30
GPU_SPECS_DIR = Path(__file__).parent / "gpu_specs"


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
class DeviceFacts:
    """What one device of a target offers (a chip divided by the devices it shows as)."""

    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float | None
    interconnect_bandwidth: float | None


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
    devices: Sequence, chip: Chip | None = None, num_chips: int | None = None
) -> DeviceFacts:
    """Per-device facts of ``devices``: the chip's (from ``chip`` or the devices' kind) divided
    by the devices per chip (libtpu shows a v4 chip as 2 TensorCore devices); on CPU the
    machine's available memory shared by the devices and the measured matmul rate."""
    chip = chip or chip_of_device_kind(devices[0].device_kind)
    if chip is None:
        return DeviceFacts(
            available_memory_bytes() // len(devices), measured_matmul_flops(), None, None
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
    (:func:`init_program_config`)."""
    import jax

    prng = importlib.import_module("jax_cuda12_plugin._prng")
    for name, target in prng.registrations().items():
        api_version = int(name.endswith("_ffi"))
        jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=api_version)


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


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)  # pylint: disable=protected-access


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
