"""Evaluation inside and outside training: the mean eval metrics over a dataset, and the
run's recorded eval settings (``MODEL_DIR/eval_settings.json``) that let `moe-jax eval`
reproduce the numbers the training run printed."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np

from moe_jax import errors, storage
from moe_jax.runtime import builders
from moe_jax.runtime.run_dir import RunDir

EVAL_SCOPE = "eval/utils.DatasetConfig"  # the dataset of eval_script.evaluate (runs/eval.gin)


def record_eval_settings(
    run_dir: RunDir, eval_steps: int, dataset_cfg: builders.DatasetConfig
) -> str:
    """Writes ``MODEL_DIR/eval_settings.json``: ``{"eval_steps": n, "dataset": {the fields
    of dataset_cfg}}``, what a run's in-training evaluation reads, for ``moe-jax eval`` to
    reproduce; returns its path."""
    path = run_dir.eval_settings_file
    settings: dict[str, Any] = {
        "eval_steps": int(eval_steps),
        "dataset": dataclasses.asdict(dataset_cfg),
    }
    settings["dataset"]["task_feature_lengths"] = dict(settings["dataset"]["task_feature_lengths"])
    storage.write_text(path, json.dumps(settings, indent=1) + "\n")
    return path


def read_eval_settings(run_dir: RunDir) -> dict[str, Any] | None:
    """The run's recorded eval settings (:func:`record_eval_settings`), or None when it has
    none (a run trained before they were recorded, an imported one)."""
    path = run_dir.eval_settings_file
    if not storage.exists(path):
        return None
    try:
        settings = json.loads(storage.read_text(path))
    except ValueError as err:  # not JSON, not UTF-8
        settings = err
    if not isinstance(settings, dict) or not {"eval_steps", "dataset"} <= set(settings):
        why = settings if isinstance(settings, ValueError) else "not eval settings"
        raise errors.InputFileError(
            f"{path} is unreadable ({why}); remove it, or pass --eval_settings=gin to "
            "evaluate with runs/eval.gin's settings"
        )
    return settings


def eval_settings_bindings(settings: dict[str, Any]) -> list[str]:
    """Gin bindings giving ``eval_script.evaluate`` the recorded ``settings``."""
    return [
        f"eval_script.evaluate.eval_steps = {settings['eval_steps']!r}",
        *(f"{EVAL_SCOPE}.{name} = {value!r}" for name, value in settings["dataset"].items()),
    ]


def describe_eval_settings(eval_steps: int, cfg: builders.DatasetConfig) -> str:
    """``8 batches of 16 x {'inputs': 64, 'targets': 16} from the validation split of task
    mc4_span_corruption over the embedded UDHR corpus (20 languages)``; a task of the user's
    own module is named without a corpus (it reads what it defines)."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import sources, tasks

    corpus = (
        f" over {sources.describe_corpus()}"
        if tasks.reads_the_corpus(cfg.mixture_or_task_name)
        else ""
    )
    return (
        f"{eval_steps} batch{'es' if eval_steps != 1 else ''} of {cfg.batch_size} x "
        f"{dict(cfg.task_feature_lengths)} from the {cfg.split} split of task "
        f"{cfg.mixture_or_task_name}{corpus}"
    )


def run_eval(
    eval_fn, params, dataset_cfg, ctx, eval_steps: int, collections=None
) -> dict[str, Any]:
    """Mean of ``eval_fn(params, batch, collections)`` metrics over the first ``eval_steps``
    batches of ``dataset_cfg`` (``num_tokens`` summed); ``collections``: the model's
    non-parameter state (e.g. MoE balancing biases), if any."""
    totals: dict[str, np.ndarray] = {}
    count = 0
    for local in builders.eval_batches(dataset_cfg, eval_steps):
        metrics = jax.device_get(eval_fn(params, builders.global_batch(local, ctx), collections))
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
        count += 1
    if not count:
        raise ValueError(
            f"the {dataset_cfg.split!r} split of {dataset_cfg.mixture_or_task_name!r} "
            "gave no batches"
        )
    return {
        name: (value / count if name != "num_tokens" else value) for name, value in totals.items()
    }
