"""One writer per run directory: ``MODEL_DIR/LOCK``.

`moe-jax train` holds the lock while it runs (process 0 of a multi-process run holds it
for all). The file is JSON naming the holder: ``{"host", "pid", "since", "lease_sec"}``;
the holder touches it (its modification time is the heartbeat) every ``lease_sec / 4``
seconds. A second trainer is refused with :class:`~moe_jax.errors.RunLockedError` naming
the holder, unless the holder is dead: a process on this host that no longer exists
(kill -9) is taken over at once; a holder on another host (or one that stopped
heartbeating) once its heartbeat is older than ``lease_sec`` (default 120 s,
``MOE_JAX_LOCK_LEASE_SEC``). A clean exit removes the file.

Creation is atomic (``os.link`` of a finished temporary file, which fails if the lock
exists) on local and NFS-like file systems. On object stores (``gs://``) no lock is taken:
they have no atomic create through this path, so one writer per run directory there is
the launcher's job (docs/training.md, "Reliability").
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from moe_jax import errors

LOCK_FILE = "LOCK"
DEFAULT_LEASE_SEC = 120.0


def lease_seconds() -> float:
    return float(os.environ.get("MOE_JAX_LOCK_LEASE_SEC", DEFAULT_LEASE_SEC))


class RunLock:
    """Holds ``MODEL_DIR/LOCK`` from :meth:`acquire` to :meth:`release` (a context manager)."""

    def __init__(self, model_dir: str, lease_sec: float | None = None):
        self.path = os.path.join(model_dir, LOCK_FILE)
        self.lease_sec = lease_seconds() if lease_sec is None else lease_sec
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "lease_sec": self.lease_sec}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict[str, Any] | None = None  # the dead holder replaced, if any

    def acquire(self) -> RunLock:
        """Takes the lock or raises :class:`~moe_jax.errors.RunLockedError` naming the holder."""
        if "://" in self.path:
            return self
        for _ in range(3):  # a dead holder's file is moved away, then retried
            if self._create():
                self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                                name="moe_jax_run_lock")
                self._thread.start()
                return self
            holder, age = self._read()
            if holder is None:
                continue  # released meanwhile
            reason = self._dead(holder, age)
            if reason is None:
                raise errors.RunLockedError(
                    f"{os.path.dirname(self.path)} is being written by another trainer: host "
                    f"{holder.get('host')}, PID {holder.get('pid')}, since {holder.get('since')} "
                    f"(heartbeat {age:.0f} s ago; its lock {self.path} expires {holder.get('lease_sec', self.lease_sec):.0f} s "
                    "after its last heartbeat). Stop it, or use another MODEL_DIR.")
            self._remove_stale(holder, reason)
        raise errors.RunLockedError(f"could not take the lock {self.path} (contended)")

    def _create(self) -> bool:
        tmp = f"{self.path}.{self.record['host']}.{self.record['pid']}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.record, f)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _read(self) -> tuple[dict[str, Any] | None, float]:
        try:
            with open(self.path) as f:
                text = f.read()
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return None, 0.0
        try:
            return json.loads(text), age
        except ValueError:  # written by something else: treat as a holder of unknown identity
            return {"host": "?", "pid": "?", "since": "?"}, age

    def _dead(self, holder: dict[str, Any], age: float) -> str | None:
        """Why ``holder`` is dead, or None when it may be alive."""
        if holder.get("host") == self.record["host"] and isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return f"PID {holder['pid']} no longer runs on this host"
            except PermissionError:
                pass  # exists, another user's
        lease = float(holder.get("lease_sec", self.lease_sec))
        if age > lease:
            return f"no heartbeat for {age:.0f} s (lease {lease:.0f} s)"
        return None

    def _remove_stale(self, holder: dict[str, Any], reason: str) -> None:
        aside = f"{self.path}.stale.{self.record['pid']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside) as f:
            moved = f.read()
        if json.loads(moved or "{}") != holder and not os.path.exists(self.path):
            os.rename(aside, self.path)  # a live holder replaced the stale one meanwhile
            return
        os.unlink(aside)
        self.took_over = {**holder, "reason": reason}

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_sec / 4):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the run's own write checks report a lost directory

    def release(self) -> None:
        """Stops the heartbeat and removes the file if it is still this process's."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        holder, _ = self._read()
        if holder == self.record:
            os.unlink(self.path)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold(model_dir: str) -> Iterator[RunLock | None]:
    """Holds ``model_dir``'s lock on process 0 for the ``with`` block; every process raises
    :class:`~moe_jax.errors.RunLockedError` when process 0 could not take it."""
    import jax
    import numpy as np

    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(model_dir).acquire()
        except errors.RunLockedError as err:
            error = err
        if lock is not None and lock.took_over:
            old = lock.took_over
            print(f"[moe-jax] took over the lock of {model_dir} from host {old.get('host')} PID "
                  f"{old.get('pid')} (since {old.get('since')}): {old['reason']}", file=sys.stderr, flush=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if bool(multihost_utils.broadcast_one_to_all(np.array(error is not None))) and error is None:
            error = errors.RunLockedError(f"{model_dir} is locked by another trainer (see process 0)")
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
