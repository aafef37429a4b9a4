"""Orbax's failures told in one line: the cause of a failed checkpoint read or write found
in the library's nested errors, and the library's own reports of a failure dropped.

A failed save logs a traceback from each of orbax's writer threads, asyncio reports the
writes it never awaited ("Task exception was never retrieved"), and TensorStore's pending
callbacks report "Event loop is closed" once each, as unraisable errors: hundreds of
tracebacks for one full disk. :func:`install_quiet_hooks` drops them (``MOE_JAX_TRACEBACK=1``
keeps them), and :class:`~moe_jax.runtime.checkpoints.Checkpointer` raises each failure as
one line naming the step and :func:`write_cause` / :func:`read_cause`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys

from moe_jax import errors

# Causes of a failed write, as the OS words them (found inside library error messages).
_WRITE_CAUSES = tuple(
    os.strerror(code)
    for code in (
        errno.ENOSPC,
        errno.EFBIG,
        errno.EDQUOT,
        errno.EACCES,
        errno.EROFS,
        errno.EPERM,
        errno.EIO,
    )
)
_FILE_IN_MESSAGE = re.compile(r'(?:local file|file) "([^"]+)"')
_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"
PARTIAL_SAVE = ".orbax-checkpoint-tmp"  # in the paths of a save not yet finished
_ORBAX_NOISE = ("Given directory is read only", "Waiting for previous save to complete")


def outside_cause(err: BaseException) -> bool:
    """Whether a failed read's cause lies outside the checkpoint's data: access, a path
    the library refused, a missing module, a network error."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, (PermissionError, ImportError, ConnectionError, TimeoutError)):
            return True
        if re.search(
            r"Permission denied|PERMISSION_DENIED|should be absolute|UNAVAILABLE|"
            r"DEADLINE_EXCEEDED|UNAUTHENTICATED",
            str(seen),
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_cause(err: BaseException, step_dir: str) -> str:
    """``"FILE: cause"`` of a failed read: TensorStore nests its errors as ``...local file
    "F": cause [tensorstore_spec=...]``; the innermost file and cause are the useful part."""
    text = str(err)
    files = list(re.finditer(r'local file "([^"]+)": ', text))
    if not files:
        return f"{step_dir}: {errors.one_line(err, 200)}"
    cause = text[files[-1].end() :].split(" [tensorstore_spec", 1)[0].splitlines()[0]
    return f"{files[-1].group(1)}: {cause[:200]}"


def write_cause(err: BaseException) -> str:
    """The OS's words for a failed write found in ``err``'s chain, else its first line."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return errors.one_line(seen)
        text = str(seen)
        for cause in _WRITE_CAUSES:
            if cause in text:
                found = _FILE_IN_MESSAGE.search(text)
                return cause + (f" ({found.group(1)})" if found else "")
        seen = seen.__cause__ or seen.__context__
    return errors.one_line(err)


class _OrbaxErrorFilter(logging.Filter):
    """Drops orbax's ERROR log records (a failed save logs a traceback from each of its
    writer threads) and asyncio's ERROR records about orbax's tasks and futures ("Task
    exception was never retrieved": the writes of a failed save that the library never
    awaited; told by orbax's source in the message or the exception's traceback, or by
    the path of a partial save in the exception, as TensorStore's futures carry no
    traceback): :class:`~moe_jax.runtime.checkpoints.Checkpointer` raises each failure as
    one line naming the step and cause instead. ``MOE_JAX_TRACEBACK=1`` keeps them. Also
    drops orbax's warnings :data:`_ORBAX_NOISE`: "Given directory is read only", which
    every reader (``read_only=True``) would print, and "Waiting for previous save to
    complete took N seconds" (slow storage such as ``gs://``: the loop waits for a save on
    purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_ORBAX_NOISE):
            return False
        if record.levelno < logging.ERROR or os.environ.get("MOE_JAX_TRACEBACK"):
            return True
        return _ORBAX_SOURCE not in record.pathname and not (
            record.name == "asyncio" and _mentions_orbax(record)
        )


def _mentions_orbax(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if _ORBAX_SOURCE in message or PARTIAL_SAVE in message:
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if _ORBAX_SOURCE in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


_ORBAX_ERRORS = _OrbaxErrorFilter()


def _quiet_closed_loop_hook(previous):
    """``sys.unraisablehook`` that drops, after a failed read or write, asyncio's "Event
    loop is closed" RuntimeError (TensorStore's pending callbacks reach an orbax event loop
    that was already closed and report it as unraisable, once per callback: hundreds of
    tracebacks for one full disk) and the errors of orbax coroutines left suspended in that
    loop when they are closed (at exit: ``ImportError: sys.meta_path is None``); the
    failure itself is reported as one line. Everything the hook needs is bound here: it
    also runs while the interpreter shuts down."""
    keep = bool(os.environ.get("MOE_JAX_TRACEBACK"))

    def hook(unraisable):
        value = unraisable.exc_value
        code = getattr(unraisable.object, "cr_code", None)
        if not keep and (
            (type(value) is RuntimeError and str(value) == "Event loop is closed")
            or _ORBAX_SOURCE in getattr(code, "co_filename", "")
        ):
            return
        previous(unraisable)

    hook.moe_jax_quiet = True  # type: ignore[attr-defined]  # marker: installed once
    return hook


def install_quiet_hooks() -> None:
    """Installs the filters of orbax's and asyncio's log records and the unraisable-error
    hook (once: later calls change nothing)."""
    logging.getLogger("absl").addFilter(_ORBAX_ERRORS)  # once: filters are a set
    logging.getLogger("asyncio").addFilter(_ORBAX_ERRORS)
    if not getattr(sys.unraisablehook, "moe_jax_quiet", False):
        sys.unraisablehook = _quiet_closed_loop_hook(sys.unraisablehook)
