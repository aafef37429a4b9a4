"""Orbax checkpoints of a training run in ``MODEL_DIR``.

Layout of one step (``MODEL_DIR/checkpoints/<step>/``), three orbax items:
  ``params``  the parameter tree (restorable alone, e.g. by `moe-jax eval`)
  ``train``   ``{"step", "opt_state", "rng"}`` and, for models that have them,
              ``"collections"`` (non-parameter state such as MoE balancing biases)
  ``meta``    JSON: step, parameter shapes by name (to refuse another model's checkpoint),
              each process's data-iterator state, the run's seed and gin config.
and once per run ``MODEL_DIR/router_init.npz``: the routers' initial weights, so that the
eval CLI can measure how far learned routers drifted (frozen routers: exactly 0).

Saves are asynchronous (training continues while the arrays are written) every
``save_period`` steps; the last ``keep`` are kept. Orbax writes a step under a temporary
name and renames it when complete, so a step half-written by a killed process is never
listed: restoring takes the previous one. Restore targets carry the *current* mesh's
shardings, so a checkpoint saved from any mesh shape restores onto any other.

Faults (docs/training.md, "Reliability"):
  * Once a step is finalized, process 0 writes ``<step>/{INTEGRITY_FILE}``: every file's
    size and CRC32C (on GCS both come from one object listing; locally each file is read
    once). Before restoring, the files are checked against it: a missing, resized or
    changed file raises :class:`UnreadableCheckpointError` (``damaged``) naming the step,
    the file and the cause in one line. `train` then moves the step aside to
    ``MODEL_DIR/unreadable_checkpoints/<step>`` (never deletes it) and falls back to the
    newest readable step (:func:`restore_latest_readable`); it names the steps set aside
    at every later start.
  * A read that fails while the files match their record (a permission, a missing
    library) is the caller's problem, not the checkpoint's: :class:`CheckpointReadError`
    stops with one line and nothing is moved. A step without a record (written by an older
    version) counts as damaged when it cannot be decoded.
  * A failed save (disk full, quota, permission) raises :class:`~moe_jax.errors.WriteFailedError`
    naming ``MODEL_DIR``, the step, the cause and the last good checkpoint, at the save that
    follows it or at the next :meth:`Checkpointer.check_for_errors`; the step's partial
    temporary directory is removed once the library's writers of the failed save are
    done, and again at :meth:`Checkpointer.close` (a trainer's next start, holding the
    run lock, removes any left by a killed process: ``remove_partial_saves``).
    The writer threads' own reports of the failure (orbax's ERROR log records, asyncio's
    "Task exception was never retrieved", "Event loop is closed", coroutines closed at
    exit) are dropped unless ``MOE_JAX_TRACEBACK=1``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from moe_jax import errors, param_paths, storage
from moe_jax.models import layer_stacking
from moe_jax.runtime.train_state import TrainState

PyTree = Any

INTEGRITY_FILE = "moe_jax_files.json"
UNREADABLE_DIR = "unreadable_checkpoints"
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


class CheckpointMismatchError(errors.CheckpointError, ValueError):
    """A checkpoint does not fit the configured model; the message names the parameters."""


class MissingCheckpointError(errors.CheckpointError, FileNotFoundError):
    """No checkpoint (or not the asked-for step) at a path the user named."""


class UnwritableModelDirError(errors.UserError, PermissionError):
    """``MODEL_DIR`` cannot be written (found before anything is built)."""


class UnreadableCheckpointError(errors.CheckpointError):
    """A checkpoint's files are missing, truncated or changed, or cannot be decoded
    (``damaged``: moving it aside is safe); names step, file and cause."""

    def __init__(self, message: str, step: int, damaged: bool = True):
        super().__init__(message)
        self.step = step
        self.damaged = damaged


class CheckpointReadError(UnreadableCheckpointError):
    """Reading a checkpoint failed for a cause outside it (a permission, a missing
    library, a network error): the checkpoint is left where it is."""

    def __init__(self, message: str, step: int):
        super().__init__(message, step, damaged=False)


def param_shapes(params: PyTree) -> dict[str, list[int]]:
    """``{"encoder/layers_0/attention/query/kernel": [32, 768], ...}`` for a parameter tree."""
    return {name: list(leaf.shape) for name, leaf in param_paths.named_leaves(params).items()}


def nonfinite_parameters(params: PyTree) -> list[str]:
    """Names of the floating-point parameters of ``params`` (global arrays on any mesh)
    holding a NaN or an Inf, in tree order; one reduction per parameter, one fetch."""
    named = {
        name: leaf
        for name, leaf in param_paths.named_leaves(params).items()
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    }
    finite = jax.device_get(
        jax.jit(lambda leaves: [jnp.isfinite(x).all() for x in leaves])(list(named.values()))
    )
    return [name for name, ok in zip(named, finite, strict=True) if not ok]


def check_finite(params: PyTree, step: int, step_dir: str) -> None:
    """Refuses restored parameters holding NaN or Inf: training never saves such a step,
    so they are damage (bytes changed where no integrity record could tell).

    Raises:
      UnreadableCheckpointError: naming the step and the first such parameter.
    """
    bad = nonfinite_parameters(params)
    if bad:
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {step_dir}: parameter {bad[0]} "
            f"({len(bad)} of {len(param_paths.named_leaves(params))}) holds NaN or Inf",
            step,
        )


def check_compatible(
    saved: dict[str, list[int]], expected: dict[str, list[int]], where: str
) -> None:
    """Raises :class:`CheckpointMismatchError` naming missing, unexpected and reshaped
    parameters when a checkpoint's parameters differ from the configured model's."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    reshaped = sorted(
        f"{k}: checkpoint {saved[k]} vs model {expected[k]}"
        for k in set(saved) & set(expected)
        if list(saved[k]) != list(expected[k])
    )
    if missing or extra or reshaped:

        def show(title, names):
            return (
                f"\n  {title} ({len(names)}): "
                + ", ".join(names[:12])
                + (" ..." if len(names) > 12 else "")
                if names
                else ""
            )

        raise CheckpointMismatchError(
            f"checkpoint {where} was saved from another model config:"
            + show("parameters in the model but not the checkpoint", missing)
            + show("parameters in the checkpoint but not the model", extra)
            + show("parameters with other shapes", reshaped)
        )


def ensure_writable(model_dir: str) -> None:
    """Refuses (``PermissionError`` naming it) a ``MODEL_DIR`` that cannot be written, before
    any training starts: each process writes and deletes a probe file (an object on GCS)."""
    probe = storage.join(model_dir, f".write_probe_{jax.process_index()}")
    try:
        storage.makedirs(model_dir)
        storage.write_text(probe, "ok")
        storage.remove(probe)
    except OSError as err:
        raise UnwritableModelDirError(
            f"MODEL_DIR={model_dir!r} is not writable ({err.strerror or err})"
        ) from None


def reached_step(model_dir: str) -> int | None:
    """The newest checkpoint step of ``MODEL_DIR`` (None: none), read from the directory
    names without creating anything."""
    steps = [
        int(name)
        for name in storage.listdir(storage.join(model_dir, "checkpoints"))
        if name.isdigit()
    ]
    return max(steps, default=None)


def set_aside_steps(model_dir: str) -> list[int]:
    """The steps in ``MODEL_DIR/unreadable_checkpoints`` (set aside as damaged)."""
    names = storage.listdir(storage.join(model_dir, UNREADABLE_DIR))
    return sorted({int(name.split(".")[0]) for name in names if name.split(".")[0].isdigit()})


def split_checkpoint_path(path: str) -> tuple[str, int | None]:
    """``DIR`` -> (DIR, None: latest); ``DIR/STEP`` or ``DIR/checkpoints/STEP`` -> (DIR, STEP);
    ``DIR`` normalised (:func:`moe_jax.storage.normalize`)."""
    path = storage.normalize(path)
    name = storage.basename(path)
    if name.isdigit():
        parent = storage.parent(path)
        if storage.basename(parent) == "checkpoints":
            parent = storage.parent(parent)
        return parent, int(name)
    return path, None


def _train_item(state: TrainState) -> dict[str, Any]:
    """The ``train`` item of a state (``collections`` only when the model has any, so
    checkpoints of models without them keep their layout)."""
    item = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    if state.collections:
        item["collections"] = state.collections
    return item


_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"
_PARTIAL_SAVE = ".orbax-checkpoint-tmp"  # in the paths of a save not yet finished


_ORBAX_NOISE = ("Given directory is read only", "Waiting for previous save to complete")


class _OrbaxErrorFilter(logging.Filter):
    """Drops orbax's ERROR log records (a failed save logs a traceback from each of its
    writer threads) and asyncio's ERROR records about orbax's tasks and futures ("Task
    exception was never retrieved": the writes of a failed save that the library never
    awaited; told by orbax's source in the message or the exception's traceback, or by
    the path of a partial save in the exception, as TensorStore's futures carry no
    traceback):
    :class:`Checkpointer` raises each failure as one line naming the step and cause
    instead. ``MOE_JAX_TRACEBACK=1`` keeps them. Also drops orbax's warnings
    :data:`_ORBAX_NOISE`: "Given directory is read only", which every reader
    (``read_only=True``) would print, and "Waiting for previous save to complete took N
    seconds" (slow storage such as ``gs://``: the loop waits for a save on purpose)."""

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
    if _ORBAX_SOURCE in message or _PARTIAL_SAVE in message:
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


def _install_quiet_hooks() -> None:
    logging.getLogger("absl").addFilter(_ORBAX_ERRORS)  # once: filters are a set
    logging.getLogger("asyncio").addFilter(_ORBAX_ERRORS)
    if not getattr(sys.unraisablehook, "moe_jax_quiet", False):
        sys.unraisablehook = _quiet_closed_loop_hook(sys.unraisablehook)


class Checkpointer:
    """Async orbax checkpoints of a :class:`TrainState` plus JSON metadata.

    ``remove_partial_saves``: remove the temporary directories of saves that never
    finished (a killed process, a failed save) when opened; only for the one writer of
    ``MODEL_DIR`` (`train`, holding the run lock), as another process's save in progress
    looks the same.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        save_period: int | None = None,
        keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
        remove_partial_saves: bool = False,
    ):
        _install_quiet_hooks()
        self.model_dir = model_dir = storage.normalize(model_dir)
        self.directory = storage.join(model_dir, "checkpoints")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=0 if read_only else save_period or 1,
                max_to_keep=keep,
                create=not read_only,
                enable_async_checkpointing=async_save,
                read_only=read_only,
                cleanup_tmp_directories=remove_partial_saves and not read_only,
            ),
        )
        self._pending: int | None = None  # a step being written in the background
        self._failed = False  # a save failed (reported once; partial directories removed)
        self.last_good: int | None = self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_dir(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def save(self, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an async save of ``state`` at its step (all processes call it).

        Raises:
          WriteFailedError: this save, or the previous one still being written, failed.
        """
        step = int(jax.device_get(state.step))
        train = _train_item(state)
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave({**meta, "step": step, "params": param_shapes(state.params)}),
        )
        saved = False
        with self._write_errors(step):
            saved = self._manager.save(step, force=force, args=args)  # waits for the previous save
        self._finished()
        if saved:
            self._pending = step
        return saved

    def check_for_errors(self) -> None:
        """Raises :class:`~moe_jax.errors.WriteFailedError` as soon as a background save
        has failed (cheap; call it every step); records a finished save's integrity."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait_until_finished()

    def wait_until_finished(self) -> None:
        with self._write_errors(self._pending):
            self._manager.wait_until_finished()
        self._finished()

    @contextlib.contextmanager
    def _write_errors(self, step: int | None):
        """Turns a failed write of ``step`` (or of the pending one) into WriteFailedError,
        once: orbax raises a failure again at every later wait and at close, and the run
        stops at the first."""
        try:
            yield
        except Exception as err:  # orbax/TensorStore wrap OSErrors in various types
            failed = self._pending if self._pending is not None else step
            self._pending = None
            self._remove_partial()
            if self._failed:
                return
            self._failed = True
            raise errors.WriteFailedError(
                f"cannot write checkpoint step {failed} to MODEL_DIR={self.model_dir}: "
                f"{_write_cause(err)}; last good checkpoint: {self.name(self.last_good)}",
                names_last_good=True,
            ) from err

    def _finished(self) -> None:
        """After a save completed: record its integrity, advance ``last_good``."""
        if self._pending is None or self._pending not in self._manager.all_steps():
            return
        if jax.process_index() == 0:
            write_integrity(self.step_dir(self._pending))
        self.last_good, self._pending = self._pending, None

    def _remove_partial(self, quiet_sec: float = 0.5, timeout_sec: float = 30.0) -> None:
        """Removes the temporary directories of a failed save (process 0). TensorStore
        finishes the writes already issued after orbax reported the first failure (a
        ``_sharding`` file, other items' data), recreating a directory removed too early:
        removes until none reappears for ``quiet_sec``."""
        if jax.process_index() != 0:
            return
        deadline = time.monotonic() + timeout_sec
        while True:
            partial = storage.glob(self.directory, "*.orbax-checkpoint-tmp*")
            for tmp in partial:
                with contextlib.suppress(OSError):  # a writer adding files meanwhile
                    storage.rmtree(tmp)
            if not partial or time.monotonic() > deadline:
                return
            time.sleep(quiet_sec)

    def name(self, step: int | None) -> str:
        """``MODEL_DIR/checkpoints/STEP`` or ``"none yet"``."""
        return "none yet" if step is None else self.step_dir(step)

    def read_meta(self, step: int, verified: bool = False) -> dict[str, Any]:
        with self._read_errors(step, verified):
            return self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]

    @contextlib.contextmanager
    def _read_errors(self, step: int, verified: bool):
        """A failed read as :class:`CheckpointReadError` when its cause is outside the
        checkpoint (``verified``: its files match their checksums; or the error is one of
        access or environment), else as a damaged :class:`UnreadableCheckpointError`."""
        try:
            yield
        except CheckpointMismatchError:
            raise
        except Exception as err:
            cause = _read_cause(err, self.step_dir(step))
            if verified or _outside_cause(err):
                raise CheckpointReadError(
                    f"cannot read checkpoint step {step} ({self.step_dir(step)}): {cause}", step
                ) from err
            raise UnreadableCheckpointError(
                f"checkpoint step {step} is unreadable: {cause}", step
            ) from err

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state at ``step`` laid out as ``target`` (``ShapeDtypeStruct`` leaves with the
        current mesh's shardings), and its metadata; refuses another model's checkpoint.

        Raises:
          UnreadableCheckpointError: a file of the step is missing, truncated or unreadable.
          CheckpointMismatchError: the checkpoint is another model config's.
        """
        verified = check_integrity(self.step_dir(step), step)
        meta = self.read_meta(step, verified)
        saved = layer_stacking.checkpoint_target(meta["params"], target)  # its layer form
        check_compatible(meta["params"], param_shapes(saved.params), self.step_dir(step))
        with self._read_errors(step, verified):
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(saved.params),
                    train=ocp.args.StandardRestore(_train_item(saved)),
                ),
            )
        check_finite(out["params"], step, self.step_dir(step))
        train = out["train"]
        state = TrainState(
            step=train["step"],
            params=out["params"],
            opt_state=train["opt_state"],
            rng=train["rng"],
            collections=train.get("collections", {}),
        )
        return layer_stacking.convert(state, target), meta

    def restore_params(
        self, step: int, target: PyTree, collections: PyTree | None = None
    ) -> tuple[PyTree, PyTree, dict[str, Any]]:
        """What a forward pass needs at ``step`` (eval, infer, analyze), without the
        optimizer state: ``(params, collections, meta)``, the parameters laid out as
        ``target`` and the non-parameter state collections (``TrainState.collections``,
        e.g. MoE balancing biases) as ``collections`` (None or ``{}``: the model has none;
        ``{}`` is returned). Only the ``collections`` part of the ``train`` item is read
        (orbax partial restore), so this needs a manager that has not saved a ``train``
        item itself (``read_only=True``, as :func:`restore_from` opens it).

        Raises:
          UnreadableCheckpointError: a file of the step is missing, truncated or unreadable.
          CheckpointMismatchError: the checkpoint is another model config's.
        """
        verified = check_integrity(
            self.step_dir(step),
            step,
            items=("params", "meta") + (("train",) if collections else ()),
        )
        meta = self.read_meta(step, verified)
        wanted = (target, collections or {})
        target, collections = layer_stacking.checkpoint_target(meta["params"], wanted)
        check_compatible(meta["params"], param_shapes(target), self.step_dir(step))
        args = {"params": ocp.args.StandardRestore(target)}
        if collections:
            item = {"collections": collections}
            args["train"] = ocp.args.PyTreeRestore(
                item,
                restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True,
            )
        with self._read_errors(step, verified):
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
        check_finite(out["params"], step, self.step_dir(step))
        restored = (out["params"], out["train"]["collections"] if collections else {})
        params, collections = layer_stacking.convert(restored, wanted)
        return params, collections, meta

    def move_aside(self, step: int) -> str:
        """Moves an unreadable step to ``MODEL_DIR/unreadable_checkpoints/<step>`` (process
        0; all processes wait for it) and forgets it; returns where it went."""
        aside = storage.join(self.model_dir, UNREADABLE_DIR)
        dest = storage.join(aside, str(step))
        if jax.process_index() == 0:
            if storage.exists(dest):
                dest = f"{dest}.{len(storage.listdir(aside))}"
            storage.move(self.step_dir(step), dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"moe_jax_move_aside_{step}")
        self._manager.reload()
        self.last_good = self._manager.latest_step()
        return dest

    def close(self) -> None:
        """Waits for a save in progress (raising its failure) and stops orbax's threads."""
        with self._write_errors(self._pending):
            self._manager.close()
        if self._failed:
            self._remove_partial()


def restore_latest_readable(
    ckpt: Checkpointer, target: TrainState, warn: Callable[[str], None]
) -> tuple[TrainState, dict[str, Any], int] | None:
    """The newest readable checkpoint of ``ckpt`` (state, metadata, step), or None when
    there is none. Each damaged newer step is moved aside with a warning that names it and
    the step used instead.

    Raises:
      UnreadableCheckpointError: every checkpoint is damaged (all moved aside).
      CheckpointReadError: a checkpoint could not be read for a cause outside it (nothing moved).
    """
    steps = ckpt.all_steps()
    for step in sorted(steps, reverse=True):
        try:
            state, meta = ckpt.restore(step, target)
            return state, meta, step
        except UnreadableCheckpointError as err:
            if not err.damaged:
                raise
            moved = ckpt.move_aside(step)
            older = [s for s in steps if s < step]
            warn(
                f"warning: {err}; moved it to {moved}; "
                + (f"resuming from step {max(older)} instead" if older else "no older checkpoint")
            )
            if not older:
                raise UnreadableCheckpointError(
                    f"no readable checkpoint in {ckpt.directory} (unreadable ones moved to "
                    f"{storage.join(ckpt.model_dir, UNREADABLE_DIR)}); {err}",
                    step,
                ) from None
    return None


def write_integrity(step_dir: str) -> None:
    """Writes ``step_dir/INTEGRITY_FILE``: ``{"files": {path: {"size", "crc32c"}}}`` of every
    file of a finished step (nothing when the step was removed meanwhile by keep-K)."""
    try:
        files = {
            rel: entry
            for rel, entry in storage.file_info(step_dir).items()
            if rel != INTEGRITY_FILE
        }
        if files:
            storage.write_text(storage.join(step_dir, INTEGRITY_FILE), json.dumps({"files": files}))
    except FileNotFoundError:
        return


def check_integrity(step_dir: str, step: int, items: tuple[str, ...] | None = None) -> bool:
    """Compares a step's files (sizes and CRC32C) with its integrity record, when it has one
    (``items``: only files under these item folders). Records of older versions hold
    sizes only; those are compared.

    Returns:
      whether every checked file's checksum matched (False: no record, or sizes only).

    Raises:
      UnreadableCheckpointError: naming the first missing, resized or changed file.
    """
    record_path = storage.join(step_dir, INTEGRITY_FILE)
    if not storage.exists(record_path):
        return False
    try:
        recorded = json.loads(storage.read_text(record_path))["files"]
    except (OSError, ValueError, KeyError) as err:
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {record_path}: {errors.one_line(err)}", step
        ) from None
    wanted = {
        rel: entry if isinstance(entry, dict) else {"size": entry}
        for rel, entry in recorded.items()
        if items is None or rel.split("/", 1)[0] in items
    }
    actual = storage.file_info(step_dir, checksums=False)
    for rel, entry in sorted(wanted.items()):
        path = storage.join(step_dir, rel)
        size = actual.get(rel, {}).get("size")
        if size != entry["size"]:
            cause = (
                "missing"
                if size is None
                else f"{size} bytes, {entry['size']} when saved (truncated)"
            )
        elif "crc32c" in entry and storage.crc32c_file(path) != entry["crc32c"]:
            cause = (
                f"CRC32C differs from the one recorded when saved (content changed, {size} bytes)"
            )
        else:
            continue
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {path}: {cause}", step
        )
    return bool(wanted) and all("crc32c" in entry for entry in wanted.values())


def _outside_cause(err: BaseException) -> bool:
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


def _read_cause(err: BaseException, step_dir: str) -> str:
    """``"FILE: cause"`` of a failed read: TensorStore nests its errors as ``...local file
    "F": cause [tensorstore_spec=...]``; the innermost file and cause are the useful part."""
    text = str(err)
    files = list(re.finditer(r'local file "([^"]+)": ', text))
    if not files:
        return f"{step_dir}: {errors.one_line(err, 200)}"
    cause = text[files[-1].end() :].split(" [tensorstore_spec", 1)[0].splitlines()[0]
    return f"{files[-1].group(1)}: {cause[:200]}"


def _write_cause(err: BaseException) -> str:
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


def restore_from(
    path: str, target: PyTree, collections: PyTree | None = None
) -> tuple[PyTree, PyTree, int, dict[str, Any]]:
    """The one restore path of every command that reads a checkpoint without resuming it
    (eval, infer, analyze, export, upcycle; ``moe_jax.runtime.builders.restore_model`` builds the
    targets): ``(params, collections, step, meta)`` of the checkpoint at ``path``, laid out as
    ``target`` / ``collections`` (see :meth:`Checkpointer.restore_params`). ``path`` is
    ``MODEL_DIR`` (latest step), ``MODEL_DIR/STEP`` or ``MODEL_DIR/checkpoints/STEP``.

    Raises:
      MissingCheckpointError: naming ``path`` when it holds no checkpoints or not that step.
      CheckpointMismatchError: when the checkpoint is another model's.
      UnreadableCheckpointError: naming the step, file and cause.
    """
    model_dir, step = split_checkpoint_path(path)
    directory = storage.join(model_dir, "checkpoints")
    if not storage.isdir(directory):
        raise MissingCheckpointError(f"no checkpoint at {path!r}: {directory} does not exist")
    ckpt = Checkpointer(model_dir, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise MissingCheckpointError(
                f"no checkpoint {'step ' + str(step) + ' ' if step is not None else ''}"
                f"at {path!r} (steps in {directory}: {ckpt.all_steps()})"
            )
        params, restored_collections, meta = ckpt.restore_params(step, target, collections)
    finally:
        ckpt.close()
    return params, restored_collections, step, meta


def gather_from_processes(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (one collective)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.array([data.size], np.int32))))
    padded = np.zeros(length, np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in np.asarray(rows)]


ROUTER_INIT_FILE = "router_init.npz"


def save_router_init(model_dir: str, params: PyTree) -> None:
    """Writes the routers' initial weights (once, by process 0) for drift measurements."""
    from jax.experimental import multihost_utils

    write_router_init(
        model_dir,
        {
            k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in param_paths.router_params(params).items()
        },
    )


def write_router_init(model_dir: str, routers: dict[str, np.ndarray]) -> None:
    """Writes ``{router parameter name: initial host array}`` as ``MODEL_DIR/router_init.npz``
    (by process 0; nothing when empty or already there)."""
    path = storage.join(model_dir, ROUTER_INIT_FILE)
    if jax.process_index() == 0 and routers and not storage.exists(path):
        storage.save_npz(path, routers)


def load_router_init(model_dir: str) -> dict[str, np.ndarray] | None:
    path = storage.join(model_dir, ROUTER_INIT_FILE)
    return storage.load_npz(path) if storage.exists(path) else None
