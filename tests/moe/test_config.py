"""``MoeConfig`` and the router configs: an option a router does not have cannot be written
(gin names the file and line, construction names the option and the router), every option
reaches its router, the configs survive serialisation, and a ``MoeLayer.*`` binding is
refused with the names that replace it."""

from __future__ import annotations

import pathlib

import gin
import pytest

from moe_jax.models.t5 import T5Config
from moe_jax.moe import config as moe_config
from moe_jax.moe import options
from moe_jax.moe.config import (
    CapacityConfig,
    ExpertChoiceRouterConfig,
    HashRouterConfig,
    MoeConfig,
    NoisyTopKRouterConfig,
    TopKRouterConfig,
)
from moe_jax.runtime import builders, gin_flags, gin_text, gin_utils
from tests.moe.moe_testlib import MODEL_FILE_REFERENCES

ROUTERS = pathlib.Path(__file__).resolve().parents[2] / "gin" / "routers"
# (router config, option, value): options those routers do not have.
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
    assert MODEL_FILE_REFERENCES.items() <= bindings.items()


def test_an_old_moelayer_binding_in_a_gin_file_is_refused_with_the_new_names(tmp_path):
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", "--gin.MoeLayer.jitter_noise=0.1"],
    )
    with pytest.raises(
        gin_text.GinConfigError, match=r"(?s)'MoeLayer'.*MoeConfig\.\*, <Router>Config"
    ):
        gin_utils.parse_gin(args)
    # in a file: one line naming the file, line and binding
    path = tmp_path / "study.gin"
    path.write_text("# the study\nMoeLayer.jitter_noise = 0.1\n")
    args = gin_flags.parse_flags(
        builders.build_parser("test", "test"),
        ["--gin_file=runs/smoke_cpu.gin", f"--gin_file={path}"],
    )
    with pytest.raises(gin_text.GinConfigError) as err:
        gin_utils.parse_gin(args)
    assert str(err.value) == (
        f"gin: {path}, line 2: `MoeLayer.jitter_noise = 0.1`: no configurable 'MoeLayer' in "
        "this version (MoeLayer takes no gin bindings: the MoE settings are MoeConfig.*, "
        "<Router>Config.*, CapacityConfig.*, ExecutionConfig.*, AuxLossConfig.*; docs/moe.md)"
    )
