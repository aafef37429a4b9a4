"""`moe-jax upcycle` (sparse upcycling) on the tiny smoke config: the upcycled MoE model
computes the dense model's outputs at step 0, the dense run is only read, bad input is one
line naming the option, and `moe-jax train` continues the upcycled run."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.commands import train, upcycle
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.runtime import builders, checkpoints, configured, gin_flags, gin_utils
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import RunSpec

TINY = [
    "--gin_file=runs/smoke_cpu.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
    "--gin.TRAIN_STEPS=4",
    "--gin.train_script.train.checkpoint_period=2",
    "--gin.train_script.train.eval_period=0",
]
# Gates summing to 1 and no token dropped: the upcycled layer is its dense MLP.
EXACT = ["--gin.TopKRouterConfig.renormalize_gates=True", "--gin.CapacityConfig.dropless=True"]
SHAPES = {"encoder_input_tokens": (8, 32), "decoder_input_tokens": (8, 8)}


def _parse(*flags: str):
    gin_utils.parse_gin(
        gin_flags.parse_flags(builders.build_parser("test", "test"), [*TINY, *flags])
    )


def _dense_run(model_dir: pathlib.Path, step: int = 7):
    """A dense run's checkpoint at ``step`` (initialised weights; no training needed)."""
    _parse("--gin.NUM_SPARSE_LAYERS=0", f"--gin.MODEL_DIR={model_dir}")
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    state = configured.train_setup(model, SHAPES, configured.run_context(), seed=3).init_state()
    state = state.replace(step=jnp.asarray(step, jnp.int32))
    ckpt = checkpoints.Checkpointer(RunDir(model_dir), async_save=False)
    ckpt.save(state, {"data_iterators": [], "random_seed": 3}, force=True)
    ckpt.close()
    return model, jax.device_get(state.params)


def _batch():
    rng = np.random.default_rng(0)
    tokens = lambda n: jnp.asarray(rng.integers(2, 300, (8, n)), jnp.int32)  # noqa: E731
    return {
        "encoder_input_tokens": tokens(32),
        "decoder_input_tokens": tokens(8),
        "decoder_target_tokens": tokens(8),
    }


def _logits(model, params, batch):
    """The model's logits, jitted (op by op, the MoE model takes seconds per call)."""

    def forward(params, batch):
        return model.module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            batch["decoder_target_tokens"],
            enable_dropout=False,
            mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION],
        )[0]

    return jax.jit(forward)(params, batch)


def _files(path: pathlib.Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")}


def _upcycled(tmp_path: pathlib.Path, *flags: str):
    """``(model, state, meta)`` of the MoE run upcycled (``flags``) into ``tmp_path/moe`` from
    the dense run in ``tmp_path/dense``."""
    out = tmp_path / "moe"
    assert upcycle.main([*TINY, *flags, f"--checkpoint={tmp_path / 'dense'}", f"--out={out}"]) == 0
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    target = configured.train_setup(model, SHAPES, configured.run_context()).abstract_state
    ckpt = checkpoints.Checkpointer(RunDir(out), read_only=True)
    state, meta = ckpt.restore(ckpt.latest_step(), target)
    ckpt.close()
    return model, state, meta


@pytest.mark.parametrize(
    "router",
    [
        pytest.param([], id="softmax"),
        pytest.param(["--gin_file=routers/sigmoid.gin"], id="sigmoid", marks=pytest.mark.slow),
    ],
)
def test_upcycled_model_equals_the_dense_model_at_step_zero(tmp_path, router):
    """Top-2 softmax scores with renormalised gates, and sigmoid scores (routers/sigmoid.gin,
    selected gates normalised to sum to 1): every expert is the dense MLP and the gates sum
    to 1, so the upcycled model is the dense model."""
    dense_model, dense_params = _dense_run(tmp_path / "dense")
    before = _files(tmp_path / "dense")
    model, state, meta = _upcycled(tmp_path, *EXACT, *router)
    assert _files(tmp_path / "dense") == before  # the dense run is only read
    assert (tmp_path / "moe" / "config.gin").exists()
    assert int(state.step) == 7 and "upcycled_from" in meta
    experts = state.params["encoder"]["layers_1"]["ffn"]["moe"]["expert"]["wi_0"]
    np.testing.assert_array_equal(
        experts[2], dense_params["encoder"]["layers_1"]["ffn"]["mlp"]["wi_0"]
    )
    batch = _batch()
    np.testing.assert_allclose(
        _logits(model, state.params, batch),
        _logits(dense_model, dense_params, batch),
        rtol=1e-5,
        atol=1e-5,
    )


FINE = ["--gin_file=routers/fine_grained.gin", *EXACT]


def test_upcycle_writes_a_config_that_keeps_every_token_unless_told(tmp_path, capsys):
    """As the README: renormalised gates and the gin files' capacity factors. The written
    config.gin binds dropless (said on stderr), so the upcycled run as configured computes
    the dense model's outputs; with --keep_capacity the capacity stays, a warning names it,
    and the upcycled model drops tokens, so its outputs differ."""
    dense_model, dense_params = _dense_run(tmp_path / "dense")
    batch = _batch()
    dense_logits = np.asarray(_logits(dense_model, dense_params, batch))
    renormalized = "--gin_file=routers/renormalized.gin"
    model, state, _ = _upcycled(tmp_path, renormalized)
    err = capsys.readouterr().err
    assert "CapacityConfig.dropless = True" in (tmp_path / "moe" / "config.gin").read_text()
    # its run.json is the run the config describes, which its first train compares with
    spec = RunSpec.from_json((tmp_path / "moe" / "run.json").read_text())
    assert spec.model.network.moe.capacity.dropless and spec.model.network.moe.num_experts == 4
    assert "binds CapacityConfig.dropless = True" in err and "warning" not in err, err
    np.testing.assert_allclose(
        _logits(model, state.params, batch), dense_logits, rtol=1e-5, atol=1e-5
    )

    out = tmp_path / "kept"
    assert (
        upcycle.main(
            [
                *TINY,
                renormalized,
                "--gin.CapacityConfig.eval_capacity_factor=0.5",
                "--keep_capacity",
                f"--checkpoint={tmp_path / 'dense'}",
                f"--out={out}",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "CapacityConfig.dropless = True" not in (out / "config.gin").read_text()
    assert re.search(
        r"warning: .*CapacityConfig.dropless=False with train/eval capacity factors 1.25 / 0.5", err
    ), err
    model = gin_utils.gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    ckpt = checkpoints.Checkpointer(RunDir(out), read_only=True)
    state, _ = ckpt.restore(
        ckpt.latest_step(),
        configured.train_setup(model, SHAPES, configured.run_context()).abstract_state,
    )
    ckpt.close()
    assert np.abs(np.asarray(_logits(model, state.params, batch)) - dense_logits).max() > 1e-3


def test_upcycle_warns_naming_the_gates_option_when_they_do_not_sum_to_one(tmp_path, capsys):
    _dense_run(tmp_path / "dense")
    _upcycled(tmp_path)  # top-2 softmax gates, not renormalised
    err = capsys.readouterr().err
    assert re.search(r"warning: .*TopKRouterConfig.renormalize_gates=False", err), err


@pytest.mark.slow
def test_fine_grained_upcycle_splits_the_dense_mlp_and_equals_it_at_step_zero(tmp_path):
    """Granularity 4 (routers/fine_grained.gin): 16 experts of 16 hidden units, top-8. Expert
    e * 4 + j is segment j of the dense hidden units (wo scaled by 4), the router's columns
    are tied per group of 4, and the upcycled model computes the dense model's outputs."""
    dense_model, dense_params = _dense_run(tmp_path / "dense")
    model, state, _ = _upcycled(tmp_path, *FINE)
    params = state.params
    moe = params["decoder"]["layers_1"]["ffn"]["moe"]
    mlp = dense_params["decoder"]["layers_1"]["ffn"]["mlp"]
    assert moe["expert"]["wi_0"].shape == (16, 32, 16)
    for e, j in ((0, 0), (1, 3), (3, 2)):
        np.testing.assert_array_equal(
            moe["expert"]["wi_1"][e * 4 + j], mlp["wi_1"][:, j * 16 : (j + 1) * 16]
        )
        np.testing.assert_array_equal(
            moe["expert"]["wo"][e * 4 + j], 4 * mlp["wo"][j * 16 : (j + 1) * 16]
        )
    router = np.asarray(moe["router"]["weights"]["w"]).reshape(32, 4, 4)
    np.testing.assert_array_equal(router, np.broadcast_to(router[..., :1], router.shape))
    assert np.ptp(router[:, :, 0], axis=1).min() > 0  # the 4 groups differ
    batch = _batch()
    np.testing.assert_allclose(
        _logits(model, params, batch),
        _logits(dense_model, dense_params, batch),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "router, exact",
    [
        (["--gin.MoeConfig.router=@HashRouterConfig()"], True),
        (["--gin_file=routers/sigmoid.gin"], True),
        (["--gin.MoeConfig.router=@RandomRouterConfig()"], False),
    ],
    ids=["hash", "sigmoid", "random"],
)
def test_fine_grained_upcycle_is_exact_when_each_segment_gets_1_over_m_of_the_gates(
    tmp_path, router, exact
):
    """``hash`` picks m k = 8 consecutive experts of 16 with gates 1/8, so every segment index
    is picked twice (gate mass 1/4 each) and the dense MLP is recovered; sigmoid scores read
    the tied router columns, so whole virtual groups are selected and their normalised gates
    give each segment index 1/4; ``random`` (its own untied matrix) picks segments unevenly
    and is not exact (module docstring)."""
    dense_model, dense_params = _dense_run(tmp_path / "dense")
    model, state, _ = _upcycled(tmp_path, *FINE, *router)
    params = state.params
    batch = _batch()
    gap = np.abs(
        np.asarray(_logits(model, params, batch))
        - np.asarray(_logits(dense_model, dense_params, batch))
    )
    assert (gap.max() < 1e-5) if exact else (gap.max() > 1e-3), gap.max()


def test_fine_grained_noise_breaks_the_copies_by_its_fraction_of_each_weights_std():
    """``--noise_std`` with granularity 4: each expert is its segment plus noise of
    ``noise_std`` x the std of the (scaled) segments, independent per expert, so the copies
    of one segment in different virtual groups differ; no noise gives exact copies."""
    from moe_jax.moe.upcycle import dense_segments, upcycle_params

    rng = np.random.default_rng(0)
    dense = {
        "enc/ffn/mlp/wi": rng.normal(size=(8, 64)).astype(np.float32),
        "enc/ffn/mlp/wo": rng.normal(size=(64, 8)).astype(np.float32),
    }
    moe_init = {
        "enc": {
            "ffn": {"moe": {"expert": {"wi": jnp.zeros((16, 8, 16)), "wo": jnp.zeros((16, 16, 8))}}}
        }
    }
    exact = upcycle_params(dense, moe_init, granularity=4)["enc"]["ffn"]["moe"]["expert"]
    noisy = upcycle_params(
        dense, moe_init, granularity=4, noise_std=0.05, rng=jax.random.PRNGKey(1)
    )["enc"]["ffn"]["moe"]["expert"]
    for name in ("wi", "wo"):
        segments = dense_segments(jnp.asarray(dense[f"enc/ffn/mlp/{name}"]), 4, output=name == "wo")
        np.testing.assert_array_equal(exact[name][4 + 2], segments[2])  # group 1, segment 2
        noise = np.asarray(noisy[name] - exact[name])
        assert abs(noise.std() / float(jnp.std(segments)) - 0.05) < 0.005, (name, noise.std())
        assert np.abs(noise[2] - noise[4 + 2]).min() > 0  # the copies of segment 2 differ


def test_bad_upcycle_input_is_one_line_naming_the_option(tmp_path, capsys):
    _dense_run(tmp_path / "dense")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        ([f"--out={tmp_path / 'full'}"], "--out="),
        ([f"--out={tmp_path / 'a'}", "--gin.MLP_DIM=32"], "wi_0: dense"),
        # granularity 2 of an MoE d_ff of 128: experts of 64 hidden units, but 1/2 of the dense 64
        # is 32
        (
            [
                f"--out={tmp_path / 'b'}",
                "--gin.MoeConfig.expert_granularity=2",
                "--gin.MoeConfig.d_ff=128",
            ],
            r"wi_0: dense .*expert_granularity=2",
        ),
    ]
    for flags, message in cases:
        assert upcycle.main([*TINY, f"--checkpoint={tmp_path / 'dense'}", *flags]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert (
        upcycle.main([*TINY, f"--checkpoint={tmp_path / 'none'}", f"--out={tmp_path / 'c'}"]) == 1
    )
    assert "--checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_train_continues_an_upcycled_run(tmp_path):
    _dense_run(tmp_path / "dense", step=2)
    out = tmp_path / "moe"
    assert upcycle.main([*TINY, f"--checkpoint={tmp_path / 'dense'}", f"--out={out}"]) == 0
    _parse(
        f"--gin_file={out / 'config.gin'}"
    )  # as the README: the upcycled run's config (dropless)
    result = train.train()
    assert sorted(result["losses"]) == [3, 4] and np.isfinite(list(result["losses"].values())).all()
