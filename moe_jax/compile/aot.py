"""Ahead-of-time compile of a run for a TPU, GPU or CPU target: nothing runs, no device is
needed.

:func:`compile_run` builds the run's exact train and eval steps (same model, optimizer with
frozen-router masking, shardings, donation: ``configured.train_setup``) over the
target's devices from abstract shapes, compiles both, and reports for each what
:mod:`moe_jax.compile.step_analysis` reads of it, with the MoE layers' choices for the
target and, when the run does not fit, what to change (:func:`fit_advice`);
:mod:`moe_jax.compile.report` prints the report. :func:`check_fits` is `moe-jax train`'s
check before its first step. The command is :mod:`moe_jax.commands.compile`.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import gin
import numpy as np

from moe_jax import hardware
from moe_jax.compile.report import gib
from moe_jax.compile.step_analysis import analyze, memory_fit
from moe_jax.errors import UserError
from moe_jax.models.t5 import T5Config
from moe_jax.moe.config import default_config as default_moe_config
from moe_jax.moe.execution import resolve_plan
from moe_jax.runtime import builders, configured, gin_text, gin_utils, steps
from moe_jax.runtime.model_protocol import Model


class DoesNotFitError(UserError, ValueError):
    """The step needs more memory per device than the devices have; the message gives the
    numbers and what to change."""


def per_device_bytes(abstract_tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` s (its largest shard)."""
    import jax

    return int(
        sum(
            math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(abstract_tree)
        )
    )


def fit_advice(
    step: Mapping[str, Any],
    *,
    mesh_shape: Mapping[str, int],
    batch_size: int,
    activation_dtype: str | None,
) -> list[str]:
    """What to change when ``step`` (an :func:`analyze` result) does not fit: for
    activations (temporaries) first when they dominate, then for the state; options already
    on (bfloat16, full remat, FSDP) are not proposed again."""
    advice = []
    if step["bytes"]["temporaries"] >= step["bytes"]["params_and_optimizer"]:
        if activation_dtype == "float32":
            advice.append("--gin.ACTIVATION_DTYPE=bfloat16 (halves activations)")
        if not gin_utils.bound_value("SCAN_LAYERS/macro.value", False):
            advice.append(
                "--gin.SCAN_LAYERS=True --gin.REMAT_POLICY=minimal (layers scanned, their "
                "projections kept and the rest recomputed: T5-Base on v5p-32 needs 6.27 "
                "instead of 9.95 GiB per device, for more work per step; RESULTS.md)"
            )
        if gin_utils.bound_value("REMAT_POLICY/macro.value", "none") != "full":
            advice.append("--gin.REMAT_POLICY=full (activations recomputed in the backward pass)")
        advice.append(
            f"a smaller per-step batch: --gin.BATCH_SIZE={max(1, batch_size // 2)} or "
            "--gin.train_script.train.accum_steps=2 (same batch in 2 microbatches)"
        )
    if not gin_utils.bound_value("standard_logical_axis_rules.fsdp", False):
        advice.append(
            "--gin.standard_logical_axis_rules.fsdp=True (parameters and optimizer "
            "state sharded over the batch axes)"
        )
    advice.append(
        f"more devices along the data or expert axis (mesh_shape now "
        f"{tuple(mesh_shape.values())} for {tuple(mesh_shape)})"
    )
    return advice


def layer_choices(target: Any, dtype: Any, config: T5Config) -> dict[str, Any]:
    """The execution plan (``moe.execution.resolve_plan``) of the MoE layers of ``config``
    (a model without ``moe`` gets the default ``MoeConfig``'s) compiled for
    ``target`` (the step's mesh, or a platform name) with ``dtype`` activations: the
    encoder's plan (``ExecutionPlan.to_dict``), with the decoder's under ``decoder`` when
    ``T5Config.decoder_moe`` differs from ``moe``."""
    moe = config.moe if config.moe is not None else default_moe_config()
    report = resolve_plan(moe, target, dtype).to_dict()
    if config.decoder_moe is not None and config.decoder_moe != moe:
        report["decoder"] = resolve_plan(config.decoder_moe, target, dtype).to_dict()
    return report


def train_bindings() -> dict[str, Any]:
    """The evaluated gin arguments of ``train_script.train`` (model, dataset configs, ...)."""
    return gin.get_bindings("train_script.train")


_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM_TEMPS = re.compile(r"temporaries \(([\d.]+)([KMGT]?)\)")


@contextlib.contextmanager
def source_keyed_cache() -> Iterator[None]:
    """JAX's persistent compilation cache keyed by the program's source lines too (its HLO
    metadata) for the block. Keyed without them (JAX's default), an executable loaded from
    the cache keeps the lines of the program it was first compiled from, and a report read
    from it names stale lines after an edit."""
    import jax

    key = "jax_compilation_cache_include_metadata_in_key"
    was = getattr(jax.config, key)
    jax.config.update(key, True)
    try:
        yield
    finally:
        jax.config.update(key, was)


def compile_step(
    step: steps.TrainStep | steps.EvalStep,
    abstract_args: tuple,
    facts: hardware.DeviceFacts,
    *,
    state_bytes: int,
    flops_per_step: float,
    tokens_per_step: int,
    num_devices: int,
    analysis: bool = True,
) -> tuple[Any, dict]:
    """(compiled executable or None, :func:`analyze` result plus ``compile_s``) of
    ``step.lower(*abstract_args)``; ``analysis`` False: :func:`memory_fit` only (the HLO
    text not read). A compiler that refuses the program for lack of memory (XLA:TPU does)
    gives a result with ``fits`` False, the temporaries it reported and its message,
    instead of an error. The analysed compile's cache entry is keyed by its source lines
    (:func:`source_keyed_cache`)."""
    import jax

    start = time.perf_counter()
    try:
        with source_keyed_cache() if analysis else contextlib.nullcontext():
            compiled = step.lower(*abstract_args).compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        temps = _OOM_TEMPS.search(str(err))
        temporaries = int(float(temps.group(1)) * _SIZE[temps.group(2)]) if temps else 0
        return None, {
            "compile_s": time.perf_counter() - start,
            "fits": False,
            "compiler_error": str(err).splitlines()[0],
            "bytes": {
                "params_and_optimizer": state_bytes,
                "arguments": state_bytes,
                "outputs": 0,
                "aliased": 0,
                "temporaries": temporaries,
                "total": state_bytes + temporaries,
                "device_memory": facts.hbm_bytes,
            },
            "collectives": {},
            "contended_scatters": None,
            "matmul_flops_by_type": None,
            "flops_per_step": flops_per_step,
            "hlo_flops_per_device": None,
            "hlo_bytes_accessed_per_device": None,
            "estimate": None,
        }
    seconds = time.perf_counter() - start
    if not analysis:
        return compiled, {"compile_s": seconds, **memory_fit(compiled, facts, state_bytes)}
    return compiled, {
        "compile_s": seconds,
        **analyze(
            compiled,
            facts,
            state_bytes=state_bytes,
            flops_per_step=flops_per_step,
            tokens_per_step=tokens_per_step,
            num_devices=num_devices,
        ),
    }


def _tokens(shapes: Mapping[str, tuple[int, int]]) -> int:
    return int(sum(math.prod(s) for s in shapes.values()))


def compile_train(
    run: builders.TrainSetup,
    cfg: builders.DatasetConfig,
    model: Model,
    facts: hardware.DeviceFacts,
    analysis: bool = True,
) -> tuple[Any, dict]:
    """:func:`compile_step` of ``run``'s train step on batches of ``cfg``."""
    shapes = cfg.input_shapes()
    return compile_step(
        run.jitted_train_step,
        (run.abstract_state, builders.abstract_batch(run.ctx, shapes, cfg.pack)),
        facts,
        state_bytes=per_device_bytes(run.abstract_state),
        flops_per_step=model.flops_per_step(shapes),
        tokens_per_step=_tokens(shapes),
        num_devices=run.ctx.mesh.size,
        analysis=analysis,
    )


def compile_eval(
    run: builders.TrainSetup,
    cfg: builders.DatasetConfig,
    model: Model,
    facts: hardware.DeviceFacts,
) -> tuple[Any, dict]:
    """:func:`compile_step` of ``run``'s eval step on batches of ``cfg`` (forward FLOPs:
    a third of training's)."""
    shapes = cfg.input_shapes()
    params = run.abstract_state.params
    return compile_step(
        run.jitted_eval_step,
        (
            params,
            builders.abstract_batch(run.ctx, shapes, cfg.pack),
            run.abstract_state.collections,
        ),
        facts,
        state_bytes=per_device_bytes(params),
        flops_per_step=model.flops_per_step(shapes) / 3,
        tokens_per_step=_tokens(shapes),
        num_devices=run.ctx.mesh.size,
    )


def check_fits(run: builders.TrainSetup, cfg: builders.DatasetConfig, model: Model) -> Any:
    """Compiles ``run``'s train step for the devices of its mesh and raises
    :class:`DoesNotFitError` with the numbers and what to change when it needs more memory
    than they have (on CPU: the machine's available memory, shared by its devices).
    Returns the compiled step, ``(state, batch) -> (state, metrics)`` with ``state``
    donated: the executable ``train`` runs, so the step is compiled once. Only its memory
    is read (:func:`memory_fit`): the HLO text's analysis is ``moe-jax compile``'s."""
    devices = list(run.ctx.mesh.devices.flat)
    facts = hardware.device_facts(devices, measure=False)  # the fit reads only the memory
    compiled, step = compile_train(run, cfg, model, facts, analysis=False)
    if not step["fits"]:
        b = step["bytes"]
        where = (
            "of this machine's available memory"
            if devices[0].platform == "cpu"
            else f"of {devices[0].device_kind} memory"
        )
        advice = fit_advice(
            step,
            mesh_shape=dict(run.ctx.mesh.shape),
            batch_size=cfg.batch_size,
            activation_dtype=model.module.config.activation_dtype_name,
        )
        raise DoesNotFitError(
            f"the train step needs {gib(b['total'])} per device "
            f"({gib(b['params_and_optimizer'])} "
            f"parameters + optimizer, {gib(b['temporaries'])} temporaries; batch {cfg.batch_size} "
            f"x {dict(cfg.task_feature_lengths)}) but each of the {len(devices)} devices has "
            f"{gib(b['device_memory'])} {where}; change one of: " + "; ".join(advice)
        )
    return compiled


def compile_run(
    devices: list,
    facts: hardware.DeviceFacts,
    *,
    target: str,
    eval_step: bool = True,
    hlo_dir: str | None = None,
    progress=print,
) -> dict[str, Any]:
    """Compiles the gin-configured run's train (and eval) step for ``devices``; the report
    that :func:`moe_jax.compile.report.format_report` prints and ``--out`` writes.
    ``hlo_dir``: where to write each compiled step's HLO text (``<step>.hlo.txt``)."""
    args = train_bindings()
    model, cfg = args["model"], args["train_dataset_cfg"]
    eval_cfg = args.get("train_eval_dataset_cfg") or cfg
    ctx = configured.run_context(devices=devices)
    run = configured.train_setup(
        model,
        cfg.input_shapes(),
        ctx,
        seed=args.get("random_seed", 0),
        accum_steps=args.get("accum_steps", 1),
        skip_nonfinite=args.get("on_nonfinite", "stop") == "skip",
    )
    report: dict[str, Any] = {
        "target": target,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mesh_shape": dict(ctx.mesh.shape),
        "batch_size": cfg.batch_size,
        "task_feature_lengths": dict(cfg.task_feature_lengths),
        "parameters": int(sum(math.prod(p.shape) for p in _leaves(run.abstract_state.params))),
        "activation_dtype": model.module.config.activation_dtype_name,
        "model_dims": {
            name: getattr(model.module.config, name)
            for name in (
                "vocab_size",
                "emb_dim",
                "mlp_dim",
                "num_heads",
                "num_encoder_layers",
                "num_decoder_layers",
            )
        },
        "moe_layer": layer_choices(
            ctx.mesh.abstract_mesh,
            model.module.config.activation_dtype_name,
            model.module.config,
        ),
        "steps": {},
    }
    progress(
        f"[moe-jax] compiling the train step for {target} ({len(devices)} devices, mesh "
        f"{report['mesh_shape']})..."
    )
    steps = [("train", compile_train, cfg)] + (
        [("eval", compile_eval, eval_cfg)] if eval_step else []
    )
    for name, compile_fn, step_cfg in steps:
        if name == "eval":
            progress("[moe-jax] compiling the eval step...")
        executable, report["steps"][name] = compile_fn(run, step_cfg, model, facts)
        if hlo_dir and executable is not None:
            pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(hlo_dir) / f"{name}.hlo.txt").write_text(executable.as_text())
    report["fits"] = all(step["fits"] for step in report["steps"].values())
    if not report["fits"]:
        worst = max(report["steps"].values(), key=lambda s: s["bytes"]["total"])
        report["advice"] = fit_advice(
            worst,
            mesh_shape=report["mesh_shape"],
            batch_size=cfg.batch_size,
            activation_dtype=report["activation_dtype"],
        )
    return report


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def parse_gin_for_compile(args) -> None:
    """``gin_utils.parse_gin``, with the run-only macros a compile does not need (``MODEL_DIR``,
    ``TRAIN_STEPS``) given placeholders where the gin files leave them required."""
    gin_utils.parse_gin(args, finalize=False)
    for macro, placeholder in (("MODEL_DIR", "/tmp/moe_jax_compile"), ("TRAIN_STEPS", 1)):
        if str(gin_utils.bound_value(f"{macro}/macro.value", None)) == "%gin.REQUIRED":
            gin.bind_parameter(f"{macro}/macro.value", placeholder)
    try:
        gin.finalize()
    except ValueError as err:
        raise gin_text.GinConfigError(f"gin: {err}") from None
