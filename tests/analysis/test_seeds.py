"""Means over a run family's seeds (``moe_jax.analysis.seeds``) as the trace analyses
report them: known values in, their mean and sample standard deviation out."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.analysis import coactivation, saturation, seeds, trace_plots
from moe_jax.analysis.trace import Trace

from .test_trace_statistics import planted_layer


def checkpoint(run: str, step: int, consistency: float, partner: float | None) -> dict:
    layers = {"encoder/layers_1": {"token_consistency": consistency}}
    if partner is not None:  # a top-1 layer has no top_partner entry at all
        layers["encoder/layers_1"]["top_partner"] = partner
    return {"run": run, "step": step, "layers": layers}


def test_checkpoint_summary_averages_a_familys_seeds_per_step():
    results = [
        checkpoint("learned/seed0", 100, 0.5, 0.1),
        checkpoint("learned/seed1", 100, 0.7, 0.3),
        checkpoint("learned/seed2", 100, 0.9, None),
        checkpoint("learned/seed0", 200, 0.6, 0.2),
        checkpoint("learned/seed1", 200, 0.8, 0.4),
        checkpoint("frozen/seed0", 100, 0.1, 0.1),  # one seed: no summary
    ]
    summary = seeds.checkpoint_summary(results, ("token_consistency", "top_partner"))
    assert [(s["family"], s["step"], s["seeds"]) for s in summary] == [
        ("learned", 100, ["learned/seed0", "learned/seed1", "learned/seed2"]),
        ("learned", 200, ["learned/seed0", "learned/seed1"]),
    ]
    at_100 = summary[0]["layers"]["encoder/layers_1"]
    assert at_100["token_consistency"] == pytest.approx([0.7, 0.2])
    assert at_100["top_partner"] is None  # seed 2's layer has none
    at_200 = summary[1]["layers"]["encoder/layers_1"]
    assert at_200["top_partner"] == pytest.approx([0.3, np.sqrt(0.02)])
    lines = seeds.summary_lines(summary)
    assert lines[0] == (
        "learned (3 seeds)@100 encoder/layers_1: token_consistency 0.700 +- 0.200; top_partner -"
    )


def test_curve_summary_averages_saturation_curves_step_by_step(tmp_path):
    """Two seeds whose first choices agree with their final ones on 0 / 1/2 / 1 and 1/2 / 1/2
    / 1 of the tokens: the family's top-1 curve is their mean at each step."""
    rng = np.random.default_rng(0)
    n = 4000
    ids = rng.integers(0, 100, size=n)
    final = np.stack([ids % 4, (ids + 1) % 4], 1)
    other = final.copy()
    other[: n // 2] = np.stack([(ids[: n // 2] + 2) % 4, (ids[: n // 2] + 3) % 4], 1)
    swapped = final[:, ::-1]

    def run(name: str, first: np.ndarray, second: np.ndarray) -> dict:
        traces = [
            Trace(name, step, {"encoder/layers_1": planted_layer(e, ids)})
            for step, e in ((100, first), (200, second), (300, final))
        ]
        return saturation.run_saturation(traces)

    runs = [run("learned/seed0", swapped, other), run("learned/seed1", other, other)]
    runs.append(run("frozen/seed0", other, swapped))
    summary = seeds.curve_summary(runs)
    assert [(s["family"], s["steps"]) for s in summary] == [("learned", [100, 200, 300])]
    top1 = np.asarray(summary[0]["layers"]["encoder/layers_1"]["top1"])
    np.testing.assert_allclose(top1[:, 0], [0.25, 0.5, 1.0])
    np.testing.assert_allclose(top1[:, 1], [np.sqrt(0.125), 0.0, 0.0], atol=1e-12)
    report = {"runs": runs, "seed_summary": summary}
    assert trace_plots.write_saturation(report, str(tmp_path)) == ["saturation.png"]
    assert (tmp_path / "saturation.png").stat().st_size > 10_000
    assert seeds.curve_lines(summary, "top1")[0].startswith(
        "learned (2 seeds) encoder/layers_1 top1: step 100 0.250 +- 0.354, step 200 0.500 +- 0.000"
    )


def test_each_layer_reports_how_well_it_predicts_the_next_layer_of_its_stack():
    rng = np.random.default_rng(0)
    ids = np.arange(2000)
    a = rng.integers(0, 4, size=2000)
    layers = {
        "encoder/layers_1": planted_layer(np.stack([a, (a + 2) % 4], 1), ids),
        "encoder/layers_3": planted_layer(np.stack([(a + 1) % 4, (a + 3) % 4], 1), ids),
        "decoder/layers_1": planted_layer(np.stack([a, (a + 2) % 4], 1), ids[:500]),
    }
    following = coactivation.next_layer(coactivation.cross_layer(layers, rng))
    assert following["encoder/layers_1"]["predicts_next"] == 1.0
    assert 0.24 < following["encoder/layers_1"]["predicts_next_random"] < 0.3
    # the decoder routes other tokens; the last layer has no next one
    assert following["encoder/layers_3"] == {"predicts_next": None, "predicts_next_random": None}
    assert following["decoder/layers_1"]["predicts_next"] is None
