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
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moe_jax.train.train_state import TrainState

PyTree = Any


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the configured model; the message names the parameters."""


def param_shapes(params: PyTree) -> dict[str, list[int]]:
    """``{"encoder/layers_0/attention/query/kernel": [32, 768], ...}`` for a parameter tree."""
    return {path_name(path): list(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_compatible(saved: dict[str, list[int]], expected: dict[str, list[int]], where: str) -> None:
    """Raises :class:`CheckpointMismatchError` naming missing, unexpected and reshaped
    parameters when a checkpoint's parameters differ from the configured model's."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    reshaped = sorted(f"{k}: checkpoint {saved[k]} vs model {expected[k]}"
                      for k in set(saved) & set(expected) if list(saved[k]) != list(expected[k]))
    if missing or extra or reshaped:
        def show(title, names):
            return f"\n  {title} ({len(names)}): " + ", ".join(names[:12]) + (" ..." if len(names) > 12 else "") if names else ""
        raise CheckpointMismatchError(
            f"checkpoint {where} was saved from another model config:"
            + show("parameters in the model but not the checkpoint", missing)
            + show("parameters in the checkpoint but not the model", extra)
            + show("parameters with other shapes", reshaped))


def ensure_writable(model_dir: str) -> None:
    """Refuses (``PermissionError`` naming it) a local ``MODEL_DIR`` that cannot be written,
    before any training starts. Remote paths (``gs://``) are left to orbax."""
    if "://" in model_dir:
        return
    path = pathlib.Path(model_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"MODEL_DIR={model_dir!r} is not writable ({err.strerror or err})") from None


def split_checkpoint_path(path: str) -> tuple[str, int | None]:
    """``DIR`` -> (DIR, None: latest); ``DIR/STEP`` or ``DIR/checkpoints/STEP`` -> (DIR, STEP)."""
    p = pathlib.Path(path)
    if p.name.isdigit():
        parent = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        return str(parent), int(p.name)
    return str(p), None


def _train_item(state: TrainState) -> dict[str, Any]:
    """The ``train`` item of a state (``collections`` only when the model has any, so
    checkpoints of models without them keep their layout)."""
    item = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    if state.collections:
        item["collections"] = state.collections
    return item


class Checkpointer:
    """Async orbax checkpoints of a :class:`TrainState` plus JSON metadata."""

    def __init__(self, model_dir: str, *, save_period: int | None = None, keep: int | None = None,
                 async_save: bool = True, read_only: bool = False):
        self.model_dir = model_dir
        self.directory = os.path.join(model_dir, "checkpoints")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=save_period or 1, max_to_keep=keep, create=not read_only,
                enable_async_checkpointing=async_save, read_only=read_only))

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def save(self, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an async save of ``state`` at its step (all processes call it)."""
        step = int(jax.device_get(state.step))
        train = _train_item(state)
        return self._manager.save(step, force=force, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave({**meta, "step": step, "params": param_shapes(state.params)})))

    def read_meta(self, step: int) -> dict[str, Any]:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The state at ``step`` laid out as ``target`` (``ShapeDtypeStruct`` leaves with the
        current mesh's shardings), and its metadata; refuses another model's checkpoint."""
        meta = self.read_meta(step)
        check_compatible(meta["params"], param_shapes(target.params), f"{self.directory}/{step}")
        out = self._manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target.params),
            train=ocp.args.StandardRestore(_train_item(target))))
        train = out["train"]
        return TrainState(step=train["step"], params=out["params"], opt_state=train["opt_state"],
                          rng=train["rng"], collections=train.get("collections", {})), meta

    def restore_params(self, step: int, target: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Only the parameters at ``step`` (for eval/infer), laid out as ``target``."""
        meta = self.read_meta(step)
        check_compatible(meta["params"], param_shapes(target), f"{self.directory}/{step}")
        out = self._manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        return out["params"], meta

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def restore_params_from(path: str, target: PyTree) -> tuple[PyTree, int, dict[str, Any]]:
    """The parameters of the checkpoint at ``path`` laid out as ``target``, its step and
    metadata (for eval/analysis). ``path`` is ``MODEL_DIR`` (latest step), ``MODEL_DIR/STEP``
    or ``MODEL_DIR/checkpoints/STEP``.

    Raises:
      FileNotFoundError: naming ``path`` when it holds no checkpoints or not that step.
      CheckpointMismatchError: when the checkpoint is another model's.
    """
    model_dir, step = split_checkpoint_path(path)
    directory = os.path.join(model_dir, "checkpoints")
    if "://" not in directory and not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint at {path!r}: {directory} does not exist")
    ckpt = Checkpointer(model_dir, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise FileNotFoundError(f"no checkpoint {'step ' + str(step) + ' ' if step is not None else ''}"
                                    f"at {path!r} (steps in {directory}: {ckpt.all_steps()})")
        params, meta = ckpt.restore_params(step, target)
    finally:
        ckpt.close()
    return params, step, meta


def gather_from_processes(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (one collective)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.array([data.size], np.int32))))
    padded = np.zeros(length, np.uint8)
    padded[:data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in np.asarray(rows)]


ROUTER_INIT_FILE = "router_init.npz"


def router_params(params: PyTree) -> dict[str, jax.Array]:
    """The leaves whose path names a router, by name."""
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if "router" in path_name(path)}


def save_router_init(model_dir: str, params: PyTree) -> None:
    """Writes the routers' initial weights (once, by process 0) for drift measurements."""
    from jax.experimental import multihost_utils

    path = os.path.join(model_dir, ROUTER_INIT_FILE)
    routers = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
               for k, v in router_params(params).items()}
    if jax.process_index() == 0 and routers and not os.path.exists(path):
        tmp = path + ".tmp.npz"
        np.savez(tmp, **routers)
        os.replace(tmp, path)


def load_router_init(model_dir: str) -> dict[str, np.ndarray] | None:
    path = os.path.join(model_dir, ROUTER_INIT_FILE)
    if not os.path.exists(path):
        return None
    with np.load(path) as data:
        return {k: data[k] for k in data.files}
