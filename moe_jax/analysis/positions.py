"""Positional routing analysis (Bershatsky & Oseledets, "On the spatial structure of
Mixture-of-Experts in Transformers"): does the router use token positions?

Per MoE layer, from the per-token routing of :mod:`moe_jax.runtime.routing`:

1. **Activation rate by position** ``r[p, e]``: the fraction of tokens at position ``p``
   that chose expert ``e`` among their ``k`` (rows sum to ``k``; the top-1 version to 1),
   and the mutual information between position and top-1 expert (bits), next to the same
   with the experts shuffled over tokens (the estimator's finite-sample floor).
2. **Correlation length** of the top-1 expert sequence ``s_t`` along each sequence:
   ``p_same(l) = P(s_t = s_{t+l})`` over pairs inside one sequence, its baseline ``b(l)`` =
   the exact expectation when positions are shuffled within each sequence, the normalised
   excess ``rho(l) = (p_same(l) - b(l)) / (1 - b(l))`` (the autocorrelation of the
   one-hot expert vectors), and three lengths: ``xi_int = 1 + 2 sum_{l < l0} rho(l)``
   (integrated autocorrelation time, summed over the initial positive run: ``l0`` = first
   lag with ``rho <= 0`` or ``max_lag + 1``), ``corr_lag`` = the number of leading lags with
   ``rho >= lag_threshold``, and the paper's domain size ``xi_domain`` = mean length of
   runs of one expert (``L / N_domain_walls``). Each is also computed on sequences whose
   positions were actually shuffled. An uncorrelated sequence has ``xi_int ~ 1``,
   ``corr_lag = 0``, ``xi_domain = 1 / (1 - b)``.
3. **Position probes**: closed-form ridge regression (one-hot targets, ridge picked on a
   validation split) from the router inputs to position parity ``p mod 2`` and block index
   ``p // n`` for each ``n`` of ``block_sizes``, trained on some sequences, tested on
   held-out ones; accuracy next to chance (uniform ``1/C`` and the majority class).
4. **Drops by position** (OpenMoE, arXiv:2402.01739: drops concentrate at the end of a
   sequence): the share of the choices dropped by capacity and of the tokens with every
   choice dropped at each position, next to both over all positions.
5. **Consecutive tokens on one expert** (Mixtral, arXiv:2401.04088, Sec. 5): over pairs of
   neighbouring tokens, P(the same first choice) and P(their top-k share an expert), next
   to the same with each sequence's tokens shuffled.

:func:`analyze` (gin ``positions_script.analyze``) restores a checkpoint, runs
``num_batches`` batches of the dataset through it and writes ``positions.json`` and the
PNGs of :mod:`moe_jax.analysis.plots`. Every statistic is vectorised over tokens.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import storage
from moe_jax.analysis import plots
from moe_jax.runtime import builders, configured, routing, run_names
from moe_jax.runtime.run_dir import RunDir

RIDGES: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # times the number of tokens


# --------------------------------------------------------------------------- helpers
def sequence_ids(segments: np.ndarray) -> np.ndarray:
    """``int64 [n, length]`` id of each token's sequence (unique over rows; -1 on padding)
    from ``segments [n, length]`` (0 = padding)."""
    n = segments.shape[0]
    width = int(segments.max(initial=0)) + 1
    ids = np.arange(n, dtype=np.int64)[:, None] * width + segments
    return np.where(segments > 0, ids, -1)


def top1(expert_index: np.ndarray) -> np.ndarray:
    """``[n, length]`` first choice of ``expert_index [n, length, k]``."""
    return expert_index[..., 0]


# --------------------------------------------------------------------------- 1. activation rate
def activation_rates(
    expert_index: np.ndarray,
    positions: np.ndarray,
    valid: np.ndarray,
    num_experts: int,
    num_positions: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Expert activation rate by position.

    Args:
      expert_index: ``int [n, length, k]`` chosen experts (``>= num_experts``: none).
      positions: ``int [n, length]`` token positions; valid: ``bool [n, length]``.
      num_positions: rows of the result (default: max valid position + 1).

    Returns:
      ``rates float64 [num_positions, num_experts]``: fraction of the tokens at each
      position that chose each expert (a row sums to ``k`` when nothing is unrouted; 0 for
      positions without tokens), and ``tokens int64 [num_positions]``.
    """
    if num_positions is None:
        num_positions = int(positions[valid].max(initial=-1)) + 1
    chosen = valid[..., None] & (expert_index < num_experts) & (expert_index >= 0)
    flat = (
        np.broadcast_to(positions[..., None], expert_index.shape)[chosen] * num_experts
        + expert_index[chosen]
    )
    counts = np.bincount(flat, minlength=num_positions * num_experts).reshape(
        num_positions, num_experts
    )
    tokens = np.bincount(positions[valid], minlength=num_positions)[:num_positions]
    return counts / np.maximum(tokens, 1)[:, None], tokens


def mutual_information_bits(a: np.ndarray, b: np.ndarray, num_a: int, num_b: int) -> float:
    """Plug-in mutual information (bits) between two label arrays of equal length."""
    joint = (
        np.bincount(a * num_b + b, minlength=num_a * num_b).reshape(num_a, num_b).astype(np.float64)
    )
    joint /= max(joint.sum(), 1.0)
    outer = joint.sum(1, keepdims=True) * joint.sum(0, keepdims=True)
    nz = joint > 0
    return float(np.sum(joint[nz] * np.log2(joint[nz] / outer[nz])))


def position_information(
    experts: np.ndarray,
    positions: np.ndarray,
    valid: np.ndarray,
    num_experts: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """``I(position; top-1 expert)`` in bits over valid tokens, and the same with the
    experts permuted over tokens (the plug-in estimator's bias floor)."""
    e, p = experts[valid], positions[valid]
    num_p = int(p.max(initial=0)) + 1
    bits = mutual_information_bits(p, e, num_p, num_experts)
    shuffled = mutual_information_bits(p, rng.permutation(e), num_p, num_experts)
    return {"bits": bits, "shuffled_bits": shuffled, "excess_bits": bits - shuffled}


# --------------------------------------------------------------------------- 2. correlation length
def same_expert_by_lag(
    experts: np.ndarray, segments: np.ndarray, max_lag: int
) -> tuple[np.ndarray, np.ndarray]:
    """``p_same [max_lag]`` = P(s_t = s_{t+l}) for l = 1..max_lag over pairs of valid tokens
    of one sequence, and the number of such pairs ``[max_lag]`` (nan / 0 where none).

    ``experts``, ``segments``: ``[n, length]`` (segments 0 = padding)."""
    p_same = np.full(max_lag, np.nan)
    pairs = np.zeros(max_lag, np.int64)
    # a loop over lags only
    for i, lag in enumerate(range(1, min(max_lag, experts.shape[1] - 1) + 1)):
        ok = (segments[:, :-lag] > 0) & (segments[:, :-lag] == segments[:, lag:])
        pairs[i] = ok.sum()
        if pairs[i]:
            p_same[i] = (ok & (experts[:, :-lag] == experts[:, lag:])).sum() / pairs[i]
    return p_same, pairs


def shuffled_baseline(
    experts: np.ndarray, segments: np.ndarray, num_experts: int, max_lag: int
) -> np.ndarray:
    """``[max_lag]`` exact expectation of :func:`same_expert_by_lag` when each sequence's
    positions are permuted at random: a sequence with expert counts ``n_e`` (length ``n``)
    contributes ``n - l`` pairs at lag ``l``, each equal with probability
    ``sum_e n_e (n_e - 1) / (n (n - 1))``. Sequences must be contiguous (they are)."""
    ids = sequence_ids(segments)
    valid = ids >= 0
    _, seq = np.unique(ids[valid], return_inverse=True)
    num_seq = int(seq.max(initial=-1)) + 1
    counts = np.bincount(seq * num_experts + experts[valid], minlength=num_seq * num_experts)
    counts = counts.reshape(num_seq, num_experts).astype(np.float64)
    n = counts.sum(1)
    q = np.sum(counts * (counts - 1), axis=1) / np.maximum(n * (n - 1), 1.0)
    weights = np.maximum(n[None, :] - np.arange(1, max_lag + 1)[:, None], 0.0)
    total = weights.sum(1)
    return np.where(total > 0, weights @ q / np.maximum(total, 1.0), np.nan)


def domain_size(experts: np.ndarray, segments: np.ndarray) -> float:
    """Mean length of the runs of one expert inside sequences (the paper's
    ``xi = L / N_domain_walls``); 1 when no two neighbours agree."""
    valid = segments > 0
    continues = np.zeros_like(valid)
    continues[:, 1:] = (segments[:, 1:] == segments[:, :-1]) & (experts[:, 1:] == experts[:, :-1])
    starts = valid & ~continues
    return float(valid.sum() / max(starts.sum(), 1))


def correlation_stats(
    experts: np.ndarray, segments: np.ndarray, num_experts: int, max_lag: int, threshold: float
) -> dict[str, Any]:
    """The correlation lengths of one set of expert sequences (see the module docstring):
    ``{"xi_int", "corr_lag", "xi_domain", "p_same", "baseline", "rho", "pairs"}``."""
    p_same, pairs = same_expert_by_lag(experts, segments, max_lag)
    base = shuffled_baseline(experts, segments, num_experts, max_lag)
    rho = np.where(1.0 - base > 1e-12, (p_same - base) / np.maximum(1.0 - base, 1e-12), np.nan)
    finite = np.nan_to_num(rho, nan=-np.inf)
    below = ~(finite >= threshold)
    corr_lag = int(np.argmax(below)) if below.any() else max_lag
    nonpositive = ~(finite > 0)
    positive_run = int(np.argmax(nonpositive)) if nonpositive.any() else max_lag
    return {
        "xi_int": float(1.0 + 2.0 * np.sum(rho[:positive_run])),
        "corr_lag": corr_lag,
        "xi_domain": domain_size(experts, segments),
        "p_same": _json_floats(p_same),
        "baseline": _json_floats(base),
        "rho": _json_floats(rho),
        "pairs": pairs.tolist(),
    }


def _json_floats(values: np.ndarray) -> list[float | None]:
    """A float list with None for nan (JSON has no NaN)."""
    return [float(v) if np.isfinite(v) else None for v in values]


def shuffle_within_sequences(
    values: np.ndarray, segments: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """``values [n, length, ...]`` with each sequence's tokens randomly permuted among that
    sequence's slots (padding untouched)."""
    key = np.where(segments > 0, segments, segments.max(initial=0) + 1).astype(np.float64)
    dest = np.argsort(key, axis=1, kind="stable")  # slots grouped by sequence
    jitter = 0.5 * rng.random(key.shape) * (segments > 0)
    src = np.argsort(key + jitter, axis=1, kind="stable")  # the same groups, random order inside
    rows = np.arange(values.shape[0])[:, None]
    out = values.copy()
    out[rows, dest] = values[rows, src]
    return out


def correlation_length(
    experts: np.ndarray,
    segments: np.ndarray,
    num_experts: int,
    *,
    max_lag: int = 16,
    threshold: float = 0.05,
    rng: np.random.Generator | None = None,
) -> dict[str, Any]:
    """``{"model": stats, "shuffled": stats}`` of :func:`correlation_stats` on the expert
    sequences ``[n, length]`` and on the same sequences with shuffled positions."""
    rng = np.random.default_rng(0) if rng is None else rng
    shuffled = shuffle_within_sequences(experts, segments, rng)
    return {
        "model": correlation_stats(experts, segments, num_experts, max_lag, threshold),
        "shuffled": correlation_stats(shuffled, segments, num_experts, max_lag, threshold),
    }


# --------------------------------------------------------------------------- 4. drops, 5. runs
def drop_rates(
    kept: np.ndarray, positions: np.ndarray, valid: np.ndarray, num_positions: int
) -> dict[str, Any]:
    """Drops by position (OpenMoE: tokens late in a sequence are dropped more).

    Args:
      kept: ``bool [n, length, k]`` whether each choice reached its expert.
      positions: ``int [n, length]``; valid: ``bool [n, length]``.

    Returns:
      ``{"choices": [num_positions], "tokens": [num_positions], "overall_choices",
      "overall_tokens"}``: the share of the choices dropped by capacity and of the tokens
      with every choice dropped at each position (0 where no token), and both over all
      positions (what a position-blind capacity would give at every position).
    """
    pos = positions[valid]
    tokens = np.maximum(np.bincount(pos, minlength=num_positions)[:num_positions], 1)
    dropped = ~kept[valid]
    choices = np.bincount(pos, weights=dropped.mean(-1), minlength=num_positions)
    whole = np.bincount(pos, weights=dropped.all(-1).astype(float), minlength=num_positions)
    return {
        "choices": (choices[:num_positions] / tokens).tolist(),
        "tokens": (whole[:num_positions] / tokens).tolist(),
        "overall_choices": float(dropped.mean()) if valid.any() else 0.0,
        "overall_tokens": float(dropped.all(-1).mean()) if valid.any() else 0.0,
    }


def consecutive_stats(expert_index: np.ndarray, segments: np.ndarray) -> dict[str, float]:
    """Mixtral (arXiv:2401.04088, Sec. 5): over pairs of neighbouring tokens of one
    sequence, ``top1_repeat`` = P(the same first choice) and ``topk_overlap`` = P(their
    ``k`` choices share an expert) (``expert_index [n, length, k]``)."""
    pair = (segments[:, :-1] > 0) & (segments[:, :-1] == segments[:, 1:])
    if not pair.any():
        return {"top1_repeat": float("nan"), "topk_overlap": float("nan")}
    a, b = expert_index[:, :-1], expert_index[:, 1:]
    overlap = (a[..., :, None] == b[..., None, :]).any(axis=(-1, -2))
    return {
        "top1_repeat": float((a[..., 0] == b[..., 0])[pair].mean()),
        "topk_overlap": float(overlap[pair].mean()),
    }


def consecutive_runs(
    expert_index: np.ndarray, segments: np.ndarray, rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    """``{"model": consecutive_stats, "shuffled": the same with each sequence's tokens
    permuted}``: the floor a router blind to the order of the tokens gives."""
    shuffled = shuffle_within_sequences(expert_index, segments, rng)
    return {
        "model": consecutive_stats(expert_index, segments),
        "shuffled": consecutive_stats(shuffled, segments),
    }


# --------------------------------------------------------------------------- 3. probes
def _ridge_fits(x: np.ndarray, y: np.ndarray, num_classes: int, ridges: Sequence[float]):
    """Closed-form ridge fits of one-hot ``y`` on standardised ``x`` for every ridge
    (one eigendecomposition); returns ``predict(x, i) -> labels`` for the i-th ridge."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = (x - mu) / sd
    onehot = np.eye(num_classes)[y]
    y_mean = onehot.mean(0)
    s, v = np.linalg.eigh(z.T @ z)
    proj = v.T @ (z.T @ (onehot - y_mean))
    weights = [v @ (proj / (s + r * len(x))[:, None]) for r in ridges]

    def predict(x_new: np.ndarray, i: int) -> np.ndarray:
        return np.argmax(((x_new - mu) / sd) @ weights[i] + y_mean, axis=-1)

    return predict


def ridge_probe(
    features: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    num_classes: int,
    *,
    train_fraction: float = 0.75,
    seed: int = 0,
    ridges: Sequence[float] = RIDGES,
) -> dict[str, Any]:
    """Linear probe ``features [n, d] -> labels [n]`` (ints < ``num_classes``) trained on
    the tokens of a ``train_fraction`` of the sequences (``groups [n]``) and tested on the
    others; the ridge is picked on a fifth of the training sequences, then refit.

    Returns ``{"accuracy", "chance", "majority", "num_classes", "ridge", "train_tokens",
    "test_tokens"}``: ``chance`` = 1 / num_classes, ``majority`` = test accuracy of always
    predicting the commonest training label.

    Raises:
      ValueError: fewer than 3 sequences (no held-out ones).
    """
    rng = np.random.default_rng(seed)
    uniq = rng.permutation(np.unique(groups))
    if len(uniq) < 3:
        raise ValueError(f"the probe needs at least 3 sequences, got {len(uniq)}")
    n_train = min(max(2, round(train_fraction * len(uniq))), len(uniq) - 1)
    train_groups = uniq[:n_train]
    n_fit = max(1, round(0.8 * n_train))
    is_train = np.isin(groups, train_groups)
    is_fit = np.isin(groups, train_groups[:n_fit])
    is_val = is_train & ~is_fit
    x = features.astype(np.float64)
    if is_val.any() and len(ridges) > 1:
        predict = _ridge_fits(x[is_fit], labels[is_fit], num_classes, ridges)
        scores = [np.mean(predict(x[is_val], i) == labels[is_val]) for i in range(len(ridges))]
        best = int(np.argmax(scores))
    else:
        best = 0
    predict = _ridge_fits(x[is_train], labels[is_train], num_classes, [ridges[best]])
    test = ~is_train
    accuracy = float(np.mean(predict(x[test], 0) == labels[test]))
    commonest = np.argmax(np.bincount(labels[is_train], minlength=num_classes))
    return {
        "accuracy": accuracy,
        "chance": 1.0 / num_classes,
        "majority": float(np.mean(labels[test] == commonest)),
        "num_classes": int(num_classes),
        "ridge": float(ridges[best]),
        "train_tokens": int(is_train.sum()),
        "test_tokens": int(test.sum()),
    }


def position_probes(
    features: np.ndarray,
    positions: np.ndarray,
    segments: np.ndarray,
    block_sizes: Sequence[int],
    *,
    train_fraction: float = 0.75,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Probes of parity (``"parity"``) and block index (``"block_<n>"``, skipped when the
    sequences span a single block) from ``features [n, length, d]`` of valid tokens."""
    valid = segments > 0
    x, pos, groups = features[valid], positions[valid], sequence_ids(segments)[valid]
    num_positions = int(pos.max(initial=0)) + 1
    out = {"parity": ridge_probe(x, pos % 2, groups, 2, train_fraction=train_fraction, seed=seed)}
    for n in block_sizes:
        classes = -(-num_positions // n)
        if classes >= 2:
            out[f"block_{n}"] = ridge_probe(
                x, pos // n, groups, classes, train_fraction=train_fraction, seed=seed
            )
    return out


# --------------------------------------------------------------------------- one layer, the binary
def analyze_layer(
    layer: routing.LayerRouting,
    *,
    block_sizes: Sequence[int] = (2, 8, 32),
    max_lag: int = 16,
    lag_threshold: float = 0.05,
    probe_train_fraction: float = 0.75,
    seed: int = 0,
) -> dict[str, Any]:
    """Every statistic of the module docstring for one MoE layer (JSON-ready)."""
    rng = np.random.default_rng(seed)
    valid = layer.valid
    num_experts = layer.num_experts
    first = top1(layer.expert_index)
    rates, tokens = activation_rates(layer.expert_index, layer.positions, valid, num_experts)
    rates1, _ = activation_rates(first[..., None], layer.positions, valid, num_experts, len(tokens))
    overall1 = np.bincount(first[valid], minlength=num_experts) / max(valid.sum(), 1)
    seen = tokens > 0
    return {
        "num_tokens": int(valid.sum()),
        "num_sequences": len(np.unique(sequence_ids(layer.segments)[valid])),
        "num_experts": num_experts,
        "k": int(layer.expert_index.shape[-1]),
        "activation_rate": {
            "top_k": rates.tolist(),
            "top1": rates1.tolist(),
            "tokens_per_position": tokens.tolist(),
            "top1_overall": overall1.tolist(),
            "top1_max_deviation": float(np.max(np.abs(rates1[seen] - overall1), initial=0.0)),
        },
        "position_information": position_information(
            first, layer.positions, valid, num_experts, rng
        ),
        "correlation": correlation_length(
            first, layer.segments, num_experts, max_lag=max_lag, threshold=lag_threshold, rng=rng
        ),
        "drop_rate": drop_rates(layer.kept, layer.positions, valid, len(tokens)),
        "consecutive": consecutive_runs(layer.expert_index, layer.segments, rng),
        "probe": position_probes(
            layer.router_inputs,
            layer.positions,
            layer.segments,
            block_sizes,
            train_fraction=probe_train_fraction,
            seed=seed,
        ),
    }


SUMMARY_LEGEND = """\
I(pos;expert)  mutual information between token position and top-1 expert, in bits
xi_int         integrated autocorrelation time of the top-1 expert along a sequence, in
               tokens (1 + 2 sum of the leading positive correlations; ~1: uncorrelated)
corr_lag       leading lags whose correlation rho reaches lag_threshold (0: uncorrelated)
xi_domain      mean length of a run of one expert, in tokens (1/(1-b) when uncorrelated)
A vs B         this model vs the same sequences with token positions shuffled
probes         held-out accuracy of a linear probe from the router inputs to position
               parity (p mod 2) and block index (p // n), vs chance 1/C and the majority class
repeat         share of neighbouring tokens with the same top-1 expert (Mixtral), A vs B
dropped        share of the choices dropped by capacity: last position, all positions"""


def summary_table(layers: dict[str, dict[str, Any]]) -> str:
    """The names' legend (:data:`SUMMARY_LEGEND`), then one line per layer: MI, correlation
    lengths (model vs shuffled), probe accuracies."""
    lines = [SUMMARY_LEGEND, ""]
    for name, stats in layers.items():
        c, run, drops = stats["correlation"], stats["consecutive"], stats["drop_rate"]
        probes = "  ".join(
            f"{t} {p['accuracy']:.3f} (chance {p['chance']:.3f}, majority {p['majority']:.3f})"
            for t, p in stats["probe"].items()
        )
        lines.append(
            f"{name}: I(pos;expert) {stats['position_information']['bits']:.3f} bits "
            f"(shuffled {stats['position_information']['shuffled_bits']:.3f}); "
            f"xi_int {c['model']['xi_int']:.2f} vs {c['shuffled']['xi_int']:.2f}, "
            f"corr_lag {c['model']['corr_lag']} vs {c['shuffled']['corr_lag']}, "
            f"xi_domain {c['model']['xi_domain']:.2f} vs {c['shuffled']['xi_domain']:.2f}; "
            f"{probes}; "
            f"repeat {run['model']['top1_repeat']:.3f} vs {run['shuffled']['top1_repeat']:.3f}; "
            f"dropped {drops['choices'][-1]:.3f}, all {drops['overall_choices']:.3f}"
        )
    return "\n".join(lines)


@gin.configurable(module="positions_script", denylist=["checkpoint_path", "out_dir"])
def analyze(
    checkpoint_path: str,
    out_dir: str | None = None,
    *,
    model: Any = gin.REQUIRED,
    dataset_cfg: Any = gin.REQUIRED,
    num_batches: int = 8,
    block_sizes: Sequence[int] = (2, 8, 32),
    max_lag: int = 16,
    lag_threshold: float = 0.05,
    probe_train_fraction: float = 0.75,
    seed: int = 0,
) -> dict[str, Any]:
    """Restores ``checkpoint_path``, routes ``num_batches`` batches of ``dataset_cfg`` and
    writes ``positions.json`` plus the PNGs to ``out_dir`` (default ``MODEL_DIR/analysis``).

    Returns the JSON's content: ``{"checkpoint", "step", "dataset", "settings", "layers":
    {"encoder/layers_3": analyze_layer(...), ...}, "files"}``.
    """

    ctx = configured.run_context()
    restored = builders.restore_model(checkpoint_path, model, dataset_cfg.input_shapes(), ctx)
    step = restored.step
    fn = routing.restored_routing_fn(model, restored, ctx)
    batches = (
        builders.global_batch(b, ctx) for b in builders.eval_batches(dataset_cfg, num_batches)
    )
    layers = routing.collect_routing(fn, restored.params, batches, restored.collections)
    settings: dict[str, Any] = dict(
        num_batches=num_batches,
        block_sizes=list(block_sizes),
        max_lag=max_lag,
        lag_threshold=lag_threshold,
        probe_train_fraction=probe_train_fraction,
        seed=seed,
    )
    stats = {
        name: analyze_layer(layer, **{k: v for k, v in settings.items() if k != "num_batches"})
        for name, layer in layers.items()
    }
    run_dir = RunDir.of_checkpoint(checkpoint_path)[0]
    out_dir = storage.normalize(out_dir or run_dir.analysis_dir)
    result = {
        "checkpoint": storage.normalize(checkpoint_path),
        "step": step,
        "dataset": {
            "mixture_or_task_name": dataset_cfg.mixture_or_task_name,
            "split": dataset_cfg.split,
            "task_feature_lengths": dict(dataset_cfg.task_feature_lengths),
            "batch_size": dataset_cfg.batch_size,
            "pack": dataset_cfg.pack,
        },
        "settings": settings,
        "layers": stats,
    }
    if jax.process_index() == 0:
        result["files"] = plots.write_all(
            stats, out_dir, title=f"{run_names.run_labels([run_dir.path])[0]} (step {step})"
        )
        storage.write_text(storage.join(out_dir, "positions.json"), json.dumps(result, indent=1))
        print(summary_table(stats), flush=True)
        print(f"[moe-jax] positional analysis in {out_dir}", file=sys.stderr)
    return result
