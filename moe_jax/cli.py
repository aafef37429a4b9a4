"""The `moe-jax` console entry point: one subcommand per binary.

Each subcommand lives in its own module and exposes ``main(argv: list[str]) -> int`` (or
the function named after a colon: ``module:function``).
Modules are imported lazily so that `moe-jax --help` and the synthetic laboratory do not
pay for importing TensorFlow/seqio.

This is the one place that turns the project's expected errors (:mod:`moe_jax.errors`)
into one line ``moe-jax <command>: error: ...`` and an exit code, for every command, and
Ctrl-C (SIGINT) or SIGTERM into one line ``moe-jax <command>: stopped by ...: <what was
saved, how to resume>`` and exit code 130 / 143 (`train` saves a checkpoint first, see
:class:`moe_jax.runtime.distributed.PreemptionWatcher`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, MutableMapping

from moe_jax import errors
from moe_jax.commands.subcommands import split_command
from moe_jax.runtime import scratch

# subcommand -> (module path, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "synthetic": ("moe_jax.synthetic.cli", "regenerate the paper's synthetic experiments"),
    "train": ("moe_jax.commands.train", "T5X-style gin-configured training"),
    "eval": ("moe_jax.commands.evaluate", "evaluate one or more checkpoints"),
    "infer": ("moe_jax.commands.infer", "decode from a checkpoint"),
    "analyze": ("moe_jax.commands.analyze", "routing analyses over a checkpoint"),
    "sweep": ("moe_jax.experiments.sweep", "expand an experiment family into runs; collect plots"),
    "compile": (
        "moe_jax.commands.compile",
        "compile a run for a TPU/GPU/CPU target: memory, fit, step time",
    ),
    "smoke": ("moe_jax.smoke", "the README's main job on embedded defaults"),
    "upcycle": (
        "moe_jax.commands.upcycle",
        "an MoE run from a dense run's checkpoint (sparse upcycling)",
    ),
    "export": ("moe_jax.commands.export", "write a checkpoint as safetensors + JSON"),
    "import": ("moe_jax.commands.import_run", "read an export into a new run directory"),
}


def _usage() -> str:
    lines = ["usage: moe-jax <command> [options]", "", "commands:"]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {help_text}")
    lines.append("")
    lines.append("`moe-jax <command> --help` for the options of one command.")
    return "\n".join(lines)


# TensorFlow (the data pipeline's) prints C++ log lines at import (the oneDNN notice, "Could
# not find cuda drivers", a CPU-features notice) and a cuInit error on a machine without a
# GPU: they read as faults to a new user. Commands that read data import it quietly first
# (its output hidden) and hide GPUs from it (data runs on the host; JAX owns accelerators),
# as T5X and MaxText do; so do the trainings `moe-jax sweep` starts (which inherit the level
# set here). Set TF_CPP_MIN_LOG_LEVEL yourself to another level (e.g. 0) to see those lines.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
NO_TENSORFLOW = frozenset({"synthetic", "sweep"})  # commands that never import it

# Library errors that, reaching a command's top, mean bad input rather than a bug: gin's
# and seqio's configuration checks raise ValueError; a missing or unreadable file the user
# named raises one of these OSErrors (its message names the file).
EXPECTED_LIBRARY_ERRORS = (
    ValueError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    UnicodeDecodeError,
)


def quiet_startup(command: str, argv: list[str]) -> None:
    """Unless the user set ``TF_CPP_MIN_LOG_LEVEL`` to another level than
    :data:`QUIET_ENV`'s (a sweep's trainings inherit that one from `moe-jax sweep`): sets
    it and, for a command that reads data, imports TensorFlow with file descriptor 2
    pointed at /dev/null and makes it see no GPU."""
    if (
        os.environ.get("TF_CPP_MIN_LOG_LEVEL", QUIET_ENV["TF_CPP_MIN_LOG_LEVEL"])
        != QUIET_ENV["TF_CPP_MIN_LOG_LEVEL"]
    ):
        return
    os.environ.update(QUIET_ENV)
    if command in NO_TENSORFLOW or "tensorflow" in sys.modules or {"-h", "--help"} & set(argv):
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        try:
            import tensorflow as tf
        except ImportError:
            return  # reported, with its message, where the command imports it
        tf.config.set_visible_devices([], "GPU")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# JAX's persistent compilation cache, on for every command (as MaxText does): a command run
# again loads its compiled steps instead of compiling them (the smoke's first step comes
# seconds sooner). ``MOE_JAX_COMPILATION_CACHE=0`` turns it off; a JAX_COMPILATION_CACHE_DIR
# the user set is used as it is. `moe-jax compile` compiles afresh: its report says how long
# the compile took.
CACHE_SWITCH = "MOE_JAX_COMPILATION_CACHE"
UNCACHED_COMMANDS = frozenset({"compile"})


def compilation_cache_dir(environ: MutableMapping[str, str], command: str = "") -> str | None:
    """Points JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR`` of
    ``environ``: this process' and those it starts) at ``$XDG_CACHE_HOME/moe-jax/jax``
    (default ``~/.cache/moe-jax/jax``) unless the user set one; returns the folder in use.
    Returns None, and turns JAX's cache off (``JAX_ENABLE_COMPILATION_CACHE``), for a
    command in :data:`UNCACHED_COMMANDS` or when ``MOE_JAX_COMPILATION_CACHE=0``."""
    off = environ.get(CACHE_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    if off or command in UNCACHED_COMMANDS:
        environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        return None
    if not environ.get("JAX_COMPILATION_CACHE_DIR"):
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(base, "moe-jax", "jax")
    return environ["JAX_COMPILATION_CACHE_DIR"]


def error_message(err: BaseException) -> str:
    """What the user sees of an expected error: a UserError's or a short ValueError's own
    message (without gin's "In call to configurable" context lines), else its first line."""

    lines = [
        line
        for line in str(err).rstrip().splitlines()
        if not line.lstrip().startswith("In call to configurable")
    ]
    text = "\n".join(lines)
    if isinstance(err, errors.UserError) or (isinstance(err, ValueError) and len(text) < 1000):
        return text
    return errors.one_line(err)


# What an interrupted command that does not say more has left: every file the project
# writes is written whole (moe_jax.storage), so running it again redoes it.
INTERRUPTED_DETAIL = "not finished (files it wrote are whole); run the same command again"


def _raise_terminated(signum: int, frame) -> None:

    raise errors.Interrupted(signum)


def _redeliver_interrupts(previous):
    """``sys.unraisablehook`` that delivers again the signal of an interrupt raised where
    Python can only report it (a garbage-collection callback, a finalizer: "Exception
    ignored in ..."), so that it still stops the command."""

    def hook(unraisable) -> None:
        value = unraisable.exc_value
        if isinstance(value, KeyboardInterrupt):  # sent again once the hook has returned
            signum = getattr(value, "signum", signal.SIGINT)
            timer = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises :class:`moe_jax.errors.Interrupted` in the main thread for the block
    (as Ctrl-C raises ``KeyboardInterrupt``) instead of ending the process silently; an
    interrupt that lands in a garbage-collection callback is delivered again."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_hook = sys.unraisablehook
    hook = sys.unraisablehook = _redeliver_interrupts(previous_hook)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sys.unraisablehook is hook:  # hooks installed inside the block chain to it
            sys.unraisablehook = previous_hook


def run_command(name: str, module_main, argv: list[str]) -> int:
    """``module_main(argv)``'s exit code; an expected error becomes one line on stderr and
    its exit code, an interrupt one line and 130 / 143 (``MOE_JAX_TRACEBACK=1`` re-raises
    either for the traceback)."""

    try:
        return int(module_main(argv) or 0)
    except (errors.UserError, *EXPECTED_LIBRARY_ERRORS) as err:
        if os.environ.get("MOE_JAX_TRACEBACK"):
            raise
        print(f"moe-jax {name}: error: {error_message(err)}", file=sys.stderr, flush=True)
        return getattr(err, "exit_code", errors.EXIT_USER_ERROR)
    except KeyboardInterrupt as err:
        if os.environ.get("MOE_JAX_TRACEBACK"):
            raise
        if not isinstance(err, errors.Interrupted) or not err.detail:
            err = errors.Interrupted(getattr(err, "signum", signal.SIGINT), INTERRUPTED_DETAIL)
        print(f"moe-jax {name}: {err}", file=sys.stderr, flush=True)
        return err.exit_code


def main(argv: list[str] | None = None) -> int:
    picked = split_command(
        list(sys.argv[1:] if argv is None else argv), SUBCOMMANDS, "moe-jax", _usage()
    )
    if isinstance(picked, int):
        return picked
    name, rest = picked
    with sigterm_interrupts(), scratch.scratch_tempdir():
        return run_command(name, functools.partial(_start, name), rest)


def _start(name: str, rest: list[str]) -> int:
    """Runs command ``name`` (compilation cache, quiet start-up, lazy import) with options
    ``rest``."""
    cache = compilation_cache_dir(os.environ, name)
    if "jax" in sys.modules:  # imported already (moe_jax.cli.main called in-process)
        config = sys.modules["jax"].config
        if cache:
            config.update("jax_compilation_cache_dir", cache)
        else:
            config.update("jax_enable_compilation_cache", False)
    if name not in NO_TENSORFLOW and sys.stderr.isatty() and not {"-h", "--help"} & set(rest):
        # on a terminal, a word before the imports' seconds (logs and refusals stay as they are)
        print(f"[moe-jax] {name}: loading JAX and TensorFlow", file=sys.stderr, flush=True)
    quiet_startup(name, rest)
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            print(
                f"moe-jax: command {name!r} is not built yet ({module_name} missing)",
                file=sys.stderr,
            )
            return 2
        raise
    return getattr(module, function or "main")(rest)


if __name__ == "__main__":
    sys.exit(main())
