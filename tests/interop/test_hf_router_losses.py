"""An imported Switch model's router losses against transformers' (``encoder_z_loss``,
``encoder_aux_loss``, ``decoder_z_loss``, ``decoder_aux_loss`` of
``SwitchTransformersForConditionalGeneration`` with ``output_router_logits=True``, stored
in tests/fixtures/hf by scripts/make_hf_fixtures.py): `moe-jax import --hf` sets
``AuxLossConfig.router_losses='hf_stack'``, whose losses are transformers'."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax.moe import losses as moe_losses
from moe_jax.moe.collections import ROUTING_COLLECTION
from moe_jax.runtime import routing
from tests.interop.conftest import FIXTURES, import_fixtures

CASES = ("switch_step2", "switch_step3_drops")
# transformers' name -> moe-jax's
NAMES = {"z_loss": "router_z_loss", "aux_loss": "load_balancing_loss"}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, pathlib.Path]:
    return import_fixtures(tmp_path_factory, CASES)


def _batch(inputs: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
        "decoder_target_tokens": targets,
    }


@pytest.mark.parametrize("case", CASES)
def test_imported_switch_model_trains_on_transformers_router_losses(imported, case):
    """Without padding every position is computed as transformers computes it: the losses
    agree within float32 rounding (the decoder of ``switch_step3_drops``, every layer
    sparse, has none: transformers skips a stack whose ``sparse_step`` is 1)."""
    assert "AuxLossConfig.router_losses = 'hf_stack'" in (imported[case] / "config.gin").read_text()
    expected = np.load(FIXTURES / case / "expected.npz")
    inputs, targets = expected["full_inputs"], expected["full_targets"]
    assert np.all(inputs > 0) and np.all(targets > 0)
    run = moe_jax.load(str(imported[case]))
    loss, metrics = run.model.loss_fn(run.params, _batch(inputs, targets), None, run.collections)
    weights = run.model.module.config.moe_config("encoder").losses
    for stack in ("encoder", "decoder"):
        for hf_name, name in NAMES.items():
            hf = float(expected[f"full_losses/{stack}_{hf_name}"])
            ours = float(metrics[f"{stack}_{name}"])
            np.testing.assert_allclose(ours, hf, rtol=1e-6, atol=1e-7, err_msg=f"{stack} {name}")
    if case == "switch_step3_drops":
        assert float(expected["full_losses/decoder_z_loss"]) == 0.0
    # transformers: loss + router_z_loss_coef * (z) + router_aux_loss_coef * (aux)
    hf_total = weights.router_z_loss_weight * sum(
        float(metrics[f"{s}_router_z_loss"]) for s in ("encoder", "decoder")
    ) + weights.load_balancing_loss_weight * sum(
        float(metrics[f"{s}_load_balancing_loss"]) for s in ("encoder", "decoder")
    )
    np.testing.assert_allclose(float(metrics["aux_loss"]), hf_total, rtol=1e-6)
    token_losses = float(metrics["cross_entropy"]) + float(metrics["z_loss"])  # the logits'
    np.testing.assert_allclose(float(loss), token_losses + hf_total, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_padded_batch_counts_padding_as_transformers_does(imported, case):
    """On a padded batch transformers' losses also read the router logits of padding
    positions, which moe-jax computes differently (padding attends to nothing and is
    routed nowhere): the losses' definition is checked on transformers' own logits, and
    moe-jax's router agrees with transformers' on every real token."""
    expected = np.load(FIXTURES / case / "expected.npz")
    config = moe_jax.load(str(imported[case])).model.module.config
    for stack in ("encoder", "decoder"):
        names = sorted(k for k in expected.files if k.startswith(f"router_logits/{stack}/"))
        assert len(names) == len(config.sparse_layers(stack))
        every_layer_sparse = len(names) == (
            config.num_encoder_layers if stack == "encoder" else config.num_decoder_layers
        )
        ours = moe_losses.hf_stack_losses(
            [moe_losses.sequence_router_sums(jnp.asarray(expected[k])) for k in names]
        )
        for hf_name, name in NAMES.items():
            hf = float(expected[f"losses/{stack}_{hf_name}"])
            if every_layer_sparse:  # skipped by transformers, and by moe-jax's model
                assert hf == 0.0
                continue
            np.testing.assert_allclose(float(ours[name]), hf, rtol=1e-6, err_msg=f"{stack} {name}")


@pytest.mark.parametrize("case", CASES)
def test_router_probabilities_of_real_tokens_are_transformers(imported, case):
    expected = np.load(FIXTURES / case / "expected.npz")
    inputs, targets = expected["inputs"], expected["targets"]
    run = moe_jax.load(str(imported[case]))
    batch = _batch(inputs, targets)
    _, state = run.model.module.apply(
        {"params": run.params, **run.collections},
        *(batch[k] for k in ("encoder_input_tokens", "decoder_input_tokens")),
        batch["decoder_target_tokens"],
        enable_dropout=False,
        mutable=[ROUTING_COLLECTION],
    )
    for layer, sown in routing.sown_by_layer(run.model, state).items():
        stack, index = layer.split("/layers_")
        real = (inputs if stack == "encoder" else targets) > 0
        hf_logits = expected[f"router_logits/{stack}/{index}"]
        hf_probs = np.exp(hf_logits - hf_logits.max(-1, keepdims=True))
        hf_probs /= hf_probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(
            np.asarray(sown["router_probs"])[real], hf_probs[real], atol=2e-5, err_msg=layer
        )
