"""Statistics of `moe-jax analyze languages` and the routing telemetry on constructed inputs."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.analysis import languages, seeds
from moe_jax.runtime import run_names
from moe_jax.runtime.routing_telemetry import (
    dead_experts,
    max_violation,
    routing_churn,
    routing_telemetry,
    shard_imbalance,
)


def _rows(labels_per_row: list[int], length: int = 6):
    row_labels = np.asarray(labels_per_row)
    valid = np.ones((len(row_labels), length), bool)
    valid[:, -1] = False  # a padding column: must be ignored
    return row_labels, valid


def test_mutual_information_is_zero_for_routing_independent_of_language():
    # 4 languages x 4 experts, every language uses every expert equally often.
    row_labels, valid = _rows([0, 1, 2, 3] * 4, length=5)
    top1 = np.tile(np.array([0, 1, 2, 3, 0]), (16, 1))
    top1[:, -1] = 3  # padding: would create dependence if counted
    info = languages.language_information(top1, row_labels, valid, 4, 4, np.random.default_rng(0))
    assert info["bits"] == 0.0
    assert info["language_entropy_bits"] == pytest.approx(2.0)


def test_mutual_information_equals_language_entropy_for_one_expert_per_language():
    # Unequal language frequencies (H != log2 L); language i -> expert 5 - i.
    row_labels, valid = _rows([0, 0, 0, 1, 1, 2, 3, 3])
    top1 = np.broadcast_to(5 - row_labels[:, None], valid.shape).copy()
    top1[~valid] = 0
    info = languages.language_information(top1, row_labels, valid, 4, 6, np.random.default_rng(0))
    freq = np.array([3, 2, 1, 2]) / 8
    entropy = float(-(freq * np.log2(freq)).sum())
    assert info["language_entropy_bits"] == pytest.approx(entropy, abs=1e-12)
    assert info["bits"] == pytest.approx(entropy, abs=1e-12)
    assert info["shuffled_label_bits"] <= info["bits"]


def test_sparsity_and_share_of_one_expert_per_language():
    row_labels, valid = _rows([0, 1, 2, 0])
    experts = np.array([2, 0, 1])[row_labels]
    probs = np.zeros((*valid.shape, 3))
    probs[np.arange(4)[:, None], np.arange(6)[None], experts[:, None]] = 1.0
    assert languages.cluster_sparsity(probs, row_labels, valid, 3) == pytest.approx(1.0)
    uniform = np.full((*valid.shape, 3), 1 / 3)
    assert languages.cluster_sparsity(uniform, row_labels, valid, 3) == pytest.approx(3.0)
    share = languages.top1_share(
        np.broadcast_to(experts[:, None], valid.shape), row_labels, valid, 3, 3
    )
    np.testing.assert_array_equal(share, np.eye(3)[[2, 0, 1]])


def test_dead_experts_and_imbalance_on_hand_built_loads():
    # 8 experts, top-2 loads summing to 2: expert 7 gets 1/100 of the assignments (< 1/80).
    load = np.array([0.3, 0.3, 0.3, 0.3, 0.3, 0.28, 0.2, 0.02])
    assert dead_experts(load) == 1
    assert dead_experts(np.full(8, 0.25)) == 0
    # 2 shards: experts 0-3 get 1.2, 4-7 get 0.8 -> max / mean = 1.2 / 1.0.
    assert shard_imbalance(load, 2) == pytest.approx(1.2)
    assert shard_imbalance(load, 1) == pytest.approx(1.0)
    assert shard_imbalance(load, 8) == pytest.approx(0.3 / 0.25)
    with pytest.raises(ValueError, match="3 shards"):
        shard_imbalance(load, 3)
    out = routing_telemetry(
        {"moe/encoder/layers_1/expert_load": load, "loss": 1.0}, expert_shards=2
    )
    assert out["moe/encoder/layers_1/dead_experts"] == 1
    assert out["moe/encoder/layers_1/shard_imbalance"] == pytest.approx(1.2)
    # MaxVio: (0.3 - 0.25) / 0.25
    assert out["moe/encoder/layers_1/max_violation"] == pytest.approx(0.2)
    assert out["loss"] == 1.0


def test_max_violation_is_zero_when_balanced_and_e_minus_1_for_one_expert():
    assert max_violation(np.full(8, 0.25)) == 0.0
    assert max_violation(np.eye(8)[3]) == pytest.approx(7.0)
    np.testing.assert_allclose(
        max_violation(np.array([[0.5, 0.5, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])),
        [1.0, 0.0],
    )


def test_routing_churn_counts_changed_valid_tokens():
    previous = np.array([[0, 1, 2, 3], [1, 1, 0, 0]])
    valid = np.array([[True, True, True, False], [True, True, True, True]])
    assert routing_churn(previous, previous, valid) == 0.0
    swapped = np.select([previous == 0, previous == 1], [1, 0], previous)  # experts 0 <-> 1
    changed = ((previous == 0) | (previous == 1))[valid].mean()
    assert routing_churn(previous, swapped, valid) == pytest.approx(changed)


def test_seed_summary_groups_a_familys_seeds_at_shared_steps(tmp_path):
    """``learned/seed0..2`` form one family: mean and sample std over the seeds at each step
    they share; a step held by one seed and a single-seed family get no summary; the curves
    PNG is written from the summary."""
    from moe_jax.analysis import plots

    def result(run, step, bits):
        layer = {
            "bits": bits,
            "shuffled_label_bits": bits / 10,
            "sparsity": 32 - bits,
            "sparsity_shuffled_router": 31.9,
        }
        return {"run": run, "step": step, "layers": {"decoder/layers_3": layer}}

    checkpoints = [
        result("learned/seed0", 100, 0.2),
        result("learned/seed1", 100, 0.4),
        result("learned/seed2", 100, 0.6),
        result("learned/seed2", 150, 0.9),
        result("frozen/seed0", 100, 0.1),
        result("dense_run", 100, 0.0),
    ]
    assert run_names.family_of("learned/seed12") == "learned"
    assert run_names.family_of("dense_run") == "dense_run"
    assert run_names.family_of("sweep/seeds") == "sweep/seeds"
    summary = seeds.checkpoint_summary(checkpoints, languages.SEED_STATISTICS)
    assert [(s["family"], s["step"], len(s["seeds"])) for s in summary] == [("learned", 100, 3)]
    mean, std = summary[0]["layers"]["decoder/layers_3"]["bits"]
    assert mean == pytest.approx(0.4) and std == pytest.approx(0.2)
    assert summary[0]["layers"]["decoder/layers_3"]["sparsity"][0] == pytest.approx(31.6)
    plots.language_curves(checkpoints, str(tmp_path / "curves.png"), summary)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
