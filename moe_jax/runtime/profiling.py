"""Device traces of chosen training steps (``train.profile_steps``), as MaxText's
``profiler`` / ``skip_first_n_steps_for_profiler``: ``jax.profiler`` around those steps,
written where TensorBoard's Profile tab and Perfetto read them."""

from __future__ import annotations

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
            self.log(f"traced steps {first}-{first + count - 1} into {self.log_dir}")

    def close(self) -> None:
        """Stops a trace still running (a run that ended or stopped inside the window)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
