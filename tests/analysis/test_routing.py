"""Token positions and sequence ids for packed and unpacked batches; layer order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_jax.analysis.positions import sequence_ids
from moe_jax.runtime import routing


def test_unpacked_rows_are_one_sequence_with_column_positions():
    tokens = jnp.array([[5, 6, 7, 1, 0], [8, 1, 0, 0, 0]])
    pos, seg = routing._positions_and_segments(tokens, tokens > 0, {}, "encoder")
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 4]] * 2)
    np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])


def test_packed_rows_use_the_packing_features():
    tokens = jnp.array([[5, 6, 1, 7, 8, 9, 1, 0]])
    batch = {
        "decoder_positions": jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]]),
        "decoder_segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
    }
    pos, seg = routing._positions_and_segments(tokens, tokens > 0, batch, "decoder")
    np.testing.assert_array_equal(pos, batch["decoder_positions"])
    np.testing.assert_array_equal(seg, batch["decoder_segment_ids"])
    ids = sequence_ids(np.asarray(jnp.concatenate([seg, seg])))
    assert len(np.unique(ids[ids >= 0])) == 4 and (ids[:, -1] == -1).all()


def test_layers_come_encoder_first_by_depth():
    names = ["decoder/layers_11", "decoder/layers_3", "encoder/layers_11", "encoder/layers_7"]
    assert sorted(names, key=routing.layer_order) == [
        "encoder/layers_7",
        "encoder/layers_11",
        "decoder/layers_3",
        "decoder/layers_11",
    ]
