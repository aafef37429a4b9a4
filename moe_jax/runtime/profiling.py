"""Device traces of chosen training steps (``train.profile_steps``), as MaxText's
``profiler`` / ``skip_first_n_steps_for_profiler``: ``jax.profiler`` around those steps,
written where TensorBoard's Profile tab and Perfetto read them; and how busy a trace's
devices were (:func:`device_timeline`: kernel time against the span, the idle gaps)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from moe_jax import errors


def check_profile_steps(profile_steps: Any) -> tuple[int, int] | None:
    """``profile_steps`` as ``(first step, count)``, or None (no trace).

    Raises:
      ConfigError: naming ``train.profile_steps`` when it is not two integers >= 1.
    """
    if profile_steps is None:
        return None
    ok = (
        isinstance(profile_steps, tuple | list)
        and len(profile_steps) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in profile_steps)
    )
    if not ok:
        raise errors.ConfigError(
            f"train.profile_steps={profile_steps!r}: expected (first step, count), two "
            "integers >= 1, e.g. --gin.train_script.train.profile_steps='(5, 3)'"
        )
    return int(profile_steps[0]), int(profile_steps[1])


class StepProfiler:
    """Traces steps ``first .. first + count - 1`` (numbered as logged: step 1 is the
    first step of the run) into ``log_dir``: ``log_dir/plugins/profile/<time>/`` holds
    the XPlane trace (TensorBoard: ``tensorboard --logdir log_dir``, Profile tab) and a
    ``*.trace.json.gz`` for Perfetto (ui.perfetto.dev) or plain JSON readers.

    The trace starts just before the first traced step is dispatched and stops once the
    last traced step has finished on the device, so it holds whole steps and the host's
    work between them (data, dispatch), which is what a step's idle device time comes
    from. Steps already done when a run resumes are not traced again.
    """

    def __init__(
        self, steps: tuple[int, int] | None, log_dir: str, log: Callable[[str], None]
    ) -> None:
        self.steps = steps
        self.log_dir = log_dir
        self.log = log
        self.active = False

    def before_step(self, done: int) -> None:
        """Called with the steps done before the next one is dispatched."""
        if self.steps is not None and done + 1 == self.steps[0]:
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True

    def after_step(self, done: int, outputs: Any) -> None:
        """Called with the steps done (dispatched) and the last step's ``outputs``: stops
        the trace once they are computed when that step is the last traced one."""
        if self.active and self.steps is not None and done == sum(self.steps) - 1:
            jax.block_until_ready(outputs)
            self.close()
            first, count = self.steps
            timeline = read_timeline(self.log_dir)
            said = "" if timeline is None else f": {timeline.describe()}"
            self.log(f"traced steps {first}-{first + count - 1} into {self.log_dir}{said}")

    def close(self) -> None:
        """Stops a trace still running (a run that ended or stopped inside the window)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


@dataclasses.dataclass(frozen=True)
class Gap:
    """An interval with no kernel running on a device: ``ms`` long, after kernel
    ``after`` and before kernel ``before``."""

    ms: float
    after: str
    before: str


@dataclasses.dataclass(frozen=True)
class DeviceTimeline:
    """How busy a trace's devices were: the union of their kernels' intervals against the
    span from the first kernel's start to the last one's end.

    Attributes:
      span_ms: first kernel start to last kernel end (all steps traced).
      busy_ms: time with at least one kernel running (overlapping streams counted once).
      kernel_ms: the kernels' durations summed (more than ``busy_ms`` where streams overlap).
      gaps: the longest idle intervals, longest first.
    """

    span_ms: float
    busy_ms: float
    kernel_ms: float
    gaps: tuple[Gap, ...]

    @property
    def busy_fraction(self) -> float:
        return self.busy_ms / self.span_ms if self.span_ms else 0.0

    def describe(self) -> str:
        """One line: busy share, span, and the longest gap."""
        if not self.span_ms:
            return "no device kernels in the trace (a CPU run has none)"
        line = f"devices busy {self.busy_fraction:.0%} of {self.span_ms:.1f} ms"
        if self.gaps:
            gap = self.gaps[0]
            line += f"; longest idle gap {gap.ms:.2f} ms, after {gap.after}, before {gap.before}"
        return line


def trace_file(log_dir: str) -> pathlib.Path | None:
    """The newest ``*.trace.json.gz`` that ``jax.profiler`` wrote under ``log_dir``."""
    paths = sorted(pathlib.Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    return paths[-1] if paths else None


def device_processes(events: list[dict[str, Any]]) -> set[Any]:
    """The ids of a trace's processes named ``/device:...`` (a GPU's or TPU's kernels; a
    CPU trace has none)."""
    return {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }


def device_timeline(events: list[dict[str, Any]], gaps: int = 10) -> DeviceTimeline:
    """The :class:`DeviceTimeline` of a trace's events (``traceEvents`` of a
    ``*.trace.json.gz``): kernels are the complete (``"X"``) events of the processes named
    ``/device:...``, on any of their streams; ``gaps``: how many idle intervals to list."""
    devices = device_processes(events)
    kernels = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in devices
    )
    if not kernels:
        return DeviceTimeline(0.0, 0.0, 0.0, ())
    busy = 0.0
    idle: list[Gap] = []
    start, end, last = kernels[0]
    for k_start, k_end, name in kernels[1:]:
        if k_start > end:  # nothing ran between end and k_start
            busy += end - start
            idle.append(Gap((k_start - end) / 1e3, last, name))
            start, end = k_start, k_end
        if k_end >= end:
            end, last = k_end, name
    busy += end - start
    return DeviceTimeline(
        span_ms=(end - kernels[0][0]) / 1e3,
        busy_ms=busy / 1e3,
        kernel_ms=sum(e - s for s, e, _ in kernels) / 1e3,
        gaps=tuple(sorted(idle, key=lambda g: -g.ms)[:gaps]),
    )


def read_timeline(log_dir: str) -> DeviceTimeline | None:
    """:func:`device_timeline` of the newest trace under ``log_dir`` (None: no trace)."""
    path = trace_file(log_dir)
    if path is None:
        return None
    return device_timeline(json.loads(gzip.decompress(path.read_bytes()))["traceEvents"])
