"""Training metrics: TensorBoard summaries, a JSON-lines file, a progress bar, MFU.

Only process 0 writes, through :mod:`moe_jax.storage` (local disk or ``gs://``).
``MODEL_DIR/train/`` and ``MODEL_DIR/eval/`` hold the TensorBoard event files (as in T5X;
:class:`EventWriter`); ``MODEL_DIR/metrics.jsonl`` one JSON object per logged step:
``{"step": 100, "split": "train", "loss": ..., "accuracy": ..., "steps_per_sec": ...}``.
Array-valued metrics (expert load per layer) go to the JSON file as lists and to
TensorBoard as histograms.

Routing telemetry per MoE layer (``moe/<stack>/layers_<i>/<name>``), derived from what the
layers sow (no extra forward pass in training): ``dead_experts`` (experts receiving under
``1 / (10 E)`` of the assignments), ``shard_imbalance`` (max / mean tokens per device along
the ``expert`` mesh axis: what makes the all-to-all wait; 1 = balanced or one shard),
``expert_imbalance`` (max / mean tokens per expert), ``max_violation`` (MaxVio,
arXiv:2408.15664: ``expert_imbalance - 1``), ``gate_margin`` (sown: mean top-1 minus
top-2 router probability). At each evaluation :class:`ChurnProbe` adds ``routing_churn``:
the fraction of a fixed probe batch's tokens whose top-1 expert changed since the previous
evaluation (one extra eval-mode forward pass of one batch).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from typing import Any

import gin
import jax
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.scalar import summary_v2 as scalar_summary

from moe_jax import hardware, param_paths, storage
from moe_jax.runtime import builders, routing
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.wandb_logger import WandbLogger


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
    per_shard = load.reshape((*load.shape[:-1], num_shards, -1)).sum(-1)
    return per_shard.max(-1) / np.maximum(per_shard.mean(-1), 1e-12)


def max_violation(expert_load: np.ndarray) -> np.ndarray:
    """MaxVio (Wang et al., arXiv:2408.15664, eq. 4): ``max_i (load_i - mean load) / mean
    load`` over ``[..., experts]`` -> ``[...]``; 0 when balanced, ``E - 1`` when one expert
    gets every token."""
    load = np.asarray(expert_load, np.float64)
    return shard_imbalance(load, load.shape[-1]) - 1.0


def routing_telemetry(metrics: dict[str, Any], expert_shards: int = 1) -> dict[str, Any]:
    """``metrics`` plus, for every ``<layer>/expert_load``, ``<layer>/dead_experts``,
    ``<layer>/shard_imbalance`` (over ``expert_shards`` devices),
    ``<layer>/expert_imbalance`` and ``<layer>/max_violation`` (:func:`max_violation`)."""
    out = dict(metrics)
    for key, value in metrics.items():
        if key.endswith(_LOAD_SUFFIX):
            layer = key[: -len(_LOAD_SUFFIX)]
            load = np.asarray(value)
            out[f"{layer}/dead_experts"] = int(dead_experts(load))
            out[f"{layer}/shard_imbalance"] = float(shard_imbalance(load, expert_shards))
            out[f"{layer}/expert_imbalance"] = float(shard_imbalance(load, load.shape[-1]))
            out[f"{layer}/max_violation"] = float(max_violation(load))
    return out


def routing_churn(previous: np.ndarray, current: np.ndarray, valid: np.ndarray) -> float:
    """Fraction of the ``valid`` tokens whose top-1 expert differs: ``[n, length]`` x3."""
    valid = np.asarray(valid, bool)
    return (
        float(np.mean(np.asarray(previous)[valid] != np.asarray(current)[valid]))
        if valid.any()
        else 0.0
    )


class ChurnProbe:
    """Top-1 experts of a fixed probe batch at each evaluation, and the churn since the
    previous one. The last choices persist in ``MODEL_DIR/routing_probe.npz``, so a resumed
    run measures churn against the evaluation before the interruption."""

    def __init__(
        self,
        model: Model,
        params_shardings: Any,
        ctx: builders.RunContext,
        probe_batch: dict[str, np.ndarray],
        run_dir: RunDir,
        collections_shardings: Any = None,
    ):
        """``probe_batch``: this process's share of the probe batch (numpy);
        ``collections_shardings``: of the model's state collections (None: it has none)."""

        self._fn = routing.routing_fn(
            model, params_shardings, ctx.mesh, ctx.rules, ctx.batch_axes, collections_shardings
        )
        self._batch = builders.global_batch(probe_batch, ctx)
        self._path = run_dir.routing_probe_file
        self._previous: dict[str, np.ndarray] = {}
        if storage.exists(self._path):
            self._previous = {
                k.replace("|", "/"): v for k, v in storage.load_npz(self._path).items()
            }

    def __call__(self, params: Any, collections: Any = None) -> dict[str, float]:
        """``{"moe/<layer>/routing_churn": fraction}`` (empty at the first evaluation);
        ``collections``: the state collections (e.g. ``router_bias``, which moves the
        selection, so churn counts its changes too)."""

        if not param_paths.router_params(params):  # a dense model: nothing routes
            return {}
        layers = routing.collect_routing(self._fn, params, [self._batch], collections)
        top1 = {name: layer.expert_index[..., 0] for name, layer in layers.items()}
        churn = {
            f"moe/{name}/routing_churn": routing_churn(
                self._previous[name], choice, layers[name].valid
            )
            for name, choice in top1.items()
            if name in self._previous and self._previous[name].shape == choice.shape
        }
        self._previous = top1
        if jax.process_index() == 0:
            storage.save_npz(self._path, {k.replace("/", "|"): v for k, v in top1.items()})
        return churn


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


class EventWriter:
    """One TensorBoard event file (``<folder>/events.out.tfevents.<time>.<host>.<pid>.v2``)
    of scalar and histogram summaries, written through :class:`moe_jax.storage.AppendFile`
    so that it lives on a local disk or an object store alike."""

    def __init__(self, folder: str):
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.v2"
        )
        self.path = storage.join(folder, name)
        self._file = storage.AppendFile(self.path)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        summary = summary_pb2.Summary()
        for tag, value in scalars.items():
            summary.value.extend(scalar_summary.scalar_pb(tag, value).value)
        self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def write_histograms(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        summary = summary_pb2.Summary()
        for tag, value in arrays.items():
            summary.value.extend(
                histogram_summary.histogram_pb(tag, np.asarray(value, np.float64)).value
            )
        self._write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: event_pb2.Event) -> None:
        self._file.append(pack_records([event.SerializeToString()]))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
        out = {
            "steps_per_sec": steps_per_sec,
            "step_time_sec": 1 / max(steps_per_sec, 1e-9),
            "tokens_per_sec": steps_per_sec * self.tokens_per_step,
            "mfu": steps_per_sec * self.flops_per_step / self.peak_flops_total,
        }
        self._start, self._steps = time.perf_counter(), 0
        return out


PROGRESS_STYLES = ("auto", "bar", "lines")


def timestamp() -> str:
    """The UTC time of a log line, ``2026-01-31T12:00:05Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--progress={auto,bar,lines}`` of the commands that train (:class:`Progress`)."""
    parser.add_argument(
        "--progress",
        choices=PROGRESS_STYLES,
        default="auto",
        help="bar: a progress bar; lines: a timestamped line per logged step and eval (for "
        "cluster logs); auto (default): the bar on a terminal, else lines",
    )


class Progress:
    """A run's progress on process 0 (silent elsewhere): a tqdm bar with ETA on a terminal;
    where stderr is not one (a sweep's ``log.txt``, a SLURM log) or with ``style='lines'``,
    one plain timestamped line per logged step and per evaluation."""

    def __init__(self, start: int, total: int, style: str = "auto"):
        if style not in PROGRESS_STYLES:
            raise ValueError(f"progress style {style!r}; expected one of {PROGRESS_STYLES}")
        self.total = total
        self.enabled = jax.process_index() == 0
        self.lines = style == "lines" or (style == "auto" and not sys.stderr.isatty())
        self._bar = None
        if self.enabled and not self.lines:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=start,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def update(self) -> None:
        """One step done."""
        if self._bar is not None:
            self._bar.update(1)

    def log(self, step: int, loss: float, tokens_per_sec: float) -> None:
        """A logged step's loss and throughput."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_sec:.0f}")
        else:
            self.write(f"step {step}/{self.total}: loss {loss:.4f}, {tokens_per_sec:,.0f} tokens/s")

    def write(self, message: str) -> None:
        """A line of its own (above the bar on a terminal; timestamped in lines)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(f"[moe-jax] {timestamp()} {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
                _drop_events_after(storage.join(folder, name), step)


def _drop_events_after(path: str, step: int) -> None:
    """Rewrites one TensorBoard event file without the events of steps after ``step`` (and
    without a torn last record)."""
    data = storage.read_bytes(path)
    records = unpack_records(data)
    kept = [r for r in records if event_pb2.Event.FromString(r).step <= step]
    packed = pack_records(kept)
    if packed != data:
        storage.write_bytes(path, packed)


def pack_records(records: list[bytes]) -> bytes:
    """TFRecord framing of ``records`` (TensorBoard's event files): per record its
    length (uint64 LE), the masked CRC32C of that, the bytes, their masked CRC32C."""
    out = bytearray()
    for record in records:
        header = struct.pack("<Q", len(record))
        out += (
            header
            + struct.pack("<I", _masked(header))
            + record
            + struct.pack("<I", _masked(record))
        )
    return bytes(out)


def unpack_records(data: bytes) -> list[bytes]:
    """The whole records of TFRecord-framed ``data``; a torn or corrupt tail (a writer
    killed mid-record) ends the list."""
    records, pos = [], 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        end = pos + 12 + length + 4
        if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != _masked(header) or end > len(data):
            break
        record = data[pos + 12 : pos + 12 + length]
        if struct.unpack("<I", data[end - 4 : end])[0] != _masked(record):
            break
        records.append(record)
        pos = end
    return records


def _masked(data: bytes) -> int:
    crc = storage.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
