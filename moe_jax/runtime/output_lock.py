"""One writer per output folder: ``FOLDER/.writing`` while `moe-jax eval` or `moe-jax
export` checks and writes it.

The run lock's mechanism (:class:`~moe_jax.runtime.run_lock.RunLock`: atomic creation, a
heartbeat, a dead holder taken over) under another file name, so that a second command
writing into the same folder at the same time is refused instead of silently replacing
the first one's results, and an output folder never looks like a run directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from moe_jax import storage
from moe_jax.runtime import run_lock
from moe_jax.runtime.run_dir import RunDir

WRITING_FILE = ".writing"


class OutputLock(run_lock.RunLock):
    """Holds ``FOLDER/.writing`` (``FOLDER`` given as a :class:`RunDir`)."""

    writer = "another command"
    advice = "Wait for it to end, or write elsewhere."

    def __init__(self, folder: RunDir):
        super().__init__(folder, path=storage.join(folder.path, WRITING_FILE))


@contextlib.contextmanager
def writing(folder: str) -> Iterator[None]:
    """Holds ``folder``'s output lock on process 0 for the ``with`` block (every process
    raises :class:`~moe_jax.errors.RunLockedError` when another command holds it); a folder
    the block created and left empty is removed at the end."""
    created = not storage.exists(folder)
    try:
        with run_lock.hold(RunDir(folder), OutputLock):
            yield
    finally:
        if created and jax.process_index() == 0 and not storage.listdir(folder):
            storage.rmtree(folder)
