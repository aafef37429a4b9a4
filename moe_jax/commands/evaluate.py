"""`moe-jax eval`: evaluate one or more checkpoints and compare them side by side.

    moe-jax eval --checkpoint=/runs/learned --checkpoint=/runs/frozen/2000
    moe-jax eval --gin_file=models/t5_moe.gin --gin_file=models/size_d32.gin \\
        --checkpoint=/runs/learned --checkpoint=/runs/frozen/2000 --checkpoint=/runs/dense

Gin: ``runs/eval.gin``, then the first run's ``MODEL_DIR/config.gin`` when no ``--gin_file``
is given (the line ``gin config: ...`` says which); otherwise ``runs/eval.gin`` then the
``--gin_file`` files. T5X's ``--gin.CHECKPOINT_PATH`` / ``--gin.EVAL_OUTPUT_DIR`` work as
``--checkpoint`` / ``--output_dir`` (from the command line and its own ``--gin_file``s; a
run's recorded ``EVAL_OUTPUT_DIR`` is never where results go; the default is
``FIRST_MODEL_DIR/eval_results/<what is compared>``, ``run_names.comparison_folder``). A
folder holding results of another comparison (other checkpoints or routers) is refused
without ``--overwrite``.

Each ``--checkpoint`` is a ``MODEL_DIR`` (latest step) or ``MODEL_DIR/STEP``, labelled by
the shortest suffix of its path that tells it from the others (``learned/NUM_EXPERTS-8/seed0``
beside ``frozen/NUM_EXPERTS-8/seed0``; ``run_names.run_labels``) or by ``--label`` (one per
checkpoint, in order); its
parameters are restored onto the current mesh (whatever mesh saved them) and evaluated on
``eval_steps`` batches of the eval split with the eval capacity factor. The eval settings
(batches, batch size, feature lengths, task, split) are by default the ones the first
run's in-training evaluation used, which ``moe-jax train`` records in
``MODEL_DIR/eval_settings.json`` (:func:`moe_jax.runtime.evaluation.record_eval_settings`),
so that re-evaluating a checkpoint reproduces the numbers the run printed; ``--eval_steps=N``
changes the count, ``--eval_settings=gin`` takes ``runs/eval.gin``'s and the gin flags'
instead, and a ``--gin.eval_script.evaluate.eval_steps`` binding wins over the record. The
lines ``eval settings: ...`` say which were used. Results, per
checkpoint: loss, token accuracy and per-MoE-layer routing statistics (expert load
histogram, dropped fraction, router entropy, router weight drift from initialisation
``||W - W0|| / ||W0||``), written as ``<label>.json`` and ``<label>_expert_load.png`` in
the output directory (``/`` and ``:`` of a label as ``_``), plus
``comparison.txt``/``comparison.json`` with the side-by-side table that is also printed,
and, when the checkpoints are seeds of sweep families (``learned/seed0``, ``learned/seed1``,
...), ``comparison_seeds.md``: mean +- std over each family's seeds per router
(``seed_table``).

``--router=NAME`` (repeatable) evaluates every checkpoint with its routers replaced
(moe_jax/analysis/counterfactual.py: ``learned``, ``init``, ``random``, ``hash``,
``uniform``, ``shuffled``): one column per checkpoint and router (``<label>:<router>``;
files ``<label>_<router>.json``, no ``:`` in file names) and ``routers.png``, accuracy and
cross-entropy per router as bars from 0 (a family's seeds: their mean, error bars their
standard deviation). Routing telemetry per layer (dead experts, per-shard imbalance, gate
margin) is in the table and the JSON.

A checkpoint trained from another model config than the gin files describe is refused
with the mismatching parameter names (evaluate each with its own gin files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import errors, plotting, storage
from moe_jax.analysis import counterfactual
from moe_jax.runtime import (
    builders,
    config_gate,
    configured,
    distributed,
    evaluation,
    gin_flags,
    gin_utils,
    output_lock,
    router_init,
    run_config,
    run_names,
    steps,
)
from moe_jax.runtime.gin_text import GinConfigError
from moe_jax.runtime.model_protocol import Model
from moe_jax.runtime.routing import layer_order
from moe_jax.runtime.routing_telemetry import routing_telemetry
from moe_jax.runtime.run_dir import RunDir

_MOE_KEY = re.compile(r"^moe/(.+)/([^/]+)$")


def routing_by_layer(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"encoder/layers_3": {"expert_load": [...], "dropped_fraction": x, ...}, ...}``,
    encoder layers first, each stack by depth (``layers_3`` before ``layers_11``)."""

    layers: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        if m := _MOE_KEY.match(key):
            layers.setdefault(m.group(1), {})[m.group(2)] = value
    return dict(sorted(layers.items(), key=lambda item: layer_order(item[0])))


def router_drift(
    routers: Mapping[str, Any], initial: dict[str, np.ndarray] | None, layers: Sequence[str]
) -> dict[str, float]:
    """Per MoE layer, ``||W - W0|| / ||W0||`` over that layer's router parameters
    (``routers``: ``{per-layer name: weights}``,
    :func:`moe_jax.runtime.router_init.per_layer_routers`; 0 for a frozen router); empty
    when the run kept no initial router weights."""

    if not initial:
        return {}
    current = {k: np.asarray(jax.device_get(v)) for k, v in routers.items()}
    drift = {}
    for layer in layers:
        names = [k for k in current if k.startswith(layer + "/") and k in initial]
        if names:
            diff = np.sqrt(sum(np.sum((current[k] - initial[k]) ** 2) for k in names))
            ref = np.sqrt(sum(np.sum(initial[k] ** 2) for k in names))
            drift[layer] = float(diff / max(ref, 1e-12))
    return drift


def plot_expert_load(layers: dict[str, dict[str, Any]], title: str, path: str) -> None:
    """Writes :func:`expert_load_figure` to ``path`` (nothing when no layer has a load)."""

    fig = expert_load_figure(layers, title)
    if fig is not None:
        plotting.save(fig, path, dpi=100)


def expert_load_figure(layers: dict[str, dict[str, Any]], title: str):
    """One bar chart per MoE layer of the fraction of tokens routed to each expert, with
    the uniform load as a dashed line. A token counts once per chosen expert, so top-k
    loads sum to k and the uniform load is k/E; experts are labelled by integer index."""

    plt = plotting.pyplot()

    loads = {
        name: np.asarray(stats["expert_load"])
        for name, stats in layers.items()
        if "expert_load" in stats
    }
    if not loads:
        return None
    fig, axes = plt.subplots(len(loads), 1, figsize=(7, 1.9 * len(loads) + 0.7), squeeze=False)
    for ax, (name, load) in zip(axes[:, 0], loads.items(), strict=True):
        k = float(load.sum())  # experts chosen per token
        ax.bar(np.arange(load.size), load, color="tab:blue", label="fraction of tokens")
        ax.axhline(
            k / load.size,
            color="gray",
            linestyle="--",
            linewidth=0.8,
            label=f"uniform: k/E = {k:.3g}/{load.size}",
        )
        plotting.integer_ticks(ax, "x")
        ax.set_xlim(-0.6, load.size - 0.4)
        ax.set_ylim(0, 1.4 * max(float(load.max()), k / load.size))  # room for the legend
        ax.set_ylabel("fraction of tokens")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("expert")
    fig.suptitle(title, fontsize=10)
    return fig


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table: one column per checkpoint, one row per statistic (MoE
    layers in :func:`routing_by_layer`'s order)."""

    rows: list[tuple[str, list[str]]] = []

    def add(name, values):
        rows.append((name, [v if isinstance(v, str) else f"{v:.4f}" for v in values]))

    labels = list(results)
    add("step", [str(r["step"]) for r in results.values()])
    for metric in ("loss", "cross_entropy", "accuracy"):
        add(metric, [r["metrics"].get(metric, float("nan")) for r in results.values()])
    layer_names = sorted(
        {layer for r in results.values() for layer in r["routing"]}, key=layer_order
    )
    for layer in layer_names:
        stats = [r["routing"].get(layer, {}) for r in results.values()]
        add(f"{layer} dropped", [s.get("dropped_fraction", "-") for s in stats])
        add(f"{layer} entropy", [s.get("router_entropy", "-") for s in stats])
        add(f"{layer} gate margin", [s.get("gate_margin", "-") for s in stats])
        add(
            f"{layer} dead experts",
            [str(s["dead_experts"]) if "dead_experts" in s else "-" for s in stats],
        )
        add(f"{layer} shard imbalance", [s.get("shard_imbalance", "-") for s in stats])
        add(
            f"{layer} max load",
            [float(np.max(s["expert_load"])) if "expert_load" in s else "-" for s in stats],
        )
        add(f"{layer} drift", [r["router_drift"].get(layer, "-") for r in results.values()])
    width = max(len(name) for name, _ in rows)
    cols = [max(len(label), *(len(v[i]) for _, v in rows)) for i, label in enumerate(labels)]
    lines = [
        " " * width
        + "  "
        + "  ".join(label.rjust(c) for label, c in zip(labels, cols, strict=True))
    ]
    lines += [
        name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(values, cols, strict=True))
        for name, values in rows
    ]
    lines += [
        f"drift of {label} is '-': {r['router_drift_missing']}"
        for label, r in results.items()
        if r.get("router_drift_missing")
    ]
    return "\n".join(lines)


def seed_table(results: dict[str, dict[str, Any]]) -> str:
    """Mean +- standard deviation (ddof 1) over the seeds of each run family and router,
    for results labelled ``FAMILY/seedN[:ROUTER]`` (``checkpoint_labels`` of a sweep's
    ``FAMILY/seedN`` directories): cross-entropy, its change from the same seed's ``learned``
    router (when evaluated), accuracy, dead experts summed over the MoE layers and the
    dropped fraction averaged over them. Empty when no family has two seeds."""
    groups: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for label, result in results.items():
        checkpoint, _, router = label.partition(":")
        family = run_names.seed_family(checkpoint)
        if family is not None:
            groups.setdefault((family, router or "learned"), []).append((checkpoint, result))

    def stat(values: list[float]) -> str:
        return f"{np.mean(values):.4f} +- {np.std(values, ddof=1):.4f}"

    lines = [
        "| run | router | seeds | cross-entropy | vs learned router | accuracy | dead experts (all "
        "layers) | dropped (mean of layers) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (family, router), members in groups.items():
        if len(members) < 2:
            continue
        entropy = [r["metrics"]["cross_entropy"] for _, r in members]
        learned = [
            results.get(f"{c}:learned", results.get(c, {})).get("metrics", {}).get("cross_entropy")
            for c, _ in members
        ]
        change = (
            "-" if None in learned else stat([e - b for e, b in zip(entropy, learned, strict=True)])
        )
        dead = [
            float(sum(s.get("dead_experts", 0) for s in r["routing"].values())) for _, r in members
        ]
        dropped = [
            float(np.mean([s.get("dropped_fraction", np.nan) for s in r["routing"].values()]))
            for _, r in members
        ]
        lines.append(
            f"| {family} | {router} | {len(members)} | {stat(entropy)} | {change} | "
            f"{stat([r['metrics']['accuracy'] for _, r in members])} | {stat(dead)} | "
            f"{stat(dropped)} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def checkpoint_labels(paths: Sequence[str], given: Sequence[str] = ()) -> list[str]:
    """One label per checkpoint: the user's ``given`` ones (``--label``), else the run's
    :func:`~moe_jax.runtime.run_names.run_labels` label (``learned/seed0``), with ``@STEP``
    when a step is given; a checkpoint named twice gets a ``'``."""
    if given:
        return run_names.checked_labels(given, len(paths))
    split = [RunDir.of_checkpoint(os.path.normpath(p)) for p in paths]
    runs = run_names.run_labels([run_dir.path for run_dir, _ in split])
    unique: list[str] = []
    for run, (_, step) in zip(runs, split, strict=True):
        name = run if step is None else f"{run}@{step}"
        while name in unique:
            name += "'"
        unique.append(name)
    return unique


METRIC_AXES = {
    "accuracy": "eval token accuracy (fraction)",
    "cross_entropy": "eval cross-entropy (nats per token)",
}


def router_summary(
    results: dict[str, dict[str, Any]], metric: str
) -> dict[str, dict[str, tuple[float, float | None, int]]]:
    """``{run family: {router: (mean, std or None, seeds)}}`` of ``metric``: the seeds of a
    family (``run_names.family_of`` of the checkpoint label) pooled, the standard deviation
    (ddof 1) only where there are two or more."""
    values: dict[str, dict[str, list[float]]] = {}
    for r in results.values():
        family = run_names.family_of(r["label"].split("@")[0])
        values.setdefault(family, {}).setdefault(r["router"], []).append(
            r["metrics"].get(metric, np.nan)
        )
    return {
        family: {
            router: (
                float(np.mean(v)),
                float(np.std(v, ddof=1)) if len(v) > 1 else None,
                len(v),
            )
            for router, v in routers.items()
        }
        for family, routers in values.items()
    }


def routers_figure(results: dict[str, dict[str, Any]]):
    """Accuracy and cross-entropy per router (categories on x): a bar per run family,
    side by side, its seeds' mean with their standard deviation as an error bar where it
    has several; the value axes start at 0 so bar heights compare."""
    plt = plotting.pyplot()
    routers = list(dict.fromkeys(r["router"] for r in results.values()))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    several = False
    for ax, metric in zip(axes, METRIC_AXES, strict=True):
        summary = router_summary(results, metric)
        colours = plotting.run_styles(list(summary))
        width = 0.8 / len(summary)
        for i, (family, by_router) in enumerate(summary.items()):
            stats = [by_router.get(name, (np.nan, None, 0)) for name in routers]
            errors = [s[1] or 0.0 for s in stats]
            seeds = max(s[2] for s in stats)
            several |= seeds > 1
            ax.bar(
                np.arange(len(routers)) + (i - (len(summary) - 1) / 2) * width,
                [s[0] for s in stats],
                width,
                yerr=errors if seeds > 1 else None,
                capsize=3,
                color=colours[family]["color"],
                label=family if seeds == 1 else f"{family} ({seeds} seeds)",
            )
        ax.set_xticks(range(len(routers)), routers, rotation=20, ha="right")
        ax.set_xlabel("router used at evaluation")
        ax.set_ylabel(METRIC_AXES[metric])
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    plotting.legend_outside(
        axes[-1], title="run (error bars: std over seeds)" if several else "checkpoint"
    )
    fig.suptitle("the same trained weights evaluated with replaced routers", fontsize=10)
    return fig


def plot_routers(results: dict[str, dict[str, Any]], path: str) -> None:
    """Writes :func:`routers_figure` as ``path``."""
    plotting.save(routers_figure(results), path, dpi=100)


@dataclasses.dataclass
class _Comparison:
    """What evaluating each checkpoint with each router shares: the model and data, the
    routers, where results go, the mesh, and the eval steps compiled so far (one per
    interceptor; variants of the parameters share one)."""

    model: Model
    dataset_cfg: Any
    eval_steps: int
    router_seed: int
    routers: list[str]
    output_dir: str
    ctx: builders.RunContext
    eval_fns: dict[str | None, Any] = dataclasses.field(default_factory=dict)

    def label(self, checkpoint_label: str, router: str) -> str:
        """A result's label: the checkpoint's, with ``:<router>`` unless only ``learned``."""
        return checkpoint_label if self.routers == ["learned"] else f"{checkpoint_label}:{router}"


@gin.configurable(module="eval_script", denylist=["routers", "labels", "overwrite"])
def evaluate(
    checkpoint_paths: str | Sequence[str] | None = None,
    output_dir: str | None = None,
    routers: Sequence[str] = (),
    labels: Sequence[str] = (),
    *,
    model: Model = gin.REQUIRED,
    dataset_cfg: Any = gin.REQUIRED,
    eval_steps: int = 20,
    router_seed: int = 0,
    overwrite: bool = False,
) -> dict[str, dict[str, Any]]:
    """Evaluates each checkpoint on ``dataset_cfg`` with each of ``routers`` (default: as
    trained) and writes JSON, plots and the table.

    Args:
      checkpoint_paths: from ``--checkpoint`` or T5X's gin macro ``CHECKPOINT_PATH``
        (runs/eval.gin).
      output_dir: from ``--output_dir`` or the gin macro ``EVAL_OUTPUT_DIR``.
      routers: counterfactual router names (``counterfactual.ROUTER_VARIANTS``); with
        several (or any but ``learned``), labels are ``<checkpoint label>:<router>``.
      labels: one per checkpoint (``--label``); default :func:`checkpoint_labels`.
      router_seed: seed of the ``random``, ``shuffled`` and ``hash`` routers.
      overwrite: replace ``output_dir``'s results of another comparison (``--overwrite``).

    Returns ``{label: {"checkpoint", "step", "router", "metrics", "routing", "router_drift"}}``
    and ``"router_drift_missing"`` (why there is no drift) for a run without initial routers.
    """

    if not checkpoint_paths:
        raise ValueError(
            "no checkpoint to evaluate: pass --checkpoint=DIR or --gin.CHECKPOINT_PATH=DIR"
        )
    if isinstance(checkpoint_paths, str):
        checkpoint_paths = [checkpoint_paths]
    names = counterfactual.check_variants(list(routers))
    first_run = RunDir.of_checkpoint(checkpoint_paths[0])[0]
    ckpt_labels = checkpoint_labels(checkpoint_paths, labels)
    default_dir = storage.join(
        first_run.eval_results_dir, run_names.comparison_folder(ckpt_labels, names)
    )
    comparison = _Comparison(
        model,
        dataset_cfg,
        eval_steps,
        router_seed,
        names,
        storage.normalize(output_dir or default_dir),
        configured.run_context(),
    )
    result_labels = [comparison.label(label, name) for label in ckpt_labels for name in names]
    with output_lock.writing(comparison.output_dir):  # no other eval checks or writes it
        _check_comparison(comparison.output_dir, result_labels, overwrite)
        results: dict[str, dict[str, Any]] = {}
        for ckpt_label, path in zip(ckpt_labels, checkpoint_paths, strict=True):
            results.update(_evaluate_checkpoint(comparison, path, ckpt_label))
        if jax.process_index() == 0:
            _write_comparison(comparison, results)
    return results


def _evaluate_checkpoint(
    comparison: _Comparison, path: str, ckpt_label: str
) -> dict[str, dict[str, Any]]:
    """The results of the checkpoint at ``path`` with each router, by label; process 0
    writes each as ``<label>.json`` and ``<label>_expert_load.png``."""
    c = comparison
    run_dir = RunDir.of_checkpoint(path)[0]
    restored = builders.restore_model(path, c.model, c.dataset_cfg.input_shapes(), c.ctx)
    initial = router_init.load(run_dir)
    results = {}
    for name in c.routers:
        params, interceptor = counterfactual.variant(
            name, c.model, restored.params, run_dir, c.router_seed
        )
        metrics = routing_telemetry(
            evaluation.run_eval(
                _eval_fn(c, name, interceptor, restored),
                params,
                c.dataset_cfg,
                c.ctx,
                c.eval_steps,
                restored.collections,
            ),
            int(dict(c.ctx.mesh.shape).get("expert", 1)),
        )
        label = c.label(ckpt_label, name)
        routing = routing_by_layer(metrics)
        result = {
            "checkpoint": run_dir.step_dir(restored.step),
            "step": restored.step,
            "label": ckpt_label,
            "router": name,
            "metrics": {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0},
            "routing": {
                layer: {k: np.asarray(v).tolist() for k, v in stats.items()}
                for layer, stats in routing.items()
            },
            "router_drift": router_drift(
                router_init.per_layer_routers(c.model, params), initial, list(routing)
            ),
            "eval_settings": {
                "eval_steps": c.eval_steps,
                "dataset": dataclasses.asdict(c.dataset_cfg),
            },
        }
        if routing and not result["router_drift"]:
            result["router_drift_missing"] = (
                f"{run_dir.router_init_file} does not exist (the routers' initial weights: "
                "`moe-jax train` writes it at step 0, `moe-jax import` when the export holds them)"
            )
        if jax.process_index() == 0:
            _write_result(c.output_dir, label, result, routing)
        results[label] = result
    return results


def _eval_fn(
    comparison: _Comparison, router: str, interceptor: Any, restored: builders.RestoredModel
) -> Any:
    """The jitted eval step for ``router`` (compiled once per interceptor)."""
    key = router if interceptor else None  # variants of the parameters share one step
    if key not in comparison.eval_fns:
        ctx = comparison.ctx
        comparison.eval_fns[key] = steps.jit_eval_step(
            comparison.model,
            restored.params_shardings,
            ctx.mesh,
            ctx.rules,
            ctx.batch_axes,
            restored.collections_shardings,
            eval_fn=counterfactual.intercepted(comparison.model.eval_fn, interceptor)
            if interceptor
            else None,
        )
    return comparison.eval_fns[key]


def _write_result(
    output_dir: str, label: str, result: dict[str, Any], routing: dict[str, dict[str, Any]]
) -> None:
    """Writes one result as ``<label>.json`` and its expert loads as
    ``<label>_expert_load.png`` (``/`` and ``:`` of the label as ``_``)."""
    file_label = run_names.file_stem(label)
    storage.write_text(storage.join(output_dir, f"{file_label}.json"), json.dumps(result, indent=1))
    plot_expert_load(
        routing,
        f"{label} (step {result['step']}): expert load",
        storage.join(output_dir, f"{file_label}_expert_load.png"),
    )


def _write_comparison(comparison: _Comparison, results: dict[str, dict[str, Any]]) -> None:
    """Prints and writes the side-by-side table (``comparison.txt``, ``comparison.json``),
    the seed table when the checkpoints are seeds of families, and ``routers.png`` when
    several routers were evaluated."""
    output_dir = comparison.output_dir
    table = comparison_table(results)
    print(
        "[moe-jax eval] evaluated "
        + evaluation.describe_eval_settings(comparison.eval_steps, comparison.dataset_cfg),
        file=sys.stderr,
    )
    print(table, flush=True)
    storage.write_text(storage.join(output_dir, "comparison.txt"), table + "\n")
    storage.write_text(storage.join(output_dir, "comparison.json"), json.dumps(results, indent=1))
    seeds = seed_table(results)
    if seeds:
        print(seeds, flush=True)
        storage.write_text(storage.join(output_dir, "comparison_seeds.md"), seeds + "\n")
    if len(comparison.routers) > 1:
        plot_routers(results, storage.join(output_dir, "routers.png"))
    print(f"[moe-jax] eval results in {output_dir}", file=sys.stderr)


def _check_comparison(output_dir: str, labels: Sequence[str], overwrite: bool) -> None:
    """Refuses to replace ``output_dir``'s results of another comparison (other checkpoints
    or routers than ``labels``) unless ``overwrite``; the same comparison is re-evaluated.

    Raises:
      ConfigError: naming the file, what it compares and the flags that help.
    """
    path = storage.join(output_dir, "comparison.json")
    if overwrite or not storage.exists(path):
        return
    earlier = list(json.loads(storage.read_text(path)))
    if sorted(earlier) != sorted(labels):
        raise errors.ConfigError(
            f"{path} holds another comparison ({', '.join(earlier)}; this one: "
            f"{', '.join(labels)}); pass --overwrite to replace it, or another --output_dir"
        )


def main(argv: list[str] | None = None) -> int:
    parser = builders.build_parser("moe-jax eval", __doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        type=storage.normalize,
        action="append",
        default=[],
        metavar="DIR[/STEP]",
        help="a MODEL_DIR (latest step) or MODEL_DIR/STEP; repeat to compare "
        "(or gin CHECKPOINT_PATH)",
    )
    parser.add_argument(
        "--output_dir",
        type=storage.normalize,
        default=None,
        help="where JSON/PNG/table go (default: FIRST_MODEL_DIR/eval_results/COMPARED, e.g. "
        "learned+frozen or learned.routers-learned+random; "
        "or gin EVAL_OUTPUT_DIR given on the command line, never a run's config's)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the output directory's results of another comparison",
    )
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME",
        help="the label of each --checkpoint, in order (default: the shortest path suffix "
        "that tells the runs apart, e.g. learned/seed0)",
    )
    parser.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="NAME",
        help="evaluate with the routers replaced: learned (default), init, random, hash, "
        "uniform, shuffled; repeat to compare",
    )
    parser.add_argument(
        "--eval_steps",
        type=int,
        default=None,
        metavar="N",
        help="batches to evaluate (default: the run's, from MODEL_DIR/eval_settings.json)",
    )
    parser.add_argument(
        "--eval_settings",
        choices=("run", "gin"),
        default="run",
        help="run (default): the eval settings the first run recorded (batches, batch size, "
        "feature lengths, task, split); gin: runs/eval.gin's and the gin flags'",
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    distributed.initialize(args)
    first = gin_flags.first_checkpoint(args)
    args.gin_file = run_config.run_gin_files(args, first, ["runs/eval.gin"], command="moe-jax eval")
    apply_eval_settings(args, first)
    gin_utils.parse_gin(args)
    evaluate(
        output_dir=args.output_dir or gin_flags.user_value(args, "EVAL_OUTPUT_DIR"),
        overwrite=args.overwrite,
        **{
            k: v
            for k, v in (
                ("checkpoint_paths", args.checkpoint),
                ("routers", args.router),
                ("labels", args.label),
            )
            if v
        },
    )
    return 0


def apply_eval_settings(args, checkpoint: str | None) -> None:
    """Adds to ``args``' gin bindings the eval settings ``--eval_settings`` / ``--eval_steps``
    ask for (the recorded ones before the command line's own bindings, which win) and says
    on stderr which they are."""

    run_dir = RunDir.of_checkpoint(checkpoint)[0] if checkpoint else None
    recorded = (
        evaluation.read_eval_settings(run_dir) if run_dir and args.eval_settings == "run" else None
    )
    if recorded is not None and run_dir:
        path = run_dir.eval_settings_file
        config_gate.refuse_untrusted_modules(  # the task module, imported like the config's
            path,
            [(f"{evaluation.EVAL_SCOPE}.module", None, recorded["dataset"].get("module"))],
            args,
        )
        args.gin_dot_bindings[:0] = evaluation.eval_settings_bindings(recorded)
        source = f"the run's, from {path} (--eval_settings=gin: runs/eval.gin's)"
    elif args.eval_settings == "run" and run_dir:
        source = f"runs/eval.gin's and the gin flags' ({run_dir} recorded none)"
    else:
        source = "runs/eval.gin's and the gin flags'"
    if args.eval_steps is not None:
        if args.eval_steps <= 0:
            raise GinConfigError(f"--eval_steps={args.eval_steps}: expected a positive integer")
        args.gin_dot_bindings.append(f"eval_script.evaluate.eval_steps = {args.eval_steps}")
        source += f", --eval_steps={args.eval_steps}"
    if jax.process_index() == 0:
        print(f"[moe-jax eval] eval settings: {source}", file=sys.stderr)
