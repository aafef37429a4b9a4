"""Routing telemetry written by a real (tiny) training run: metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json

import gin
import numpy as np

from moe_jax.commands import train
from moe_jax.runtime import builders, gin_flags, gin_utils
from tests.analysis.conftest import TINY

LAYERS = ("encoder/layers_1", "decoder/layers_1")


def test_training_logs_telemetry_and_zero_churn_when_nothing_changes(tmp_path):
    # learning rate 0: the parameters, hence the probe batch's routing, never change
    flags = [
        *TINY,
        f"--gin.MODEL_DIR={tmp_path}",
        "--gin.TRAIN_STEPS=2",
        "--gin.train_script.train.eval_period=1",
        "--gin.train_script.train.eval_steps=1",
        "--gin.learning_rate_schedule.base_learning_rate=0.0",
        "--gin.learning_rate_schedule.final_learning_rate=0.0",
    ]
    gin_utils.parse_gin(gin_flags.parse_flags(builders.build_parser("test", "test"), flags))
    try:
        train.train()
    finally:
        gin.clear_config()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    evals = sorted((r for r in records if r["split"] == "eval"), key=lambda r: r["step"])
    assert [r["step"] for r in evals] == [1, 2]
    for layer in LAYERS:
        key = f"moe/{layer}"
        for record in train_records + evals:
            load = np.asarray(record[f"{key}/expert_load"])
            share = load / load.sum()
            assert record[f"{key}/dead_experts"] == int((share < 0.1 / load.size).sum())
            assert record[f"{key}/shard_imbalance"] == 1.0  # one expert shard
            assert np.isclose(record[f"{key}/expert_imbalance"], load.max() / load.mean())
            assert np.isclose(record[f"{key}/max_violation"], load.max() / load.mean() - 1)
            assert 0.0 <= record[f"{key}/gate_margin"] <= 1.0
        assert f"{key}/routing_churn" not in evals[0]  # nothing to compare yet
        assert evals[1][f"{key}/routing_churn"] == 0.0
    assert (tmp_path / "routing_probe.npz").exists()
    assert list((tmp_path / "eval").iterdir()) and list((tmp_path / "train").iterdir())
