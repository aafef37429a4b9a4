"""Training metrics: TensorBoard summaries (clu), a JSON-lines file, a progress bar, MFU.

Only process 0 writes. ``MODEL_DIR/train/`` and ``MODEL_DIR/eval/`` hold the TensorBoard
event files (as in T5X); ``MODEL_DIR/metrics.jsonl`` one JSON object per logged step:
``{"step": 100, "split": "train", "loss": ..., "accuracy": ..., "steps_per_sec": ...}``.
Array-valued metrics (expert load per layer) go to the JSON file as lists and to
TensorBoard as histograms.

Routing telemetry per MoE layer (``moe/<stack>/layers_<i>/<name>``), derived from what the
layers sow (no extra forward pass in training): ``dead_experts`` (experts receiving under
``1 / (10 E)`` of the assignments), ``shard_imbalance`` (max / mean tokens per device along
the ``expert`` mesh axis: what makes the all-to-all wait; 1 = balanced or one shard),
``expert_imbalance`` (max / mean tokens per expert), ``gate_margin`` (sown: mean top-1 minus
top-2 router probability). At each evaluation :class:`ChurnProbe` adds ``routing_churn``:
the fraction of a fixed probe batch's tokens whose top-1 expert changed since the previous
evaluation (one extra eval-mode forward pass of one batch).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import hardware


@gin.configurable
def peak_flops_per_device(override: float | None = None) -> float:
    """Peak FLOP/s of one device: ``override`` when bound, else the chip's dense bf16 peak
    (``moe_jax.hardware.CHIPS``, by device kind), else (CPU) the measured rate of a jitted
    float32 2048x2048 matmul."""
    if override:
        return float(override)
    return hardware.device_facts(jax.devices()).peak_flops


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


DEAD_EXPERT_FRACTION = 0.1  # dead: under DEAD_EXPERT_FRACTION / E of the assignments
_LOAD_SUFFIX = "/expert_load"


def dead_experts(expert_load: np.ndarray, fraction: float = DEAD_EXPERT_FRACTION) -> np.ndarray:
    """Experts receiving under ``fraction / E`` of the assignments.

    Args:
      expert_load: ``[..., experts]`` tokens (or fractions of tokens) sent to each expert.

    Returns:
      int ``[...]`` counts.
    """
    load = np.asarray(expert_load, np.float64)
    share = load / np.maximum(load.sum(-1, keepdims=True), 1e-12)
    return (share < fraction / load.shape[-1]).sum(-1)


def shard_imbalance(expert_load: np.ndarray, num_shards: int) -> np.ndarray:
    """Max / mean tokens per shard when the experts are split into ``num_shards``
    contiguous blocks (the ``expert`` mesh axis): ``[..., experts]`` -> ``[...]``; 1 when
    balanced, ``num_shards`` when one shard gets every token."""
    load = np.asarray(expert_load, np.float64)
    if load.shape[-1] % num_shards:
        raise ValueError(f"{load.shape[-1]} experts do not split over {num_shards} shards")
    per_shard = load.reshape(load.shape[:-1] + (num_shards, -1)).sum(-1)
    return per_shard.max(-1) / np.maximum(per_shard.mean(-1), 1e-12)


def routing_telemetry(metrics: dict[str, Any], expert_shards: int = 1) -> dict[str, Any]:
    """``metrics`` plus, for every ``<layer>/expert_load``, ``<layer>/dead_experts``,
    ``<layer>/shard_imbalance`` (over ``expert_shards`` devices) and
    ``<layer>/expert_imbalance``."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(_LOAD_SUFFIX):
            layer = key[: -len(_LOAD_SUFFIX)]
            load = np.asarray(value)
            out[f"{layer}/dead_experts"] = int(dead_experts(load))
            out[f"{layer}/shard_imbalance"] = float(shard_imbalance(load, expert_shards))
            out[f"{layer}/expert_imbalance"] = float(shard_imbalance(load, load.shape[-1]))
    return out


def routing_churn(previous: np.ndarray, current: np.ndarray, valid: np.ndarray) -> float:
    """Fraction of the ``valid`` tokens whose top-1 expert differs: ``[n, length]`` x3."""
    valid = np.asarray(valid, bool)
    return float(np.mean(np.asarray(previous)[valid] != np.asarray(current)[valid])) if valid.any() else 0.0


class ChurnProbe:
    """Top-1 experts of a fixed probe batch at each evaluation, and the churn since the
    previous one. The last choices persist in ``MODEL_DIR/routing_probe.npz``, so a resumed
    run measures churn against the evaluation before the interruption."""

    FILE = "routing_probe.npz"

    def __init__(self, model: Any, params_shardings: Any, ctx: Any, probe_batch: dict[str, np.ndarray],
                 model_dir: str, collections_shardings: Any = None):
        """``probe_batch``: this process's share of the probe batch (numpy);
        ``collections_shardings``: of the model's state collections (None: it has none)."""
        from moe_jax.analysis import routing
        from moe_jax.train import setup

        self._fn = routing.routing_fn(model, params_shardings, ctx.mesh, ctx.batch_axes, collections_shardings)
        self._batch = setup.global_batch(probe_batch, ctx)
        self._path = os.path.join(model_dir, self.FILE)
        self._previous: dict[str, np.ndarray] = {}
        if os.path.exists(self._path):
            with np.load(self._path) as saved:
                self._previous = {k.replace("|", "/"): saved[k] for k in saved.files}

    def __call__(self, params: Any, collections: Any = None) -> dict[str, float]:
        """``{"moe/<layer>/routing_churn": fraction}`` (empty at the first evaluation);
        ``collections``: the state collections (e.g. ``router_bias``, which moves the
        selection, so churn counts its changes too)."""
        from moe_jax.analysis import routing
        from moe_jax.train import checkpoints

        if not checkpoints.router_params(params):  # a dense model: nothing routes
            return {}
        layers = routing.collect_routing(self._fn, params, [self._batch], collections)
        top1 = {name: layer.expert_index[..., 0] for name, layer in layers.items()}
        churn = {f"moe/{name}/routing_churn": routing_churn(self._previous[name], choice,
                                                            layers[name].valid)
                 for name, choice in top1.items()
                 if name in self._previous and self._previous[name].shape == choice.shape}
        self._previous = top1
        if jax.process_index() == 0:
            np.savez(self._path, **{k.replace("/", "|"): v for k, v in top1.items()})
        return churn


class MetricsWriter:
    """TensorBoard + JSON lines for one split (``train``/``eval``) of a run; adds the
    routing telemetry (:func:`routing_telemetry`) for ``expert_shards`` devices along the
    ``expert`` mesh axis."""

    def __init__(self, model_dir: str, split: str, expert_shards: int = 1):
        self.split = split
        self.expert_shards = expert_shards
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
        scalars, arrays = scalarize(routing_telemetry(flatten_metrics(metrics), self.expert_shards))
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
