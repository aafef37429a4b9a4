"""Weights & Biases beside TensorBoard (``--gin.WANDB_PROJECT=NAME``).

When :class:`WandbSettings` names a project, :func:`start` opens a W&B run on process 0 and
:class:`moe_jax.runtime.metrics.MetricsWriter` sends it every metric it writes to
TensorBoard, under the same step: scalars as ``<split>/<name>`` (``train/loss``,
``eval/moe/encoder/layers_1/max_violation``), arrays (the expert load per layer) as
histograms. The run's config is ``MODEL_DIR/config.gin``: its text (``gin_config``) and one
key per binding (``train_script.train.total_steps``). The W&B run id is kept in
``MODEL_DIR/wandb_run_id``, so a resumed run continues the same W&B run. TensorBoard and
``metrics.jsonl`` are written as always; without a project nothing here runs and ``wandb``
is never imported.

W&B steps only increase: after a resume from a checkpoint older than the last logged step
(a preempted run), W&B keeps the values first logged for the steps run again, where
TensorBoard and ``metrics.jsonl`` keep the new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from moe_jax import storage
from moe_jax.runtime.run_dir import RunDir

RUN_ID_FILE = "wandb_run_id"


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Where a run's metrics go on W&B (gin macros ``WANDB_PROJECT``, ``WANDB_ENTITY``,
    ``WANDB_RUN_NAME``, ``WANDB_TAGS`` of ``gin/runs/pretrain.gin``).

    Attributes:
      project: the W&B project; None (the default): no W&B.
      entity: the W&B user or team (None: the account's default).
      name: the run's display name (None: the last two parts of ``MODEL_DIR``).
      tags: the run's tags.
    """

    project: str | None = None
    entity: str | None = None
    name: str | None = None
    tags: Sequence[str] = ()


def gin_bindings(text: str) -> dict[str, str]:
    """``{"scope/configurable.parameter": value text}`` of a gin config's bindings (a value
    continued over several lines joined into one; macros as ``NAME``)."""
    bindings: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", "import ", "include ")):
            continue
        if line[0].isspace() and key is not None:  # a continuation of the last value
            bindings[key] += " " + line.strip()
        elif " = " in line:
            key, value = (part.strip() for part in line.split(" = ", 1))
            bindings[key] = value
    return bindings


class WandbLogger:
    """An open W&B run (:func:`start`)."""

    def __init__(self, run: Any):
        self._run = run

    @property
    def run_id(self) -> str:
        return str(self._run.id)

    def log(
        self, split: str, step: int, scalars: Mapping[str, float], arrays: Mapping[str, np.ndarray]
    ) -> None:
        """One logged step's metrics, as :class:`~moe_jax.runtime.metrics.MetricsWriter`
        writes them to TensorBoard."""
        import wandb

        data: dict[str, Any] = {f"{split}/{name}": value for name, value in scalars.items()}
        for name, value in arrays.items():
            if value.size:
                data[f"{split}/{name}"] = wandb.Histogram(np.asarray(value, np.float64).tolist())
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()


def start(run_dir: RunDir, settings: WandbSettings | None = None) -> WandbLogger | None:
    """Opens (or, with ``MODEL_DIR/wandb_run_id``, resumes) the W&B run of ``run_dir`` on
    process 0; None when ``settings`` (default: gin's) names no project, and on other
    processes. Its local files go to ``MODEL_DIR/wandb`` (a local ``MODEL_DIR``) or W&B's
    default folder. ``WANDB_MODE=offline`` keeps everything local."""
    settings = WandbSettings() if settings is None else settings
    if not settings.project or jax.process_index() != 0:
        return None
    import wandb  # deferred: only runs that log to W&B need it

    id_file = storage.join(run_dir.path, RUN_ID_FILE)
    resumed = storage.exists(id_file)
    run_id = storage.read_text(id_file).strip() if resumed else None  # None: W&B draws one
    config_text = (
        storage.read_text(run_dir.config_file) if storage.exists(run_dir.config_file) else ""
    )
    local = storage.is_local(run_dir.path)
    run = wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or "/".join(run_dir.path.rstrip("/").split("/")[-2:]),
        tags=list(settings.tags),
        id=run_id,
        resume="allow",
        dir=run_dir.path if local else None,
        config={"gin_config": config_text, **gin_bindings(config_text)},
    )
    if not resumed:
        storage.write_text(id_file, str(run.id))
    return WandbLogger(run)
