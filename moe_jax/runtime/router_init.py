"""The routers' initial weights of a run (``MODEL_DIR/router_init.npz``, per layer): kept at
step 0, read to measure how far learned routers drifted (frozen routers: exactly 0) and by
the ``init`` counterfactual router."""

from __future__ import annotations

import zipfile
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from moe_jax import errors, param_paths, storage
from moe_jax.models import layer_stacking
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.run_dir import RunDir


def per_layer_routers(model: Model, params: Any) -> dict[str, Any]:
    """``{per-layer router parameter name: leaf}`` of ``params`` (in ``model``'s layout;
    only the routers are split per layer)."""
    return param_paths.router_params(model.per_layer(param_paths.router_tree(params)))


def save(run_dir: RunDir, model: Model, params: Any) -> None:
    """Keeps the router parameters of ``params`` (``model``'s, global arrays on any mesh;
    gathered by every process, written once by process 0) as the run's initial routers,
    per layer."""
    write(
        run_dir,
        {
            k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in per_layer_routers(model, params).items()
        },
    )


def write(run_dir: RunDir, routers: dict[str, np.ndarray]) -> None:
    """Writes ``{router parameter name: initial host array}`` as ``MODEL_DIR/router_init.npz``
    (by process 0; nothing when empty or already there)."""
    path = run_dir.router_init_file
    if jax.process_index() == 0 and routers and not storage.exists(path):
        storage.save_npz(path, routers)


def load(run_dir: RunDir) -> dict[str, np.ndarray] | None:
    """``{per-layer router parameter name: initial array}`` of the run (a scanned run's
    older file, stacked, split per layer); None when it kept none."""
    path = run_dir.router_init_file
    if not storage.exists(path):
        return None
    try:
        return layer_stacking.unstack_names(storage.load_npz(path))
    except (ValueError, EOFError, zipfile.BadZipFile) as err:  # bytes of another file
        raise errors.InputFileError(
            f"{path} is unreadable ({type(err).__name__}: {err}); it holds the routers' "
            "initial weights: restore it, or remove it (router drift is then not reported)"
        ) from None
