"""MMoE (Ma et al. 2018): correlated-task generator, per-task gates, and a small run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.synthetic import models
from moe_jax.synthetic.experiments import mmoe

KEY = jax.random.PRNGKey(0)
CFG = dict(mmoe.PRESETS["quick"])


def test_weight_cosine_is_rho_and_label_correlation_grows_with_it():
    rhos = [-0.5, 0.0, 0.5, 0.9, 1.0]
    corr = []
    for rho in rhos:
        task = mmoe.make_correlated_tasks(KEY, 20, rho, c=1.5)
        w = np.asarray(task.w)
        np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.5, rtol=1e-5)
        np.testing.assert_allclose(w[0] @ w[1] / 1.5**2, rho, atol=1e-5)
        batch = mmoe.sample_correlated_tasks(task, jax.random.PRNGKey(1), 20000)
        assert batch.x.shape == (20000, 20) and batch.y.shape == (20000, 2)
        corr.append(float(mmoe.pearson(batch.y[:, 0], batch.y[:, 1])))
    assert np.all(np.diff(corr) > 0.05), corr
    assert abs(corr[1]) < 0.05 and corr[-1] > 0.95, corr
    with pytest.raises(ValueError, match="rho"):
        mmoe.make_correlated_tasks(KEY, 20, 1.5)


def test_one_key_gives_the_same_directions_and_inputs_for_every_rho():
    a, b = (mmoe.make_correlated_tasks(KEY, 10, rho) for rho in (0.0, 0.9))
    np.testing.assert_array_equal(a.w[0], b.w[0])
    np.testing.assert_array_equal(a.alpha, b.alpha)
    x_a, x_b = (mmoe.sample_correlated_tasks(t, jax.random.PRNGKey(3), 16).x for t in (a, b))
    np.testing.assert_array_equal(x_a, x_b)


def test_mmoe_has_a_gate_per_task_omoe_one_and_shared_bottom_matches_the_size():
    built = mmoe.build_models(CFG)
    params = {name: model.init(KEY) for name, model in built.items()}
    e, d = CFG["num_experts"], CFG["d"]
    assert params["MMoE"]["router"]["w"].shape == (2, e, d)
    assert params["OMoE"]["router"]["w"].shape == (1, e, d)
    assert "router" not in params["shared bottom"]
    n_mmoe, n_sb = models.count_params(params["MMoE"]), models.count_params(params["shared bottom"])
    assert abs(n_sb - n_mmoe) / n_mmoe < 0.03, (n_sb, n_mmoe)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, d))
    for name, model in built.items():
        pred, _ = model.apply(params[name], x)
        assert pred.shape == (32, 2), name


def test_copying_one_gate_makes_mmoe_compute_the_omoe_function():
    built = mmoe.build_models(CFG)
    mmoe_params = built["MMoE"].init(KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (64, CFG["d"]))
    gate = mmoe_params["router"]["w"][:1]
    omoe_params = {**mmoe_params, "router": {"w": gate}}
    tied = {**mmoe_params, "router": {"w": jnp.concatenate([gate, gate])}}
    omoe_pred, _ = built["OMoE"].apply(omoe_params, x)
    untied_pred, untied_gates = built["MMoE"].apply(mmoe_params, x)
    tied_pred, tied_gates = built["MMoE"].apply(tied, x)
    np.testing.assert_allclose(tied_pred, omoe_pred, rtol=1e-5, atol=1e-6)
    # task 2's own gate matters
    assert not np.allclose(untied_pred[:, 1], omoe_pred[:, 1], atol=1e-3)
    np.testing.assert_allclose(untied_pred[:, 0], omoe_pred[:, 0], rtol=1e-5, atol=1e-6)
    assert (
        float(mmoe.gate_divergence(tied_gates)) < 1e-6 < float(mmoe.gate_divergence(untied_gates))
    )


def test_runs_cover_rho_by_seed_with_one_init_per_seed():
    runs, rows = mmoe.rho_grid([3, 5], [0.0, 0.5, 1.0], 128, 4)
    assert [(r["rho"], r["seed"]) for r in rows] == [
        (rho, s) for rho in (0.0, 0.5, 1.0) for s in (3, 5)
    ]
    np.testing.assert_array_equal(runs.data_index, np.arange(6))
    np.testing.assert_array_equal(runs.key[0], runs.key[4])  # seed 3 at rho 0 and rho 1
    assert not np.array_equal(runs.key[0], runs.key[1])


@pytest.mark.slow
def test_small_run_moe_beats_shared_bottom_at_every_correlation(tmp_path):
    cfg = dict(CFG, rhos=[0.0, 1.0], n_test=1024, steps=1000)
    result = mmoe.run(cfg, [0, 1, 2, 3], tmp_path)
    by = {(e["model"], e["rho"]): e for e in result["summary"]}
    for rho in cfg["rhos"]:  # mean over seeds of the paired ratio; single seeds can tie
        assert by["shared bottom", rho]["loss_vs_mmoe"] > 1.2, result["summary"]
        assert by["MMoE", rho]["loss_vs_mmoe"] == 1.0
        assert by["OMoE", rho]["gate_divergence"] == 0.0
    assert by["MMoE", 0.0]["label_corr"] < 0.1 < 0.9 < by["MMoE", 1.0]["label_corr"]
    assert by["MMoE", 0.0]["gate_divergence"] > 0.05  # the two gates are trained apart
    # the training log: no stopping rule in this preset, so every run takes the cap
    for e in result["summary"]:
        assert e["steps"] == 1000 and e["converged"] == 0.0, e
        # train loss is the mean over both tasks' squared errors, the test loss their sum:
        # about half, less where a model fits its training set more closely (OMoE: ~0.35)
        assert 0.3 < e["train_loss"] / e["loss"] < 0.7, e
    steps = sorted({e["step"] for e in result["curves"]})
    assert steps == [500, 1000]
    first, last = (
        {e["model"]: e["loss"] for e in result["curves"] if e["step"] == s and e["rho"] == 0.0}
        for s in (500, 1000)
    )
    assert all(last[m] < first[m] for m in mmoe.MODELS), (first, last)
    assert (tmp_path / "mmoe.png").stat().st_size > 0 and (tmp_path / "mmoe.csv").exists()
