"""Section 3.4: CIFAR-100 class clusters with a CNN router.

Each input is a pair (CIFAR-100 image, random vector v ~ N(0, I)); the target is w_c^T v
with c the image's class and w_c ~ N(0, I / dim_v) a per-class vector (drawn per seed).
The CNN router sees only the image; the depth-3 MLP experts see v and the CNN's
penultimate features. Learned vs frozen router (paper: loss 0.55 vs 0.80 with 200 experts).

The images come from the real ``tensorflow_datasets`` ``cifar100`` builder, imported
lazily here only (the rest of the laboratory never imports TensorFlow); tests run it under
``tfds.testing.mock_data``. Quick preset: the first ``classes`` classes only.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic import models, train
from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.experiments import common

PRESETS = {
    "quick": dict(
        classes=10,
        num_experts=24,
        dim_v=16,
        hidden=64,
        channels=[16, 32],
        features=64,
        n_train=5000,
        n_test=1000,
        steps=1000,
        batch=64,
    ),
    "converged": dict(
        classes=10,
        num_experts=24,
        dim_v=16,
        hidden=64,
        channels=[16, 32],
        features=64,
        n_train=5000,
        n_test=1000,
        steps=6000,
        batch=64,
        schedule="cosine",
        converge_window=1000,
        converge_rtol=1e-3,
        chunk=250,
    ),
    "paper": dict(
        classes=100,
        num_experts=200,
        dim_v=32,
        hidden=128,
        channels=[32, 64],
        features=128,
        n_train=50000,
        n_test=10000,
        steps=20000,
        batch=256,
    ),
}
METRICS = ("loss", "loss_soft", "sparsity", "sparsity_nats", "purity")


def load_cifar100(split: str, classes: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` images of ``split`` whose fine label is below ``classes``:
    images ``[n', 32, 32, 3]`` float32 standardised per channel, labels ``[n']`` int32
    (n' <= n when the split holds fewer)."""
    import tensorflow_datasets as tfds

    chunks, kept = [], 0
    for images, labels in tfds.as_numpy(
        tfds.load("cifar100", split=split, as_supervised=True).batch(1024)
    ):
        keep = labels < classes
        chunks.append((images[keep], labels[keep]))
        kept += int(keep.sum())
        if kept >= n:
            break
    images = np.concatenate([c[0] for c in chunks])[:n].astype(np.float32) / 255.0
    images = (images - images.mean(axis=(0, 1, 2))) / (images.std(axis=(0, 1, 2)) + 1e-6)
    return images, np.concatenate([c[1] for c in chunks])[:n].astype(np.int32)


def sample_pairs(
    images: np.ndarray, labels: np.ndarray, label_vectors: jax.Array, key: jax.Array
) -> Batch:
    """x = (images ``[n, 32, 32, 3]``, v ``[n, dim_v]``), y = w_label^T v ``[n, 1]``,
    cluster = the class ``[n]``; label_vectors ``[classes, dim_v]``."""
    v = jax.random.normal(key, (labels.shape[0], label_vectors.shape[1]))
    y = jnp.sum(label_vectors[labels] * v, axis=-1, keepdims=True)
    return Batch((jnp.asarray(images), v), y, jnp.asarray(labels))


def run(cfg: dict[str, Any], seeds: list[int], out_dir: pathlib.Path) -> dict[str, Any]:
    k, e = cfg["classes"], cfg["num_experts"]
    train_images, train_labels = load_cifar100("train", k, cfg["n_train"])
    test_images, test_labels = load_cifar100("test", k, cfg["n_test"])
    label_vectors = [
        jax.random.normal(common.seed_key(s, 0), (k, cfg["dim_v"])) / cfg["dim_v"] ** 0.5
        for s in seeds
    ]
    train_set = train.stack_datasets(
        [
            sample_pairs(train_images, train_labels, w, common.seed_key(s, 2))
            for w, s in zip(label_vectors, seeds, strict=True)
        ]
    )
    test_set = train.stack_datasets(
        [
            sample_pairs(test_images, test_labels, w, common.seed_key(s, 3))
            for w, s in zip(label_vectors, seeds, strict=True)
        ]
    )
    runs, coords = train.grid(seeds, [int(train_labels.shape[0])], [e])
    model = models.MoE(
        "cnn",
        "mlp",
        e,
        cfg["dim_v"],
        1,
        expert_hidden=cfg["hidden"],
        cnn_channels=tuple(cfg["channels"]),
        cnn_features=cfg["features"],
    )
    rows = []
    for mode in ("learned", "frozen"):
        opt = common.train_config(
            cfg,
            steps=cfg["steps"],
            batch_size=cfg["batch"],
            optimizer="adam",
            lr_router=1e-3,
            lr_experts=1e-3,
            router_mode=mode,
        )
        params = train.train_runs(model, opt, runs, train_set, desc=f"cifar100 {mode}")
        rows += common.table(
            coords, train.evaluate_runs(model, params, runs, test_set, k), model=f"MoE {mode}"
        )
    summary = common.summarise(rows, ("model",), METRICS)

    fig, (ax,) = common.figure(1, 5.0)
    names = [s["model"] for s in summary]
    ax.bar(names, [s["loss"] for s in summary], yerr=[s["loss_std"] for s in summary], capsize=3)
    ax.set_ylabel("normalised test loss (top-1)")
    ax.set_title(f"CIFAR-100, {k} classes, E = {e}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    result = {
        "experiment": "cifar100",
        "config": cfg,
        "seeds": seeds,
        "num_train": int(train_labels.shape[0]),
        "summary": summary,
    }
    result["files"] = common.write_outputs(out_dir, "cifar100", result, rows, fig)
    return result


EXPERIMENTS = {
    "cifar100": common.Experiment(
        "cifar100",
        "CIFAR-100 class clusters, CNN router: learned vs frozen (Sec. 3.4; needs the dataset)",
        PRESETS,
        run,
    )
}
