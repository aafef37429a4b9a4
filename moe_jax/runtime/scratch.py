"""A command's temporary files in a folder of its own, removed when the command ends.

Libraries write temporary files they do not always remove (TensorFlow's autograph writes
one ``__autograph_generated_file*.py`` module per traced ``tf.data`` function and removes
them only at a clean interpreter exit). Every `moe-jax` command runs with Python's
temporary folder pointed at ``<tmp>/moe_jax_<random>/``, removed at the command's end, so
a run leaves nothing in the temporary folder. Files meant to outlive the command (the
smoke's run directory) go to :func:`outer_tempdir`.

Matplotlib, when its config or cache folder (``$XDG_CONFIG_HOME`` / ``$XDG_CACHE_HOME``,
``~/.config`` / ``~/.cache``) cannot be made, makes a temporary one and removes it at
interpreter exit, after the scratch folder is gone; in that case ``MPLCONFIGDIR`` is set to
``<tmp>/moe_jax_matplotlib`` (outside the scratch folder, kept as matplotlib's cache).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

_outer: list[str] = []  # the temporary folders the active scratch folders replaced


@contextlib.contextmanager
def scratch_tempdir() -> Iterator[str]:
    """Points :mod:`tempfile` (and what uses it) at a fresh folder for the block; removes
    the folder, and whatever was left in it, at the end."""
    outer = tempfile.gettempdir()
    _matplotlib_folder_outside(outer)
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


def _matplotlib_folder_outside(outer: str) -> None:
    """Sets ``MPLCONFIGDIR`` to ``outer/moe_jax_matplotlib`` when it is unset and
    matplotlib's own config or cache folder cannot be made (matplotlib's rule on Linux)."""
    if "MPLCONFIGDIR" in os.environ or not sys.platform.startswith(("linux", "freebsd")):
        return
    for variable, default in (("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache")):
        base = os.environ.get(variable) or os.path.join(os.path.expanduser("~"), default)
        folder = os.path.join(base, "matplotlib")
        with contextlib.suppress(OSError):
            os.makedirs(folder, exist_ok=True)
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            os.environ["MPLCONFIGDIR"] = os.path.join(outer, "moe_jax_matplotlib")
            return


def outer_tempdir() -> str:
    """The temporary folder outside the command's scratch folder (for files that outlive
    the command)."""
    return _outer[0] if _outer else tempfile.gettempdir()
