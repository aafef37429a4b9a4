"""One writer per run directory: ``MODEL_DIR/LOCK``.

`moe-jax train` holds the lock while it runs (process 0 of a multi-process run holds it
for all). The file is JSON naming the holder: ``{"host", "pid", "since", "lease_sec"}``;
the holder refreshes it (its modification time is the heartbeat) every ``lease_sec / 4``
seconds: locally by touching it, on GCS by rewriting the object. A second trainer is refused with
:class:`~moe_jax.errors.RunLockedError` naming the holder, unless the holder is dead: a process on
this host that no longer exists (kill -9), or an empty file (a writer stopped between creating and
writing it; the project's own locks are created whole), is taken over at once; a holder on another
host (or one that stopped heartbeating) once its heartbeat is older than ``lease_sec`` (default 120
s, ``MOE_JAX_LOCK_LEASE_SEC``). A heartbeat more than ``lease_sec`` in the future (another host's
clock ahead) cannot be compared with this host's clock: the lock is watched for two of its
holder's heartbeat periods, and taken over when it did not change. A clean exit removes the file.

Creation is atomic (:func:`moe_jax.storage.create_exclusive`): ``os.link`` of a finished
temporary file on local and NFS-like file systems, an upload with ``ifGenerationMatch=0``
on GCS. A stale lock is removed only while it still holds the dead holder's record.
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
from collections.abc import Callable, Iterator
from typing import Any

from moe_jax import errors, storage
from moe_jax.runtime import distributed
from moe_jax.runtime.run_dir import RunDir

DEFAULT_LEASE_SEC = 120.0


def lease_seconds() -> float:
    return float(os.environ.get("MOE_JAX_LOCK_LEASE_SEC", DEFAULT_LEASE_SEC))


def _holder(data: bytes) -> dict[str, Any]:
    """The holder a lock file's bytes name: ``{}`` for an empty file (created but never
    written: its writer died at once, see ``_dead``), one of unknown identity for bytes that
    are not a lock's record (written by something else)."""
    text = data.decode(errors="replace")
    if not text.strip():
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"host": "?", "pid": "?", "since": "?"}


class RunLock:
    """Holds ``MODEL_DIR/LOCK`` from :meth:`acquire` to :meth:`release` (a context manager)."""

    writer = "another trainer"  # who holds it, and what to do, in the refusal
    advice = "Stop it, or use another MODEL_DIR."

    def __init__(self, run_dir: RunDir, lease_sec: float | None = None, path: str | None = None):
        self.run_dir = run_dir
        self.path = path or run_dir.lock_file
        self.lease_sec = lease_seconds() if lease_sec is None else lease_sec
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "lease_sec": self.lease_sec,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict[str, Any] | None = None  # the dead holder replaced, if any

    def acquire(self) -> RunLock:
        """Takes the lock or raises :class:`~moe_jax.errors.RunLockedError` naming the holder.
        On a store without an atomic create, prints one line saying that no lock is held."""
        for _ in range(3):  # a dead holder's file is moved away, then retried
            try:
                created = self._create()
            except NotImplementedError as err:
                print(
                    f"[moe-jax] warning: no run lock is held for {self.run_dir} ({err}): make "
                    "sure one trainer writes it",
                    file=sys.stderr,
                    flush=True,
                )
                return self
            if created:
                self._thread = threading.Thread(
                    target=self._heartbeat, daemon=True, name="moe_jax_run_lock"
                )
                self._thread.start()
                return self
            holder, age = self._read()
            if holder is None:
                continue  # released meanwhile
            reason = self._dead(holder, age)
            if reason is None:
                beat = (
                    f"heartbeat {age:.0f} s ago"
                    if age >= 0
                    else f"heartbeat {-age:.0f} s in the future (clocks differ between hosts?)"
                    " and still beating"
                )
                raise errors.RunLockedError(
                    f"{self.run_dir} is being written by {self.writer}: host "
                    f"{holder.get('host')}, PID {holder.get('pid')}, since {holder.get('since')} "
                    f"({beat}; its lock {self.path} expires "
                    f"{holder.get('lease_sec', self.lease_sec):.0f} s "
                    f"after its last heartbeat). {self.advice}"
                )
            self._remove_stale(holder, reason)
        raise errors.RunLockedError(f"could not take the lock {self.path} (contended)")

    def _create(self) -> bool:
        storage.makedirs(self.run_dir.path)
        return storage.create_exclusive(self.path, json.dumps(self.record).encode())

    def _read(self) -> tuple[dict[str, Any] | None, float]:
        try:
            data = storage.read_bytes(self.path)
            age = time.time() - storage.modified_time(self.path)
        except FileNotFoundError:
            return None, 0.0
        return _holder(data), age

    def _dead(self, holder: dict[str, Any], age: float) -> str | None:
        """Why ``holder`` is dead, or None when it may be alive."""
        if not holder:  # a lock is created whole (create_exclusive): an empty one has no holder
            return "the lock file is empty (its writer stopped before writing it)"
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
        if -age > lease:
            return self._still(lease / 2, f"its heartbeat is {-age:.0f} s in the future")
        return None

    def _still(self, watch_sec: float, beat: str) -> str | None:
        """Why the holder is dead when the lock's heartbeat, too far in the future to be
        compared with this host's clock (another host's clock ahead, a touched file), does
        not change for ``watch_sec`` (two of the holder's heartbeat periods), else None."""
        print(
            f"[moe-jax] {self.path}: {beat} (clocks differ between hosts?); watching it for "
            f"{watch_sec:.1f} s to tell whether its holder is alive",
            file=sys.stderr,
            flush=True,
        )
        try:
            first = storage.modified_time(self.path)
            time.sleep(watch_sec)
            if storage.modified_time(self.path) != first:
                return None
        except FileNotFoundError:
            return "released meanwhile"  # nothing to remove: the next attempt creates it
        return f"{beat} and did not change in {watch_sec:.1f} s"

    def _remove_stale(self, holder: dict[str, Any], reason: str) -> None:
        """Removes the lock if it still holds ``holder``'s record (a contender that took it
        over meanwhile keeps it)."""
        current, _ = self._read()
        if current != holder:
            return
        if storage.is_local(self.path):  # rename first: of two contenders, one gets the file
            aside = f"{self.path}.stale.{self.record['pid']}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            with open(aside, "rb") as f:
                moved = f.read()
            if _holder(moved) != holder and not os.path.exists(self.path):
                os.rename(aside, self.path)  # a live holder replaced the stale one meanwhile
                return
            os.unlink(aside)
        elif not storage.remove(self.path):
            return
        self.took_over = {**holder, "reason": reason}

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_sec / 4):
            try:
                if storage.is_local(self.path):
                    os.utime(self.path)
                elif self._read()[0] == self.record:
                    storage.write_text(self.path, json.dumps(self.record))
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
            storage.remove(self.path)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold(run_dir: RunDir, make: Callable[[RunDir], RunLock] = RunLock) -> Iterator[RunLock | None]:
    """Holds ``run_dir``'s lock (``make(run_dir)``) on process 0 for the ``with`` block;
    every process raises :class:`~moe_jax.errors.RunLockedError` when process 0 could not
    take it."""

    def take() -> RunLock:
        lock = make(run_dir).acquire()
        if lock.took_over:
            old = lock.took_over
            holder = (
                f"host {old.get('host')} PID {old.get('pid')} (since {old.get('since')})"
                if old.get("host")
                else "no holder"
            )
            print(
                f"[moe-jax] took over the lock of {run_dir} from {holder}: {old['reason']}",
                file=sys.stderr,
                flush=True,
            )
        return lock

    lock = distributed.process_zero_decides(
        take,
        lambda: errors.RunLockedError(f"{run_dir} is locked by another trainer (see process 0)"),
    )
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
