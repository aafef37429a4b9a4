"""`moe-jax upcycle`: an MoE run directory from a dense T5 run (sparse upcycling).

    moe-jax upcycle --checkpoint=/tmp/dense_run --out=/tmp/moe_run \\
        --gin_file=experiments/fig5_learned.gin --gin_file=routers/renormalized.gin \\
        --gin_file=experiments/cpu_scale.gin
    moe-jax train --gin_file=/tmp/moe_run/config.gin --gin.TRAIN_STEPS=2000

Reads the dense run's parameters (latest step, or ``--checkpoint=DIR/STEP``), builds the MoE
model the gin files describe, starts every expert as its layer's dense MLP (with
fine-grained experts, routers/fine_grained.gin: each group of ``m`` experts as the ``m``
segments of its hidden units, the router's columns tied per group; moe_jax/moe/upcycle.py)
(``--noise_std`` adds noise), routers as the gin files say (learned / frozen, their
initialisation from the run's seed), copies every other weight, starts a fresh optimizer
state and writes ``OUT/checkpoints/<step>`` and ``OUT/config.gin`` (every binding of the
gin files, ``MODEL_DIR`` = OUT). The step is the dense run's (``--reset_step``: 0); the
data stream continues from that step. The dense run is only read. See docs/moe.md.

What it preserves: the upcycled model computes the dense model's outputs at step 0 only
when no token is dropped and each token's gates sum to 1 (:func:`step_zero_differences`).
Unless ``--keep_capacity``, a token-choice layer that would drop tokens is written dropless
(``MoeLayer.dropless = True`` in ``OUT/config.gin``, said on stderr), so the run as
configured starts as the dense model and trains dropless; with ``--keep_capacity`` the
capacity factors of the gin files stay and a warning names them. What still differs is
printed as a warning.
"""

from __future__ import annotations

import sys
from typing import Any

import gin
import jax

from moe_jax import storage
from moe_jax.train import gin_utils


def _keeps_every_token(layer: Any) -> bool:
    """Whether ``layer`` (a ``MoeLayer``) routes every assignment of a routing group at
    both capacity factors: dropless, or a capacity of the whole group."""
    from moe_jax.moe import capacity

    if layer.dropless:
        return True
    tokens = layer.group_size
    return all(capacity.expert_capacity(tokens, layer.routed_experts, layer.choices_per_token, factor,
                                        layer.min_expert_capacity, layer.capacity_rule) >= tokens
               for factor in (layer.train_capacity_factor, layer.eval_capacity_factor))


def step_zero_differences(layer: Any, noise_std: float = 0.0) -> list[str]:
    """Why the upcycled model would not compute the dense model's outputs at step 0, for the
    gin-configured ``layer`` (a ``MoeLayer``): one line per cause naming the option, empty
    when it does (moe_jax/moe/upcycle.py gives the conditions)."""
    causes = []
    if not _keeps_every_token(layer):
        causes.append(
            f"MoeLayer.dropless=False with train/eval capacity factors {layer.train_capacity_factor:g} / "
            f"{layer.eval_capacity_factor:g}: an expert takes at most its capacity of a group's tokens and "
            "the others skip the layer (all experts are the same MLP, so the router's choices are uneven); "
            "--gin.MoeLayer.dropless=True keeps every token")
    if layer.router_type == "expert_choice":
        causes.append("MoeLayer.router_type='expert_choice': experts pick tokens, so a token may get "
                      "none or several experts")
    elif (layer.router_type in ("top_k", "noisy_top_k") and layer.router_score == "softmax"
          and not layer.renormalize_gates and layer.choices_per_token < layer.routed_experts):
        causes.append("MoeLayer.renormalize_gates=False: a token's top-k softmax gates sum to less than 1 "
                      "(include routers/renormalized.gin)")
    if layer.num_shared_experts:
        causes.append(f"MoeLayer.num_shared_experts={layer.num_shared_experts}: shared experts start from "
                      "the MoE initialisation and add to the copied MLP")
    if noise_std:
        causes.append(f"--noise_std={noise_std:g} perturbs the experts")
    return causes


def make_dropless_if_needed(keep_capacity: bool) -> tuple[bool, Any]:
    """Binds ``MoeLayer.dropless = True`` (gin parsed, not finalized) when the configured
    token-choice layer would drop tokens and ``keep_capacity`` is False; returns whether it
    did and the ``MoeLayer`` as then configured."""
    from moe_jax.moe.layer import MoeLayer

    layer = MoeLayer()
    if keep_capacity or _keeps_every_token(layer) or layer.router_type == "expert_choice":
        return False, layer
    gin.bind_parameter("MoeLayer.dropless", True)
    return True, MoeLayer()


def _dense_params(path: str) -> tuple[dict[str, Any], int]:
    """``({"encoder/layers_0/...": array}, step)`` of the dense checkpoint at ``path``."""
    from moe_jax.train import checkpoints

    model_dir, step = checkpoints.split_checkpoint_path(path)
    if not storage.isdir(storage.join(model_dir, "checkpoints")):
        raise FileNotFoundError(f"upcycle: --checkpoint={path!r} holds no checkpoints")
    ckpt = checkpoints.Checkpointer(model_dir, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        shapes = ckpt.read_meta(step)["params"]
    finally:
        ckpt.close()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict[str, Any] = {}
    for name, shape in shapes.items():
        node = target
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(shape), jax.numpy.float32, sharding=device)
    params, _, step, _ = checkpoints.restore_from(f"{model_dir}/{step}", target)
    flat = {checkpoints.path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    return flat, step


def _train_argument(name: str) -> Any:
    """The gin-bound ``train_script.train`` argument ``name`` (a configurable reference or
    macro evaluated)."""
    value = gin.query_parameter(f"train_script.train.{name}")
    return value.scoped_configurable_fn() if hasattr(value, "scoped_configurable_fn") else value


def upcycle(checkpoint: str, out: str, *, noise_std: float = 0.0, reset_step: bool = False) -> dict[str, Any]:
    """Writes the upcycled MoE run to ``out`` (gin already parsed); returns its summary."""
    from moe_jax.moe.layer import MoeLayer
    from moe_jax.moe.upcycle import upcycle_params
    from moe_jax.train import checkpoints, evaluate, setup

    if storage.listdir(out):
        raise FileExistsError(f"upcycle: --out={out!r} is not empty; give a new directory")
    model = _train_argument("model")
    dataset_cfg = _train_argument("train_dataset_cfg")
    seed = int(_train_argument("random_seed"))
    if not model.module.config.has_moe:
        raise ValueError("upcycle: the gin files describe a model without MoE layers "
                         "(T5Config.num_sparse_*_layers = 0)")
    dense, dense_step = _dense_params(checkpoint)
    run = setup.build_train_setup(model, dataset_cfg.input_shapes(), setup.run_context(), seed=seed)
    state, shardings = run.init_state(), run.shardings
    params = upcycle_params(dense, jax.device_get(state.params), granularity=MoeLayer().expert_granularity,
                            noise_std=noise_std, rng=jax.random.PRNGKey(seed))
    params = jax.device_put(params, shardings.params)
    with jax.set_mesh(run.ctx.mesh):
        opt_state = jax.jit(run.tx.init, out_shardings=shardings.opt_state)(params)
    step = 0 if reset_step else dense_step
    state = state.replace(step=jax.device_put(jax.numpy.asarray(step, jax.numpy.int32), shardings.step),
                          params=params, opt_state=opt_state)
    ckpt = checkpoints.Checkpointer(out, async_save=False)
    try:
        ckpt.save(state, {"data_iterators": [], "random_seed": seed,
                          "upcycled_from": f"{checkpoint} step {dense_step}"}, force=True)
        ckpt.wait_until_finished()
    finally:
        ckpt.close()
    checkpoints.save_router_init(out, params)
    if jax.process_index() == 0:
        storage.write_text(storage.join(out, "config.gin"), gin.config_str())
        eval_cfg = _train_argument("train_eval_dataset_cfg")
        if eval_cfg is not None:
            evaluate.record_eval_settings(out, _train_argument("eval_steps"), eval_cfg)
    return {"out": out, "step": step, "dense_step": dense_step, "num_params": model.num_params(params)}


def main(argv: list[str] | None = None) -> int:
    from moe_jax.train import setup

    parser = setup.build_parser("moe-jax upcycle", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=storage.normalize, required=True, metavar="DENSE_DIR[/STEP]",
                        help="the dense run (MODEL_DIR, latest step) or MODEL_DIR/STEP; only read")
    parser.add_argument("--out", type=storage.normalize, required=True, metavar="MOE_DIR", help="new MoE run directory (must be empty)")
    parser.add_argument("--noise_std", type=float, default=0.0,
                        help="expert noise, as a fraction of each dense weight's std (default 0: exact copies)")
    parser.add_argument("--reset_step", action="store_true", help="start the MoE run at step 0 (default: the dense step)")
    parser.add_argument("--keep_capacity", action="store_true",
                        help="keep the gin files' capacity factors (tokens beyond an expert's capacity are "
                             "dropped, so the step-0 model is not the dense one); default: a layer that "
                             "would drop tokens is written dropless (MoeLayer.dropless = True)")
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    args.gin_dot_bindings.append(f"MODEL_DIR = {args.out!r}")
    try:
        gin_utils.parse_gin(args, finalize=False)
        made_dropless, layer = make_dropless_if_needed(args.keep_capacity)
        gin.finalize()
        result = upcycle(args.checkpoint, args.out, noise_std=args.noise_std, reset_step=args.reset_step)
    except (gin_utils.GinConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"moe-jax upcycle: error: {err}", file=sys.stderr)
        return 1
    if made_dropless:
        print(f"[moe-jax] upcycle: {args.out}/config.gin binds MoeLayer.dropless = True (the gin files' "
              f"capacity factors {layer.train_capacity_factor:g} / {layer.eval_capacity_factor:g} would drop "
              "tokens), so the step-0 model is the dense one and training continues dropless; "
              "--keep_capacity keeps the capacity factors", file=sys.stderr)
    for cause in step_zero_differences(layer, args.noise_std):
        print(f"[moe-jax] upcycle: warning: the upcycled model differs from the dense one at step 0: {cause}",
              file=sys.stderr)
    print(f"[moe-jax] upcycled {args.checkpoint} (step {result['dense_step']}) into {result['out']} at step "
          f"{result['step']}: {result['num_params']:,} parameters", file=sys.stderr)
    return 0
