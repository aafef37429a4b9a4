"""`moe-jax upcycle`: an MoE run directory from a dense T5 run (sparse upcycling).

    moe-jax upcycle --checkpoint=/tmp/dense_run --out=/tmp/moe_run \\
        --gin_file=experiments/fig5_learned.gin --gin_file=experiments/cpu_scale.gin
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
"""

from __future__ import annotations

import sys
from typing import Any

import gin
import jax

from moe_jax import storage
from moe_jax.train import gin_utils


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


def upcycle(checkpoint: str, out: str, *, noise_std: float = 0.0, reset_step: bool = False) -> dict[str, Any]:
    """Writes the upcycled MoE run to ``out`` (gin already parsed); returns its summary."""
    from moe_jax.moe.layer import MoeLayer
    from moe_jax.moe.upcycle import upcycle_params
    from moe_jax.train import checkpoints, setup

    if storage.listdir(out):
        raise FileExistsError(f"upcycle: --out={out!r} is not empty; give a new directory")
    model = gin.query_parameter("train_script.train.model").scoped_configurable_fn()
    dataset_cfg = gin.query_parameter("train_script.train.train_dataset_cfg").scoped_configurable_fn()
    seed = gin.query_parameter("train_script.train.random_seed")
    seed = seed.scoped_configurable_fn() if hasattr(seed, "scoped_configurable_fn") else int(seed)
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
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    args.gin_dot_bindings.append(f"MODEL_DIR = {args.out!r}")
    try:
        gin_utils.parse_gin(args)
        result = upcycle(args.checkpoint, args.out, noise_std=args.noise_std, reset_step=args.reset_step)
    except (gin_utils.GinConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"moe-jax upcycle: error: {err}", file=sys.stderr)
        return 1
    print(f"[moe-jax] upcycled {args.checkpoint} (step {result['dense_step']}) into {result['out']} at step "
          f"{result['step']}: {result['num_params']:,} parameters", file=sys.stderr)
    return 0
