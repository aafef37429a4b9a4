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
state and writes ``OUT/checkpoints/<step>``, ``OUT/config.gin`` (every binding of the
gin files, ``MODEL_DIR`` = OUT) and ``OUT/run.json`` (the run's spec, which its first
``train`` compares with). The step is the dense run's (``--reset_step``: 0); the
data stream continues from that step. The dense run is only read. See docs/moe.md.

What it preserves: the upcycled model computes the dense model's outputs at step 0 only
when no token is dropped and each token's gates sum to 1 (:func:`step_zero_differences`).
Unless ``--keep_capacity``, a token-choice layer that would drop tokens is written dropless
(``CapacityConfig.dropless = True`` in ``OUT/config.gin``, said on stderr), so the run as
configured starts as the dense model and trains dropless; with ``--keep_capacity`` the
capacity factors of the gin files stay and a warning names them. What still differs is
printed as a warning.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import gin
import jax

from moe_jax import param_paths, storage
from moe_jax.moe import capacity
from moe_jax.moe.config import MoeConfig, TopKRouterConfig
from moe_jax.moe.upcycle import upcycle_params
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    evaluation,
    gin_flags,
    gin_text,
    gin_utils,
    router_init,
)
from moe_jax.runtime.run_dir import RunDir


def _keeps_every_token(config: MoeConfig) -> bool:
    """Whether a layer of ``config`` routes every assignment of a routing group at both
    capacity factors: dropless, or a capacity of the whole group."""
    cap = config.capacity
    if cap.dropless:
        return True
    tokens = cap.group_size
    return all(
        capacity.expert_capacity(
            tokens,
            config.routed_experts,
            config.choices_per_token,
            factor,
            cap.min_expert_capacity,
            cap.capacity_rule,
            cap.expert_capacity,
        )
        >= tokens
        for factor in (cap.train_capacity_factor, cap.eval_capacity_factor)
    )


def step_zero_differences(config: MoeConfig, noise_std: float = 0.0) -> list[str]:
    """Why the upcycled model would not compute the dense model's outputs at step 0, for MoE
    layers of ``config``: one line per cause naming the option, empty when it does
    (moe_jax/moe/upcycle.py gives the conditions)."""
    causes = []
    cap, router = config.capacity, config.router
    if not _keeps_every_token(config):
        causes.append(
            "CapacityConfig.dropless=False with train/eval capacity factors "
            f"{cap.train_capacity_factor:g} / {cap.eval_capacity_factor:g}: an expert takes at "
            "most its capacity of a group's tokens and the others skip the layer (all experts "
            "are the same MLP, so the router's choices are uneven); "
            "--gin.CapacityConfig.dropless=True keeps every token"
        )
    partial_gates = config.choices_per_token < config.routed_experts
    if config.router_type == "expert_choice":
        causes.append(
            "ExpertChoiceRouterConfig: experts pick tokens, so a token may get none or several "
            "experts"
        )
    elif (
        isinstance(router, TopKRouterConfig)
        and router.score_function == "softmax"
        and not router.renormalize_gates
        and partial_gates
    ):
        causes.append(
            "TopKRouterConfig.renormalize_gates=False: a token's top-k softmax gates sum to less "
            "than 1 (include routers/renormalized.gin)"
        )
    elif config.router_type == "noisy_top_k" and partial_gates:
        causes.append(
            "NoisyTopKRouterConfig: a token's top-k softmax gates sum to less than 1 (this router "
            "does not renormalise them; TopKRouterConfig.renormalize_gates does)"
        )
    if config.num_shared_experts:
        causes.append(
            f"MoeConfig.num_shared_experts={config.num_shared_experts}: shared experts start from "
            "the MoE initialisation and add to the copied MLP"
        )
    if noise_std:
        causes.append(f"--noise_std={noise_std:g} perturbs the experts")
    return causes


def moe_configs() -> list[MoeConfig]:
    """The distinct MoE configs (encoder's, decoder's) of the gin-configured model."""
    config = _train_argument("model").module.config
    if not config.has_moe:
        return []
    return list(dict.fromkeys((config.moe_config("encoder"), config.moe_config("decoder"))))


def make_dropless_if_needed(keep_capacity: bool) -> tuple[bool, list[MoeConfig]]:
    """Binds ``CapacityConfig.dropless = True`` (gin parsed, not finalized) when a configured
    token-choice layer would drop tokens and ``keep_capacity`` is False; returns whether it
    did and the model's MoE configs as then configured."""
    configs = moe_configs()
    if (
        keep_capacity
        or all(_keeps_every_token(c) for c in configs)
        or any(c.router_type == "expert_choice" for c in configs)
    ):
        return False, configs
    gin.bind_parameter("CapacityConfig.dropless", True)
    return True, moe_configs()


def _dense_params(path: str) -> tuple[dict[str, Any], int]:
    """``({"encoder/layers_0/...": array}, step)`` of the dense checkpoint at ``path`` (per
    layer, whether it was saved scanned or not)."""

    run_dir, step = RunDir.of_checkpoint(path)
    if not storage.isdir(run_dir.checkpoints_dir):
        raise FileNotFoundError(f"upcycle: --checkpoint={path!r} holds no checkpoints")
    ckpt = checkpoints.Checkpointer(run_dir, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"upcycle: --checkpoint={path!r} holds no finished checkpoint")
        shapes = checkpoints.per_layer_shapes(ckpt.read_meta(step)["params"])
    finally:
        ckpt.close()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict[str, Any] = {}
    for name, shape in shapes.items():
        node = target
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=device)
    params, _, step, _ = checkpoints.restore_from(run_dir.step_dir(step), target)
    return param_paths.named_leaves(params), step


def _train_argument(name: str) -> Any:
    """The gin-bound ``train_script.train`` argument ``name`` (a configurable reference or
    macro evaluated)."""
    value = gin.query_parameter(f"train_script.train.{name}")
    return value.scoped_configurable_fn() if hasattr(value, "scoped_configurable_fn") else value


def upcycle(
    checkpoint: str, out: str, *, noise_std: float = 0.0, reset_step: bool = False
) -> dict[str, Any]:
    """Writes the upcycled MoE run to ``out`` (gin already parsed); returns its summary."""

    if storage.listdir(out):
        raise FileExistsError(f"upcycle: --out={out!r} is not empty; give a new directory")
    spec = configured.train_spec()[0]  # the run's run.json (refused here, before any write)
    model = _train_argument("model")
    dataset_cfg = _train_argument("train_dataset_cfg")
    seed = int(_train_argument("random_seed"))
    if not model.module.config.has_moe:
        raise ValueError(
            "upcycle: the gin files describe a model without MoE layers "
            "(T5Config.num_sparse_*_layers = 0)"
        )
    granularities = {c.expert_granularity for c in moe_configs()}
    if len(granularities) > 1:
        raise ValueError(
            f"upcycle: the encoder's and the decoder's MoeConfig.expert_granularity differ "
            f"({sorted(granularities)}); upcycling takes one"
        )
    dense, dense_step = _dense_params(checkpoint)
    run = configured.train_setup(
        model, dataset_cfg.input_shapes(), configured.run_context(), seed=seed
    )
    state, shardings = run.init_state(), run.shardings
    params = upcycle_params(
        dense,
        model.per_layer(jax.device_get(state.params)),
        granularity=granularities.pop(),
        noise_std=noise_std,
        rng=jax.random.PRNGKey(seed),
    )
    params = jax.device_put(model.own_layout(params), shardings.params)
    with jax.set_mesh(run.ctx.mesh):
        opt_state = jax.jit(run.tx.init, out_shardings=shardings.opt_state)(params)
    step = 0 if reset_step else dense_step
    state = dataclasses.replace(
        state,
        step=jax.device_put(jax.numpy.asarray(step, jax.numpy.int32), shardings.step),
        params=params,
        opt_state=opt_state,
    )
    run_dir = RunDir(out)
    ckpt = checkpoints.Checkpointer(run_dir, async_save=False)
    try:
        ckpt.save(
            state,
            {
                "data_iterators": [],
                "random_seed": seed,
                "upcycled_from": f"{checkpoint} step {dense_step}",
            },
            force=True,
        )
        ckpt.wait_until_finished()
    finally:
        ckpt.close()
    router_init.save(run_dir, model, params)
    if jax.process_index() == 0:
        storage.write_text(run_dir.config_file, gin.config_str())
        storage.write_text(run_dir.spec_file, spec.to_json())
        eval_cfg = _train_argument("train_eval_dataset_cfg")
        if eval_cfg is not None:
            evaluation.record_eval_settings(run_dir, _train_argument("eval_steps"), eval_cfg)
    return {
        "out": out,
        "step": step,
        "dense_step": dense_step,
        "num_params": model.num_params(params),
    }


def main(argv: list[str] | None = None) -> int:

    parser = builders.build_parser("moe-jax upcycle", __doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        type=storage.normalize,
        required=True,
        metavar="DENSE_DIR[/STEP]",
        help="the dense run (MODEL_DIR, latest step) or MODEL_DIR/STEP; only read",
    )
    parser.add_argument(
        "--out",
        type=storage.normalize,
        required=True,
        metavar="MOE_DIR",
        help="new MoE run directory (must be empty)",
    )
    parser.add_argument(
        "--noise_std",
        type=float,
        default=0.0,
        help="expert noise, as a fraction of each dense weight's std (default 0: exact copies)",
    )
    parser.add_argument(
        "--reset_step",
        action="store_true",
        help="start the MoE run at step 0 (default: the dense step)",
    )
    parser.add_argument(
        "--keep_capacity",
        action="store_true",
        help="keep the gin files' capacity factors (tokens beyond an expert's capacity are "
        "dropped, so the step-0 model is not the dense one); default: a layer that "
        "would drop tokens is written dropless (CapacityConfig.dropless = True)",
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    args.gin_dot_bindings.append(f"MODEL_DIR = {args.out!r}")
    try:
        gin_utils.parse_gin(args, finalize=False)
        made_dropless, configs = make_dropless_if_needed(args.keep_capacity)
        gin.finalize()
        result = upcycle(
            args.checkpoint, args.out, noise_std=args.noise_std, reset_step=args.reset_step
        )
    except (gin_text.GinConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"moe-jax upcycle: error: {err}", file=sys.stderr)
        return 1
    if made_dropless:
        factors = ", ".join(
            f"{c.capacity.train_capacity_factor:g} / {c.capacity.eval_capacity_factor:g}"
            for c in configs
        )
        print(
            f"[moe-jax] upcycle: {RunDir(args.out).config_file} binds CapacityConfig.dropless = "
            "True (the "
            f"gin files' "
            f"capacity factors {factors} would drop tokens), so the step-0 model is the dense one "
            "and training continues dropless; --keep_capacity keeps the capacity factors",
            file=sys.stderr,
        )
    for cause in dict.fromkeys(
        c for config in configs for c in step_zero_differences(config, args.noise_std)
    ):
        print(
            f"[moe-jax] upcycle: warning: the upcycled model differs from the dense one at step 0: "
            f"{cause}",
            file=sys.stderr,
        )
    print(
        f"[moe-jax] upcycled {args.checkpoint} (step {result['dense_step']}) into {result['out']} "
        f"at step {result['step']}: {result['num_params']:,} parameters",
        file=sys.stderr,
    )
    return 0
