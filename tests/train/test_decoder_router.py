"""A model whose decoder routes differently from its encoder (learned top-2 encoder, hash
decoder: routers/hash_decoder.gin) trains, saves, restores, evaluates and exports through
the CLI, and both MoE configs survive the round trip (config.gin, export's config.json)."""

from __future__ import annotations

import json

import gin
from safetensors.numpy import load_file

from moe_jax import cli
from moe_jax.interop import export_format
from moe_jax.models.t5 import T5Config
from moe_jax.moe import HashRouterConfig, TopKRouterConfig
from moe_jax.runtime import configured  # noqa: F401  (registers the gin names)

TRAIN = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin_file=routers/hash_decoder.gin",
    "--gin_file=data/vocab_byte.gin",
    "--gin.VOCAB_SIZE=384",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.TRAIN_STEPS=2",
    "--gin.train_script.train.eval_period=0",
]


def _config_of(model_dir) -> T5Config:
    """The ``T5Config`` a run directory's config.gin builds."""
    gin.clear_config()
    gin.parse_config_file(str(model_dir / "config.gin"))
    try:
        with gin.config_scope("MODEL"):  # the recorded bindings: MODEL/EncoderDecoderModel...
            return gin.query_parameter("%MODEL").scoped_configurable_fn().module.config
    finally:
        gin.clear_config()


def test_decoder_with_its_own_router_trains_evaluates_and_exports(tmp_path):
    run, out = tmp_path / "run", tmp_path / "export"
    assert cli.main(["train", *TRAIN, f"--gin.MODEL_DIR={run}"]) == 0
    gin.clear_config()
    config = _config_of(run)
    assert config.moe_config("encoder").router == TopKRouterConfig(num_selected_experts=2)
    assert config.moe_config("decoder").router == HashRouterConfig(num_selected_experts=1)

    assert (
        cli.main(
            ["eval", f"--checkpoint={run}", f"--output_dir={tmp_path / 'eval'}", "--eval_steps=1"]
        )
        == 0
    )
    metrics = json.loads((tmp_path / "eval" / "run.json").read_text())["metrics"]
    # the hash decoder sows no router losses; the learned encoder does
    assert metrics["moe/encoder/layers_1/router_z_loss"] > 0 and metrics["loss"] > 0

    assert cli.main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
    exported = json.loads((out / export_format.CONFIG_JSON).read_text())["t5_config"]
    assert (exported["moe"]["router"]["type"], exported["decoder_moe"]["router"]["type"]) == (
        "top_k",
        "hash",
    )
    assert T5Config.from_dict(exported) == config
    arrays = load_file(out / export_format.WEIGHTS_FILE)
    assert "encoder/layers_1/mlp/router/router_weights/w/kernel" in arrays
    assert not any(n.startswith("decoder/") and "/router/" in n for n in arrays)  # hash: no weights
