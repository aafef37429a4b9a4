"""``MoeConfig`` and the router configs: an option a router does not have cannot be written
(gin names the file and line, construction names the option and the router), every option
reaches its router, the configs survive serialisation, and old ``MoeLayer.*`` bindings
translate (options their router ignored are left out, each with a warning)."""

from __future__ import annotations

import dataclasses
import pathlib

import gin
import pytest

from moe_jax.models.t5 import T5Config
from moe_jax.moe import config as moe_config
from moe_jax.moe import legacy_gin, options
from moe_jax.moe.config import (
    CapacityConfig,
    ExpertChoiceRouterConfig,
    HashRouterConfig,
    MoeConfig,
    NoisyTopKRouterConfig,
    TopKRouterConfig,
)
from moe_jax.runtime import builders, gin_flags, gin_text, gin_utils

ROUTERS = pathlib.Path(__file__).resolve().parents[2] / "gin" / "routers"
# (router config, option): the combinations the old layer accepted and silently ignored.
IGNORED_BEFORE = [
    ("NoisyTopKRouterConfig", "jitter_noise", "0.5"),
    ("ExpertChoiceRouterConfig", "batch_prioritized_routing", "True"),
    ("HashRouterConfig", "jitter_noise", "0.5"),
    ("RandomRouterConfig", "jitter_noise", "0.5"),
    ("HierarchicalRouterConfig", "jitter_noise", "0.5"),
    ("NoisyHierarchicalRouterConfig", "jitter_noise", "0.5"),
    ("NoisyTopKRouterConfig", "renormalize_gates", "True"),
    ("ExpertChoiceRouterConfig", "renormalize_gates", "True"),
    ("HashRouterConfig", "renormalize_gates", "True"),
    ("HashRouterConfig", "batch_prioritized_routing", "True"),
]


@pytest.fixture(autouse=True)
def _fresh_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.mark.parametrize("router, option, value", IGNORED_BEFORE, ids=str)
def test_an_option_the_router_lacks_is_refused_at_parse_naming_file_line_option_router(
    tmp_path, router, option, value
):
    path = tmp_path / "study.gin"
    path.write_text(f"# the study\nMoeConfig.router = @{router}()\n{router}.{option} = {value}\n")
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", f"--gin_file={path}"],
    )
    with pytest.raises(gin_text.GinConfigError) as err:
        gin_utils.parse_gin(args)
    message = str(err.value)
    assert router in message and option in message and str(path) in message and "line 3" in message
    with pytest.raises(TypeError, match=f"{option}"):
        getattr(moe_config, router)(**{option: True})
    old_name = {"init_stddev": "router_init_stddev"}.get(option, option)
    router_type = getattr(moe_config, router).router_type
    with pytest.raises(
        legacy_gin.LegacyOptionError, match=f"MoeLayer.{old_name}: the '{router_type}' router"
    ):
        legacy_gin.config_from_fields(router_type=router_type, **{old_name: True})


@pytest.mark.parametrize("router", list(moe_config.ROUTER_CONFIGS))
def test_every_option_of_a_router_config_reaches_its_router_module(router):
    cls = moe_config.ROUTER_CONFIGS[router]
    module_fields = set(cls.module.__dataclass_fields__)
    assert set(cls().module_options()) <= module_fields, router


def test_the_router_registry_has_one_config_per_router_type():
    assert tuple(moe_config.ROUTER_CONFIGS) == options.ROUTER_TYPES
    modules = [cls.module for cls in moe_config.ROUTER_CONFIGS.values()]
    assert len(set(modules)) == len(modules)
    kinds = {
        name: (cls.token_choice, cls.hierarchical)
        for name, cls in moe_config.ROUTER_CONFIGS.items()
    }
    assert [name for name, (token_choice, _) in kinds.items() if not token_choice] == [
        "expert_choice"
    ]
    assert [name for name, (_, hierarchical) in kinds.items() if hierarchical] == [
        "hierarchical",
        "noisy_hierarchical",
    ]


def test_construction_refuses_what_the_layer_refused_naming_the_option():
    with pytest.raises(
        ValueError, match=r"CapacityConfig.dropless=True needs a token-choice router"
    ):
        MoeConfig(
            num_experts=4,
            d_ff=8,
            router=ExpertChoiceRouterConfig(),
            capacity=CapacityConfig(dropless=True),
        )
    with pytest.raises(
        ValueError, match=r"num_selected_experts=5 must be between 1 and MoeConfig.num_experts=4"
    ):
        MoeConfig(num_experts=4, d_ff=8, router=TopKRouterConfig(num_selected_experts=5))
    with pytest.raises(ValueError, match=r"TopKRouterConfig.score_function='tanh'"):
        TopKRouterConfig(score_function="tanh")
    with pytest.raises(ValueError, match=r"MoeConfig.router=.* is not a router config"):
        MoeConfig(router=CapacityConfig())
    # a decoder whose router reads later tokens is refused when the model's config is built
    with pytest.raises(
        ValueError, match=r"NoisyTopKRouterConfig.batch_prioritized_routing=True .* the decoder"
    ):
        T5Config(
            num_sparse_decoder_layers=1,
            moe=MoeConfig(router=NoisyTopKRouterConfig(batch_prioritized_routing=True)),
        )
    T5Config(
        num_sparse_encoder_layers=1,
        moe=MoeConfig(router=NoisyTopKRouterConfig(batch_prioritized_routing=True)),
    )


def test_encoder_and_decoder_configs_from_gin_scopes_and_back_from_a_dict():
    gin.parse_config_files_and_bindings(
        [str(ROUTERS / "top2.gin"), str(ROUTERS / "hash_decoder.gin")],
        [
            "T5Config.moe = @MoeConfig()",
            "MoeConfig.capacity = @CapacityConfig()",
            "MoeConfig.losses = @AuxLossConfig()",
            "MoeConfig.num_experts = 4",
            "MoeConfig.d_ff = 16",
            "CapacityConfig.group_size = 64",
        ],
    )
    config = T5Config(
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
    )
    encoder, decoder = config.moe_config("encoder"), config.moe_config("decoder")
    assert encoder.router == TopKRouterConfig(num_selected_experts=2)
    assert decoder.router == HashRouterConfig(num_selected_experts=1)
    assert (
        encoder.capacity == decoder.capacity and decoder.capacity.group_size == 64
    )  # unscoped: shared
    assert (
        encoder.losses.load_balancing_loss_weight,
        decoder.losses.load_balancing_loss_weight,
    ) == (0.01, 0.0)
    gin.clear_config()  # from_dict reads no binding
    assert T5Config.from_dict(config.to_dict()) == config
    assert moe_config.from_dict(decoder.to_dict()) == decoder


def test_old_bindings_translate_and_ignored_options_are_left_out_with_a_warning():
    text = (
        "NUM_EXPERTS = 4\nMoeLayer.num_experts = %NUM_EXPERTS\n"
        "MoeLayer.router_type = 'noisy_top_k'\nMoeLayer.jitter_noise = 0.5\n"
        "MoeLayer.renormalize_gates = False\nMoeLayer.dropless = True\n"
        "MoeLayer.causal = False\nMoeLayer.load_loss_weight = 0.1\n"
    )
    translated, warnings = legacy_gin.translate(text)
    assert "MoeLayer" not in translated.replace("# MoeLayer.*", "")
    assert warnings == [
        "MoeLayer.jitter_noise = 0.5 had no effect on the 'noisy_top_k' router; left out"
    ]
    gin.parse_config(translated)
    config = MoeConfig()
    assert config.router == NoisyTopKRouterConfig() and config.num_experts == 4
    assert config.capacity.dropless and config.losses.load_loss_weight == 0.1
    assert legacy_gin.translate("MODEL_DIR = '/x'\n") == ("MODEL_DIR = '/x'\n", [])
    flat = legacy_gin.legacy_fields(config)
    assert legacy_gin.config_from_fields(**flat) == dataclasses.replace(config)


def test_a_config_built_in_python_reads_no_binding_of_its_parts():
    """Only gin's references build a part from its bindings: a part (or ``T5Config.moe``)
    left out gets its type's defaults, whatever gin binds."""
    gin.parse_config(
        "CapacityConfig.group_size = 64\nTopKRouterConfig.num_selected_experts = 1\n"
        "MoeConfig.num_experts = 3\nAuxLossConfig.load_balancing_loss_weight = 0.5\n"
    )
    moe = MoeConfig(num_experts=4, d_ff=8)
    assert moe.capacity == CapacityConfig(group_size=4096) and moe.capacity.group_size == 4096
    assert moe.router.num_selected_experts == 2 and moe.losses.load_balancing_loss_weight == 0.01
    assert T5Config(num_sparse_encoder_layers=1).moe == moe_config.default_config()
    assert moe_config.default_config().num_experts == 8


def test_the_model_file_binds_every_part_reference():
    bindings = gin_utils.config_bindings((ROUTERS.parent / "models" / "t5_moe.gin").read_text())
    assert legacy_gin.PART_REFERENCES.items() <= bindings.items()


def test_a_config_written_before_the_part_references_builds_the_same_model():
    """A run's config.gin of the previous form (parts and ``T5Config.moe`` None, built from
    their bindings then; ``T5Config.dtype``) reads in the current form; a dense one leaves
    ``moe`` to its default, None; a config in the current form stays as it is."""
    before = (
        "MODEL/T5Config.dtype = 'bfloat16'\nMODEL/T5Config.moe = None\n"
        "MODEL/T5Config.num_sparse_encoder_layers = 1\n"
        "MODEL/MoeConfig.capacity = None\nMODEL/MoeConfig.num_experts = 4\n"
        "MODEL/MoeConfig.router = @TopKRouterConfig()\nMODEL/CapacityConfig.group_size = 64\n"
    )
    translated, warnings = legacy_gin.translate(before)
    assert warnings == [] and "MODEL/MoeConfig.capacity = @CapacityConfig()" in translated
    gin.parse_config(translated)
    with gin.config_scope("MODEL"):
        config = T5Config()
    assert config.activation_dtype_name == "bfloat16"
    assert config.moe is not None and config.moe.num_experts == 4
    assert config.moe.capacity.group_size == 64
    dense = "MODEL/T5Config.dtype = 'float32'\nMODEL/T5Config.moe = None\n"
    current = "MODEL/T5Config.activation_dtype_name = 'float32'\n"
    assert legacy_gin.translate(dense) == (current, [])  # moe: its default, None
    assert legacy_gin.translate(current + "MODEL/T5Config.moe = None\n")[0].endswith("None\n")


def test_an_old_moelayer_binding_in_a_gin_file_is_refused_with_the_new_names():
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", "--gin.MoeLayer.jitter_noise=0.1"],
    )
    with pytest.raises(
        gin_text.GinConfigError, match=r"(?s)'MoeLayer'.*MoeConfig\.\*, <Router>Config"
    ):
        gin_utils.parse_gin(args)
