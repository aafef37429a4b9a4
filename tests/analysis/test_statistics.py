"""The positional statistics on inputs built by hand, where the answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.analysis import positions

N, L = 64, 64


def _grid(n: int = N, length: int = L) -> tuple[np.ndarray, np.ndarray]:
    pos = np.broadcast_to(np.arange(length), (n, length)).copy()
    return pos, np.ones((n, length), np.int32)


def test_activation_rates_sum_to_k_per_position_and_count_only_real_tokens():
    rng = np.random.default_rng(0)
    pos, seg = _grid()
    seg[:10, 40:] = 0  # padding at the end of 10 rows
    index = np.stack([rng.permutation(8)[:2] for _ in range(N * L)]).reshape(N, L, 2)
    index[seg == 0] = 8  # padding = num_experts, never counted
    rates, tokens = positions.activation_rates(index, pos, seg > 0, 8)
    assert rates.shape == (L, 8)
    np.testing.assert_array_equal(tokens, [N] * 40 + [N - 10] * 24)
    np.testing.assert_allclose(rates.sum(1), 2.0)
    top1, _ = positions.activation_rates(index[..., :1], pos, seg > 0, 8)
    np.testing.assert_allclose(top1.sum(1), 1.0)
    # a position-determined choice shows up as a one-hot row
    fixed = np.broadcast_to((pos % 8)[..., None], (N, L, 1))
    rates, _ = positions.activation_rates(fixed, pos, seg > 0, 8)
    np.testing.assert_array_equal(rates, np.eye(8)[np.arange(L) % 8])


@pytest.mark.parametrize("num_experts", [4, 32])
def test_correlation_length_of_blocks_of_four_and_of_their_shuffle(num_experts):
    rng = np.random.default_rng(1)
    pos, seg = _grid()
    # expert decided by position // 4: one random expert per block of 4 positions
    experts = np.take_along_axis(rng.integers(0, num_experts, (N, L // 4)), pos // 4, axis=1)
    result = positions.correlation_length(
        experts, seg, num_experts, max_lag=16, threshold=0.05, rng=rng
    )
    model, shuffled = result["model"], result["shuffled"]
    np.testing.assert_allclose(model["rho"][:3], [0.75, 0.5, 0.25], atol=0.07)
    assert 3.5 < model["xi_int"] < 4.3
    assert model["corr_lag"] == 3  # rho(1..3) >= 0.05, rho(4) ~ 0
    # runs of one expert are 4 long (longer when neighbouring blocks draw the same expert)
    expected_domain = 4.0 / (1.0 - 1.0 / num_experts)
    assert abs(model["xi_domain"] - expected_domain) < 0.1 * expected_domain
    assert abs(shuffled["xi_int"] - 1.0) < 0.1 and shuffled["corr_lag"] == 0
    assert max(abs(r) for r in shuffled["rho"]) < 0.05
    assert shuffled["xi_domain"] < 1.5


def test_shuffled_baseline_is_the_mean_over_random_shuffles():
    rng = np.random.default_rng(2)
    pos, seg = _grid(16, 12)
    seg[:, 7:] = 2  # two packed sequences per row
    seg[:4, 10:] = 0
    experts = (pos // 3) % 4
    exact = positions.shuffled_baseline(experts, seg, 4, max_lag=5)
    draws = [
        positions.same_expert_by_lag(positions.shuffle_within_sequences(experts, seg, rng), seg, 5)[
            0
        ]
        for _ in range(400)
    ]
    np.testing.assert_allclose(np.mean(draws, axis=0), exact, atol=0.01)


def test_shuffle_keeps_each_sequence_and_the_padding():
    rng = np.random.default_rng(3)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0]])
    values = np.arange(seg.size).reshape(seg.shape)
    out = positions.shuffle_within_sequences(values, seg, rng)
    for row in range(2):
        for s in (0, 1, 2):
            assert sorted(out[row][seg[row] == s]) == sorted(values[row][seg[row] == s])
    np.testing.assert_array_equal(out[seg == 0], values[seg == 0])
    assert not np.array_equal(out, values)


def test_probe_reads_linearly_encoded_parity_and_not_noise():
    rng = np.random.default_rng(4)
    pos, seg = _grid()
    noise = rng.normal(size=(N, L, 16))
    encoded = noise.copy()
    encoded[..., 3] += 4.0 * (2 * (pos % 2) - 1)  # parity on one direction
    probes = positions.position_probes(encoded, pos, seg, block_sizes=(8,))
    assert probes["parity"]["accuracy"] > 0.99
    assert probes["parity"]["test_tokens"] == N * L // 4  # a quarter of the sequences held out
    chance = positions.position_probes(noise, pos, seg, block_sizes=(8, 32))
    assert abs(chance["parity"]["accuracy"] - 0.5) < 0.06
    assert (
        chance["block_8"]["num_classes"] == 8 and abs(chance["block_8"]["accuracy"] - 0.125) < 0.05
    )
    assert chance["block_32"]["chance"] == 0.5


def test_probe_reads_block_index_when_encoded():
    rng = np.random.default_rng(5)
    pos, seg = _grid()
    features = rng.normal(size=(N, L, 8)) * 0.01
    features[..., 0] += pos / L  # a ramp: block index is linear-readable
    features[..., 1] += (pos / L) ** 2
    probes = positions.position_probes(features, pos, seg, block_sizes=(32,))
    assert probes["block_32"]["accuracy"] > 0.95
    assert probes["block_32"]["accuracy"] > probes["parity"]["accuracy"] + 0.3


def test_position_information_detects_position_dependent_routing():
    rng = np.random.default_rng(6)
    pos, seg = _grid()
    random_experts = rng.integers(0, 4, (N, L))
    dependent = np.where(rng.random((N, L)) < 0.5, pos % 4, random_experts)
    info = positions.position_information(dependent, pos, seg > 0, 4, rng)
    none = positions.position_information(random_experts, pos, seg > 0, 4, rng)
    assert info["excess_bits"] > 0.3
    assert abs(none["excess_bits"]) < 0.05
