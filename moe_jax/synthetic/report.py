"""`moe-jax synthetic report --results DIR`: the fidelity table of the synthetic suite.

Each row of ``TARGETS`` is one number the paper reports (or one claim it makes) and where
our run's JSON (``<DIR>/<experiment>.json``, written by ``moe-jax synthetic <experiment>``)
holds the same quantity. The table gives the paper's value, the ``quick`` preset's value
(``--quick DIR``, optional), the converged value with its std over seeds, and a verdict:

* **magnitude within 2x**: the paper's claim holds and the value is within a factor 2 of
  the paper's (for "-> 0"-type claims, the paper's value is a bound and "within 2x" means
  at most twice it);
* **direction reproduced**: the claim holds (an ordering, a trend), the magnitude does not;
* **not reproduced**: the claim fails.

Only runs of the ``converged`` (or ``paper``) preset are judged: each JSON records its
``preset`` and ``seeds``, and a row of another preset (``quick``) gives its value labelled
with the preset and the verdict "not judged (quick preset)"; a JSON without a recorded
preset is "not judged (preset not recorded)".

An exact identity (paper value 0, an upper bound) counts as "within 2x" up to float32
rounding (``FLOAT32_EXACT``).

Line numbers ("l. 127") point into a plain-text extraction of the paper's PDF; they locate
a passage to within a few lines.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from moe_jax import plotting
from moe_jax.synthetic.experiments import common

Result = dict[str, Any]
VERDICTS = ("magnitude within 2x", "direction reproduced", "not reproduced")
JUDGED_PRESETS = ("converged", "paper")  # runs long enough to compare with the paper


def preset_of(result: Result) -> str:
    """The preset a result was run with (``"preset"`` of its JSON), ``"unrecorded"``."""
    return str(result.get("preset", "unrecorded"))


def not_judged(preset: str) -> str:
    """The verdict of a row whose run is not of a judged preset."""
    return f"not judged ({'preset not recorded' if preset == 'unrecorded' else preset + ' preset'})"


FLOAT32_EXACT = 1e-5  # "exactly 0" for a float32 computation


def entry(result: Result, **where: Any) -> dict[str, Any]:
    """The summary entry of ``result`` matching ``where`` (its largest ``num_train`` if several)."""
    found = [e for e in result["summary"] if all(e.get(k) == v for k, v in where.items())]
    if not found:
        raise KeyError(f"no summary entry with {where}")
    return max(found, key=lambda e: e.get("num_train", 0))


def value(metric: str, **where: Any) -> Callable[[Result], tuple[float, float]]:
    """(mean, std over seeds) of ``metric`` in the entry matching ``where``."""

    def get(result: Result) -> tuple[float, float]:
        e = entry(result, **where)
        return float(e[metric]), float(e.get(metric + "_std", 0.0))

    return get


def largest(key: str, result: Result, **where: Any) -> Any:
    return max(e[key] for e in result["summary"] if all(e.get(k) == v for k, v in where.items()))


def smallest(key: str, result: Result, **where: Any) -> Any:
    return min(e[key] for e in result["summary"] if all(e.get(k) == v for k, v in where.items()))


@dataclasses.dataclass(frozen=True)
class Target:
    """One row: ``paper`` is the paper's number (None for a claim without one), ``bound``
    "upper" when it is an upper bound (loss -> 0 read as <= paper), "lower" for a lower
    bound; ``get(result) -> (mean, std)``; ``claim(result) -> bool`` the paper's
    qualitative statement; ``quantity`` says which loss / definition is compared."""

    experiment: str
    name: str
    paper: float | None
    source: str
    get: Callable[[Result], tuple[float, float]]
    claim: Callable[[Result], bool]
    quantity: str = ""
    bound: str = "value"

    def verdict(self, result: Result) -> str:
        if not self.claim(result):
            return VERDICTS[2]
        if self.paper is None:
            return VERDICTS[1]
        mean, _ = self.get(result)
        if self.bound == "upper":
            close = mean <= (2 * self.paper if self.paper > 0 else FLOAT32_EXACT)
        elif self.bound == "lower":
            close = mean >= self.paper / 2
        else:
            close = (
                self.paper / 2 <= mean <= 2 * self.paper if self.paper > 0 else abs(mean) <= 1e-12
            )
        return VERDICTS[0] if close else VERDICTS[1]


def _lt(
    a: Callable[[Result], tuple[float, float]], b: Callable[[Result], tuple[float, float]]
) -> Callable[[Result], bool]:
    return lambda r: a(r)[0] < b(r)[0]


def _above(
    get: Callable[[Result], tuple[float, float]], limit: float, *, inclusive: bool = False
) -> Callable[[Result], bool]:
    """The claim that ``get``'s mean is > ``limit`` (>= when ``inclusive``)."""
    if inclusive:
        return lambda r: get(r)[0] >= limit
    return lambda r: get(r)[0] > limit


def _ratio(num: Callable, den: Callable) -> Callable[[Result], tuple[float, float]]:
    """num / den of the means; the std is the ratio's first-order propagated std."""

    def get(r: Result) -> tuple[float, float]:
        (a, sa), (b, sb) = num(r), den(r)
        return a / b, abs(a / b) * float(np.hypot(sa / a if a else 0.0, sb / b if b else 0.0))

    return get


def _fig2_falls_with_n(r: Result) -> bool:
    k = r["config"]["k"]
    return (
        value("loss", num_experts=k, num_train=largest("num_train", r, num_experts=k))(r)[0]
        < value("loss", num_experts=k, num_train=smallest("num_train", r, num_experts=k))(r)[0]
    )


def _tok(metric: str, model: str, output: str, length: int):
    return value(metric, model=model, output=output, length=length)


def _frozen_over_learned(metric: str = "loss") -> Callable[[Result], tuple[float, float]]:
    """Frozen-router over learned-router ``metric`` at the largest training set (> 1: learning
    helps)."""

    def get(r: Result) -> tuple[float, float]:
        n = largest("num_train", r)
        return _ratio(
            value(metric, model="MoE frozen", num_train=n),
            value(metric, model="MoE learned", num_train=n),
        )(r)

    return get


def _learning_helps_rows(experiment: str, figure: str, source: str) -> list[Target]:
    """Frozen / learned loss at the largest n (the paper's claim: > 1), top-1 (the paper's
    evaluation, l. 98) and soft (the training-mode MoE)."""
    rows = []
    for metric, suffix, quantity in (
        ("loss", "", "normalised, top-1 (l. 98)"),
        ("loss_soft", " (soft)", "normalised, soft MoE"),
    ):
        ratio = _frozen_over_learned(metric)
        rows.append(
            Target(
                experiment,
                f"{figure}: frozen / learned loss, largest n{suffix}",
                None,
                source,
                ratio,
                _above(ratio, 1),
                quantity,
            )
        )
    return rows


def _largest_n(metric: str, model: str) -> Callable[[Result], tuple[float, float]]:
    return lambda r: value(metric, model=model, num_train=largest("num_train", r, model=model))(r)


def _fig2(metric: str) -> Callable[[Result], tuple[float, float]]:
    def get(r: Result) -> tuple[float, float]:
        k = r["config"]["k"]
        return value(metric, num_experts=k, num_train=largest("num_train", r, num_experts=k))(r)

    return get


def _dense_catches_up(r: Result) -> bool:
    return (
        _tok("mse", "dense 2 layers", "linear", 16)(r)[0]
        < _tok("mse", "dense 2 layers", "linear", 4)(r)[0]
    )


def _sparsity_order(length: int):
    def claim(r: Result) -> bool:
        learned = _tok("sparsity", "MoE learned", "linear", length)(r)[0]
        shuffled = _tok("shuffled_sparsity", "MoE learned", "linear", length)(r)[0]
        frozen = _tok("sparsity", "MoE frozen", "linear", length)(r)[0]
        return learned < shuffled < frozen

    return claim


TABLE1_MSE = {
    "MoE learned": (0.0016, 0.0017, 0.0015),
    "dense 2 layers": (0.0044, 0.0021, 0.0015),
    "MoE frozen": (0.0046, 0.0020, 0.0027),
}
"""Table 1 (l. 329-333), linear output: MSE at s = 4, 8, 16."""


def _tokenized_rows() -> list[Target]:
    rows = []
    for model, values in TABLE1_MSE.items():
        metric = "mse" if model == "dense 2 layers" else "mse_soft"
        for length, paper in zip((4, 8, 16), values, strict=True):
            claim = (
                _dense_catches_up
                if model == "dense 2 layers"
                else _lt(
                    _tok("mse_soft", "MoE learned", "linear", length),
                    _tok("mse_soft", "MoE frozen", "linear", length),
                )
            )
            quantity = "raw MSE" if model == "dense 2 layers" else "raw MSE, soft MoE (l. 325)"
            rows.append(
                Target(
                    "tokenized",
                    f"Table 1, linear, s = {length}: {model} MSE",
                    paper,
                    "Table 1, l. 329-333",
                    _tok(metric, model, "linear", length),
                    claim,
                    quantity,
                )
            )
    paper_sparsity = {"sparsity": (13.0, 14.14, 14.29), "shuffled_sparsity": (14.29, 15.41, 15.6)}
    for metric, values in paper_sparsity.items():
        for length, paper in zip((4, 8, 16), values, strict=True):
            rows.append(
                Target(
                    "tokenized",
                    f"Table 2, s = {length}: {metric.replace('_', ' ')}",
                    paper,
                    "Table 2, l. 336-339",
                    _tok(metric, "MoE learned", "linear", length),
                    _sparsity_order(length),
                    "mean over clusters of exp(entropy)",
                )
            )
    for length, paper in zip((4, 8, 16), (28.52, 28.51, 28.53), strict=True):
        rows.append(
            Target(
                "tokenized",
                f"Table 2, s = {length}: frozen sparsity",
                paper,
                "Table 2, l. 339",
                _tok("sparsity", "MoE frozen", "linear", length),
                _sparsity_order(length),
                "mean over clusters of exp(entropy)",
            )
        )
    rows.append(
        Target(
            "tokenized",
            "quadratic, s = 4: MoE beats dense",
            None,
            "l. 327",
            _tok("mse_soft", "MoE learned", "quadratic", 4),
            _lt(
                _tok("mse_soft", "MoE learned", "quadratic", 4),
                _tok("mse", "dense 2 layers", "quadratic", 4),
            ),
            "raw MSE, soft MoE",
        )
    )
    rows.append(
        Target(
            "tokenized",
            "quadratic: learned sparsity (shuffled 11.5)",
            8.8,
            "l. 327",
            _tok("sparsity", "MoE learned", "quadratic", 4),
            _lt(
                _tok("sparsity", "MoE learned", "quadratic", 4),
                _tok("shuffled_sparsity", "MoE learned", "quadratic", 4),
            ),
            "s not stated; ours s = 4",
        )
    )
    return rows


def _tokenized_ratio_rows() -> list[Target]:
    """Table 1's MSEs as ratios to the learned MoE's (soft MoE, l. 325; dense raw MSE): the
    paper's label scale is not stated, so these are the magnitudes that can be compared.
    Its dense / MoE ratio falls to 1 at s = 16 (the dense model catching up)."""
    rows = []
    for model, metric in (("dense 2 layers", "mse"), ("MoE frozen", "mse_soft")):
        for i, length in enumerate((4, 8, 16)):
            ratio = _ratio(
                _tok(metric, model, "linear", length),
                _tok("mse_soft", "MoE learned", "linear", length),
            )
            rows.append(
                Target(
                    "tokenized",
                    f"Table 1, linear, s = {length}: {model} / MoE learned MSE",
                    round(TABLE1_MSE[model][i] / TABLE1_MSE["MoE learned"][i], 3),
                    "Table 1, l. 329-333",
                    ratio,
                    _above(ratio, 1, inclusive=True),
                    "MSE ratio, soft MoE (l. 325)",
                )
            )
    return rows


def _dict(metric: str, model: str, atoms: int):
    return value(metric, model=model, atoms=atoms)


def _dict_mse_ratio(
    num: str, den: str, atoms: int, moe_metric: str
) -> Callable[[Result], tuple[float, float]]:
    """MSE of model ``num`` over model ``den`` at ``atoms``; MoE models read ``moe_metric``
    (``mse`` top-1 or ``mse_soft``), dense ones ``mse``. Scale-free, unlike the raw MSEs."""

    def metric(model: str) -> str:
        return "mse" if model.startswith("dense") else moe_metric

    return _ratio(_dict(metric(num), num, atoms), _dict(metric(den), den, atoms))


def _dictionary_ratio_rows() -> list[Target]:
    """The paper's C.3 MSEs as ratios to the learned MoE's (l. 349-351: 0.26 / 0.23,
    0.38 / 0.23, 0.19 / 0.041), top-1 and soft MoE: its label scale is not stated, so the
    ratios are the magnitudes that can be compared."""
    rows = []
    for moe_metric, suffix, quantity in (
        ("mse", "", "MSE ratio, top-1 MoE (l. 98)"),
        ("mse_soft", " (soft)", "MSE ratio, soft MoE"),
    ):
        for num, den, atoms, paper in (
            ("dense 2 layers", "MoE learned", 128, 0.26 / 0.23),
            ("MoE frozen", "MoE learned", 128, 0.38 / 0.23),
            ("dense 1 layer", "MoE learned", 32, 0.19 / 0.041),
        ):
            ratio = _dict_mse_ratio(num, den, atoms, moe_metric)
            rows.append(
                Target(
                    "dictionary",
                    f"c = {atoms}: {num} / {den} MSE{suffix}",
                    round(paper, 3),
                    "l. 349-351",
                    ratio,
                    _above(ratio, 1),
                    quantity,
                )
            )
    return rows


def _dictionary_rows() -> list[Target]:
    def moe_lt_dense_lt_frozen(r: Result) -> bool:
        return (
            _dict("mse", "MoE learned", 128)(r)[0]
            < _dict("mse", "dense 2 layers", 128)(r)[0]
            < _dict("mse", "MoE frozen", 128)(r)[0]
        )

    def dense1_worst(r: Result) -> bool:
        return _dict("mse", "dense 1 layer", 32)(r)[0] > max(
            _dict("mse", "dense 2 layers", 32)(r)[0], _dict("mse", "MoE learned", 32)(r)[0]
        )

    def any_result(r: Result) -> bool:
        return True

    top1, raw, sparsity = "raw MSE, top-1 MoE (l. 98)", "raw MSE", "mean of exp(entropy)"
    # (row name, paper's number, source line, metric, model, c, claim, quantity)
    rows = [
        ("c = 32: MoE MSE", 0.041, "l. 349", "mse", "MoE learned", 32, dense1_worst, top1),
        ("c = 32: dense 2-layer MSE", 0.043, "l. 349", "mse", "dense 2 layers", 32,
         dense1_worst, raw),
        ("c = 32: dense 1-layer MSE", 0.19, "l. 349", "mse", "dense 1 layer", 32,
         dense1_worst, raw),
        ("c = 128: MoE MSE", 0.23, "l. 349-351", "mse", "MoE learned", 128,
         moe_lt_dense_lt_frozen, top1),
        ("c = 128: dense 2-layer MSE", 0.26, "l. 351", "mse", "dense 2 layers", 128,
         moe_lt_dense_lt_frozen, raw),
        ("c = 128: frozen MoE MSE", 0.38, "l. 351", "mse", "MoE frozen", 128,
         moe_lt_dense_lt_frozen, top1),
        ("c = 32: sparsity per pair (= shuffled)", 4.5, "l. 349", "sparsity", "MoE learned",
         32, any_result, sparsity),
        ("c = 128: sparsity per pair (= shuffled 3.01)", 3.01, "l. 351", "sparsity",
         "MoE learned", 128, any_result, sparsity),
    ]  # fmt: skip
    return [
        Target("dictionary", name, paper, source, _dict(metric, model, c), claim, quantity)
        for name, paper, source, metric, model, c, claim, quantity in rows
    ]


TARGETS: list[Target] = [
    Target(
        "fig2",
        "Fig 2(a): E = k test loss, largest n (-> 0)",
        0.01,
        "l. 123, Fig. 2; target < 0.01",
        _fig2("loss"),
        _fig2_falls_with_n,
        "normalised, top-1 (l. 98)",
        "upper",
    ),
    Target(
        "fig2",
        "Fig 2(c): sparsity, largest n (-> 1)",
        1.0,
        "l. 127",
        _fig2("sparsity"),
        lambda r: _fig2("sparsity")(r)[0] < _fig2("shuffled_sparsity")(r)[0],
        "mean of exp(entropy); learned < shuffled",
    ),
    Target(
        "fig2",
        "Fig 2(b): loss at E = k/4 above E = k",
        None,
        "l. 123",
        lambda r: value(
            "loss", num_experts=min(r["config"]["experts"]), num_train=max(r["config"]["sizes"])
        )(r),
        lambda r: (
            value(
                "loss", num_experts=min(r["config"]["experts"]), num_train=max(r["config"]["sizes"])
            )(r)[0]
            > _fig2("loss")(r)[0]
        ),
        "normalised, top-1",
    ),
    Target(
        "fig3",
        "Fig 3(a): frozen / learned loss, largest n (target >= 3)",
        3.0,
        "l. 139, Fig. 3; target",
        _frozen_over_learned(),
        lambda r: _frozen_over_learned()(r)[0] > 1,
        "normalised, top-1",
        "lower",
    ),
    Target(
        "fig3",
        "Fig 3(a): MoE between the two dense models",
        None,
        "l. 143",
        _largest_n("loss", "MoE learned"),
        lambda r: (
            _largest_n("loss", "dense (whole MoE's params)")(r)[0]
            < _largest_n("loss", "MoE learned")(r)[0]
            < _largest_n("loss", "dense (1 expert's params)")(r)[0]
        ),
        "normalised, top-1",
    ),
    Target(
        "fig3",
        "Fig 3(b) / C.1: norm uniformity, largest n",
        1.025,
        "l. 295",
        _largest_n("norm_uniformity", "MoE learned"),
        lambda r: _largest_n("norm_uniformity", "MoE learned")(r)[0] < 2.0,
        "E norm(M_i)^2 / (E norm(M_i))^2",
    ),
    *_learning_helps_rows("fig4", "Fig 4(a)", "l. 155, Fig. 4"),
    Target(
        "fig4",
        "Fig 4(b): learned sparsity below shuffled",
        None,
        "l. 155",
        _largest_n("sparsity", "MoE learned"),
        lambda r: (
            _largest_n("sparsity", "MoE learned")(r)[0]
            < _largest_n("shuffled_sparsity", "MoE learned")(r)[0]
        ),
        "mean of exp(entropy)",
    ),
    *_learning_helps_rows("fig6", "Fig 6", "l. 161, Fig. 6"),
    Target(
        "spurious",
        "Sec 3.1: signal fraction after training, no weight decay",
        0.84,
        "l. 151",
        value("ratio_final", weight_decay=0.0),
        lambda r: (
            value("ratio_final", weight_decay=0.0)(r)[0]
            > value("ratio_init", weight_decay=0.0)(r)[0]
        ),
        "sum norm(w_i')^2 / sum norm(w_i)^2",
    ),
    Target(
        "spurious",
        "Sec 3.1: signal fraction, weight decay",
        0.9,
        "l. 151",
        value("ratio_final", weight_decay=1e-3),
        lambda r: (
            value("ratio_final", weight_decay=1e-3)(r)[0]
            > value("ratio_final", weight_decay=0.0)(r)[0]
        ),
        "weight decay 1e-3 (value not stated)",
    ),
    Target(
        "spurious",
        "Sec 3.1: test loss (0.01)",
        0.01,
        "l. 145",
        value("loss", weight_decay=0.0),
        lambda r: value("loss", weight_decay=0.0)(r)[0] < 0.5,
        "normalised, top-1",
        "upper",
    ),
    Target(
        "theorem1",
        "Thm 1: off-V router norm falls under weight decay",
        None,
        "l. 193-205",
        value("off_norm_final", weight_decay=1e-3),
        lambda r: (
            value("off_norm_final", weight_decay=1e-3)(r)[0]
            < value("off_norm_init", weight_decay=1e-3)(r)[0]
        ),
        "mean norm(Proj_{V-perp} w_i)",
    ),
    Target(
        "theorem2",
        "Thm 2: clusters covered at 2 k ln k experts",
        1.0,
        "l. 75",
        lambda r: value("coverage", router_init="data", num_experts=largest("num_experts", r))(r),
        lambda r: (
            value("coverage", router_init="data", num_experts=largest("num_experts", r))(r)[0]
            > value("coverage", router_init="data", num_experts=smallest("num_experts", r))(r)[0]
        ),
        "data-initialised router",
    ),
    Target(
        "lemma1",
        "Lemma 1: max abs(grad - closed-form k-means gradient)",
        0.0,
        "Lemma 1",
        lambda r: (r["summary"]["max_grad_gap"], 0.0),
        lambda r: r["summary"]["max_grad_gap"] < 1e-4,
        "exact identity (0 up to float32 rounding, 1e-5)",
        "upper",
    ),
    Target(
        "theorem4",
        "Thm 4: abs cos(w, z) -> 1",
        1.0,
        "App. F",
        value("abs_cos_w_z"),
        lambda r: value("abs_cos_w_z")(r)[0] > 0.9,
        "",
    ),
    *_tokenized_rows(),
    *_tokenized_ratio_rows(),
    *_dictionary_rows(),
    *_dictionary_ratio_rows(),
]


def _cell(x: float, std: float | None = None) -> str:
    def fmt(v: float) -> str:
        return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"

    return fmt(x) + (f" +- {fmt(std)}" if std else "")


def load_results(directory: pathlib.Path | None) -> tuple[dict[str, Result], list[str]]:
    """``{experiment: JSON}`` of the experiments in ``TARGETS`` found in ``directory`` and the
    names of those missing."""
    found, missing = {}, []
    for name in dict.fromkeys(t.experiment for t in TARGETS):
        path = directory / f"{name}.json" if directory is not None else None
        if path is not None and path.exists():
            found[name] = json.loads(path.read_text())
        else:
            missing.append(name)
    return found, missing


def rows(converged: dict[str, Result], quick: dict[str, Result]) -> list[dict[str, Any]]:
    """One dict per target whose experiment is in ``converged``."""
    out = []
    for t in TARGETS:
        if t.experiment not in converged:
            continue
        result = converged[t.experiment]
        preset = preset_of(result)
        try:
            mean, std = t.get(result)
            verdict = t.verdict(result) if preset in JUDGED_PRESETS else not_judged(preset)
        except (KeyError, ValueError):  # a setting this run did not train (e.g. a smaller preset)
            out.append(dict(experiment=t.experiment, result=t.name, absent=True))
            continue
        q = _optional(t.get, quick.get(t.experiment))
        q_preset = preset_of(quick[t.experiment]) if t.experiment in quick else None
        out.append(
            dict(
                experiment=t.experiment,
                result=t.name,
                quantity=t.quantity,
                source=t.source,
                paper=t.paper,
                bound=t.bound,
                quick=q,
                quick_preset=q_preset,
                converged=mean,
                std=std,
                preset=preset,
                seeds=len(result.get("seeds", [])),
                verdict=verdict,
            )
        )
    return out


def _optional(get: Callable[[Result], tuple[float, float]], result: Result | None) -> float | None:
    """The mean of ``get(result)``, or None when there is no result or it lacks the setting."""
    try:
        return None if result is None else get(result)[0]
    except (KeyError, ValueError):
        return None


def markdown(table: list[dict[str, Any]], missing: list[str]) -> str:
    def paper(r: dict[str, Any]) -> str:
        if r["paper"] is None:
            return "-"
        bound = {"upper": "<= ", "lower": ">= "}.get(r["bound"], "")
        return bound + _cell(r["paper"])

    def row(cells: list[Any]) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    lines = [
        row(
            [
                "experiment",
                "result",
                "quantity",
                "paper (source)",
                "quick",
                "converged (mean +- std over seeds)",
                "verdict",
            ]
        ),
        "|---|---|---|---|---|---|---|",
    ]
    absent = [f"{r['experiment']}: {r['result']}" for r in table if r.get("absent")]
    table = [r for r in table if not r.get("absent")]
    for r in table:
        quick = (
            "-" if r["quick"] is None else _labelled(r["quick_preset"], "quick", _cell(r["quick"]))
        )
        seeds = f"{r['seeds']} seed{'s' * (r['seeds'] != 1)}"
        value = _labelled(r["preset"], "converged", f"{_cell(r['converged'], r['std'])} ({seeds})")
        if r["preset"] == "quick" and r["quick"] is None:  # a quick run: its own column
            quick, value = f"{_cell(r['converged'], r['std'])} ({seeds})", "-"
        lines.append(
            row(
                [
                    r["experiment"],
                    r["result"],
                    r["quantity"],
                    f"{paper(r)} ({r['source']})",
                    quick,
                    value,
                    r["verdict"],
                ]
            )
        )
    judged = [r for r in table if r["verdict"] in VERDICTS]
    counts = {v: sum(r["verdict"] == v for r in judged) for v in VERDICTS}
    lines += [
        "",
        "Verdicts: "
        + ", ".join(f"{n} {v}" for v, n in counts.items())
        + f" (of {len(judged)} rows).",
    ]
    if len(judged) < len(table):
        lines.append(
            f"Not judged: {len(table) - len(judged)} rows whose run is not of the converged "
            "preset (the paper's numbers are for converged runs)."
        )
    if absent:
        lines.append(f"Not in these runs (setting not trained): {'; '.join(absent)}.")
    if missing:
        lines.append(
            f"Missing (no JSON in the results folder): {', '.join(m + '.json' for m in missing)}."
        )
    return "\n".join(lines) + "\n"


def _labelled(preset: str | None, column: str, text: str) -> str:
    """``text``, prefixed with its preset when that is not the ``column``'s."""
    return text if preset == column else f"{preset}: {text}"


def plot(table: list[dict[str, Any]], path: pathlib.Path) -> None:
    """One summary PNG: converged value / paper value per row with a paper number (log
    axis, the 2x band shaded), a point coloured by verdict joined to 1 (the paper's value);
    the title says how many of the table's rows are shown and why the others are not."""
    from matplotlib.patches import Patch

    absent = [r for r in table if r.get("absent") or r["verdict"] not in VERDICTS]
    present = [r for r in table if r not in absent]
    no_paper = [r for r in present if r["paper"] in (None, 0.0)]
    shown = [r for r in present if r["paper"] not in (None, 0.0)]
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(10.5, 0.28 * max(len(shown), 4) + 1.6))
    colours = {VERDICTS[0]: "tab:green", VERDICTS[1]: "tab:orange", VERDICTS[2]: "tab:red"}
    y = np.arange(len(shown))
    ratio = (
        np.array([max(abs(r["converged"] / r["paper"]), 1e-3) for r in shown])
        if shown
        else np.zeros(0)
    )
    ax.hlines(y, np.minimum(ratio, 1.0), np.maximum(ratio, 1.0), color="lightgray", lw=1, zorder=1)
    ax.scatter(ratio, y, c=[colours[r["verdict"]] for r in shown], s=22, zorder=3)
    ax.axvspan(0.5, 2.0, color="gray", alpha=0.15)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(y, [f"{r['experiment']}: {r['result']}" for r in shown], fontsize=6)
    ax.set_ylim(max(len(shown), 1) - 0.5, -0.5)
    ax.set_xlabel("|converged value / paper value| (log scale; 1 = the paper's value)")
    handles = [Patch(color=c, label=v) for v, c in colours.items()] + [
        Patch(color="gray", alpha=0.15, label="within 2x")
    ]
    plotting.legend_outside(ax, handles=handles, title="verdict")
    left_out = ([f"{len(no_paper)} without a paper number"] if no_paper else []) + (
        [f"{len(absent)} not trained or not judged in these runs"] if absent else []
    )
    ax.set_title(
        f"synthetic suite: fidelity to the paper ({len(shown)} of {len(table)} rows"
        + (f"; not shown: {', '.join(left_out)}, see report.md" if left_out else "")
        + ")",
        fontsize=9,
    )
    common.style_log_axes(ax)
    plotting.save(fig, str(path), dpi=100)


def write(
    results: pathlib.Path, quick: pathlib.Path | None, out: pathlib.Path
) -> tuple[dict[str, str], list[str]]:
    """Write ``<out>/report.md`` and ``<out>/report.png``; returns the paths and the missing
    experiments. Raises FileNotFoundError when ``results`` is not a folder."""
    if not results.is_dir():
        raise FileNotFoundError(f"--results {results}: no such folder")
    converged, missing = load_results(results)
    quick_results, _ = load_results(quick) if quick is not None else ({}, [])
    table = rows(converged, quick_results)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": str(out / "report.md"), "png": str(out / "report.png")}
    pathlib.Path(paths["md"]).write_text(markdown(table, missing))
    plot(table, pathlib.Path(paths["png"]))
    return paths, missing
