"""Expert co-activation and cross-layer routing consistency (`moe-jax analyze coactivation`;
OLMoE, arXiv:2409.02060, Sec. 5.3 and Fig. 24).

Per MoE layer, over the tokens of a routing trace (:mod:`moe_jax.analysis.trace`):

* ``coactivation [experts, experts]``: ``C[i, j] = P(j among a token's k | i among them)``,
  the share of the tokens routed to ``i`` that also chose ``j`` (diagonal 0; needs k >= 2).
  ``top_partner`` = the mean over used experts of ``max_j C[i, j]`` and ``max_pair`` =
  ``max C``; ``*_random``: the same for a random router with the layer's load (each token
  draws ``k`` distinct experts with probabilities proportional to the load), the level of
  co-activation that load alone gives. High values over the floor mean experts that work in
  pairs (OLMoE finds little co-activation: specialised, not redundant, experts).

Across layers of one stack (they route the same tokens), ``cross_layer.predictability
[layers, layers]``: how well layer i's top-1 expert predicts layer j's, the accuracy of the
best map from i's experts to j's (``sum_e max_f n(e, f) / n``; 1: j's expert is a function
of i's), with ``cross_layer.random``: the same with layer j's choices permuted over tokens
(the accuracy of always predicting j's commonest expert, plus the sample-size bias). None
between layers of different stacks. Each layer's entry repeats its row's step to the next
layer of its stack as ``predicts_next`` and ``predicts_next_random`` (None for a stack's
last layer).

Runs of one family (``learned/seed0``, ``learned/seed1``, ...) also get ``seed_summary``:
the mean and standard deviation over the seeds of :data:`SEED_STATISTICS` per step and
layer (:mod:`moe_jax.analysis.seeds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from moe_jax.analysis import languages, seeds, trace_plots
from moe_jax.analysis import trace as trace_lib

# The per-layer statistics averaged over a family's seeds (``seed_summary``).
SEED_STATISTICS = (
    "top_partner",
    "top_partner_random",
    "max_pair",
    "max_pair_random",
    "predicts_next",
    "predicts_next_random",
)


def chosen(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """``bool [tokens, num_experts]``: which experts each token of ``experts [tokens, k]``
    chose."""
    out = np.zeros((len(experts), num_experts), bool)
    np.put_along_axis(out, experts.astype(np.int64), True, axis=1)
    return out


def coactivation_matrix(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """``float64 [E, E]``: ``C[i, j]`` = share of the tokens choosing ``i`` that also chose
    ``j`` (rows of unused experts and the diagonal 0)."""
    onehot = chosen(experts, num_experts).astype(np.float64)
    pairs = onehot.T @ onehot
    counts = np.diag(pairs).copy()
    np.fill_diagonal(pairs, 0.0)
    return pairs / np.maximum(counts, 1.0)[:, None]


def random_router(load: np.ndarray, tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``int [tokens, k]``: ``k`` distinct experts per token drawn with probabilities
    proportional to ``load [experts]`` (Gumbel top-k; experts of load 0 only when needed)."""
    logits = np.log(np.maximum(load, 1e-12))[None, :] + rng.gumbel(size=(tokens, len(load)))
    return np.argsort(-logits, axis=1)[:, :k]


def pair_summary(matrix: np.ndarray, used: np.ndarray) -> dict[str, float]:
    """``{"top_partner", "max_pair"}`` of a co-activation matrix over ``used`` experts."""
    if not used.any():
        return {"top_partner": 0.0, "max_pair": 0.0}
    return {
        "top_partner": float(np.mean(matrix[used].max(axis=1))),
        "max_pair": float(matrix.max()),
    }


def analyze_layer(layer: trace_lib.LayerTrace, rng: np.random.Generator) -> dict[str, Any]:
    """The co-activation statistics of one layer (``None`` values for k = 1)."""
    e, k = layer.num_experts, layer.k
    if k < 2:
        return {"k": k, "num_experts": e, "coactivation": None, "top_partner": None}
    matrix = coactivation_matrix(layer.experts, e)
    load = chosen(layer.experts, e).mean(axis=0)
    baseline = coactivation_matrix(random_router(load, len(layer.experts), k, rng), e)
    model, floor = pair_summary(matrix, load > 0), pair_summary(baseline, load > 0)
    return {
        "k": k,
        "num_experts": e,
        "coactivation": matrix.tolist(),
        "top_partner": model["top_partner"],
        "max_pair": model["max_pair"],
        "top_partner_random": floor["top_partner"],
        "max_pair_random": floor["max_pair"],
    }


def predictability(source: np.ndarray, target: np.ndarray) -> float:
    """Accuracy of the best map from ``source [tokens]`` labels to ``target [tokens]``
    labels: ``sum_e max_f n(e, f) / n``."""
    width = int(target.max(initial=0)) + 1
    joint = np.bincount(source.astype(np.int64) * width + target, minlength=0)
    joint = np.pad(joint, (0, (-len(joint)) % width)).reshape(-1, width)
    return float(joint.max(axis=1).sum() / max(len(source), 1))


def cross_layer(
    layers: dict[str, trace_lib.LayerTrace], rng: np.random.Generator
) -> dict[str, Any]:
    """``{"layers": names, "predictability": [[...]], "random": [[...]]}`` of every ordered
    pair of layers (None between layers that routed different tokens)."""
    names = list(layers)
    model: list[list[float | None]] = [[None] * len(names) for _ in names]
    floor: list[list[float | None]] = [[None] * len(names) for _ in names]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if layers[a].same_tokens(layers[b]):
                source, target = layers[a].experts[:, 0], layers[b].experts[:, 0]
                model[i][j] = predictability(source, target)
                floor[i][j] = predictability(source, rng.permutation(target))
    return {"layers": names, "predictability": model, "random": floor}


def next_layer(cross: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per layer of :func:`cross_layer`'s result: ``{"predicts_next", "predicts_next_random"}``,
    its predictability of the next layer when that layer routed the same tokens, else None."""
    names = cross["layers"]
    out = {}
    for i, name in enumerate(names):
        last = i + 1 == len(names)
        out[name] = {
            "predicts_next": None if last else cross["predictability"][i][i + 1],
            "predicts_next_random": None if last else cross["random"][i][i + 1],
        }
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per layer, then the cross-layer predictability of consecutive layers."""
    lines = []
    for name, s in result["layers"].items():
        if s["top_partner"] is None:
            lines.append(f"{result['run']}@{result['step']} {name}: k = 1, no pairs")
            continue
        lines.append(
            f"{result['run']}@{result['step']} {name}: top partner {s['top_partner']:.3f} "
            f"(random router {s['top_partner_random']:.3f}), max pair {s['max_pair']:.3f} "
            f"(random router {s['max_pair_random']:.3f})"
        )
    cross = result["cross_layer"]
    names = cross["layers"]
    for i in range(len(names) - 1):
        value, floor = cross["predictability"][i][i + 1], cross["random"][i][i + 1]
        if value is not None:
            lines.append(
                f"{result['run']}@{result['step']} {names[i]} -> {names[i + 1]}: "
                f"predictability {value:.3f} (random {floor:.3f})"
            )
    return lines


@gin.configurable(
    module="coactivation_script", denylist=["checkpoint_paths", "out_dir", "all_steps", "trace_dir"]
)
def analyze(
    checkpoint_paths: Sequence[str],
    out_dir: str | None = None,
    all_steps: bool = False,
    trace_dir: str | None = None,
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """Writes ``coactivation.json`` (``{"checkpoints": [{"run", "step", "data", "layers":
    {name: analyze_layer(...) | next_layer(...)[name]}, "cross_layer": cross_layer(...)}],
    "seed_summary"}``) and one PNG per checkpoint to ``out_dir`` (default:
    ``languages.output_dirs``); ``trace_dir`` (``--trace``): read each checkpoint's routing
    from that trace folder instead of routing the data again (``trace.traces``); ``data``:
    the routed data's settings (``Trace.data``)."""
    results = []
    for trace in trace_lib.traces(checkpoint_paths, all_steps, trace_dir):
        rng = np.random.default_rng(seed)
        layers = {name: analyze_layer(layer, rng) for name, layer in trace.layers.items()}
        cross = cross_layer(trace.layers, rng)
        for name, values in next_layer(cross).items():
            layers[name].update(values)
        results.append(
            {
                "run": trace.run,
                "step": trace.step,
                "data": trace.data,
                "layers": layers,
                "cross_layer": cross,
            }
        )
    report: dict[str, Any] = {
        "seed": seed,
        "checkpoints": results,
        "seed_summary": seeds.checkpoint_summary(results, SEED_STATISTICS),
    }
    trace_lib.write_report(
        "coactivation",
        report,
        languages.output_dirs(checkpoint_paths, out_dir),
        trace_plots.write_coactivation,
        [line for result in results for line in summary_lines(result)]
        + seeds.summary_lines(report["seed_summary"]),
    )
    return report
