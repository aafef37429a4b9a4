"""Theorem 1: under weight regularisation the router rows lose their component outside V."""

from __future__ import annotations

from moe_jax.synthetic.experiments import spurious


def test_off_subspace_router_norm_decays_with_weight_decay_only(tmp_path):
    cfg = dict(
        spurious.THEOREM1["quick"],
        k=8,
        d=60,
        d_signal=6,
        n_train=2048,
        n_test=256,
        steps=500,
        batch=128,
        weight_decays=[0.0, 1e-2],
    )
    result = spurious.EXPERIMENTS["theorem1"].run(cfg, [0, 1], tmp_path)
    plain, decayed = ({e["weight_decay"]: e for e in result["summary"]}[wd] for wd in (0.0, 1e-2))
    assert decayed["off_norm_final"] < 0.3 * decayed["off_norm_init"], decayed
    assert plain["off_norm_final"] > 2 * decayed["off_norm_final"], plain
    assert decayed["ratio_final"] > plain["ratio_final"] > plain["ratio_init"]
    assert (tmp_path / "theorem1.png").stat().st_size > 0
