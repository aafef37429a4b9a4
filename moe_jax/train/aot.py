"""`moe-jax compile`: compile a run for its TPU, GPU or CPU target before launching it.

Ahead of time (hence the module name): nothing runs, no device is needed.

    moe-jax compile --target=tpu:v5p:2x2x4 --gin_file=gin/experiments/base_learned.gin \\
        --gin_file=gin/meshes/v4_32.gin [--out=report.json] [--hlo_dir=DIR]

Takes the flags of `moe-jax train`. Builds the run's exact train step and eval step (same
model, optimizer with frozen-router masking, shardings, donation: ``setup.build_train_setup``)
over the target's devices from abstract shapes, compiles both (no device, data or
vocabulary file needed), and prints per device: parameter + optimizer bytes, temporaries,
the total against the chip's HBM, the collectives of the HLO by kind, FLOPs and bytes per
step, a roofline estimate of step time and tokens/s, and the MoE layer's choices for the
target. Exits 1, naming what to change, when the run does not fit. ``--hlo_dir`` keeps
each compiled step's optimized HLO (``train.hlo.txt``, ``eval.hlo.txt``), the text the
collective counts are read from. What a compiler does not report is printed as unknown,
never as zero: GPU executables compiled without a GPU have no cost analysis, so their
estimate covers compute and collectives only and says so. The compilers' own start-up
output (libtpu's host and worker warnings, CUDA's) is hidden unless ``--verbose``.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from moe_jax import hardware
from moe_jax.errors import UserError
from moe_jax.train import setup

COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
)
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_HLO_OP = re.compile(
    r"=\s*(?P<shape>\(*[a-z0-9]+\[[^=]*?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-done)?\("
)
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_HLO_COMMENT = re.compile(r"/\*.*?\*/")


MOE_SOURCE = "/ffn/moe/"  # JAX source path of the ops of a T5 block's MoE layer (models/t5.py)


class DoesNotFitError(UserError, ValueError):
    """The step needs more memory per device than the devices have; the message gives the
    numbers and what to change."""


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": result bytes}}`` of the collective ops of an HLO module
    (an async pair counted once, by its ``-done``, whose shape is the result: a ``-start``'s
    tuple also holds operands and, for collective-permute, sync flags; an op inside a loop
    body counted once). A ``ragged-all-to-all``'s result is its receive buffer, sized for the
    worst case (the dropless layer under expert parallelism): an upper bound on what it moves."""
    out = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    # long tuples carry /*index=5*/ comments, whose '=' would end the shape early
    for match in _HLO_OP.finditer(_HLO_COMMENT.sub("", hlo_text)):
        shapes = _SHAPE.findall(match.group("shape"))
        kind = out[match.group("op")]
        kind["count"] += 1
        kind["bytes"] += sum(
            _DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in shapes
        )
    return {kind: stats for kind, stats in out.items() if stats["count"]}


def per_device_bytes(abstract_tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` s (its largest shard)."""
    import jax

    return int(
        sum(
            math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(abstract_tree)
        )
    )


def analyze(
    compiled,
    facts: hardware.DeviceFacts,
    *,
    state_bytes: int,
    flops_per_step: float,
    tokens_per_step: int,
    num_devices: int,
) -> dict[str, Any]:
    """Memory, collectives, cost and a roofline step time of one compiled step (per device)."""
    mem = compiled.memory_analysis()
    total = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    return {
        "bytes": {
            "params_and_optimizer": state_bytes,
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "total": total,
            "device_memory": facts.hbm_bytes,
        },
        "fits": total <= facts.hbm_bytes,
        "flops_per_step": flops_per_step,
        "hlo_flops_per_device": cost.get("flops"),
        "hlo_bytes_accessed_per_device": cost.get("bytes accessed"),
        **hlo_analysis(
            compiled.as_text(),
            facts,
            flops_per_step=flops_per_step,
            bytes_accessed=cost.get("bytes accessed"),
            tokens_per_step=tokens_per_step,
            num_devices=num_devices,
        ),
    }


def hlo_analysis(
    hlo_text: str,
    facts: hardware.DeviceFacts,
    *,
    flops_per_step: float,
    bytes_accessed: float | None,
    tokens_per_step: int,
    num_devices: int,
) -> dict[str, Any]:
    """What the compiled HLO text gives: its ``collectives``, the ``moe_layers``' share and
    the roofline ``estimate`` ``max(FLOPs / peak, bytes accessed / HBM bandwidth) +
    collective bytes / interconnect bandwidth``, with the model's FLOPs split evenly over
    the devices (XLA's cost analysis counts a loop body once) and the chip's bf16 peak.

    ``bytes_accessed`` None (no cost analysis) or a chip without an HBM bandwidth (CPU):
    ``hbm_s`` is None and the estimate covers compute and collectives only (``covers``
    says which terms it holds; ``step_s`` and ``tokens_per_s`` are then bounds)."""
    coll = collectives(hlo_text)
    compute_s = flops_per_step / num_devices / facts.peak_flops
    hbm_s = (
        bytes_accessed / facts.hbm_bandwidth
        if bytes_accessed is not None and facts.hbm_bandwidth
        else None
    )
    comm_s = (
        sum(c["bytes"] for c in coll.values()) / facts.interconnect_bandwidth
        if facts.interconnect_bandwidth
        else None
    )
    step_s = max(compute_s, hbm_s or 0.0) + (comm_s or 0.0)
    covers = (
        ["compute"]
        + (["HBM"] if hbm_s is not None else [])
        + (["collectives"] if comm_s is not None else [])
    )
    return {
        "collectives": coll,
        "moe_layers": moe_layer_costs(hlo_text),
        "estimate": {
            "compute_s": compute_s,
            "hbm_s": hbm_s,
            "collectives_s": comm_s,
            "covers": covers,
            "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s if step_s else None,
        },
    }


def moe_layer_costs(hlo_text: str) -> dict[str, float]:
    """The MoE layers' share of a compiled step, from its scheduled operations
    (``hlo_costs``: one read of each operand, one write of each result): ``hlo_bytes`` of the
    operations whose JAX source lies in a MoE layer (module path ``.../ffn/moe/...``, forward
    and backward) against the step's ``step_hlo_bytes``, the part of them that gathers,
    scatters or sorts (``indexed_bytes``) and their matmul ``flops``."""
    from moe_jax import hlo_costs

    ops = hlo_costs.parse(hlo_text)
    step, moe = hlo_costs.summary(ops), hlo_costs.summary_of(ops, MOE_SOURCE)
    return {
        "hlo_bytes": moe["bytes"],
        "step_hlo_bytes": step["bytes"],
        "indexed_bytes": moe["indexed_bytes"],
        "flops": moe["flops"],
    }


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
        if _gin_value("REMAT_POLICY/macro.value", "none") != "full":
            advice.append("--gin.REMAT_POLICY=full (activations recomputed in the backward pass)")
        advice.append(
            f"a smaller per-step batch: --gin.BATCH_SIZE={max(1, batch_size // 2)} or "
            "--gin.train_script.train.accum_steps=2 (same batch in 2 microbatches)"
        )
    if not _gin_value("standard_logical_axis_rules.fsdp", False):
        advice.append(
            "--gin.standard_logical_axis_rules.fsdp=True (parameters and optimizer "
            "state sharded over the batch axes)"
        )
    advice.append(
        f"more devices along the data or expert axis (mesh_shape now "
        f"{tuple(mesh_shape.values())} for {tuple(mesh_shape)})"
    )
    return advice


def _gin_value(name: str, default: Any) -> Any:
    import gin

    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def layer_choices(target: Any, dtype: Any, config: Any) -> dict[str, Any]:
    """The execution plan (``moe.execution.resolve_plan``) of the MoE layers of ``config``
    (a ``T5Config``; a model without ``moe`` gets the default ``MoeConfig``'s) compiled for
    ``target`` (the step's mesh, or a platform name) with ``dtype`` activations: the
    encoder's plan (``ExecutionPlan.to_dict``), with the decoder's under ``decoder`` when
    ``T5Config.decoder_moe`` differs from ``moe``."""
    from moe_jax.moe.config import MoeConfig
    from moe_jax.moe.execution import resolve_plan

    moe = config.moe if config.moe is not None else MoeConfig()
    report = resolve_plan(moe, target, dtype).to_dict()
    if config.decoder_moe is not None and config.decoder_moe != moe:
        report["decoder"] = resolve_plan(config.decoder_moe, target, dtype).to_dict()
    return report


def train_bindings() -> dict[str, Any]:
    """The evaluated gin arguments of ``train_script.train`` (model, dataset configs, ...)."""
    import gin

    return gin.get_bindings("train_script.train")


_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM_TEMPS = re.compile(r"temporaries \(([\d.]+)([KMGT]?)\)")


def compile_step(
    lowered_fn,
    abstract_args: tuple,
    facts: hardware.DeviceFacts,
    *,
    state_bytes: int,
    flops_per_step: float,
    tokens_per_step: int,
    num_devices: int,
) -> tuple[Any, dict]:
    """(compiled executable or None, :func:`analyze` result plus ``compile_s``) of
    ``lowered_fn.lower(*abstract_args)``. A compiler that refuses the program for lack of
    memory (XLA:TPU does) gives a result with ``fits`` False, the temporaries it reported
    and its message, instead of an error."""
    import jax

    start = time.perf_counter()
    try:
        compiled = lowered_fn.lower(*abstract_args).compile()
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
            "flops_per_step": flops_per_step,
            "hlo_flops_per_device": None,
            "hlo_bytes_accessed_per_device": None,
            "estimate": None,
        }
    seconds = time.perf_counter() - start
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
    run: setup.TrainSetup, cfg: setup.DatasetConfig, model, facts: hardware.DeviceFacts
) -> tuple[Any, dict]:
    """:func:`compile_step` of ``run``'s train step on batches of ``cfg``."""
    shapes = cfg.input_shapes()
    return compile_step(
        run.train_step,
        (run.abstract_state, setup.abstract_batch(run.ctx, shapes, cfg.pack)),
        facts,
        state_bytes=per_device_bytes(run.abstract_state),
        flops_per_step=model.flops_per_step(shapes),
        tokens_per_step=_tokens(shapes),
        num_devices=run.ctx.mesh.size,
    )


def compile_eval(
    run: setup.TrainSetup, cfg: setup.DatasetConfig, model, facts: hardware.DeviceFacts
) -> tuple[Any, dict]:
    """:func:`compile_step` of ``run``'s eval step on batches of ``cfg`` (forward FLOPs:
    a third of training's)."""
    shapes = cfg.input_shapes()
    params = run.abstract_state.params
    return compile_step(
        run.eval_step,
        (params, setup.abstract_batch(run.ctx, shapes, cfg.pack), run.abstract_state.collections),
        facts,
        state_bytes=per_device_bytes(params),
        flops_per_step=model.flops_per_step(shapes) / 3,
        tokens_per_step=_tokens(shapes),
        num_devices=run.ctx.mesh.size,
    )


def check_fits(run: setup.TrainSetup, cfg: setup.DatasetConfig, model) -> dict[str, Any]:
    """Compiles ``run``'s train step for the devices of its mesh (what ``train`` is about to
    run; the jitted step then reuses this compilation) and raises :class:`DoesNotFitError`
    with the numbers and what to change when it needs more memory than they have (on
    CPU: the machine's available memory, shared by its devices). Returns the analysis."""
    devices = list(run.ctx.mesh.devices.flat)
    _, step = compile_train(run, cfg, model, hardware.device_facts(devices))
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
            activation_dtype=model.module.config.dtype,
        )
        raise DoesNotFitError(
            f"the train step needs {_gib(b['total'])} per device "
            f"({_gib(b['params_and_optimizer'])} "
            f"parameters + optimizer, {_gib(b['temporaries'])} temporaries; batch {cfg.batch_size} "
            f"x {dict(cfg.task_feature_lengths)}) but each of the {len(devices)} devices has "
            f"{_gib(b['device_memory'])} {where}; change one of: " + "; ".join(advice)
        )
    return step


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
    that :func:`format_report` prints and ``--out`` writes. ``hlo_dir``: where to write each
    compiled step's HLO text (``<step>.hlo.txt``)."""
    args = train_bindings()
    model, cfg = args["model"], args["train_dataset_cfg"]
    eval_cfg = args.get("train_eval_dataset_cfg") or cfg
    ctx = setup.run_context(devices=devices)
    run = setup.build_train_setup(
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
        "activation_dtype": model.module.config.dtype,
        "model_dims": {
            name: getattr(model.module.config, name)
            for name in (
                "vocab_size",
                "emb_dim",
                "mlp_dim",
                "num_encoder_layers",
                "num_decoder_layers",
            )
        },
        "moe_layer": layer_choices(
            ctx.mesh.abstract_mesh, model.module.config.dtype, model.module.config
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


def _gib(n: float) -> str:
    return f"{n / hardware.GiB:.2f} GiB"


def format_report(report: Mapping[str, Any]) -> str:
    """The printed report: one block per step, then the verdict."""
    lines = [
        f"target {report['target']}: {report['devices']} x {report['device_kind']}, mesh "
        f"{report['mesh_shape']}; {report['parameters']:,} parameters; batch "
        f"{report['batch_size']} x {report['task_feature_lengths']}; activations "
        f"{report['activation_dtype']}",
        f"MoE layer for {report['moe_layer']['platform']}: dispatch="
        f"{report['moe_layer']['dispatch']!r}, "
        f"per_expert_loop={report['moe_layer']['per_expert_loop']}",
    ]
    for name, step in report["steps"].items():
        b, est = step["bytes"], step["estimate"]
        if est is None:  # the compiler refused it for lack of memory
            lines += [
                f"{name} step, per device: params + optimizer {_gib(b['params_and_optimizer'])}, "
                f"temporaries {_gib(b['temporaries'])}: DOES NOT FIT {_gib(b['device_memory'])}",
                f"  compiler: {step['compiler_error']}",
            ]
            continue
        coll = (
            ", ".join(f"{c['count']} {kind}" for kind, c in step["collectives"].items()) or "none"
        )
        lines += [
            f"{name} step (compiled in {step['compile_s']:.1f} s), per device:",
            f"  params + optimizer {_gib(b['params_and_optimizer'])}, arguments "
            f"{_gib(b['arguments'])}, temporaries {_gib(b['temporaries'])}",
            f"  total {_gib(b['total'])} of {_gib(b['device_memory'])} "
            f"({100 * b['total'] / b['device_memory']:.0f}%): "
            f"{'fits' if step['fits'] else 'DOES NOT FIT'}",
            f"  collectives: {coll}",
            f"  {quantity(step['flops_per_step'], 'FLOP')} per step (model); HLO per device: "
            + (
                f"{quantity(step['hlo_flops_per_device'], 'FLOP')}, "
                f"{quantity(step['hlo_bytes_accessed_per_device'], 'B')} accessed"
                if step["hlo_flops_per_device"] is not None
                or step["hlo_bytes_accessed_per_device"] is not None
                else "FLOPs and bytes accessed unknown (the compiler gave no cost analysis)"
            ),
            estimate_line(est),
        ]
        moe = step["moe_layers"]
        if moe["hlo_bytes"]:
            lines.append(
                f"  MoE layers: {quantity(moe['hlo_bytes'], 'B')} of the step's "
                f"{quantity(moe['step_hlo_bytes'], 'B')} of HLO operand/result bytes "
                f"({100 * moe['hlo_bytes'] / moe['step_hlo_bytes']:.0f}%; gathers/scatters/sorts "
                f"{quantity(moe['indexed_bytes'], 'B')}), {quantity(moe['flops'], 'FLOP')} of "
                f"matmuls"
            )
    if report["fits"]:
        lines.append("verdict: fits")
    else:
        lines.append("verdict: DOES NOT FIT. Change one of:")
        lines += [f"  - {a}" for a in report["advice"]]
    return "\n".join(lines)


_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def quantity(value: float | None, unit: str, missing: str = "unknown") -> str:
    """``value`` with a decimal prefix and 3 significant digits (``7.06e8, "FLOP"`` ->
    ``706 MFLOP``; ``0.0346e9, "B"`` -> ``34.6 MB``); ``missing`` when None."""
    if value is None:
        return missing
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1.0, ""))
    return f"{plain(value / scale)} {prefix}{unit}"


def plain(value: float) -> str:
    """``value`` to 3 significant digits without an exponent (5355860 -> ``5,360,000``,
    1190.4 -> ``1,190``, 8.93e-05 -> ``0.0000893``)."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{float(f'{value:.3g}'):,.0f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def estimate_line(est: Mapping[str, Any]) -> str:
    """The roofline line of a step: milliseconds per step, its terms, and tokens/s in plain
    units, saying which terms it leaves out (then both numbers are bounds)."""
    terms = [f"compute {plain(est['compute_s'] * 1e3)}"]
    terms += [f"HBM {plain(est['hbm_s'] * 1e3)}"] if est["hbm_s"] is not None else []
    terms += (
        [f"collectives {plain(est['collectives_s'] * 1e3)}"]
        if est["collectives_s"] is not None
        else []
    )
    left_out = [
        name
        for name, key in (("HBM", "hbm_s"), ("collectives", "collectives_s"))
        if est[key] is None
    ]
    label = (
        "estimate"
        if not left_out
        else (
            f"estimate of {' and '.join(est['covers'])} only ({' and '.join(left_out)} time "
            "unknown: a lower bound on the step time, an upper bound on tokens/s)"
        )
    )
    rate = "unknown" if est["tokens_per_s"] is None else f"{plain(est['tokens_per_s'])} tokens/s"
    return f"  {label}: {plain(est['step_s'] * 1e3)} ms/step ({', '.join(terms)} ms), {rate}"


def parse_gin_for_compile(args) -> None:
    """``gin_utils.parse_gin``, with the run-only macros a compile does not need (``MODEL_DIR``,
    ``TRAIN_STEPS``) given placeholders where the gin files leave them required."""
    import gin

    from moe_jax.train import gin_utils

    gin_utils.parse_gin(args, finalize=False)
    for macro, placeholder in (("MODEL_DIR", "/tmp/moe_jax_compile"), ("TRAIN_STEPS", 1)):
        if str(_gin_value(f"{macro}/macro.value", None)) == "%gin.REQUIRED":
            gin.bind_parameter(f"{macro}/macro.value", placeholder)
    try:
        gin.finalize()
    except ValueError as err:
        raise gin_utils.GinConfigError(f"gin: {err}") from None


def main(argv: list[str] | None = None) -> int:
    from moe_jax.train import gin_utils

    parser = setup.build_parser("moe-jax compile", __doc__.splitlines()[0])
    parser.add_argument(
        "--target",
        required=True,
        metavar="PLATFORM:CHIP:TOPOLOGY",
        help="tpu:v5e:4x4, tpu:v5p:2x2x4, gpu:h100:8, cpu:8, ...",
    )
    parser.add_argument("--out", default=None, metavar="FILE.json", help="write the report as JSON")
    parser.add_argument("--no_eval", action="store_true", help="compile the train step only")
    parser.add_argument(
        "--hlo_dir",
        default=None,
        metavar="DIR",
        help="write each compiled step's HLO text to DIR/<step>.hlo.txt",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the compilers' own start-up output and logs (libtpu, CUDA, XLA)",
    )
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    hint = ""
    try:
        target = hardware.parse_target(args.target)
        hint = "" if args.verbose else " (--verbose shows the compiler's own output)"
        with hardware.native_output_hidden(not args.verbose) as messages:
            devices = hardware.target_devices(target)
            parse_gin_for_compile(args)
            report = compile_run(
                devices,
                hardware.device_facts(devices, target.chip, target.num_chips),
                target=target.spec,
                eval_step=not args.no_eval,
                hlo_dir=args.hlo_dir,
                progress=lambda m: print(m, file=messages, flush=True),
            )
    except (gin_utils.GinConfigError, FileNotFoundError, ValueError) as err:
        print(f"moe-jax compile: error: {err}{hint}", file=sys.stderr)
        return 1
    print(format_report(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["fits"] else 1
