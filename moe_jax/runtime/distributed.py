"""Multi-host start-up, decisions taken by process 0, objects gathered from every process,
and preemption notices.

:func:`initialize` calls ``jax.distributed.initialize`` when the run is multi-process:
  * TPU pods and SLURM/Open MPI clusters: JAX detects its peers itself
    (``--multiprocess_gpu`` or ``JAX_MULTIPROCESS=1`` asks for that detection on GPUs);
  * explicit: ``--coordinator_address=HOST:PORT --process_count=N --process_index=I``
    (or ``JAX_COORDINATOR_ADDRESS``, ``JAX_PROCESS_COUNT``, ``JAX_PROCESS_INDEX``).
Timeouts are bounded: start-up waits at most ``initialization_timeout`` seconds for the
peers, and the coordination service's heartbeat makes every process exit with an error
within about ``heartbeat_timeout`` seconds when one of them dies, instead of hanging in a
collective. ``JAX_NUM_CPU_DEVICES`` sets the CPU devices per process (local pod emulation).

:class:`PreemptionWatcher` turns SIGTERM (a TPU preemption notice) and Ctrl-C into "save
and exit" at a step every process agrees on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from moe_jax import errors


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host")
    group.add_argument(
        "--coordinator_address",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="HOST:PORT of process 0's coordinator (GPU clusters, local emulation)",
    )
    group.add_argument(
        "--process_count",
        type=int,
        default=_env_int("JAX_PROCESS_COUNT"),
        help="number of processes",
    )
    group.add_argument(
        "--process_index",
        type=int,
        default=_env_int("JAX_PROCESS_INDEX"),
        help="this process's index",
    )
    group.add_argument(
        "--multiprocess_gpu",
        action="store_true",
        default=os.environ.get("JAX_MULTIPROCESS") == "1",
        help="let JAX detect the cluster (SLURM, Open MPI) itself",
    )
    group.add_argument(
        "--initialization_timeout",
        type=int,
        default=300,
        help="seconds to wait for all processes at start-up",
    )
    group.add_argument(
        "--heartbeat_timeout",
        type=int,
        default=60,
        help="seconds without a peer's heartbeat before every process fails",
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _on_tpu_pod() -> bool:
    return bool(os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",")) or bool(
        os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")
    )


def initialize(args: argparse.Namespace) -> None:
    """Starts ``jax.distributed`` when the flags/environment describe a multi-process run.

    Must run before any other JAX call. A single process without flags does nothing.
    """
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
    explicit = args.coordinator_address is not None or (args.process_count or 1) > 1
    if not (explicit or args.multiprocess_gpu or _on_tpu_pod()):
        return
    if explicit and (
        args.coordinator_address is None or args.process_count is None or args.process_index is None
    ):
        raise ValueError(
            "a multi-process run needs all of --coordinator_address, "
            "--process_count and --process_index (or let JAX detect the cluster "
            "with --multiprocess_gpu / on a TPU pod)"
        )
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.process_count,
        process_id=args.process_index,
        initialization_timeout=args.initialization_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        shutdown_timeout_seconds=min(args.heartbeat_timeout, 60),
    )


T = TypeVar("T")


def process_zero_decides(
    decide: Callable[[], T], elsewhere: Callable[[], errors.UserError]
) -> T | None:
    """Runs ``decide`` on process 0 only (a check of the run directory, taking its lock) and
    returns its result there (None on the other processes). When it raises an expected error
    (:class:`~moe_jax.errors.UserError`), every process raises, so that none is left waiting
    in a collective: process 0 that error, the others ``elsewhere()``."""
    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = decide()
        except errors.UserError as err:
            error = err
    if jax.process_count() > 1:
        failed = bool(multihost_utils.broadcast_one_to_all(np.array(error is not None)))
        if failed and error is None:
            raise elsewhere()
    if error is not None:
        raise error
    return result


def gather_from_processes(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (one collective)."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.array([data.size], np.int32))))
    padded = np.zeros(length, np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in np.asarray(rows)]


class PreemptionWatcher:
    """SIGTERM or Ctrl-C (SIGINT) -> :meth:`reached` is True at a step all processes agree
    on; :attr:`signum` is the signal.

    Multi-process: JAX's preemption service (started by ``jax.distributed``) catches
    SIGTERM and picks the sync step; Ctrl-C raises ``KeyboardInterrupt`` at once. Single
    process: a signal handler sets a flag; a Ctrl-C after the first signal raises
    ``KeyboardInterrupt`` (stop without waiting for the step and its save).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}
        if not self._multi:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum

    def reached(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
        return self.signum is not None

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
