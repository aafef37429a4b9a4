"""A run's metrics: TensorBoard event files, a JSON-lines file and Weights & Biases, written
together by :class:`MetricsWriter`, read back, and cut at a step on resume.

Only process 0 writes, through :mod:`moe_jax.storage` (local disk or ``gs://``).
``MODEL_DIR/train/`` and ``MODEL_DIR/eval/`` hold the TensorBoard event files (as in T5X;
:class:`~moe_jax.runtime.event_files.EventWriter`); ``MODEL_DIR/metrics.jsonl`` one JSON
object per logged step: ``{"step": 100, "split": "train", "loss": ..., "accuracy": ...,
"steps_per_sec": ...}``. Array-valued metrics (expert load per layer) go to the JSON file
as lists and to TensorBoard as histograms. Each logged step's metrics get the routing
telemetry of :mod:`moe_jax.runtime.routing_telemetry`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import numpy as np

from moe_jax import storage
from moe_jax.runtime.event_files import EventWriter, drop_events_after
from moe_jax.runtime.routing_telemetry import routing_telemetry
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.wandb_logger import WandbLogger


def scalarize(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Splits fetched metrics into scalars and arrays (per-layer routing statistics)."""
    scalars, arrays = {}, {}
    for name, fetched in metrics.items():
        value = np.asarray(fetched)
        if value.ndim == 0:
            scalars[name] = float(value)
        else:
            arrays[name] = value
    return scalars, arrays


def flatten_metrics(metrics: Any, prefix: str = "") -> dict[str, Any]:
    """Nested metric dicts (per-layer routing stats) -> ``{"routing/encoder/layer_3/...": x}``."""
    if isinstance(metrics, dict):
        out = {}
        for key, value in metrics.items():
            out.update(flatten_metrics(value, f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): metrics}


class MetricsWriter:
    """TensorBoard (one event file per split: ``MODEL_DIR/train``, ``MODEL_DIR/eval``) and
    ``MODEL_DIR/metrics.jsonl`` of a run, and the same metrics to ``wandb`` when given (a
    :class:`~moe_jax.runtime.wandb_logger.WandbLogger`); adds the routing telemetry
    (:func:`routing_telemetry`) for ``expert_shards`` devices along the ``expert`` mesh axis.
    Only process 0 writes."""

    def __init__(self, run_dir: RunDir, expert_shards: int = 1, wandb: WandbLogger | None = None):
        self.run_dir = run_dir
        self.expert_shards = expert_shards
        self.enabled = jax.process_index() == 0
        self._events: dict[str, EventWriter] = {}
        self._jsonl = storage.AppendFile(run_dir.metrics_file) if self.enabled else None
        self._wandb = wandb if self.enabled else None

    def write(self, split: str, step: int, metrics: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        scalars, arrays = scalarize(routing_telemetry(flatten_metrics(metrics), self.expert_shards))
        if split not in self._events:
            self._events[split] = EventWriter(self.run_dir.events_dir(split))
        self._events[split].write_scalars(step, scalars)
        if arrays:
            self._events[split].write_histograms(step, {k: v for k, v in arrays.items() if v.size})
        record = {
            "step": step,
            "split": split,
            **scalars,
            **{k: v.tolist() for k, v in arrays.items()},
        }
        self._jsonl.append((json.dumps(record) + "\n").encode())  # one write per whole line
        if self._wandb is not None:
            self._wandb.log(split, step, scalars, arrays)

    def flush(self) -> None:
        """Makes everything written so far durable (on GCS: uploaded); called at each save."""
        for events in self._events.values():
            events.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        for events in self._events.values():
            events.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.close()


def read_metrics(run_dir: RunDir, split: str | None = None) -> list[dict[str, Any]]:
    """The records of ``MODEL_DIR/metrics.jsonl`` (of one ``split`` when given), skipping
    a line that is not whole JSON; [] when the run has none."""
    path = run_dir.metrics_file
    if not storage.exists(path):
        return []
    records = []
    for line in storage.read_text(path).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if split is None or record.get("split") == split:
            records.append(record)
    return records


def drop_records_after(run_dir: RunDir, step: int) -> None:
    """Removes the metrics of steps after ``step`` from ``metrics.jsonl`` and the
    TensorBoard event files of ``MODEL_DIR/{train,eval}`` (process 0, on resume), so a run
    resumed from its checkpoint at ``step`` logs each later step once. A line that is not
    whole JSON (a write cut short by a full disk or a kill) is dropped with a warning."""
    path = run_dir.metrics_file
    if storage.exists(path):
        lines = storage.read_text(path).splitlines(keepends=True)
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                if line.strip():
                    print(
                        f"[moe-jax] warning: {path}, line {number}: not a whole JSON record "
                        "(a write cut short); dropped",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            if record.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if kept != lines:
            storage.write_text(path, "".join(kept))
    for split in RunDir.EVENT_SPLITS:
        folder = run_dir.events_dir(split)
        for name in storage.listdir(folder):
            if "tfevents" in name:
                drop_events_after(storage.join(folder, name), step)
