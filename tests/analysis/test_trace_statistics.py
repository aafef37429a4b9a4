"""The statistics over routing traces on planted routings whose answers are known:
vocabulary specialisation, saturation, co-activation, cross-layer consistency, drops by
position and same-expert runs."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.analysis import coactivation, positions, saturation, vocabulary
from moe_jax.analysis.trace import LayerTrace, Trace


def planted_layer(experts: np.ndarray, token_id: np.ndarray, num_experts: int = 4) -> LayerTrace:
    n, k = experts.shape
    return LayerTrace(
        example=np.arange(n, dtype=np.int64) // 8,
        position=(np.arange(n) % 8).astype(np.int32),
        token_id=token_id.astype(np.int32),
        label=np.full(n, -1, np.int32),
        experts=experts.astype(np.int32),
        probs=np.full((n, k), 1.0 / k, np.float32),
        kept=np.ones((n, k), bool),
        num_experts=num_experts,
    )


# ---------------------------------------------------------------------------- vocabulary
def test_token_categories():
    cases = {
        (0, "<pad>"): "special",
        (1, "</s>"): "special",
        (8100, "<extra_id_3>"): "sentinel",
        (5, ","): "punctuation",
        (6, "▁("): "punctuation",
        (7, "▁1948"): "number",
        (8, "▁Human"): "capitalized",
        (9, "▁rights"): "word",
        (10, "ing"): "subword",
    }
    for (token_id, piece), category in cases.items():
        assert vocabulary.token_category(token_id, piece) == category, piece


def test_token_consistency_is_one_when_each_id_has_one_expert_and_floored_by_a_random_router():
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 50, size=4000)
    top1 = ids % 4  # context-independent: the id decides the expert
    assert vocabulary.token_consistency(ids, top1, 4, min_count=5) == 1.0
    floor = vocabulary.token_consistency(ids, rng.permutation(top1), 4, min_count=5)
    assert 0.25 < floor < 0.6
    # each id split evenly between two experts: 0.5 exactly
    ids_even = np.repeat(np.arange(10, 50), 100)
    split = np.where(np.arange(4000) % 2 == 0, ids_even % 4, (ids_even + 1) % 4)
    assert vocabulary.token_consistency(ids_even, split, 4, min_count=5) == pytest.approx(0.5)
    # ids seen fewer than min_count times are left out
    assert vocabulary.token_consistency(np.arange(10), np.zeros(10, int), 4, min_count=2) is None


def test_category_information_equals_category_entropy_when_the_category_decides_the_expert():
    pieces = {10: "▁The", 11: ",", 12: "▁1948", 13: "ing"}  # 4 categories, one expert each
    rng = np.random.default_rng(1)
    ids = rng.integers(10, 14, size=2000)
    top1 = ids - 10
    layer = planted_layer(np.stack([top1, (top1 + 1) % 4], 1), ids)
    stats = vocabulary.analyze_layer(layer, pieces, rng, min_count=5, top_tokens=2)
    freq = np.bincount(ids - 10) / len(ids)
    assert stats["category_bits"] == pytest.approx(-np.sum(freq * np.log2(freq)))
    assert stats["category_shuffled_bits"] < 0.01
    share = np.asarray(stats["category_share"])
    row = vocabulary.CATEGORIES.index("punctuation")
    np.testing.assert_allclose(share[row], [0, 1, 0, 0])
    assert stats["token_consistency"] == 1.0 and stats["random_router"] < 0.4
    assert [t["piece"] for t in stats["expert_tokens"][2]] == ["▁1948"]
    assert stats["expert_tokens"][2][0]["share"] == 1.0


# ---------------------------------------------------------------------------- saturation
def test_topk_agreement_counts_shared_experts_per_token():
    a = np.array([[0, 1], [2, 3]])
    final = np.array([[1, 0], [2, 0]])
    assert saturation.top1_agreement(a, final) == 0.5
    assert saturation.topk_agreement(a, final) == 0.75


def test_saturation_curves_against_the_final_checkpoint():
    rng = np.random.default_rng(0)
    n = 4000
    ids = rng.integers(0, 100, size=n)
    final = np.stack([ids % 4, (ids + 1) % 4], 1)
    swapped = final[:, ::-1]  # same top-2 sets, other first choice
    half = final.copy()
    half[: n // 2] = np.stack([(ids[: n // 2] + 2) % 4, (ids[: n // 2] + 3) % 4], 1)
    traces = [
        Trace("r", step, {"encoder/layers_1": planted_layer(e, ids)})
        for step, e in ((300, final), (100, swapped), (200, half))
    ]
    result = saturation.run_saturation(traces)
    assert result["steps"] == [100, 200, 300] and result["final_step"] == 300
    curves = result["layers"]["encoder/layers_1"]
    np.testing.assert_allclose(curves["top1"], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(curves["topk"], [1.0, 0.5, 1.0])
    # a router with the final load that ignores the token agrees by chance only
    assert all(0.15 < v < 0.35 for v in curves["top1_random"])
    assert all(0.35 < v < 0.65 for v in curves["topk_random"])


def test_saturation_refuses_traces_of_different_tokens():
    e = np.zeros((8, 1), int)
    traces = [
        Trace("r", 1, {"l": planted_layer(e, np.arange(8))}),
        Trace("r", 2, {"l": planted_layer(e, np.arange(8) + 1)}),
    ]
    with pytest.raises(ValueError, match="different tokens"):
        saturation.run_saturation(traces)


# ---------------------------------------------------------------------------- co-activation
def test_coactivation_of_experts_that_always_work_in_pairs():
    rng = np.random.default_rng(0)
    pair = rng.integers(0, 2, size=3000)
    experts = np.stack([2 * pair, 2 * pair + 1], 1)  # {0, 1} or {2, 3}
    matrix = coactivation.coactivation_matrix(experts, 4)
    np.testing.assert_allclose(
        matrix, [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], atol=0
    )
    stats = coactivation.analyze_layer(planted_layer(experts, pair), rng)
    assert stats["top_partner"] == 1.0 and stats["max_pair"] == 1.0
    # random router with the same (uniform) load: each partner ~1/3
    assert 0.3 < stats["top_partner_random"] < 0.45


def test_top1_layers_have_no_pairs():
    stats = coactivation.analyze_layer(
        planted_layer(np.zeros((8, 1), int), np.arange(8)), np.random.default_rng(0)
    )
    assert stats["coactivation"] is None and stats["k"] == 1


def test_cross_layer_predictability():
    rng = np.random.default_rng(0)
    ids = np.arange(4000)
    a = rng.integers(0, 4, size=4000)
    b = (a + 1) % 4  # a function of a
    c = rng.integers(0, 4, size=4000)  # independent of a
    layers = {
        "encoder/layers_1": planted_layer(np.stack([a, (a + 2) % 4], 1), ids),
        "encoder/layers_3": planted_layer(np.stack([b, (b + 2) % 4], 1), ids),
        "encoder/layers_5": planted_layer(np.stack([c, (c + 2) % 4], 1), ids),
        "decoder/layers_1": planted_layer(np.stack([a, (a + 2) % 4], 1), ids[:800]),
    }
    cross = coactivation.cross_layer(layers, rng)
    p = cross["predictability"]
    assert p[0][1] == 1.0 and p[1][0] == 1.0 and p[0][0] == 1.0
    assert 0.24 < p[0][2] < 0.3  # independent: the commonest expert's share, ~1/4
    assert 0.24 < cross["random"][0][1] < 0.3
    assert p[0][3] is None and cross["random"][3][0] is None  # other tokens


# ---------------------------------------------------------------------------- positions
def test_drop_rates_by_position():
    n, length, k = 6, 8, 2
    kept = np.ones((n, length, k), bool)
    kept[:, -1, :] = False  # the last position loses both choices
    kept[:, -2, 1] = False  # the one before loses its second
    valid = np.ones((n, length), bool)
    pos = np.broadcast_to(np.arange(length), (n, length))
    drops = positions.drop_rates(kept, pos, valid, length)
    np.testing.assert_allclose(drops["choices"], [0, 0, 0, 0, 0, 0, 0.5, 1.0])
    np.testing.assert_allclose(drops["tokens"], [0, 0, 0, 0, 0, 0, 0, 1.0])
    assert drops["overall_choices"] == pytest.approx(1.5 / 8)
    assert drops["overall_tokens"] == pytest.approx(1 / 8)


def test_consecutive_tokens_on_one_expert():
    length = 8
    first = np.broadcast_to(np.arange(length) // 2, (50, length))  # runs of 2 tokens
    second = (first + 1) % 4
    index = np.stack([first, second], -1)
    segments = np.ones((50, length), int)
    stats = positions.consecutive_stats(index, segments)
    assert stats["top1_repeat"] == pytest.approx(4 / 7)  # pairs (0,1), (2,3), (4,5), (6,7)
    # neighbours of different blocks share an expert: block b's second is block b+1's first
    assert stats["topk_overlap"] == 1.0
    runs = positions.consecutive_runs(index, segments, np.random.default_rng(0))
    assert runs["shuffled"]["top1_repeat"] < runs["model"]["top1_repeat"]
