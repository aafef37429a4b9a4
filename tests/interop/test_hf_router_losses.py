"""An imported Switch model's router losses against transformers' (``encoder_z_loss``,
``encoder_aux_loss``, ``decoder_z_loss``, ``decoder_aux_loss`` of
``SwitchTransformersForConditionalGeneration`` with ``output_router_logits=True``, stored
in tests/fixtures/hf by scripts/make_hf_fixtures.py): `moe-jax import --hf` sets
``AuxLossConfig.router_losses='hf_stack'``, whose losses are transformers', and
``T5Config.padding_semantics='hf'``, which computes padding positions as transformers does,
so that they are on a padded batch too."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

import moe_jax
from moe_jax.models.model import EncoderDecoderModel
from tests.interop.conftest import FIXTURES, import_fixtures

CASES = ("switch_step2", "switch_step3_drops")
# transformers' name -> moe-jax's
NAMES = {"z_loss": "router_z_loss", "aux_loss": "load_balancing_loss"}
# each stack's tokens in a batch of model features (0: padding)
_TOKENS = {"encoder": "encoder_input_tokens", "decoder": "decoder_target_tokens"}


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
    expected = np.load(FIXTURES / case / "expected.npz")
    inputs, targets = expected["full_inputs"], expected["full_targets"]
    assert np.all(inputs > 0) and np.all(targets > 0)
    run = moe_jax.load(str(imported[case]))
    assert run.model.module.config.moe.losses.router_losses == "hf_stack"  # the import's
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


def _router_logits(module, run, batch) -> dict[str, np.ndarray]:
    """``{"encoder/1": float32 [batch, length, experts]}``: every MoE layer's router logits
    (``module``'s forward pass of ``batch`` with ``run``'s parameters)."""
    _, state = module.apply(
        {"params": run.params, **run.collections},
        *(batch[k] for k in ("encoder_input_tokens", "decoder_input_tokens")),
        batch["decoder_target_tokens"],
        enable_dropout=False,
        capture_intermediates=lambda mdl, method: mdl.name == "router" and method == "__call__",
        mutable=["intermediates"],
    )
    out = {}
    for stack in ("encoder", "decoder"):
        tokens = batch[_TOKENS[stack]]
        for layer, sown in state["intermediates"][stack].items():
            logits = np.asarray(sown["ffn"]["moe"]["router"]["__call__"][0].logits)
            # [groups, tokens_per_group, experts]: one group per sequence
            out[f"{stack}/{layer.removeprefix('layers_')}"] = logits.reshape(*tokens.shape, -1)
    return out


def _padded(case: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The fixture's padded batch (as model features) and everything the fixture holds."""
    expected = dict(np.load(FIXTURES / case / "expected.npz"))
    return _batch(expected["inputs"], expected["targets"]), expected


@pytest.mark.parametrize("case", CASES)
def test_padded_batch_router_logits_and_losses_are_transformers(imported, case):
    """On a padded batch (``T5Config.padding_semantics='hf'``, which the import sets) every
    position's router logits, padding included, are transformers', and so are the losses
    that read them all."""
    batch, expected = _padded(case)
    run = moe_jax.load(str(imported[case]))
    assert run.model.module.config.padding_semantics == "hf"
    ours = _router_logits(run.model.module, run, batch)
    assert set(ours) == {k.split("/", 1)[1] for k in expected if k.startswith("router_logits/")}
    for layer, logits in ours.items():
        hf = expected[f"router_logits/{layer}"]
        np.testing.assert_allclose(logits, hf, atol=1e-5 * np.abs(hf).max(), err_msg=layer)
    _, metrics = run.model.loss_fn(run.params, batch, None, run.collections)
    for stack in ("encoder", "decoder"):
        for hf_name, name in NAMES.items():
            hf = float(expected[f"losses/{stack}_{hf_name}"])
            np.testing.assert_allclose(
                float(metrics[f"{stack}_{name}"]), hf, rtol=1e-6, atol=1e-7, err_msg=name
            )


@pytest.mark.parametrize("case", CASES)
def test_mask_semantics_differ_from_transformers_on_padding_only(imported, case):
    """``padding_semantics='mask'`` (the default): the real tokens' router logits are still
    transformers', the padding positions' are not (a padding position attends to nothing),
    and the losses, which read them, differ."""
    batch, expected = _padded(case)
    run = moe_jax.load(str(imported[case]))
    config = dataclasses.replace(run.model.module.config, padding_semantics="mask")
    module = run.model.module.clone(config=config)
    for layer, logits in _router_logits(module, run, batch).items():
        hf = expected[f"router_logits/{layer}"]
        real = batch[_TOKENS[layer.split("/")[0]]] > 0
        np.testing.assert_allclose(logits[real], hf[real], atol=1e-5 * np.abs(hf).max())
        assert not np.allclose(logits[~real], hf[~real], atol=1e-2), layer
    _, metrics = EncoderDecoderModel(module).loss_fn(run.params, batch, None, run.collections)
    for stack in ("encoder", "decoder"):
        for hf_name, name in NAMES.items():
            hf = float(expected[f"losses/{stack}_{hf_name}"])
            if hf:  # by 2.6 % to 74 % on the fixtures
                assert abs(float(metrics[f"{stack}_{name}"]) / hf - 1) > 0.02, (stack, name)
