"""The routers' initial weights of a run (``MODEL_DIR/router_init.npz``): kept at step 0,
read to measure how far learned routers drifted (frozen routers: exactly 0) and by the
``init`` counterfactual router."""

from __future__ import annotations

import zipfile
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from moe_jax import errors, param_paths, storage
from moe_jax.runtime.run_dir import RunDir


def save(run_dir: RunDir, params: Any) -> None:
    """Keeps the router parameters of ``params`` (global arrays on any mesh; gathered by
    every process, written once by process 0) as the run's initial routers."""
    write(
        run_dir,
        {
            k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in param_paths.router_params(params).items()
        },
    )


def write(run_dir: RunDir, routers: dict[str, np.ndarray]) -> None:
    """Writes ``{router parameter name: initial host array}`` as ``MODEL_DIR/router_init.npz``
    (by process 0; nothing when empty or already there)."""
    path = run_dir.router_init_file
    if jax.process_index() == 0 and routers and not storage.exists(path):
        storage.save_npz(path, routers)


def load(run_dir: RunDir) -> dict[str, np.ndarray] | None:
    """``{router parameter name: initial array}`` of the run; None when it kept none."""
    path = run_dir.router_init_file
    if not storage.exists(path):
        return None
    try:
        return storage.load_npz(path)
    except (ValueError, EOFError, zipfile.BadZipFile) as err:  # bytes of another file
        raise errors.InputFileError(
            f"{path} is unreadable ({type(err).__name__}: {err}); it holds the routers' "
            "initial weights: restore it, or remove it (router drift is then not reported)"
        ) from None
