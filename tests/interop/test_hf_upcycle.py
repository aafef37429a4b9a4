"""Sparse upcycling from an imported T5 v1.1 (Komatsuzaki et al.): `moe-jax upcycle` of
the run `moe-jax import --hf` wrote computes, at step 0, the logits transformers computed
for the dense model."""

from __future__ import annotations

import numpy as np
import pytest

import moe_jax
from moe_jax import cli
from tests.interop.conftest import FIXTURES

# the fixture's shape (scripts/make_hf_fixtures.py) as gin/models/t5_moe.gin's macros
SHAPE = [
    "--gin.EMBED_DIM=16",
    "--gin.MLP_DIM=24",
    "--gin.NUM_HEADS=2",
    "--gin.HEAD_DIM=4",
    "--gin.NUM_ENCODER_LAYERS=2",
    "--gin.NUM_DECODER_LAYERS=2",
    "--gin.VOCAB_SIZE=384",
    "--gin.T5Config.relpos_num_buckets=8",
    "--gin.T5Config.relpos_max_distance=16",
]


@pytest.mark.slow  # import, upcycle and a forward pass: about 50 s on a 2-core CPU
def test_upcycled_t5_v1_1_starts_as_the_dense_model(tmp_path):
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    assert cli.main(["import", f"--hf={FIXTURES / 't5_v1_1'}", f"--model_dir={dense}"]) == 0
    files = ["models/t5_moe.gin", "routers/renormalized.gin", "runs/pretrain.gin"]
    moe_flags = ["--gin.NUM_EXPERTS=4", "--gin.NUM_SPARSE_LAYERS=1", "--gin.TRAIN_STEPS=10"]
    args = [f"--checkpoint={dense}", f"--out={moe}", *(f"--gin_file={f}" for f in files)]
    assert cli.main(["upcycle", *args, *SHAPE, *moe_flags]) == 0
    expected = np.load(FIXTURES / "t5_v1_1" / "expected.npz")
    out = moe_jax.load(str(moe)).forward(expected["inputs"], expected["targets"])
    assert sorted(out.experts) == ["decoder/layers_1", "encoder/layers_1"]
    real = expected["targets"] > 0
    hf_logits = expected["logits"][real]
    np.testing.assert_allclose(out.logits[real], hf_logits, atol=1e-5 * np.abs(hf_logits).max())
