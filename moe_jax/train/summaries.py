"""Training metrics: TensorBoard summaries (clu), a JSON-lines file, a progress bar, MFU.

Only process 0 writes. ``MODEL_DIR/train/`` and ``MODEL_DIR/eval/`` hold the TensorBoard
event files (as in T5X); ``MODEL_DIR/metrics.jsonl`` one JSON object per logged step:
``{"step": 100, "split": "train", "loss": ..., "accuracy": ..., "steps_per_sec": ...}``.
Array-valued metrics (expert load per layer) go to the JSON file as lists and to
TensorBoard as histograms.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import gin
import jax
import numpy as np

from moe_jax.hardware import measured_matmul_flops

# Dense peak FLOP/s per chip (bf16 for accelerators) for MFU. CPU: measured (see below).
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
}


@gin.configurable
def peak_flops_per_device(override: float | None = None) -> float:
    """Peak FLOP/s of one device: ``override`` when bound, else the table above by device
    kind, else (CPU) the measured rate of a jitted float32 2048x2048 matmul."""
    if override:
        return float(override)
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return measured_matmul_flops()


def scalarize(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Splits fetched metrics into scalars and arrays (per-layer routing statistics)."""
    scalars, arrays = {}, {}
    for name, value in metrics.items():
        value = np.asarray(value)
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
    """TensorBoard + JSON lines for one split (``train``/``eval``) of a run."""

    def __init__(self, model_dir: str, split: str):
        self.split = split
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._jsonl = None
        if self.enabled:
            from clu import metric_writers

            self._tb = metric_writers.create_default_writer(os.path.join(model_dir, split),
                                                            asynchronous=False)
            self._jsonl = open(os.path.join(model_dir, "metrics.jsonl"), "a")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        scalars, arrays = scalarize(flatten_metrics(metrics))
        self._tb.write_scalars(step, scalars)
        if arrays:
            self._tb.write_histograms(step, {k: v for k, v in arrays.items() if v.size})
        record = {"step": step, "split": self.split, **scalars,
                  **{k: v.tolist() for k, v in arrays.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
            self._jsonl.close()


class ThroughputMeter:
    """Steps/s, tokens/s and MFU over the steps since the last :meth:`rates` call."""

    def __init__(self, flops_per_step: float, tokens_per_step: int, peak_flops_total: float):
        self.flops_per_step = flops_per_step
        self.tokens_per_step = tokens_per_step
        self.peak_flops_total = peak_flops_total
        self._start, self._steps = time.perf_counter(), 0

    def tick(self) -> None:
        self._steps += 1

    def rates(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        steps_per_sec = self._steps / elapsed
        out = {"steps_per_sec": steps_per_sec, "step_time_sec": 1 / max(steps_per_sec, 1e-9),
               "tokens_per_sec": steps_per_sec * self.tokens_per_step,
               "mfu": steps_per_sec * self.flops_per_step / self.peak_flops_total}
        self._start, self._steps = time.perf_counter(), 0
        return out


def progress_bar(start: int, total: int, desc: str = "train"):
    """A tqdm bar with ETA on process 0 (disabled elsewhere)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True,
                disable=jax.process_index() != 0, mininterval=1.0)


def drop_records_after(model_dir: str, step: int) -> None:
    """Removes the metrics of steps after ``step`` from ``metrics.jsonl`` and the
    TensorBoard event files of ``MODEL_DIR/{train,eval}`` (process 0, on resume), so a run
    resumed from its checkpoint at ``step`` logs each later step once."""
    path = os.path.join(model_dir, "metrics.jsonl")
    if "://" in model_dir:
        return
    if os.path.exists(path):
        with open(path) as f:
            lines = f.readlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)
    for split in ("train", "eval"):
        folder = os.path.join(model_dir, split)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if "tfevents" in name:
                _drop_events_after(os.path.join(folder, name), step)


def _drop_events_after(path: str, step: int) -> None:
    """Rewrites one TensorBoard event file without the events of steps after ``step``."""
    import tensorflow as tf
    from tensorboard.compat.proto import event_pb2

    records = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(path)]
    kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
    if len(kept) == len(records):
        return
    with tf.io.TFRecordWriter(path + ".tmp") as writer:
        for record in kept:
            writer.write(record)
    os.replace(path + ".tmp", path)
