"""Hugging Face checkpoints in and out, against what transformers computed
(tests/fixtures/hf, written by scripts/make_hf_fixtures.py; no torch here): `moe-jax import
--hf`, ``moe_jax.load(...).forward``, `moe-jax export --format=hf`."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file

import moe_jax
from moe_jax import cli
from tests.interop.conftest import FIXTURES, import_fixtures

CASES = ("t5_v1_1", "t5_relu_tied", "switch_step2", "switch_step3_drops")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, pathlib.Path]:
    return import_fixtures(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_experts_agree_with_transformers(imported, case):
    """At every position of the padded batch, padding included: the import sets
    ``T5Config.padding_semantics='hf'``, so padding is computed, and routed (taking
    capacity after its sequence's real tokens), as transformers does."""
    expected = np.load(FIXTURES / case / "expected.npz")
    inputs, targets = expected["inputs"], expected["targets"]
    out = moe_jax.load(str(imported[case])).forward(inputs, targets)
    assert out.logits.dtype == np.float32 and out.logits.shape == expected["logits"].shape
    hf_logits = expected["logits"]
    # float32 rounding: transformers' own float32 run differs from float64 by about 1e-6
    np.testing.assert_allclose(out.logits, hf_logits, atol=1e-5 * np.abs(hf_logits).max())
    hf_layers = {k.removeprefix("experts/") for k in expected.files if k.startswith("experts/")}
    ours = {name.replace("layers_", "") for name in out.experts}
    assert ours == hf_layers  # the same sparse layers
    for name, experts in out.experts.items():
        hf = expected[f"experts/{name.replace('layers_', '')}"]
        assert experts.shape == (*hf.shape, 1)
        np.testing.assert_array_equal(experts[..., 0], hf, err_msg=name)


def test_capacity_drops_tokens_in_the_drop_case(imported):
    """The fixture exercises what it is there for: transformers dropped tokens."""
    expected = np.load(FIXTURES / "switch_step3_drops" / "expected.npz")
    real = expected["inputs"] > 0
    assert np.sum(expected["experts/encoder/1"][real] == -1) >= 3
    # and padding that took an expert's capacity
    assert np.any(expected["experts/decoder/1"][expected["targets"] == 0] >= 0)


@pytest.mark.parametrize("case", CASES)
def test_hf_to_moe_jax_to_hf_is_bit_for_bit(imported, case, tmp_path):
    out = tmp_path / "hf"
    assert (
        cli.main(["export", "--format=hf", f"--checkpoint={imported[case]}", f"--out={out}"]) == 0
    )
    original, exported = (
        load_file(FIXTURES / case / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    for name, array in original.items():
        assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
    # transformers 5 writes a v1.1 head as tied without output scaling: exported untied
    assert set(exported) - set(original) == ({"lm_head.weight"} if case == "t5_v1_1" else set())
    config, source = (json.loads((d / "config.json").read_text()) for d in (out, FIXTURES / case))
    same = ("architectures", "d_model", "d_ff", "num_layers", "num_decoder_layers", "vocab_size")
    switch = (
        "num_experts",
        "expert_capacity",
        "router_bias",
        "encoder_sparse_step",
        "decoder_sparse_step",
        "num_sparse_encoder_layers",
        "num_sparse_decoder_layers",
    )
    for key in same + (switch if "switch" in case else ("feed_forward_proj",)):
        assert config[key] == source[key], key
