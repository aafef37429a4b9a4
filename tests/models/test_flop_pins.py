"""Numbers read from the model's configuration, pinned as the code gave them when the MoE
settings were gin bindings of ``MoeLayer``: FLOP counts, the MoE config an export writes,
and the compile report's MoE choices."""

from __future__ import annotations

import dataclasses

import gin
import pytest

from moe_jax.compile import aot
from moe_jax.interop import export_format
from moe_jax.models.t5 import T5Config
from moe_jax.moe import ExecutionConfig
from moe_jax.runtime import builders, gin_flags, gin_utils

SHAPES = {"encoder_input_tokens": (8, 64), "decoder_input_tokens": (8, 16)}
# name: (gin files and flags, training FLOPs per example, forward FLOPs per example)
CONFIGS = {
    "smoke": (["runs/smoke_cpu.gin"], 44101632.0, 14700544.0),
    "base_fine_grained_shared": (
        [
            "runs/smoke_cpu.gin",
            "models/size_base.gin",
            "routers/fine_grained.gin",
            "routers/shared_experts.gin",
        ],
        49334059008.0,
        16444686336.0,
    ),
    "tiny_hierarchical": (
        ["runs/smoke_cpu.gin", "routers/hierarchical.gin"],
        44101632.0,
        14700544.0,
    ),
    "tiny_expert_choice": (
        [
            "runs/smoke_cpu.gin",
            "routers/expert_choice.gin",
            "--gin.NUM_SPARSE_LAYERS=0",
            "--gin.T5Config.num_sparse_encoder_layers=1",
        ],
        43499520.0,
        14499840.0,
    ),
}
# The smoke model's MoE config as its export writes it (config.json's ``t5_config.moe``):
# the values export format 1 wrote as MoeLayer's gin fields, in the nested form (the
# options the top_k router lacks, ``num_expert_groups``, ``num_selected_groups`` and
# ``router_seed``, were at their defaults; the options added since, at theirs: no fixed
# ``expert_capacity``, no ``group_by_sequence``, ``balance_scope='batch'``, no ``router_bias``,
# ``router_losses='per_layer'``).
SMOKE_MOE = {
    "accept_causal_leak": False,
    "activation": "gated_gelu",
    "capacity": {
        "capacity_order": "auto",
        "capacity_rule": "t5x",
        "dropless": False,
        "eval_capacity_factor": 2.0,
        "expert_capacity": None,
        "group_by_sequence": False,
        "group_size": 256,
        "min_expert_capacity": 4,
        "train_capacity_factor": 1.25,
    },
    "d_ff": 64,
    "execution": {
        "data_axis": "data",
        "dispatch": "auto",
        "expert_axis": "expert",
        "gather_gradients": None,
        "grouped_matmul": "auto",
        "model_axis": "model",
        "per_expert_loop": None,
        "scatter_rows": None,
    },
    "expert_dropout_rate": 0.0,
    "expert_granularity": 1,
    "losses": {
        "balance_scope": "batch",
        "entropy_loss_weight": 0.0,
        "importance_loss_weight": 0.0,
        "load_balancing_loss_weight": 0.01,
        "load_loss_weight": 0.0,
        "router_losses": "per_layer",
        "router_z_loss_weight": 0.0001,
    },
    "num_experts": 4,
    "num_shared_experts": 0,
    "router": {
        "type": "top_k",
        "batch_prioritized_routing": False,
        "bias_update_rate": 0.0,
        "init_stddev": 0.02,
        "jitter_noise": 0.0,
        "max_groups_per_token": 0,
        "num_limited_groups": None,
        "num_selected_experts": 2,
        "renormalize_gates": False,
        "router_bias": False,
        "score_function": "softmax",
    },
    "shared_expert_d_ff": None,
}


def _model(files: list[str]):
    flags = [f if f.startswith("--") else f"--gin_file={f}" for f in files]
    gin_utils.parse_gin(gin_flags.parse_flags(builders.build_parser("test", "test"), flags))
    try:
        return gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    finally:
        gin.clear_config()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flops_per_example_pinned(name):
    files, training, forward = CONFIGS[name]
    model = _model(files)
    assert model.flops_per_example(SHAPES) == training
    assert model.flops_per_example(SHAPES, training=False) == forward


def test_export_config_and_compile_choices_pinned():
    model = _model(CONFIGS["smoke"][0])
    t5 = export_format.architecture(model)["t5_config"]
    assert t5["decoder_moe"] is None and t5["moe"] == SMOKE_MOE
    assert T5Config.from_dict(t5).moe == model.module.config.moe
    config = model.module.config
    assert aot.layer_choices("cpu", "float32", config) == {
        "platform": "cpu",
        "dispatch": "sort",
        "per_expert_loop": True,
        "implementation": "sort",
        "choice_major_combine": False,
        "exchange": "local",
        "grouped_matmul": False,
        "gather_gradients": False,
        "scatter_rows": False,
        "gather_in_kernel": False,
    }
    tpu = aot.layer_choices("tpu", "bfloat16", config)
    assert tpu == {
        "platform": "tpu",
        "dispatch": "sort",
        "per_expert_loop": False,
        "implementation": "sort",
        "choice_major_combine": True,
        "exchange": "local",
        "grouped_matmul": False,
        "gather_gradients": False,
        "scatter_rows": True,
        "gather_in_kernel": False,
    }
    # a decoder config of its own: its plan under "decoder", the encoder's keys unchanged
    decoder_moe = dataclasses.replace(
        config.moe, execution=ExecutionConfig(dispatch="einsum", per_expert_loop=True)
    )
    assert aot.layer_choices(
        "tpu", "bfloat16", dataclasses.replace(config, decoder_moe=decoder_moe)
    ) == {
        **tpu,
        "decoder": {
            "platform": "tpu",
            "dispatch": "einsum",
            "per_expert_loop": True,
            "implementation": "einsum",
            "choice_major_combine": False,
            "exchange": "local",
            "grouped_matmul": False,
            "gather_gradients": False,
            "scatter_rows": False,
            "gather_in_kernel": False,
        },
    }
    same = dataclasses.replace(config, decoder_moe=config.moe)
    assert aot.layer_choices("tpu", "bfloat16", same) == tpu
