"""Figure 6 (mixture of subspaces): a learned MLP router beats a frozen one given enough data."""

from __future__ import annotations

from moe_jax.synthetic.experiments import fig6


def test_learned_mlp_router_beats_frozen_on_subspaces(tmp_path):
    cfg = dict(fig6.PRESETS["quick"], sizes=[8192], n_test=1024)
    result = fig6.run(cfg, [0, 1], tmp_path)
    by_model = {e["model"]: e for e in result["summary"]}
    learned, frozen = by_model["MoE learned"], by_model["MoE frozen"]
    assert learned["loss_soft"] < 0.85 * frozen["loss_soft"], result["summary"]
    assert learned["sparsity"] < frozen["sparsity"]
    assert learned["norm_uniformity"] < 1.5  # every expert keeps a comparable router weight
    assert (tmp_path / "fig6.png").stat().st_size > 0
