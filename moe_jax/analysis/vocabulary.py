"""Vocabulary specialisation (`moe-jax analyze vocabulary`): do experts specialise by token
id (OpenMoE, arXiv:2402.01739: context-independent specialisation; OLMoE, arXiv:2409.02060:
vocabulary specialisation) and by token category (ST-MoE, arXiv:2202.08906, Sec. 7: encoder
experts specialise in punctuation, numbers, proper nouns; decoder experts do not)?

Per MoE layer, over the tokens of a routing trace (:mod:`moe_jax.analysis.trace`):

* ``token_consistency``: for each token id seen at least ``min_count`` times, the share of
  its occurrences whose top-1 expert is the id's commonest one, averaged over those
  occurrences (1: every id always goes to one expert, whatever its context; ``1/E`` or so
  for a router that ignores the token). ``random_router``: the same with the top-1 experts
  permuted over tokens (a router with the same load that ignores the token; the
  statistic's floor at this sample size).
* ``category_bits``: ``I(category; top-1 expert)`` in bits for the categories of
  :data:`CATEGORIES` (:func:`token_category`), with ``category_shuffled_bits`` (categories
  permuted over tokens: the plug-in estimator's floor) and ``category_share
  [categories, experts]`` (the share of each category's tokens by top-1 expert).
* ``expert_tokens``: per expert, the ``top_tokens`` pieces with the highest share of their
  occurrences routed to it (OLMoE's vocabulary specialisation ``#(x -> e) / #x``).

Runs of one family (``learned/seed0``, ``learned/seed1``, ...) also get ``seed_summary``:
the mean and standard deviation over the seeds of :data:`SEED_STATISTICS` per step and
layer (:mod:`moe_jax.analysis.seeds`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from moe_jax.analysis import languages, seeds, trace_plots
from moe_jax.analysis import trace as trace_lib
from moe_jax.analysis.positions import mutual_information_bits

CATEGORIES: tuple[str, ...] = (
    "special",
    "sentinel",
    "punctuation",
    "number",
    "capitalized",
    "word",
    "subword",
)
# The per-layer statistics averaged over a family's seeds (``seed_summary``).
SEED_STATISTICS = (
    "token_consistency",
    "random_router",
    "category_bits",
    "category_shuffled_bits",
    "category_excess_bits",
)


def token_category(token_id: int, piece: str) -> str:
    """The category of one token (the first that applies): ``special`` (ids 0-2: padding /
    start, end, unknown; or a ``<...>`` piece), ``sentinel`` (``<extra_id_N>``),
    ``punctuation`` (only punctuation or symbols), ``number`` (holds a digit),
    ``capitalized`` (starts with an upper-case letter: proper nouns and sentence starts),
    ``word`` (starts a word: ``▁`` prefix), else ``subword`` (continues a word)."""
    text = piece.lstrip("▁")
    if piece.startswith("<extra_id_"):
        return "sentinel"
    if token_id < 3 or (piece.startswith("<") and piece.endswith(">")):
        return "special"
    if text and all(unicodedata.category(c)[0] in "PS" for c in text):
        return "punctuation"
    if any(c.isdigit() for c in text):
        return "number"
    if text[:1].isupper():
        return "capitalized"
    return "word" if piece.startswith("▁") else "subword"


def categories_of(token_ids: np.ndarray, pieces: Mapping[int, str]) -> np.ndarray:
    """``int [tokens]`` index in :data:`CATEGORIES` of each token."""
    ids, inverse = np.unique(token_ids, return_inverse=True)
    codes = np.asarray(
        [CATEGORIES.index(token_category(int(i), pieces.get(int(i), ""))) for i in ids], np.int64
    )
    return codes[inverse.reshape(-1)]


def modal_share(token_ids: np.ndarray, top1: np.ndarray, num_experts: int, min_count: int):
    """Per token id seen ``>= min_count`` times: ``(ids [m], counts [m], share [m], expert_counts
    [m, num_experts])``, ``share`` = the fraction of its occurrences on its commonest top-1
    expert."""
    ids, inverse = np.unique(token_ids, return_inverse=True)
    counts = np.zeros((len(ids), num_experts), np.int64)
    np.add.at(counts, (inverse.reshape(-1), top1), 1)
    total = counts.sum(1)
    keep = total >= min_count
    counts, total = counts[keep], total[keep]
    return ids[keep], total, counts.max(1) / np.maximum(total, 1), counts


def token_consistency(
    token_ids: np.ndarray, top1: np.ndarray, num_experts: int, min_count: int
) -> float | None:
    """Occurrence-weighted mean of :func:`modal_share` (None: no id seen ``min_count`` times)."""
    _, total, share, _ = modal_share(token_ids, top1, num_experts, min_count)
    return float(np.sum(share * total) / total.sum()) if total.sum() else None


def expert_tokens(
    token_ids: np.ndarray,
    top1: np.ndarray,
    pieces: Mapping[int, str],
    num_experts: int,
    min_count: int,
    top: int,
) -> list[list[dict[str, Any]]]:
    """Per expert, its ``top`` pieces by the share of their occurrences routed to it
    (``[{"piece", "token_id", "share", "count"}]``, ids seen ``>= min_count`` times)."""
    ids, total, _, counts = modal_share(token_ids, top1, num_experts, min_count)
    shares = counts / np.maximum(total, 1)[:, None]
    out = []
    for e in range(num_experts):
        order = np.lexsort((-total, -shares[:, e]))[:top]
        out.append(
            [
                {
                    "piece": pieces.get(int(ids[i]), ""),
                    "token_id": int(ids[i]),
                    "share": float(shares[i, e]),
                    "count": int(total[i]),
                }
                for i in order
                if shares[i, e] > 0
            ]
        )
    return out


def analyze_layer(
    layer: trace_lib.LayerTrace,
    pieces: Mapping[int, str],
    rng: np.random.Generator,
    *,
    min_count: int = 5,
    top_tokens: int = 8,
) -> dict[str, Any]:
    """Every statistic of the module docstring for one layer (JSON-ready)."""
    top1, e = layer.experts[:, 0], layer.num_experts
    category = categories_of(layer.token_id, pieces)
    num_c = len(CATEGORIES)
    joint = np.bincount(category * e + top1, minlength=num_c * e).reshape(num_c, e)
    bits = mutual_information_bits(category, top1, num_c, e)
    shuffled_bits = mutual_information_bits(rng.permutation(category), top1, num_c, e)
    return {
        "num_tokens": len(top1),
        "num_experts": e,
        "token_consistency": token_consistency(layer.token_id, top1, e, min_count),
        "random_router": token_consistency(layer.token_id, rng.permutation(top1), e, min_count),
        "token_ids_counted": len(modal_share(layer.token_id, top1, e, min_count)[0]),
        "category_bits": bits,
        "category_shuffled_bits": shuffled_bits,
        "category_excess_bits": bits - shuffled_bits,
        "category_tokens": joint.sum(1).tolist(),
        "category_share": (joint / np.maximum(joint.sum(1, keepdims=True), 1)).tolist(),
        "expert_tokens": expert_tokens(layer.token_id, top1, pieces, e, min_count, top_tokens),
    }


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """One line per layer of one checkpoint's result."""
    lines = []
    for name, s in result["layers"].items():
        consistency = s["token_consistency"]
        shown = "-" if consistency is None else f"{consistency:.3f}"
        floor = "-" if s["random_router"] is None else f"{s['random_router']:.3f}"
        lines.append(
            f"{result['run']}@{result['step']} {name}: token-id consistency {shown} "
            f"(random router {floor}); I(category;expert) {s['category_bits']:.3f} bits "
            f"(shuffled {s['category_shuffled_bits']:.3f})"
        )
    return lines


@gin.configurable(
    module="vocabulary_script", denylist=["checkpoint_paths", "out_dir", "all_steps", "trace_dir"]
)
def analyze(
    checkpoint_paths: Sequence[str],
    out_dir: str | None = None,
    all_steps: bool = False,
    trace_dir: str | None = None,
    *,
    min_count: int = 5,
    top_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Writes ``vocabulary.json`` (``{"categories", "settings", "checkpoints": [{"run",
    "step", "data", "layers": {name: analyze_layer(...)}}], "seed_summary"}``) and one PNG
    per checkpoint to ``out_dir`` (default: ``languages.output_dirs``); ``trace_dir``
    (``--trace``): read each checkpoint's routing from that trace folder instead of routing
    the data again (``trace.traces``); ``data``: the routed data's settings (``Trace.data``)."""
    results = []
    for trace in trace_lib.traces(checkpoint_paths, all_steps, trace_dir):
        rng = np.random.default_rng(seed)
        layers = {
            name: analyze_layer(
                layer, trace.pieces, rng, min_count=min_count, top_tokens=top_tokens
            )
            for name, layer in trace.layers.items()
        }
        results.append({"run": trace.run, "step": trace.step, "data": trace.data, "layers": layers})
    report: dict[str, Any] = {
        "categories": list(CATEGORIES),
        "settings": {"min_count": min_count, "top_tokens": top_tokens, "seed": seed},
        "checkpoints": results,
        "seed_summary": seeds.checkpoint_summary(results, SEED_STATISTICS),
    }
    trace_lib.write_report(
        "vocabulary",
        report,
        languages.output_dirs(checkpoint_paths, out_dir),
        trace_plots.write_vocabulary,
        [line for result in results for line in summary_lines(result)]
        + seeds.summary_lines(report["seed_summary"]),
    )
    return report
