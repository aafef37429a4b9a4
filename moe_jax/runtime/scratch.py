"""A command's temporary files in a folder of its own, removed when the command ends.

Libraries write temporary files they do not always remove (TensorFlow's autograph writes
one ``__autograph_generated_file*.py`` module per traced ``tf.data`` function and removes
them only at a clean interpreter exit). Every `moe-jax` command runs with Python's
temporary folder pointed at ``<tmp>/moe_jax_<random>/``, removed at the command's end, so
a run leaves nothing in the temporary folder. Files meant to outlive the command (the
smoke's run directory) go to :func:`outer_tempdir`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

_outer: list[str] = []  # the temporary folders the active scratch folders replaced


@contextlib.contextmanager
def scratch_tempdir() -> Iterator[str]:
    """Points :mod:`tempfile` (and what uses it) at a fresh folder for the block; removes
    the folder, and whatever was left in it, at the end."""
    outer = tempfile.gettempdir()
    folder = tempfile.mkdtemp(prefix="moe_jax_")
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    _outer.append(outer)
    try:
        yield folder
    finally:
        _outer.pop()
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def outer_tempdir() -> str:
    """The temporary folder outside the command's scratch folder (for files that outlive
    the command)."""
    return _outer[0] if _outer else tempfile.gettempdir()
