"""Appendix C.3 (dictionary learning): learned routing helps, and a pair of atoms uses fewer
experts than one atom with the other varying."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moe_jax.synthetic.data import Batch
from moe_jax.synthetic.experiments import dictionary


def test_pair_and_atom_cluster_ids():
    test = Batch(jnp.zeros((3, 1)), jnp.zeros((3, 1)), jnp.array([[2, 0], [0, 2], [1, 3]]))
    np.testing.assert_array_equal(dictionary.by_pair(test, 4).cluster, [2, 2, 7])
    np.testing.assert_array_equal(dictionary.by_atom(test).cluster, [2, 0, 1])


def test_moe_beats_frozen_and_linear_dense_on_dictionary(tmp_path):
    cfg = dict(
        dictionary.PRESETS["quick"],
        atoms=[16],
        d=16,
        num_experts=16,
        n_train=4096,
        n_test=1024,
        steps=750,
    )
    result = dictionary.run(cfg, [0, 1], tmp_path)
    by_model = {e["model"]: e for e in result["summary"]}
    learned = by_model["MoE learned"]
    assert learned["loss_soft"] < 0.8 * by_model["MoE frozen"]["loss_soft"], result["summary"]
    assert learned["loss_soft"] < 0.8 * by_model["dense 1 layer"]["loss_soft"]
    assert learned["sparsity"] < learned["sparsity_atom"]
    assert (tmp_path / "dictionary.png").stat().st_size > 0
