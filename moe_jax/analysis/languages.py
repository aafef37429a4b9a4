"""Languages as latent clusters: does a router route by language? (`moe-jax analyze languages`)

The paper's claim is that a learned router discovers the latent cluster structure of its
data. The embedded corpus is one text in 20 languages, so language is a known latent
cluster of real data: each example's label comes from the corpus' structure
(:func:`moe_jax.data.labels.label_groups`: one task per language; for the user's text
corpus given as ``{label: pattern}`` groups, one task per label, and "language" below reads
"label"). Per MoE layer, over the valid tokens of every label's examples (each token
labelled with its example's language):

* ``bits``: mutual information ``I(language; top-1 expert)`` (plug-in estimator, bits);
  ``shuffled_label_bits``: the same with the labels permuted over *examples* (tokens of
  one example keep sharing a label), the estimator's floor at this sample size;
  ``excess_bits`` = the difference; ``language_entropy_bits`` = ``H(language)``, the most
  ``bits`` can be (one expert per language).
* ``sparsity``: the paper's average sparsity per cluster ``E_i exp H(E_{x in C_i} R(x))``
  with languages as clusters (:func:`moe_jax.synthetic.metrics.sparsity`, the effective
  number of experts a language's tokens use; 1 = one expert per language, E = uniform);
  ``sparsity_shuffled_router``: the same with the router's input rows permuted
  (:func:`moe_jax.analysis.counterfactual.shuffle_router_inputs`, the paper's baseline).
* ``top1_share [languages, experts]``: fraction of each language's tokens whose first
  choice is each expert (the heatmap).

Several checkpoints (``--checkpoint`` repeated, or ``--all_steps`` for every saved step of
each run) give curves over steps, one line per run. Runs that differ only by their seed
directory (``learned/seed0``, ``learned/seed1``: a sweep family's layout) form one family:
``seed_summary`` (in ``languages.json``) gives the mean and standard deviation over its
seeds at each step they share, and the curves draw the family's seeds in one colour with
their mean in bold.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import partitioning, storage
from moe_jax.analysis import counterfactual, plots, seeds
from moe_jax.analysis.positions import mutual_information_bits
from moe_jax.runtime import builders, checkpoints, configured, router_init, routing, run_names
from moe_jax.runtime.run_dir import RunDir
from moe_jax.synthetic import metrics as synthetic_metrics

# ------------------------------------------------------------------------------ statistics


def language_information(
    top1: np.ndarray,
    row_labels: np.ndarray,
    valid: np.ndarray,
    num_labels: int,
    num_experts: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """``I(language; top-1 expert)`` in bits over the valid tokens, its shuffled-label floor
    and ``H(language)``.

    Args:
      top1: ``int [n, length]`` first-choice expert; valid: ``bool [n, length]``.
      row_labels: ``int [n]`` label of each example (row).
    """
    labels = np.broadcast_to(row_labels[:, None], valid.shape)
    e, lab = top1[valid], labels[valid]
    bits = mutual_information_bits(lab, e, num_labels, num_experts)
    shuffled = np.broadcast_to(rng.permutation(row_labels)[:, None], valid.shape)[valid]
    floor = mutual_information_bits(shuffled, e, num_labels, num_experts)
    freq = np.bincount(lab, minlength=num_labels) / max(lab.size, 1)
    h = float(-np.sum(freq[freq > 0] * np.log2(freq[freq > 0])))
    return {
        "bits": bits,
        "shuffled_label_bits": floor,
        "excess_bits": bits - floor,
        "language_entropy_bits": h,
    }


def top1_share(
    top1: np.ndarray, row_labels: np.ndarray, valid: np.ndarray, num_labels: int, num_experts: int
) -> np.ndarray:
    """``[labels, experts]`` fraction of each label's valid tokens with each first choice."""
    labels = np.broadcast_to(row_labels[:, None], valid.shape)[valid]
    counts = np.bincount(labels * num_experts + top1[valid], minlength=num_labels * num_experts)
    counts = counts.reshape(num_labels, num_experts).astype(np.float64)
    return counts / np.maximum(counts.sum(1, keepdims=True), 1.0)


def cluster_sparsity(
    probs: np.ndarray, row_labels: np.ndarray, valid: np.ndarray, num_labels: int
) -> float:
    """The paper's average sparsity per cluster (``exp`` of the entropy of each language's
    mean router distribution, averaged over languages) from ``probs [n, length, experts]``."""
    labels = np.broadcast_to(row_labels[:, None], valid.shape)[valid]
    return float(synthetic_metrics.sparsity(probs[valid], labels, num_labels)["effective"])


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def analyze_layer(
    layer: routing.LayerRouting,
    row_labels: np.ndarray,
    num_labels: int,
    shuffled_kernel: np.ndarray | None,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Every statistic of the module docstring for one layer (``shuffled_kernel [d_model,
    experts]``: the router with permuted inputs, or None for routers without one kernel)."""
    valid = layer.valid
    top1 = np.where(valid, layer.expert_index[..., 0], 0)
    stats: dict[str, Any] = {
        "num_tokens": int(valid.sum()),
        "num_examples": len(row_labels),
        "num_experts": layer.num_experts,
    }
    stats.update(language_information(top1, row_labels, valid, num_labels, layer.num_experts, rng))
    stats["sparsity"] = cluster_sparsity(layer.router_probs, row_labels, valid, num_labels)
    stats["sparsity_shuffled_router"] = (
        None
        if shuffled_kernel is None
        else cluster_sparsity(
            _softmax(layer.router_inputs @ shuffled_kernel), row_labels, valid, num_labels
        )
    )
    stats["top1_share"] = top1_share(
        top1, row_labels, valid, num_labels, layer.num_experts
    ).tolist()
    return stats


def router_kernels(routers: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{"encoder/layers_3": w [d_model, experts]}``: each MoE layer's single router kernel
    of ``routers`` (``{per-layer name: weights}``,
    :func:`moe_jax.runtime.router_init.per_layer_routers`; layers whose router has several
    kernels, e.g. noisy top-k, are left out)."""

    kernels: dict[str, list[np.ndarray]] = {}
    for name, leaf in routers.items():
        if name.endswith("/w") and np.ndim(leaf) == 2:
            parts = name.split("/router/")[0].split("/")
            layer = "/".join(p for p in parts if p not in routing._SKIPPED_PATH_PARTS)
            kernels.setdefault(layer, []).append(np.asarray(jax.device_get(leaf)))
    return {layer: ws[0] for layer, ws in kernels.items() if len(ws) == 1}


# ------------------------------------------------------------------------------------ data


def labelled_examples(
    groups: Mapping[str, str],
    feature_lengths: Mapping[str, int],
    split: str,
    max_examples_per_label: int,
    seed: int,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The first ``max_examples_per_label`` unpacked examples of each label's task:
    (features ``{name: int32 [n, length]}``, ``int [n]`` label index in ``groups`` order)."""
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import pipeline

    rows: dict[str, list[np.ndarray]] = {}
    labels: list[int] = []
    for index, task in enumerate(groups.values()):
        ds = pipeline.get_dataset(
            task,
            dict(feature_lengths),
            split,
            1,
            shuffle=False,
            seed=seed,
            pack=False,
            num_epochs=1,
        )
        for example in ds.take(max_examples_per_label).as_numpy_iterator():
            for name, value in example.items():
                rows.setdefault(name, []).append(value)
            labels.append(index)
    if not labels:
        raise ValueError(f"the {split!r} split gave no examples for any label")
    return {name: np.concatenate(v) for name, v in rows.items()}, np.asarray(labels)


def global_batches(
    features: Mapping[str, np.ndarray], batch_size: int, ctx: Any
) -> Iterator[dict[str, jax.Array]]:
    """``features`` in global batches of ``batch_size`` rows, the last padded with empty
    rows (never routed); each process feeds its contiguous share of every batch."""

    n = len(next(iter(features.values())))
    per_process = partitioning.per_process_batch_size(batch_size)
    for start in range(0, n, batch_size):
        batch = {}
        for name, value in features.items():
            block = value[start : start + batch_size]
            pad = np.zeros((batch_size - len(block), *block.shape[1:]), block.dtype)
            block = np.concatenate([block, pad])
            batch[name] = block[
                jax.process_index() * per_process : (jax.process_index() + 1) * per_process
            ]
        yield builders.global_batch(batch, ctx)


# ------------------------------------------------------------------------------- checkpoints


def expand_checkpoints(paths: Sequence[str], all_steps: bool) -> list[str]:
    """``paths``, or with ``all_steps`` every saved step of each path's ``MODEL_DIR``
    (``MODEL_DIR/checkpoints/STEP``, ascending)."""

    if not all_steps:
        return list(paths)
    out = []
    for path in paths:
        run_dir = RunDir.of_checkpoint(path)[0]
        steps = checkpoints.Checkpointer(run_dir).all_steps()
        if not steps:
            raise FileNotFoundError(f"--checkpoint={path!r}: no checkpoints in {run_dir}")
        out += [run_dir.step_dir(s) for s in sorted(steps)]
    return out


# The per-layer statistics averaged over a family's seeds (``seed_summary`` in languages.json).
SEED_STATISTICS = ("bits", "shuffled_label_bits", "sparsity")


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per layer of one checkpoint's result."""
    lines = []
    for name, s in result["layers"].items():
        shuffled = s["sparsity_shuffled_router"]
        lines.append(
            f"{result['run']}@{result['step']} {name}: I(lang;expert) {s['bits']:.3f} bits "
            f"(shuffled labels {s['shuffled_label_bits']:.3f}, "
            f"H(lang) {s['language_entropy_bits']:.2f}); "
            f"sparsity {s['sparsity']:.2f} (shuffled router "
            f"{'-' if shuffled is None else f'{shuffled:.2f}'}, of {s['num_experts']})"
        )
    return lines


@gin.configurable(module="languages_script", denylist=["checkpoint_paths", "out_dir", "all_steps"])
def analyze(
    checkpoint_paths: Sequence[str],
    out_dir: str | None = None,
    all_steps: bool = False,
    *,
    model: Any = gin.REQUIRED,
    mixture_or_task_name: str = gin.REQUIRED,
    task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
    split: str = "train",
    max_examples_per_label: int = 64,
    batch_size: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Routes each label's examples through every checkpoint and writes ``languages.json``,
    a heatmap per checkpoint and, with several steps, ``languages_curves.png``.

    Args:
      checkpoint_paths: checkpoints of one or several runs of the same model.
      all_steps: analyse every saved step of each checkpoint's run.
      mixture_or_task_name: the run's task (its labels come from
        :func:`moe_jax.data.labels.label_groups`).
      split: ``train`` by default: the embedded corpus' validation split holds 3-7
        examples per language, too few for a 20 x 32 contingency table.
      max_examples_per_label: unpacked examples per language (the first ones, unshuffled).
      seed: of the shuffled labels and the shuffled router.

    Raises:
      moe_jax.data.labels.NoLabelsError: the run's corpus or task has no labels.
    """
    # deferred on purpose: TensorFlow/seqio load only when data is read
    from moe_jax.data import labels as data_labels

    groups = data_labels.label_groups(mixture_or_task_name)
    paths = expand_checkpoints(checkpoint_paths, all_steps)
    features, row_labels = labelled_examples(
        groups, task_feature_lengths, split, max_examples_per_label, seed
    )
    input_shapes = {
        "encoder_input_tokens": (batch_size, task_feature_lengths["inputs"]),
        "decoder_input_tokens": (batch_size, task_feature_lengths["targets"]),
    }
    results = _route_checkpoints(
        paths, model, input_shapes, features, (row_labels, len(groups)), batch_size, seed
    )
    out_dirs = output_dirs(paths, out_dir)
    report: dict[str, Any] = {
        "labels": list(groups),
        "split": split,
        "max_examples_per_label": max_examples_per_label,
        "num_examples": {label: int(np.sum(row_labels == i)) for i, label in enumerate(groups)},
        "checkpoints": results,
        "seed_summary": seeds.checkpoint_summary(results, SEED_STATISTICS),
    }
    if jax.process_index() == 0:
        for line in seeds.summary_lines(report["seed_summary"]):
            print(line, flush=True)
        for folder in out_dirs:
            report["files"] = plots.write_languages(report, folder)
            storage.write_text(storage.join(folder, "languages.json"), json.dumps(report, indent=1))
            print(f"[moe-jax] language analysis in {folder}", file=sys.stderr)
    return report


def output_dirs(paths: Sequence[str], out_dir: str | None) -> list[str]:
    """Where the analysis of checkpoints ``paths`` goes: ``out_dir`` (``--out``); by default
    the run's ``MODEL_DIR/analysis`` or, for several runs, each run's
    ``MODEL_DIR/analysis/<the runs compared>`` (``learned+frozen``,
    ``run_names.comparison_folder``), so that every run holds the comparison it is part of."""
    if out_dir:
        return [storage.normalize(out_dir)]
    runs = list(dict.fromkeys(RunDir.of_checkpoint(p)[0].path for p in paths))
    if len(runs) == 1:
        return [RunDir(runs[0]).analysis_dir]
    name = run_names.comparison_folder(run_names.run_labels(runs))
    return [storage.join(RunDir(run).analysis_dir, name) for run in runs]


def _route_checkpoints(
    paths: Sequence[str],
    model: Any,
    input_shapes: dict[str, tuple[int, int]],
    features: dict[str, np.ndarray],
    labels: tuple[np.ndarray, int],
    batch_size: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Per checkpoint, ``{"checkpoint", "run", "step", "layers": {name: analyze_layer(...)}}``
    of routing ``features`` (``[examples, length]`` per feature) whose rows carry ``labels``
    (``(row labels [examples], number of labels)``); process 0 prints each one's summary."""
    row_labels, num_labels = labels
    ctx = configured.run_context()
    fn = None
    results = []
    run_dirs = [RunDir.of_checkpoint(path)[0].path for path in paths]
    run_label = dict(zip(run_dirs, run_names.run_labels(run_dirs), strict=True))
    for path, run_dir in zip(paths, run_dirs, strict=True):
        restored = builders.restore_model(path, model, input_shapes, ctx)
        params, step = restored.params, restored.step
        if fn is None:
            fn = routing.restored_routing_fn(model, restored, ctx)
        layers = routing.collect_routing(
            fn, params, global_batches(features, batch_size, ctx), restored.collections
        )
        routers = router_init.per_layer_routers(model, params)
        shuffled = router_kernels(counterfactual.shuffle_router_inputs(routers, seed))
        n = len(row_labels)
        rng = np.random.default_rng(seed)
        result = {
            "checkpoint": storage.normalize(path),
            "run": run_label[run_dir],
            "step": step,
            "layers": {
                name: analyze_layer(
                    layer.first_rows(n), row_labels, num_labels, shuffled.get(name), rng
                )
                for name, layer in layers.items()
            },
        }
        results.append(result)
        if jax.process_index() == 0:
            print("\n".join(summary_lines(result)), flush=True)
    return results
