"""Tables 1-2 (tokenized mixture): learning to route beats a frozen router, token by token."""

from __future__ import annotations

from moe_jax.synthetic.experiments import tokenized


def test_learned_router_beats_frozen_and_is_sparser_than_shuffled_on_quadratic_tokens(tmp_path):
    cfg = dict(
        tokenized.PRESETS["quick"],
        k=8,
        d=8,
        num_experts=8,
        lengths=[4],
        outputs=["quadratic"],
        n_train=1024,
        n_test=512,
        steps=500,
    )
    result = tokenized.run(cfg, [0, 1], tmp_path)
    by_model = {e["model"]: e for e in result["summary"]}
    learned, frozen = by_model["MoE learned"], by_model["MoE frozen"]
    assert learned["loss_soft"] < 0.8 * frozen["loss_soft"], result["summary"]
    assert learned["sparsity"] < learned["shuffled_sparsity"] < frozen["sparsity"]
    # a small frozen router routes almost uniformly
    assert frozen["sparsity"] > 0.8 * cfg["num_experts"]
    assert (tmp_path / "tokenized.png").stat().st_size > 0 and (tmp_path / "tokenized.csv").exists()
