"""The project's expected errors: bad input and run-directory faults a user can fix.

Every `moe-jax` command turns these into one line ``moe-jax <command>: error: <message>``
and the error's exit code (:func:`moe_jax.cli.main`), never a traceback; set
``MOE_JAX_TRACEBACK=1`` to see the traceback as well. Anything else is a bug and keeps
its traceback. Raise a subclass of :class:`UserError` whose message names the option,
file or step at fault (one line; a short indented detail list may follow).

Exit codes: 1 bad input or a refused run; 3 the loss became non-finite (`train`);
74 (``EX_IOERR``) a write to the run directory failed (disk full, quota, permission);
130 stopped by Ctrl-C (SIGINT), 143 by SIGTERM (:class:`Interrupted`; `train` saves a
checkpoint first), as a shell reports a process ended by those signals.
"""

from __future__ import annotations

import os
import signal

EXIT_USER_ERROR = 1
EXIT_NONFINITE = 3
EXIT_WRITE_FAILED = 74
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143


class UserError(Exception):
    """An expected error: the message alone tells the user what to fix."""

    exit_code: int = EXIT_USER_ERROR


class ConfigError(UserError, ValueError):
    """A configured value is invalid (``BATCH_SIZE=0``, ``TRAIN_STEPS=-5``); names the option."""


class InputFileError(UserError, OSError):
    """An input file the user named is missing, unreadable or not in the expected format."""


class CheckpointError(UserError):
    """A checkpoint cannot be used; the message names the step, the file and the cause."""


class WriteFailedError(UserError, OSError):
    """Writing to the run directory failed (disk full, quota, permission lost); the message
    names the file. ``names_last_good``: the message already names the last good
    checkpoint (`train` adds it to those that do not)."""

    exit_code = EXIT_WRITE_FAILED

    def __init__(self, message: str, *, names_last_good: bool = False):
        super().__init__(message)
        self.names_last_good = names_last_good


def write_failed(path: str | os.PathLike, err: BaseException) -> WriteFailedError:
    """``cannot write PATH: cause`` for an error raised while writing ``path``."""
    cause = err.strerror if isinstance(err, OSError) and err.strerror else one_line(err)
    return WriteFailedError(f"cannot write {os.fspath(path)}: {cause}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped a command; ``detail`` says what was saved and
    how to resume. A :class:`KeyboardInterrupt` (not an ``Exception``), so that no
    ``except Exception`` on the way up swallows it; exit code ``128 + signum``."""

    def __init__(self, signum: int = signal.SIGINT, detail: str = ""):
        super().__init__(signum, detail)
        self.signum = signum
        self.detail = detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        what = "Ctrl-C (SIGINT)" if self.signum == signal.SIGINT else name
        return f"stopped by {what}" + (f": {self.detail}" if self.detail else "")


class RunLockedError(UserError):
    """Another live process is writing the run directory; names the holder."""


def one_line(err: BaseException, limit: int = 300) -> str:
    """``"Type: first line of the message"`` cut at ``limit`` characters: the cause of a
    library error whose full message is long (TensorStore's run to thousands of lines)."""
    text = str(err).strip().splitlines()
    first = text[0].strip() if text else ""
    if isinstance(err, OSError) and err.strerror:
        first = err.strerror + (f": {err.filename}" if err.filename else "")
    first = first if len(first) <= limit else first[:limit] + "..."
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
