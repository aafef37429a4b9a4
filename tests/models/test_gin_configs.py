"""The gin files of gin/models/: they parse, and their parameter counts match the formulas."""

from __future__ import annotations

import contextlib
import functools
import pathlib

import gin
import jax
import pytest

import moe_jax.runtime.configured  # noqa: F401  (registers MoeConfig with gin)

REPO = pathlib.Path(__file__).resolve().parents[2]
SHAPES = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}


@contextlib.contextmanager
def gin_model(*files: str, bindings: tuple[str, ...] = ()):
    """The MODEL of the gin files (its ``T5Config`` and MoE config built from them)."""
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO))
    gin.parse_config_files_and_bindings(
        [str(REPO / "gin" / "models" / f) for f in files],
        ["EncoderDecoderModel.vocabulary = 32128", *bindings],
    )
    try:
        yield gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config()


def _param_count(*files: str) -> int:
    with gin_model(*files) as model:
        init = functools.partial(model.get_initial_variables, input_shapes=SHAPES)
        return model.num_params(jax.eval_shape(init, jax.random.key(0))["params"])


def _flops_per_token(shapes, *files: str) -> float:
    with gin_model(*files) as model:
        return model.flops_per_token(shapes)


def _dense_count(vocab, d, heads, head_dim, d_ff, layers):
    attn, mlp = 4 * d * heads * head_dim, 3 * d * d_ff
    encoder = layers * (attn + mlp + 2 * d) + d + heads * 32
    decoder = layers * (2 * attn + mlp + 3 * d) + d + heads * 32
    return 2 * vocab * d + encoder + decoder


@pytest.mark.parametrize("size,d,d_ff", [("size_base.gin", 768, 2048), ("size_d32.gin", 32, 256)])
def test_paper_sizes_have_the_formula_parameter_counts(size, d, d_ff):
    dense = _dense_count(32128, d, 12, 64, d_ff, 12)
    if size == "size_base.gin":
        assert dense == 247_577_856  # T5 v1.1 base
    assert _param_count("t5_dense.gin", size) == dense
    # MoE: 3 sparse layers per stack; each swaps one gated MLP for 32 of them plus a router.
    experts, sparse_layers = 32, 6
    assert _param_count("t5_moe.gin", size) == dense + sparse_layers * (
        (experts - 1) * 3 * d * d_ff + d * experts
    )
    # FLOP-matched dense: the same 6 layers get a 2 x d_ff dense MLP.
    assert _param_count("t5_dense_flop_matched.gin", size) == dense + sparse_layers * 3 * d * d_ff


def test_flop_matched_baseline_matches_the_moe_flops_up_to_the_router():
    shapes = {"encoder_input_tokens": (1, 512), "decoder_input_tokens": (1, 114)}
    dense, matched, moe = (
        _flops_per_token(shapes, f, "size_d32.gin")
        for f in ("t5_dense.gin", "t5_dense_flop_matched.gin", "t5_moe.gin")
    )
    # The routers (d_model x E per token, 3 sparse layers per stack, x3 for training)
    # are the only difference between the MoE model and its FLOP-matched baseline.
    router = 3 * 2 * 32 * 32 * 3
    assert dense < matched < moe
    assert moe - matched == pytest.approx(router, rel=1e-6)


def test_macros_override_from_bindings():
    with gin_model("t5_moe.gin", "size_tiny.gin", bindings=("NUM_SPARSE_LAYERS = 2",)) as model:
        config = model.module.config
    assert config.sparse_layers("decoder") == (0, 1)
    assert (config.num_heads, config.head_dim, config.emb_dim) == (4, 8, 32)


@pytest.mark.parametrize("router", ["top2.gin", "switch.gin"])
def test_fine_grained_scales_the_capacity_factors_of_a_router_file_read_before_it(router):
    """routers/top2.gin (which the Figure 5 experiments include) sets the capacity factors
    through the macros, so routers/fine_grained.gin read after it multiplies them by m = 4;
    they once bound the layer's factors directly and the fine-grained runs kept 1.25 / 2.0."""
    from moe_jax.moe import MoeConfig

    files = [
        str(REPO / "gin" / d / f)
        for d, f in (("models", "t5_moe.gin"), ("routers", router), ("routers", "fine_grained.gin"))
    ]
    gin.add_config_file_search_path(str(REPO))
    try:
        for parsed, expected in (
            (files, (5.0, 8.0)),
            (files[:2], (1.25, 2.0)),
        ):  # router alone: its own
            gin.clear_config()
            gin.parse_config_files_and_bindings(parsed, [], finalize_config=False)
            capacity = MoeConfig().capacity
            assert (capacity.train_capacity_factor, capacity.eval_capacity_factor) == expected
    finally:
        gin.clear_config()
