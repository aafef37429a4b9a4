"""Scanned layers (``T5Config.scan_layers``): which layers a scan covers; with the same
(converted) parameters a scanned and an unrolled model give the same loss, metrics per
layer, gradients, state updates, per-token routing and decoded tokens; trees convert
between the two forms and back; checkpoints of either form restore into a model of the
other, optimizer state and state collections included."""

from __future__ import annotations

import functools
import os

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec

from moe_jax import param_paths, storage
from moe_jax.analysis import counterfactual, languages
from moe_jax.commands import evaluate
from moe_jax.interop import export_format
from moe_jax.models import layer_stacking
from moe_jax.models.model import EncoderDecoderModel
from moe_jax.models.t5 import EncoderDecoder, layer_groups
from moe_jax.moe.config import (
    AuxLossConfig,
    CapacityConfig,
    MoeConfig,
    RandomRouterConfig,
    TopKRouterConfig,
)
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    router_init,
    routing,
    train_state,
)
from moe_jax.runtime.checkpoint_checks import param_shapes, write_integrity
from moe_jax.runtime.run_dir import RunDir
from tests.models.conftest import random_batch, tiny_config

SHAPES = {"encoder_input_tokens": (8, 8), "decoder_input_tokens": (8, 6)}
# 4 + 4 layers; MoE: layers 1 and 3 of each stack, so both stacks are (dense, MoE) x 2
MOE = MoeConfig(
    num_experts=4,
    d_ff=32,
    activation="gated_gelu",
    router=TopKRouterConfig(bias_update_rate=0.01),  # a state collection: router_bias
    capacity=CapacityConfig(group_size=8),
)


def _model(scan: bool, moe: bool) -> EncoderDecoderModel:
    sparse = dict(num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, moe=MOE) if moe else {}
    config = tiny_config(
        num_encoder_layers=4,
        num_decoder_layers=4,
        scan_layers=scan,
        scan_min_layers=2,
        **sparse,
    )
    return EncoderDecoderModel(EncoderDecoder(config), z_loss=1e-4)


def _close(a, b, rtol=1e-5, atol=1e-6) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def test_layer_groups_scan_the_repeated_blocks():
    dense, sparse = "D", "S"
    assert layer_groups([dense, dense, dense, sparse] * 3) == ((0, 4, 3),)  # Base, mixed
    assert layer_groups([sparse] * 3 + [dense] * 9) == ((0, 1, 3), (3, 1, 9))  # bottom
    assert layer_groups([dense, dense, sparse] * 3 + [dense]) == ((0, 3, 3), (9, 1, 1))
    assert layer_groups([dense, sparse]) == ((0, 1, 1), (1, 1, 1))  # nothing repeats
    assert layer_groups([dense] * 4, min_layers=6) == tuple((i, 1, 1) for i in range(4))
    base = tiny_config(
        num_encoder_layers=12, num_decoder_layers=12, num_sparse_encoder_layers=3, scan_layers=True
    )
    assert base.layer_groups("encoder") == ((0, 4, 3),) and base.layer_groups("decoder") == (
        (0, 1, 12),
    )
    assert tiny_config(scan_layers=True).layer_groups("encoder") == (
        (0, 1, 1),
        (1, 1, 1),
    )  # too few
    unrolled = tiny_config(num_encoder_layers=12).layer_groups("encoder")  # the default
    assert unrolled == tuple((i, 1, 1) for i in range(12))
    # a router salted by its module path: its layers stay unrolled, the dense runs scan
    salted = tiny_config(
        num_encoder_layers=8,
        num_sparse_encoder_layers=2,
        scan_layers=True,
        scan_min_layers=2,
        moe=MoeConfig(num_experts=4, d_ff=32, router=RandomRouterConfig()),
    )
    assert salted.layer_groups("encoder") == ((0, 1, 3), (3, 1, 1), (4, 1, 3), (7, 1, 1))


@functools.cache
def _pair(moe: bool):
    """(scanned model, unrolled model, scanned variables, the same converted)."""
    scanned, unrolled = _model(True, moe), _model(False, moe)
    variables = nn.unbox(scanned.get_initial_variables(jax.random.key(0), SHAPES))
    return scanned, unrolled, variables, scanned.per_layer(variables)


@pytest.mark.parametrize(
    "moe", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "moe"]
)
def test_scanned_model_has_the_unrolled_parameters_stacked(moe):
    scanned, unrolled, variables, converted = _pair(moe)
    boxed = scanned.get_initial_variables(jax.random.key(0), SHAPES)
    fresh = nn.unbox(unrolled.get_initial_variables(jax.random.key(0), SHAPES))
    # the same names and shapes once unstacked, so the same parameter count and FLOPs
    assert jax.tree.map(np.shape, converted) == jax.tree.map(np.shape, fresh)
    assert scanned.num_params(variables["params"]) == unrolled.num_params(fresh["params"])
    assert scanned.flops_per_example(SHAPES) == unrolled.flops_per_example(SHAPES)
    # every stacked parameter carries the 'layers' logical axis first
    specs = {
        param_paths.path_name(path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(
            nn.get_partition_spec(boxed["params"]),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )[0]
    }
    stacked = {n: s for n, s in specs.items() if "/scan_0/" in n}
    assert stacked and all(s[0] == "layers" for s in stacked.values())
    assert all("layers" not in s for n, s in specs.items() if n not in stacked)
    position = "layers_1_3" if moe else "layers_0_1_2_3"
    assert f"encoder/scan_0/{position}/self_attention/attention/query" in stacked
    # converting back (the layout the model's config gives) gives the scanned tree
    again = scanned.own_layout(converted)
    assert jax.tree.structure(again) == jax.tree.structure(variables)
    _close(again, variables, rtol=0, atol=0)


def _random_draws(jaxpr) -> int:
    """How many random-bits operations ``jaxpr`` holds, a loop's body counted once (the
    size of the program to compile, not the arrays it draws)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("random_bits", "threefry2x32")
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                count += _random_draws(inner) if hasattr(inner, "eqns") else 0
    return count


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_seed_initialises_both_layer_forms_alike_with_one_program_per_block(moe):
    scanned, unrolled, _, converted = _pair(moe)
    boxed = unrolled.get_initial_variables(jax.random.key(0), SHAPES)
    # the same values, bit for bit, and the unrolled form's logical axis names
    assert jax.tree.structure(converted) == jax.tree.structure(nn.unbox(boxed))
    _close(nn.unbox(boxed), converted, rtol=0, atol=0)
    specs = jax.tree.leaves(
        nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    assert specs and all(layer_stacking.LAYERS_AXIS not in spec for spec in specs)
    # the unrolled layers are initialised by the scanned block's program, drawn once per
    # block position, where the unrolled network's own init draws once per layer
    key = jax.random.key(0)
    tokens = [
        jax.numpy.ones(SHAPES[k], jax.numpy.int32)
        for k in ("encoder_input_tokens", "decoder_input_tokens")
    ]
    own = jax.make_jaxpr(lambda k: unrolled.module.init(k, *tokens, tokens[1]))(key)
    draws = {
        form: _random_draws(model.init_program(SHAPES, jax.typeof(key)).jaxpr.jaxpr)
        for form, model in (("scanned", scanned), ("unrolled", unrolled))
    }
    assert draws["unrolled"] == draws["scanned"] < _random_draws(own.jaxpr) / 1.5


@pytest.mark.parametrize(
    "moe", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "moe"]
)
def test_scanned_model_gives_the_unrolled_loss_gradients_and_state(moe):
    scanned, unrolled, variables, converted = _pair(moe)
    batch = random_batch(1, *SHAPES["encoder_input_tokens"], SHAPES["decoder_input_tokens"][1])

    def step(model, v):  # training mode (train capacity, bias updates); dropout rate 0
        state = {k: x for k, x in v.items() if k != "params"}
        fn = jax.value_and_grad(model.train_loss_fn, has_aux=True)
        return jax.jit(fn)(v["params"], state, batch, jax.random.key(2))

    (loss, (metrics, new_state)), grads = step(scanned, variables)
    (ref_loss, (ref_metrics, ref_state)), ref_grads = step(unrolled, converted)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert set(metrics) == set(ref_metrics)  # per layer: moe/encoder/layers_1/...
    assert any("/layers_3/" in name for name in metrics) == moe
    _close(metrics, ref_metrics)
    _close(scanned.per_layer(grads), ref_grads, rtol=1e-4, atol=1e-7)
    _close(scanned.per_layer(new_state), ref_state)
    if moe:  # the bias moved, per layer as unrolled
        moved = jax.tree.map(np.allclose, new_state["router_bias"], variables["router_bias"])
        assert not any(jax.tree.leaves(moved))
    # eval metrics and greedy decoding (each jitted: one compile instead of one per op)
    state = {k: x for k, x in variables.items() if k != "params"}
    ref_state = scanned.per_layer(state)
    _close(
        jax.jit(scanned.eval_fn)(variables["params"], batch, state),
        jax.jit(unrolled.eval_fn)(converted["params"], batch, ref_state),
    )

    def predict(model, params, state):
        return jax.jit(lambda p, s: model.predict_batch(p, batch, state=s))(params, state)

    np.testing.assert_array_equal(
        predict(scanned, variables["params"], state),
        predict(unrolled, converted["params"], ref_state),
    )


def test_hf_stack_router_losses_of_a_scanned_model_are_the_unrolled_ones():
    """``router_losses='hf_stack'``: each stack's losses come from its sparse layers' sums,
    read per layer from a scan's stacked collection as from unrolled layers."""
    moe = MoeConfig(
        num_experts=4,
        d_ff=32,
        activation="relu",
        router=TopKRouterConfig(num_selected_experts=1),
        capacity=CapacityConfig(group_size=8),
        losses=AuxLossConfig(router_losses="hf_stack"),
    )
    models = [
        EncoderDecoderModel(
            EncoderDecoder(
                tiny_config(
                    num_encoder_layers=4,
                    num_decoder_layers=4,
                    num_sparse_encoder_layers=2,
                    num_sparse_decoder_layers=2,
                    scan_layers=scan,
                    scan_min_layers=2,
                    moe=moe,
                )
            )
        )
        for scan in (True, False)
    ]
    variables = nn.unbox(models[0].get_initial_variables(jax.random.key(0), SHAPES))
    batch = random_batch(1, *SHAPES["encoder_input_tokens"], SHAPES["decoder_input_tokens"][1])
    unstacked = layer_stacking.unstack_layers(variables)["params"]
    scanned = jax.jit(models[0].eval_fn)(variables["params"], batch)
    unrolled = jax.jit(models[1].eval_fn)(unstacked, batch)
    names = [
        f"{s}_{n}" for s in ("encoder", "decoder") for n in ("router_z_loss", "load_balancing_loss")
    ]
    assert all(float(scanned[name]) > 0 for name in names)
    _close({n: scanned[n] for n in names}, {n: unrolled[n] for n in names})
    weights = moe.losses
    expected = sum(
        weights.router_z_loss_weight * scanned[f"{s}_router_z_loss"]
        + weights.load_balancing_loss_weight * scanned[f"{s}_load_balancing_loss"]
        for s in ("encoder", "decoder")
    )
    np.testing.assert_allclose(scanned["aux_loss"], expected, rtol=1e-6)


def test_routing_of_a_scanned_model_is_per_layer_as_unrolled():
    """The per-token routing that analyses and the churn probe read (runtime/routing.py)."""
    scanned, unrolled, variables, converted = _pair(True)
    batch = random_batch(3, *SHAPES["encoder_input_tokens"], SHAPES["decoder_input_tokens"][1])
    ctx = configured.run_context()
    found = []
    for model, v in ((scanned, variables), (unrolled, converted)):
        shardings = train_state.param_shardings(model, SHAPES, ctx.mesh, ctx.rules)
        state_shardings = builders.collections_shardings(model, SHAPES, ctx)
        fn = routing.routing_fn(
            model, shardings, ctx.mesh, ctx.rules, ctx.batch_axes, state_shardings
        )
        params = jax.device_put(v["params"], shardings)
        state = jax.device_put({"router_bias": v["router_bias"]}, state_shardings)
        found.append(
            routing.collect_routing(fn, params, [builders.global_batch(batch, ctx)], state)
        )
    layers, ref = found
    assert (
        list(layers)
        == list(ref)
        == [
            "encoder/layers_1",
            "encoder/layers_3",
            "decoder/layers_1",
            "decoder/layers_3",
        ]
    )
    for name, layer in layers.items():
        np.testing.assert_array_equal(layer.expert_index, ref[name].expert_index)
        np.testing.assert_allclose(layer.router_probs, ref[name].router_probs, rtol=1e-5)


def test_names_and_leaves_convert_per_layer():
    named = {"encoder/scan_0/layers_1_3/ffn/w": np.arange(6.0).reshape(2, 3), "x/y": np.ones(2)}
    assert layer_stacking.layer_names("encoder/scan_0/layers_1_3/ffn/w") == [
        "encoder/layers_1/ffn/w",
        "encoder/layers_3/ffn/w",
    ]
    per_layer = layer_stacking.unstack_names(named)
    np.testing.assert_array_equal(per_layer["encoder/layers_3/ffn/w"], [3.0, 4.0, 5.0])
    assert set(per_layer) == {"encoder/layers_1/ffn/w", "encoder/layers_3/ffn/w", "x/y"}
    # Adafactor's (1,) placeholders are the same in both forms
    tree = {"encoder": {"scan_0": {"layers_0_1": {"v": np.zeros((2, 5)), "v_row": np.zeros(1)}}}}
    flat = layer_stacking.unstack_layers(tree)
    assert jax.tree.map(np.shape, flat) == {
        "encoder": {"layers_0": {"v": (5,), "v_row": (1,)}, "layers_1": {"v": (5,), "v_row": (1,)}}
    }
    back = layer_stacking.stack_layers(flat, layer_stacking.tree_layout(tree))
    assert jax.tree.map(np.shape, back) == jax.tree.map(np.shape, tree)


def _saved_names(step_dir: str, item: str) -> list[str]:
    """The leaf names of an orbax item of a checkpoint step, as its metadata lists them."""
    metadata = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, item))
    return list(param_paths.named_leaves(metadata.item_metadata.tree))


def _save_stacked(run_dir: RunDir, state: train_state.TrainState) -> None:
    """Step 0 of ``run_dir`` as scanned runs wrote checkpoints before every checkpoint was
    per layer: each item in the scanned model's own layout."""
    item = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    manager = ocp.CheckpointManager(run_dir.checkpoints_dir)
    try:
        manager.save(
            0,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params),
                train=ocp.args.StandardSave({**item, "collections": state.collections}),
                meta=ocp.args.JsonSave(
                    {"data_iterators": [], "step": 0, "params": param_shapes(state.params)}
                ),
            ),
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    write_integrity(run_dir.step_dir(0))


def _check_restores(run_dir: RunDir, target: EncoderDecoderModel, expected) -> None:
    """``train``'s restore and the eval/infer/analyze one of ``run_dir``'s step 0 into
    ``target`` give ``expected`` (per layer) in ``target``'s layout and shardings."""
    ctx = configured.run_context()
    abstract = configured.train_setup(target, SHAPES, ctx).abstract_state
    reader = checkpoints.Checkpointer(run_dir, read_only=True)
    restored, _ = reader.restore(0, abstract)
    reader.close()
    assert jax.tree.structure(restored) == jax.tree.structure(abstract)
    jax.tree.map(
        lambda a, t: a.sharding.is_equivalent_to(t.sharding, a.ndim) or pytest.fail(str(t)),
        restored,
        abstract,
    )
    _close(target.per_layer(restored), expected, rtol=0, atol=0)
    model = builders.restore_model(run_dir.path, target, SHAPES, ctx)
    _close(target.per_layer(model.params), expected.params, rtol=0, atol=0)
    _close(target.per_layer(model.collections), expected.collections, rtol=0, atol=0)


@pytest.mark.parametrize(
    "saved_scanned",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["scanned_saved", "unrolled_saved"],
)
def test_checkpoints_are_per_layer_and_restore_into_either_form(tmp_path, saved_scanned):
    """Train state (Adafactor: factored moments and (1,) placeholders), parameters and the
    router_bias collection are written per layer whatever the run's form (the orbax items'
    own metadata, and the checkpoint's parameter list), and restore through `train`'s
    restore and the eval/infer/analyze one into a model of either form."""
    ctx = configured.run_context()
    source, other = _model(saved_scanned, True), _model(not saved_scanned, True)
    state = configured.train_setup(source, SHAPES, ctx).init_state()
    run_dir = RunDir(str(tmp_path))
    writer = checkpoints.Checkpointer(run_dir, async_save=False)
    writer.save(state, {"data_iterators": []}, force=True)
    writer.wait_until_finished()
    meta = writer.read_meta(0)
    writer.close()
    expected = source.per_layer(state)
    per_layer = param_paths.named_leaves(expected.params)
    assert (
        _saved_names(run_dir.step_dir(0), "params") == sorted(per_layer) == sorted(meta["params"])
    )
    train_names = _saved_names(run_dir.step_dir(0), "train")
    assert "opt_state/0/v_row/encoder/layers_3/ffn/moe/expert/wi_0" in train_names
    assert "collections/router_bias/encoder/layers_3/ffn/moe/router/bias" in train_names
    assert not [n for n in train_names if "scan_" in n]
    for target in (source, other):
        _check_restores(run_dir, target, expected)


def test_an_older_stacked_checkpoint_restores_into_either_form(tmp_path):
    """Scanned runs' checkpoints written before checkpoints were per layer (parameters,
    optimizer state and collections stacked) keep restoring, into either form, and list
    their parameters per layer to what reads a checkpoint's shapes (upcycle)."""
    ctx = configured.run_context()
    scanned = _model(True, True)
    state = configured.train_setup(scanned, SHAPES, ctx).init_state()
    run_dir = RunDir(str(tmp_path))
    _save_stacked(run_dir, state)
    assert "encoder/scan_0/layers_1_3/ffn/moe/expert/wi_0" in _saved_names(
        run_dir.step_dir(0), "params"
    )
    expected = scanned.per_layer(state)
    for target in (scanned, _model(False, True)):
        _check_restores(run_dir, target, expected)
    reader = checkpoints.Checkpointer(run_dir, read_only=True)
    shapes = checkpoints.per_layer_shapes(reader.read_meta(0)["params"])
    reader.close()
    assert shapes == {n: x.shape for n, x in param_paths.named_leaves(expected.params).items()}


def test_exports_and_router_readers_see_the_layers_of_a_scanned_model(tmp_path):
    """What reads parameters by per-layer name (export and import, router drift, the
    languages analysis' router kernels, counterfactual routers) gives for a scanned model
    what it gives for the same parameters unrolled; a scanned run's older, stacked
    ``router_init.npz`` is read per layer."""
    scanned, unrolled, variables, converted = _pair(True)
    params, flat = variables["params"], converted["params"]
    arrays = export_format.arrays_for_export(scanned.per_layer(params))
    _close(arrays, export_format.arrays_for_export(flat), rtol=0, atol=0)
    abstract = scanned.per_layer(jax.eval_shape(lambda: params))
    imported = scanned.own_layout(export_format.params_from_export(arrays, abstract, "test"))
    _close(imported, params, rtol=0, atol=0)
    assert "encoder/layers_3/mlp/router/router_weights/w/kernel" in arrays
    routers = router_init.per_layer_routers(scanned, params)
    assert routers.keys() == param_paths.router_params(flat).keys()
    run_dir = RunDir(str(tmp_path))
    stacked = {k: np.asarray(v) * 0.5 for k, v in param_paths.router_params(params).items()}
    storage.save_npz(run_dir.router_init_file, stacked)  # as scanned runs wrote it
    initial = router_init.load(run_dir)
    assert initial is not None and initial.keys() == routers.keys()
    layers = ["encoder/layers_1", "encoder/layers_3", "decoder/layers_1", "decoder/layers_3"]
    drift = evaluate.router_drift(routers, initial, layers)
    assert sorted(drift) == sorted(layers) and all(v == pytest.approx(1.0) for v in drift.values())
    _close(
        languages.router_kernels(routers),
        languages.router_kernels(param_paths.router_params(flat)),
        rtol=0,
        atol=0,
    )
    for name in ("init", "random", "shuffled"):
        new, _ = counterfactual.variant(name, scanned, params, run_dir, seed=3)
        ref, _ = counterfactual.variant(name, unrolled, flat, run_dir, seed=3)
        assert jax.tree.structure(new) == jax.tree.structure(params)
        _close(scanned.per_layer(new), ref, rtol=0, atol=0)
        before = router_init.per_layer_routers(unrolled, flat)
        after = router_init.per_layer_routers(unrolled, ref)
        assert [k for k, w in after.items() if not np.allclose(w, before[k])]
