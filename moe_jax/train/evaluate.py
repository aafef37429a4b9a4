"""`moe-jax eval`: evaluate one or more checkpoints and compare them side by side.

    moe-jax eval --checkpoint=/runs/learned --checkpoint=/runs/frozen/2000
    moe-jax eval --gin_file=models/t5_moe.gin --gin_file=models/size_d32.gin \\
        --checkpoint=/runs/learned --checkpoint=/runs/frozen/2000 --checkpoint=/runs/dense

Gin: ``runs/eval.gin``, then the first run's ``MODEL_DIR/config.gin`` when no ``--gin_file``
is given (the line ``gin config: ...`` says which); otherwise ``runs/eval.gin`` then the
``--gin_file`` files. T5X's ``--gin.CHECKPOINT_PATH`` / ``--gin.EVAL_OUTPUT_DIR`` work as
``--checkpoint`` / ``--output_dir``.

Each ``--checkpoint`` is a ``MODEL_DIR`` (latest step) or ``MODEL_DIR/STEP``; its
parameters are restored onto the current mesh (whatever mesh saved them) and evaluated on
``eval_steps`` batches of the eval split with the eval capacity factor. Results, per
checkpoint: loss, token accuracy and per-MoE-layer routing statistics (expert load
histogram, dropped fraction, router entropy, router weight drift from initialisation
``||W - W0|| / ||W0||``), written as ``<label>.json`` and ``<label>_expert_load.png`` in
the output directory, plus ``comparison.txt``/``comparison.json`` with the side-by-side
table that is also printed.

A checkpoint trained from another model config than the gin files describe is refused
with the mismatching parameter names (evaluate each with its own gin files).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax.train import distributed, gin_utils, setup

_MOE_KEY = re.compile(r"^moe/(.+)/([^/]+)$")


def run_eval(eval_fn, params, dataset_cfg, ctx, eval_steps: int, collections=None) -> dict[str, Any]:
    """Mean of ``eval_fn(params, batch, collections)`` metrics over the first ``eval_steps``
    batches of ``dataset_cfg`` (``num_tokens`` summed); ``collections``: the model's
    non-parameter state (e.g. MoE balancing biases), if any."""
    totals: dict[str, np.ndarray] = {}
    count = 0
    for local in setup.eval_batches(dataset_cfg, eval_steps):
        metrics = jax.device_get(eval_fn(params, setup.global_batch(local, ctx), collections))
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
        count += 1
    if not count:
        raise ValueError(f"the {dataset_cfg.split!r} split of {dataset_cfg.mixture_or_task_name!r} "
                         "gave no batches")
    return {name: (value / count if name != "num_tokens" else value) for name, value in totals.items()}


def _restore_collections(path: str, step: int, abstract_state) -> Any:
    """The non-parameter state collections (e.g. MoE balancing biases) saved at ``step``
    of ``path``'s run (restored with the rest of the train state, which is dropped)."""
    from moe_jax.train import checkpoints

    ckpt = checkpoints.Checkpointer(checkpoints.split_checkpoint_path(path)[0], read_only=True)
    try:
        return ckpt.restore(step, abstract_state)[0].collections
    finally:
        ckpt.close()


def routing_by_layer(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"encoder/layers_3": {"expert_load": [...], "dropped_fraction": x, ...}, ...}``."""
    layers: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        if m := _MOE_KEY.match(key):
            layers.setdefault(m.group(1), {})[m.group(2)] = value
    return dict(sorted(layers.items()))


def router_drift(params, initial: dict[str, np.ndarray] | None, layers: Sequence[str]) -> dict[str, float]:
    """Per MoE layer, ``||W - W0|| / ||W0||`` over that layer's router parameters
    (0 for a frozen router); empty when the run kept no initial router weights."""
    from moe_jax.train import checkpoints

    if not initial:
        return {}
    current = {k: np.asarray(jax.device_get(v)) for k, v in checkpoints.router_params(params).items()}
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
    import matplotlib.pyplot as plt

    fig = expert_load_figure(layers, title)
    if fig is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def expert_load_figure(layers: dict[str, dict[str, Any]], title: str):
    """One bar chart per MoE layer of the fraction of tokens routed to each expert, with
    the uniform load as a dashed line. A token counts once per chosen expert, so top-k
    loads sum to k and the uniform load is k/E; experts are labelled by integer index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    loads = {name: np.asarray(stats["expert_load"]) for name, stats in layers.items()
             if "expert_load" in stats}
    if not loads:
        return None
    fig, axes = plt.subplots(len(loads), 1, figsize=(7, 1.9 * len(loads) + 0.7), squeeze=False)
    for ax, (name, load) in zip(axes[:, 0], loads.items()):
        k = float(load.sum())  # experts chosen per token
        ax.bar(np.arange(load.size), load, color="tab:blue", label="fraction of tokens")
        ax.axhline(k / load.size, color="gray", linestyle="--", linewidth=0.8,
                   label=f"uniform: k/E = {k:.3g}/{load.size}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(-0.6, load.size - 0.4)
        ax.set_ylim(0, 1.4 * max(float(load.max()), k / load.size))  # room for the legend
        ax.set_ylabel("load")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("expert")
    fig.suptitle(title, fontsize=10)
    return fig


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table: one column per checkpoint, one row per statistic."""
    rows: list[tuple[str, list[str]]] = []

    def add(name, values):
        rows.append((name, [v if isinstance(v, str) else f"{v:.4f}" for v in values]))

    labels = list(results)
    add("step", [str(r["step"]) for r in results.values()])
    for metric in ("loss", "cross_entropy", "accuracy"):
        add(metric, [r["metrics"].get(metric, float("nan")) for r in results.values()])
    layer_names = sorted({layer for r in results.values() for layer in r["routing"]})
    for layer in layer_names:
        stats = [r["routing"].get(layer, {}) for r in results.values()]
        add(f"{layer} dropped", [s.get("dropped_fraction", "-") for s in stats])
        add(f"{layer} entropy", [s.get("router_entropy", "-") for s in stats])
        add(f"{layer} max load", [float(np.max(s["expert_load"])) if "expert_load" in s else "-"
                                  for s in stats])
        add(f"{layer} drift", [r["router_drift"].get(layer, "-") for r in results.values()])
    width = max(len(name) for name, _ in rows)
    cols = [max(len(label), *(len(v[i]) for _, v in rows)) for i, label in enumerate(labels)]
    lines = [" " * width + "  " + "  ".join(label.rjust(c) for label, c in zip(labels, cols))]
    lines += [name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(values, cols))
              for name, values in rows]
    return "\n".join(lines)


def checkpoint_labels(paths: Sequence[str]) -> list[str]:
    """Short unique labels (run directory names, with the step when given)."""
    labels = []
    for path in paths:
        p = os.path.normpath(path)
        label = os.path.basename(p) if not os.path.basename(p).isdigit() else \
            f"{os.path.basename(os.path.dirname(p))}@{os.path.basename(p)}"
        while label in labels:
            label += "'"
        labels.append(label)
    return labels


@gin.configurable(module="eval_script")
def evaluate(checkpoint_paths: str | Sequence[str] | None = None, output_dir: str | None = None, *,
             model: Any = gin.REQUIRED, dataset_cfg: Any = gin.REQUIRED,
             eval_steps: int = 20) -> dict[str, dict[str, Any]]:
    """Evaluates each checkpoint on ``dataset_cfg`` and writes JSON, plots and the table.

    ``checkpoint_paths`` and ``output_dir`` come from ``--checkpoint`` / ``--output_dir`` or
    T5X's gin macros ``CHECKPOINT_PATH`` / ``EVAL_OUTPUT_DIR`` (runs/eval.gin).

    Returns ``{label: {"checkpoint", "step", "metrics", "routing", "router_drift"}}``.
    """
    from moe_jax.train import checkpoints, train_state, train_step

    if not checkpoint_paths:
        raise ValueError("no checkpoint to evaluate: pass --checkpoint=DIR or --gin.CHECKPOINT_PATH=DIR")
    if isinstance(checkpoint_paths, str):
        checkpoint_paths = [checkpoint_paths]

    ctx = setup.run_context()
    input_shapes = dataset_cfg.input_shapes()
    params_sharding = train_state.param_shardings(model, input_shapes, ctx.mesh, ctx.rules)
    target = train_state.abstract_with_shardings(setup.abstract_params(model, input_shapes), params_sharding)
    full = setup.build_train_setup(model, input_shapes, ctx) if model.state_logical_axes(input_shapes) else None
    eval_fn = train_step.jit_eval_step(model, params_sharding, ctx.mesh, ctx.batch_axes,
                                       full.shardings.collections if full else None)
    output_dir = output_dir or os.path.join(checkpoints.split_checkpoint_path(checkpoint_paths[0])[0],
                                            "eval_results")
    os.makedirs(output_dir, exist_ok=True)
    results = {}
    for label, path in zip(checkpoint_labels(checkpoint_paths), checkpoint_paths):
        model_dir = checkpoints.split_checkpoint_path(path)[0]
        params, step, _ = checkpoints.restore_params_from(path, target)
        collections = _restore_collections(path, step, full.abstract_state) if full else None
        metrics = run_eval(eval_fn, params, dataset_cfg, ctx, eval_steps, collections)
        routing = routing_by_layer(metrics)
        results[label] = {
            "checkpoint": f"{os.path.join(model_dir, 'checkpoints')}/{step}", "step": step,
            "metrics": {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0},
            "routing": {layer: {k: np.asarray(v).tolist() for k, v in stats.items()}
                        for layer, stats in routing.items()},
            "router_drift": router_drift(params, checkpoints.load_router_init(model_dir), list(routing)),
        }
        if jax.process_index() == 0:
            with open(os.path.join(output_dir, f"{label}.json"), "w") as f:
                json.dump(results[label], f, indent=1)
            plot_expert_load(routing, f"{label} (step {step}): expert load",
                             os.path.join(output_dir, f"{label}_expert_load.png"))
    table = comparison_table(results)
    if jax.process_index() == 0:
        print(table, flush=True)
        with open(os.path.join(output_dir, "comparison.txt"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(output_dir, "comparison.json"), "w") as f:
            json.dump(results, f, indent=1)
        print(f"[moe-jax] eval results in {output_dir}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = setup.build_parser("moe-jax eval", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="DIR[/STEP]",
                        help="a MODEL_DIR (latest step) or MODEL_DIR/STEP; repeat to compare "
                             "(or gin CHECKPOINT_PATH)")
    parser.add_argument("--output_dir", default=None,
                        help="where JSON/PNG/table go (default: FIRST_MODEL_DIR/eval_results; "
                             "or gin EVAL_OUTPUT_DIR)")
    args = gin_utils.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    distributed.initialize(args)
    args.gin_file = gin_utils.run_gin_files(
        gin_utils.first_checkpoint(args), ["runs/eval.gin"], args.gin_file,
        command="moe-jax eval")
    gin_utils.parse_gin(args)
    evaluate(**{k: v for k, v in (("checkpoint_paths", args.checkpoint),
                                  ("output_dir", args.output_dir)) if v})
    return 0
