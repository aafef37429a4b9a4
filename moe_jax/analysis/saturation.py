"""Router saturation (`moe-jax analyze saturation`; OLMoE, arXiv:2409.02060, Sec. 5.1): how
early in training does the router settle on its final choices?

For each run, every checkpoint's routing of the same tokens (:mod:`moe_jax.analysis.trace`)
is compared token by token with the run's last checkpoint, per MoE layer:

* ``top1``: the share of tokens whose first choice equals the final checkpoint's;
* ``topk``: the mean over tokens of ``|top-k(step) ∩ top-k(final)| / k`` (OLMoE's top-k
  saturation; equals ``top1`` for k = 1);
* ``top1_random``, ``topk_random``: the same against the final routing permuted over
  tokens (a router with the final one's load that ignores the token: what agreement comes
  from the load alone).

Curves over ``step / final step`` show saturation; OLMoE reports ~60% top-8 agreement at 1%
of training and ~80% at 40%. Runs of one family (``learned/seed0``, ``learned/seed1``,
...) with the same steps also get ``seed_summary``: each curve's mean and standard
deviation over the seeds, step by step (:func:`moe_jax.analysis.seeds.curve_summary`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from moe_jax.analysis import languages, seeds, trace_plots
from moe_jax.analysis import trace as trace_lib
from moe_jax.runtime.run_dir import RunDir


def top1_agreement(experts: np.ndarray, final: np.ndarray) -> float:
    """Share of tokens whose first choice in ``experts [tokens, k]`` equals ``final``'s."""
    return float(np.mean(experts[:, 0] == final[:, 0]))


def topk_agreement(experts: np.ndarray, final: np.ndarray) -> float:
    """Mean over tokens of ``|set(experts[t]) ∩ set(final[t])| / k`` (``[tokens, k]``,
    distinct experts per token)."""
    shared = (experts[:, :, None] == final[:, None, :]).any(axis=2).sum(axis=1)
    return float(np.mean(shared / final.shape[1]))


def agreement(
    layer: trace_lib.LayerTrace, final: trace_lib.LayerTrace, rng: np.random.Generator
) -> dict[str, float]:
    """``{"top1", "topk", "top1_random", "topk_random"}`` of ``layer`` against ``final``.

    Raises:
      ValueError: the two traces routed different tokens.
    """
    if not layer.same_tokens(final):
        raise ValueError(
            "the checkpoints routed different tokens; trace them with the same "
            "trace_script.collect settings"
        )
    shuffled = final.experts[rng.permutation(len(final.experts))]
    return {
        "top1": top1_agreement(layer.experts, final.experts),
        "topk": topk_agreement(layer.experts, final.experts),
        "top1_random": top1_agreement(layer.experts, shuffled),
        "topk_random": topk_agreement(layer.experts, shuffled),
    }


def run_saturation(traces: Sequence[trace_lib.Trace], seed: int = 0) -> dict[str, Any]:
    """The curves of one run's ``traces`` (any order) against its last step: ``{"run",
    "final_step", "data", "steps": [...], "layers": {name: {"top1": [...], "topk": [...],
    "top1_random": [...], "topk_random": [...]}}}``, ascending steps."""
    ordered = sorted(traces, key=lambda t: t.step)
    final = ordered[-1]
    layers: dict[str, dict[str, list[float]]] = {}
    for name, last in final.layers.items():
        rng = np.random.default_rng(seed)
        for t in ordered:
            for key, value in agreement(t.layers[name], last, rng).items():
                layers.setdefault(name, {}).setdefault(key, []).append(value)
    return {
        "run": final.run,
        "final_step": final.step,
        "data": final.data,
        "steps": [t.step for t in ordered],
        "layers": layers,
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """Per layer, the agreement at each step."""
    return [
        f"{result['run']} {name}: "
        + ", ".join(
            f"step {step} top-1 {t1:.2f} top-k {tk:.2f}"
            for step, t1, tk in zip(result["steps"], curves["top1"], curves["topk"], strict=True)
        )
        + f" (random router at the first step: top-1 {curves['top1_random'][0]:.2f}, "
        f"top-k {curves['topk_random'][0]:.2f})"
        for name, curves in result["layers"].items()
    ]


@gin.configurable(
    module="saturation_script", denylist=["checkpoint_paths", "out_dir", "all_steps", "trace_dir"]
)
def analyze(
    checkpoint_paths: Sequence[str],
    out_dir: str | None = None,
    all_steps: bool = False,
    trace_dir: str | None = None,
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """Writes ``saturation.json`` (``{"runs": [run_saturation(...)], "seed_summary":
    seeds.curve_summary(...)}``) and
    ``saturation.png`` to ``out_dir`` (default: ``languages.output_dirs``). Each run needs
    several checkpoints: ``--all_steps`` or ``--checkpoint`` repeated. ``trace_dir``
    (``--trace``): read each checkpoint's routing from that trace folder instead of routing
    the data again (``trace.traces``; it must hold every compared step).

    Raises:
      ValueError: a run with a single checkpoint.
    """
    paths = languages.expand_checkpoints(checkpoint_paths, all_steps)
    per_run = Counter(RunDir.of_checkpoint(path)[0].path for path in paths)
    single = [run for run, count in per_run.items() if count < 2]
    if single:
        raise ValueError(
            f"saturation compares a run's checkpoints; {single} has one: pass --all_steps "
            "or several --checkpoint of the run"
        )
    by_run: dict[str, list[trace_lib.Trace]] = {}
    for trace in trace_lib.traces(paths, trace_dir=trace_dir):
        by_run.setdefault(trace.run, []).append(trace)
    report: dict[str, Any] = {
        "seed": seed,
        "runs": [run_saturation(traces, seed) for traces in by_run.values()],
    }
    report["seed_summary"] = seeds.curve_summary(report["runs"])
    trace_lib.write_report(
        "saturation",
        report,
        languages.output_dirs(checkpoint_paths, out_dir),
        trace_plots.write_saturation,
        [line for result in report["runs"] for line in summary_lines(result)]
        + seeds.curve_lines(report["seed_summary"], "topk"),
    )
    return report
