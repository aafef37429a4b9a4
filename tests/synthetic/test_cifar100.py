"""Section 3.4 on TFDS mock data (nothing can be downloaded here): the real `cifar100`
loader, the (image, v) pairs and an end-to-end run of the CNN-router MoE."""

from __future__ import annotations

import csv
import json

import jax
import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from moe_jax.synthetic.experiments import cifar100  # noqa: E402


def test_loader_keeps_the_first_classes_and_standardises():
    with tfds.testing.mock_data(num_examples=60):
        images, labels = cifar100.load_cifar100("train", 50, 20)
    assert images.shape[1:] == (32, 32, 3) and images.dtype == np.float32
    assert 0 < labels.shape[0] <= 20 and labels.shape[0] == images.shape[0] and np.all(labels < 50)
    np.testing.assert_allclose(images.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)
    batch = cifar100.sample_pairs(images, labels, jax.numpy.ones((50, 3)), jax.random.PRNGKey(0))
    # w = 1: y = sum(v)
    np.testing.assert_allclose(batch.y[:, 0], batch.x[1].sum(axis=1), rtol=1e-5)


def test_cifar100_runs_end_to_end_on_mock_data(tmp_path):
    cfg = dict(
        cifar100.PRESETS["quick"],
        classes=100,
        num_experts=4,
        dim_v=4,
        hidden=8,
        channels=[4],
        features=8,
        n_train=48,
        n_test=24,
        steps=20,
        batch=8,
    )
    with tfds.testing.mock_data(num_examples=48):
        result = cifar100.run(cfg, [0, 1], tmp_path)
    assert {s["model"] for s in result["summary"]} == {"MoE learned", "MoE frozen"}
    assert all(np.isfinite(s["loss"]) and s["seeds"] == 2 for s in result["summary"])
    saved = json.loads((tmp_path / "cifar100.json").read_text())
    assert saved["num_train"] == 48
    with open(tmp_path / "cifar100.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["model"], int(r["seed"]), int(r["num_train"])) for r in rows) == [
        (m, s, 48) for m in ("MoE frozen", "MoE learned") for s in (0, 1)
    ]
    for entry in saved["summary"]:  # the JSON's mean over seeds is the CSV's two runs averaged
        losses = [float(r["loss"]) for r in rows if r["model"] == entry["model"]]
        assert entry["loss"] == pytest.approx(np.mean(losses), rel=1e-6) and entry[
            "loss_std"
        ] == pytest.approx(np.std(losses), rel=1e-5, abs=1e-9)
    # same data and init: only the router's training differs
    by_model = {e["model"]: e for e in saved["summary"]}
    assert by_model["MoE learned"]["loss"] != by_model["MoE frozen"]["loss"]
