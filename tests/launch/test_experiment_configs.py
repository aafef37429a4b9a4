"""The paper's experiment gin files (gin/experiments/) parse through the trainer's flag
parser and describe the runs of Section 3.7 / Appendix C.4."""

from __future__ import annotations

import argparse

import flax.linen as nn
import gin
import jax
import pytest

from moe_jax.runtime import gin_flags, gin_utils


def _parse(*files: str, bindings: tuple[str, ...] = ()) -> None:
    parser = argparse.ArgumentParser()
    gin_flags.add_gin_flags(parser)
    argv = [f"--gin_file=experiments/{f}" for f in files] + [f"--gin.{b}" for b in bindings]
    gin_utils.parse_gin(gin_flags.parse_flags(parser, [*argv, "--gin.MODEL_DIR=/tmp/x"]))


@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()


def _model_config() -> dict:
    return {
        name: gin.query_parameter(f"%{name}")
        for name in (
            "EMBED_DIM",
            "MLP_DIM",
            "NUM_HEADS",
            "HEAD_DIM",
            "NUM_ENCODER_LAYERS",
            "NUM_DECODER_LAYERS",
        )
    }


@pytest.mark.parametrize("mode", ["frozen", "learned"])
def test_fig5_moe_runs_are_the_papers_model_with_the_requested_router(mode):
    _parse(f"fig5_{mode}.gin")
    assert _model_config() == {
        "EMBED_DIM": 32,
        "MLP_DIM": 256,
        "NUM_HEADS": 12,
        "HEAD_DIM": 64,
        "NUM_ENCODER_LAYERS": 12,
        "NUM_DECODER_LAYERS": 12,
    }
    assert gin.query_parameter("freeze.router_mode.mode") == mode
    assert gin.query_parameter("%NUM_SELECTED_EXPERTS") == 2  # TopKRouterConfig's k is this macro
    assert (
        gin.query_parameter("%TRAIN_CAPACITY_FACTOR") == 1.25
    )  # CapacityConfig's factors are these macros
    assert gin.query_parameter("%EVAL_CAPACITY_FACTOR") == 2.0
    assert gin.query_parameter("%NUM_EXPERTS") == 32
    assert gin.query_parameter("%TRAIN_STEPS") == 500000
    assert gin.query_parameter("create_optimizer.name") == "adam"
    assert gin.query_parameter("sources.make_source.corpus") == "tfds"


def test_fig5_dense_baseline_doubles_the_mlp_where_the_moe_is_sparse():
    _parse("fig5_dense.gin")
    assert gin.query_parameter("T5Config.sparse_layer_type") == "dense"
    assert gin.query_parameter("%FLOP_MATCHED_MLP_DIM") == 2 * gin.query_parameter("%MLP_DIM")


def test_base_scale_and_expert_count_family():
    """The Base-scale file builds T5-Base with the requested expert count in layers 3, 7, 11
    of each stack (parameter shapes of the model gin constructs, not the bindings)."""
    _parse("base_learned.gin", bindings=("NUM_EXPERTS=8", "EncoderDecoderModel.vocabulary=250112"))
    model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}
    params = jax.eval_shape(lambda: model.get_initial_variables(jax.random.key(0), shapes))[
        "params"
    ]
    flat = {
        "/".join(str(k.key) for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(params))[0]
    }
    for stack in ("encoder", "decoder"):
        sparse = sorted(
            int(name.split("/")[1][len("layers_") :])
            for name in flat
            if name.startswith(f"{stack}/") and name.endswith("moe/expert/wi_0")
        )
        assert sparse == [3, 7, 11]
        assert flat[f"{stack}/layers_3/ffn/moe/expert/wi_0"] == (8, 768, 2048)
        assert flat[f"{stack}/layers_3/ffn/moe/router/weights/w"] == (768, 8)
        assert flat[f"{stack}/layers_0/ffn/mlp/wi_0"] == (768, 2048)
    assert flat["token_embedder/embedding"] == (250112, 768)


def test_cpu_overlay_switches_to_the_embedded_corpus_and_short_sequences():
    _parse("fig5_learned.gin", "cpu_scale.gin")
    assert gin.query_parameter("sources.make_source.corpus") == "embedded"
    assert gin.query_parameter("vocab.get_vocabulary.kind") == "embedded"
    assert gin.query_parameter("vocab.get_vocabulary.path") is None  # nothing fetched from gs://
    assert gin.query_parameter("%TASK_FEATURE_LENGTHS") == {"inputs": 64, "targets": 16}
    assert _model_config()["EMBED_DIM"] == 32


@pytest.mark.parametrize(
    "experiment", ["fig5_learned.gin", "fig5_dense.gin", "base_frozen.gin", "base_dense.gin"]
)
def test_accelerator_runs_use_bfloat16_activations_and_the_cpu_overlay_float32(experiment):
    _parse(experiment)
    assert gin.query_parameter("%ACTIVATION_DTYPE") == "bfloat16"
    assert gin.query_parameter("T5Config.param_dtype") == "float32"
    gin.clear_config()
    _parse(experiment, "cpu_scale.gin")
    assert gin.query_parameter("%ACTIVATION_DTYPE") == "float32"


@pytest.mark.parametrize(
    "mesh,dtype", [("v4_32", "bfloat16"), ("gpu_8x_h100", "bfloat16"), ("cpu_8", "float32")]
)
def test_accelerator_meshes_switch_a_run_to_bfloat16(mesh, dtype):
    parser = argparse.ArgumentParser()
    gin_flags.add_gin_flags(parser)
    gin_utils.parse_gin(
        gin_flags.parse_flags(
            parser, ["--gin_file=runs/smoke_cpu.gin", f"--gin_file=meshes/{mesh}.gin"]
        )
    )
    assert gin.query_parameter("%ACTIVATION_DTYPE") == dtype


@pytest.mark.parametrize("experiment", ["base_learned.gin", "base_frozen.gin", "base_dense.gin"])
def test_base_runs_shard_parameters_over_the_batch_axes(experiment):
    # the MoE pair and its FLOP-matched dense baseline run the same layout (a fair comparison)
    _parse(experiment)
    assert gin.query_parameter("standard_logical_axis_rules.fsdp") is True
