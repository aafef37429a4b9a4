"""Orbax checkpoints of a training run: async saves, keep-K, restores onto any mesh.

Layout of one step (``MODEL_DIR/checkpoints/<step>/``, :meth:`RunDir.step_dir
<moe_jax.runtime.run_dir.RunDir.step_dir>`), three orbax items:
  ``params``  the parameter tree (restorable alone, e.g. by `moe-jax eval`)
  ``train``   ``{"step", "opt_state", "rng"}`` and, for models that have them,
              ``"collections"`` (non-parameter state such as MoE balancing biases)
  ``meta``    JSON: step, parameter shapes by name (to refuse another model's checkpoint),
              each process's data-iterator state, the run's seed and gin config.

Every item is per layer (``encoder/layers_3/...``, :meth:`EncoderDecoderModel.per_layer
<moe_jax.models.model.EncoderDecoderModel.per_layer>`), whether the run's layers are
scanned or not: the parameters, the optimizer state (its moments mirror the parameters)
and the state collections; compute copies are never saved. A scanned run's stacked leaves
are split at each save, leaf by leaf, into per-layer device arrays: a transient copy of
those leaves (for a fully scanned model, about its parameters and optimizer state) held
until the save has copied them to host memory. A restore reads any checkpoint, per layer
or stacked (written before checkpoints were per layer), into the target's layout.

Saves are asynchronous (training continues while the arrays are written) every
``save_period`` steps; the last ``keep`` are kept. Orbax writes a step under a temporary
name and renames it when complete, so a step half-written by a killed process is never
listed: restoring takes the previous one. Restore targets carry the *current* mesh's
shardings, so a checkpoint saved from any mesh shape restores onto any other.

Faults (docs/training.md, "Reliability"):
  * A step is checked before its arrays are used (:mod:`~moe_jax.runtime.checkpoint_checks`:
    integrity record, parameter shapes, finite parameters and, when resuming, a finite
    optimizer state). A damaged step
    (:class:`~moe_jax.runtime.checkpoint_checks.UnreadableCheckpointError`) is moved aside
    by `train` to ``MODEL_DIR/unreadable_checkpoints/<step>`` (never deleted), which falls
    back to the newest readable step (:func:`restore_latest_readable`) and names the steps
    set aside at every later start.
  * A read that fails while the files match their record (a permission, a missing
    library) is the caller's problem, not the checkpoint's: :class:`CheckpointReadError`
    stops with one line and nothing is moved.
  * A failed save (disk full, quota, permission) raises :class:`~moe_jax.errors.WriteFailedError`
    naming ``MODEL_DIR``, the step, the cause and the last good checkpoint, at the save that
    follows it or at the next :meth:`Checkpointer.check_for_errors`; the step's partial
    temporary directory is removed once the library's writers of the failed save are
    done, and again at :meth:`Checkpointer.close` (a trainer's next start, holding the
    run lock, removes any left by a killed process: ``remove_partial_saves``).
    The library's own reports of the failure are dropped
    (:mod:`~moe_jax.runtime.orbax_failures`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from moe_jax import errors, storage
from moe_jax.models import layer_stacking
from moe_jax.runtime import orbax_failures, store_credentials
from moe_jax.runtime.checkpoint_checks import (
    CheckpointMismatchError,
    UnreadableCheckpointError,
    check_compatible,
    check_finite,
    check_integrity,
    param_shapes,
    write_integrity,
)
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.train_state import TrainState, with_compute_copies

PyTree = Any


# Orbax's replica-parallel save writes each slice of a replicated array from a different
# replica, which spreads a pod's writes over its hosts. In one process the same host writes
# every slice anyway, and each slice is an eager op per device and array: about 1.2 s per
# save of the smoke model over 8 CPU devices. Slices under a MiB gain nothing anywhere.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def register_array_handler() -> None:
    """Saves ``jax.Array`` leaves replica-parallel only across processes (orbax's default
    there) and in slices of at least :data:`MIN_REPLICA_SLICE_BYTES`."""
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(),  # as orbax registers it
            use_replica_parallel=None if jax.process_count() > 1 else False,
            min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
        ),
        override=True,
        ignore_warnings=True,  # orbax warns of every override
    )


class MissingCheckpointError(errors.CheckpointError, FileNotFoundError):
    """No checkpoint (or not the asked-for step) at a path the user named."""


class CheckpointReadError(UnreadableCheckpointError):
    """Reading a checkpoint failed for a cause outside it (a permission, a missing
    library, a network error): the checkpoint is left where it is."""

    def __init__(self, message: str, step: int):
        super().__init__(message, step, damaged=False)


def _train_item(state: TrainState) -> dict[str, Any]:
    """The ``train`` item of a state (``collections`` only when the model has any, so
    checkpoints of models without them keep their layout)."""
    item = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    if state.collections:
        item["collections"] = state.collections
    return item


class Checkpointer:
    """Async orbax checkpoints of a :class:`TrainState` plus JSON metadata.

    ``remove_partial_saves``: remove the temporary directories of saves that never
    finished (a killed process, a failed save) when opened; only for the one writer of
    ``MODEL_DIR`` (`train`, holding the run lock), as another process's save in progress
    looks the same.
    """

    def __init__(
        self,
        run_dir: RunDir,
        *,
        save_period: int | None = None,
        keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
        remove_partial_saves: bool = False,
    ):
        orbax_failures.install_quiet_hooks()
        register_array_handler()
        store_credentials.open_quietly(run_dir.checkpoints_dir)
        self.run_dir = run_dir
        self._manager = ocp.CheckpointManager(
            run_dir.checkpoints_dir,
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

    def save(self, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an async save of ``state`` (in its model's layout) at its step, per layer
        (all processes call it).

        Raises:
          WriteFailedError: this save, or the previous one still being written, failed.
        """
        step = int(jax.device_get(state.step))
        params = layer_stacking.unstack_layers(state.params)  # per layer, as every item
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            train=ocp.args.StandardSave(layer_stacking.unstack_layers(_train_item(state))),
            meta=ocp.args.JsonSave({**meta, "step": step, "params": param_shapes(params)}),
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
                f"cannot write checkpoint step {failed} to MODEL_DIR={self.run_dir}: "
                f"{orbax_failures.write_cause(err)}; last good checkpoint: "
                f"{self.run_dir.checkpoint_name(self.last_good)}",
                names_last_good=True,
            ) from err

    def _finished(self) -> None:
        """After a save completed: record its integrity, advance ``last_good``."""
        if self._pending is None or self._pending not in self._manager.all_steps():
            return
        if jax.process_index() == 0:
            write_integrity(self.run_dir.step_dir(self._pending))
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
            partial = storage.glob(self.run_dir.checkpoints_dir, f"*{orbax_failures.PARTIAL_SAVE}*")
            for tmp in partial:
                with contextlib.suppress(OSError):  # a writer adding files meanwhile
                    storage.rmtree(tmp)
            if not partial or time.monotonic() > deadline:
                return
            time.sleep(quiet_sec)

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
            step_dir = self.run_dir.step_dir(step)
            cause = orbax_failures.read_cause(err, step_dir)
            if verified or orbax_failures.outside_cause(err):
                raise CheckpointReadError(
                    f"cannot read checkpoint step {step} ({step_dir}): {cause}", step
                ) from err
            raise UnreadableCheckpointError(
                f"checkpoint step {step} is unreadable: {cause}", step
            ) from err

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state at ``step`` laid out as ``target`` (``ShapeDtypeStruct`` leaves with the
        current mesh's shardings, in the model's layout), and its metadata; refuses another
        model's checkpoint.

        Raises:
          UnreadableCheckpointError: a file of the step is missing, truncated or unreadable.
          CheckpointMismatchError: the checkpoint is another model config's.
        """
        step_dir = self.run_dir.step_dir(step)
        verified = check_integrity(step_dir, step)
        meta = self.read_meta(step, verified)
        saved = layer_stacking.checkpoint_target(meta["params"], target)  # its layer form
        check_compatible(meta["params"], param_shapes(saved.params), step_dir)
        with self._read_errors(step, verified):
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(saved.params),
                    train=ocp.args.StandardRestore(_train_item(saved)),
                ),
            )
        check_finite(out["params"], step, step_dir)
        train = out["train"]
        check_finite({"opt_state": train["opt_state"]}, step, step_dir, "optimizer state")
        state = TrainState(
            step=train["step"],
            params=out["params"],
            opt_state=train["opt_state"],
            rng=train["rng"],
            collections=train.get("collections", {}),
        )
        copies = target.compute_params  # not saved: made from the parameters
        state = layer_stacking.convert(state, dataclasses.replace(target, compute_params={}))
        return with_compute_copies(state, copies), meta

    def restore_params(
        self, step: int, target: PyTree, collections: PyTree | None = None
    ) -> tuple[PyTree, PyTree, dict[str, Any]]:
        """What a forward pass needs at ``step`` (eval, infer, analyze), without the
        optimizer state: ``(params, collections, meta)``, the parameters laid out as
        ``target`` (in the model's layout, or per layer) and the non-parameter state
        collections (``TrainState.collections``, e.g. MoE balancing biases) as
        ``collections`` (None or ``{}``: the model has none; ``{}`` is returned). Only the
        ``collections`` part of the ``train`` item is read (orbax partial restore), so this
        needs a manager that has not saved a ``train`` item itself (``read_only=True``, as
        :func:`restore_from` opens it).

        Raises:
          UnreadableCheckpointError: a file of the step is missing, truncated or unreadable.
          CheckpointMismatchError: the checkpoint is another model config's.
        """
        step_dir = self.run_dir.step_dir(step)
        verified = check_integrity(
            step_dir, step, items=("params", "meta") + (("train",) if collections else ())
        )
        meta = self.read_meta(step, verified)
        wanted = (target, collections or {})
        target, collections = layer_stacking.checkpoint_target(meta["params"], wanted)
        check_compatible(meta["params"], param_shapes(target), step_dir)
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
        check_finite(out["params"], step, step_dir)
        restored = (out["params"], out["train"]["collections"] if collections else {})
        params, collections = layer_stacking.convert(restored, wanted)
        return params, collections, meta

    def move_aside(self, step: int) -> str | None:
        """Moves an unreadable step to ``MODEL_DIR/unreadable_checkpoints/<step>`` (process
        0; all processes wait for it) and forgets it; returns where it went (on process 0;
        None on the others)."""
        dest = None
        if jax.process_index() == 0:
            dest = self.run_dir.set_aside_path(step)
            storage.move(self.run_dir.step_dir(step), dest)
        if jax.process_count() > 1:
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


def per_layer_shapes(saved: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """``{per-layer parameter name: shape}`` of a checkpoint's metadata ``params``
    (:meth:`Checkpointer.read_meta`); an older scanned run's stacked parameters
    (``encoder/scan_0/layers_3_7_11/...``) split into their layers'."""
    stacked = {name: jax.ShapeDtypeStruct(tuple(s), np.float32) for name, s in saved.items()}
    per_layer = layer_stacking.unstack_names(stacked)
    return {name: tuple(leaf.shape) for name, leaf in per_layer.items()}


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
                    f"no readable checkpoint in {ckpt.run_dir.checkpoints_dir} (unreadable "
                    f"ones moved to {ckpt.run_dir.unreadable_dir}); {err}",
                    step,
                ) from None
    return None


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
    run_dir, step = RunDir.of_checkpoint(path)
    directory = run_dir.checkpoints_dir
    if not storage.isdir(directory):
        raise MissingCheckpointError(f"no checkpoint at {path!r}: {directory} does not exist")
    ckpt = Checkpointer(run_dir, read_only=True)
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
