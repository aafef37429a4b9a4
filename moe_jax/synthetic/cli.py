"""`moe-jax synthetic <experiment> [--preset quick|converged|paper] [--seed N | --seeds 0,1,2]
[--out DIR] [--set KEY=VALUE ...]`.

Regenerates one synthetic result of the paper (or `all` of the suite) into ``--out``:
``<name>.json`` (numbers), ``<name>.csv`` (one row per run) and ``<name>.png``, and prints
its results table. ``--set KEY=VALUE`` (repeatable, one experiment only) changes one entry
of the preset, e.g. ``--set lr_router=0.1 --set sizes=[1024,8192]``; the JSON's ``config``
is the preset as it ran. `moe-jax synthetic list` describes the experiments;
`moe-jax synthetic report --results DIR [--quick DIR]` writes the fidelity table
(``report.md``, ``report.png``) of a folder of results.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import time
from typing import Any

from moe_jax import errors, plotting
from moe_jax.synthetic import report as fidelity
from moe_jax.synthetic.experiments import EXPERIMENTS, SUITE, load
from moe_jax.synthetic.experiments.common import PRESETS, TRAINING_KEYS, console_table

DEFAULT_SEEDS = {"quick": [0, 1], "converged": [0, 1, 2], "paper": [0, 1, 2]}


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds must be comma-separated integers, got {text!r}"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds is empty")
    return seeds


def _override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): VALUE is a Python literal (1e-3, [640, 25600], 'mean')
    or, if it is not one, the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()


def apply_overrides(
    preset: dict[str, Any], overrides: list[tuple[str, Any]], where: str
) -> dict[str, Any]:
    """A copy of ``preset`` with ``overrides`` applied. A key must be one of the preset's
    or a training key (schedule, convergence rule); a value must have the type of the
    preset's (an int may stand for a float). ``where`` names the preset in errors."""
    cfg = dict(preset)
    for key, given in overrides:
        if key not in cfg and key not in TRAINING_KEYS:
            keys = ", ".join(sorted(set(cfg) | set(TRAINING_KEYS)))
            raise ValueError(f"--set {key}: {where} has no such key; keys: {keys}")
        value = given
        if key in cfg:
            current = cfg[key]
            if (
                isinstance(current, float)
                and isinstance(given, int)
                and not isinstance(given, bool)
            ):
                value = float(given)
            if type(value) is not type(current):
                raise ValueError(
                    f"--set {key}={value!r}: {where} has {key}={current!r}, "
                    f"a {type(current).__name__}, not a {type(value).__name__}"
                )
        cfg[key] = value
    return cfg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-jax synthetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "experiment",
        help=f"one of: {', '.join(EXPERIMENTS)}, or 'all' (the suite without cifar100), 'list', "
        "'report' or 'plot' (redraw PNGs from --results' JSON)",
    )
    p.add_argument(
        "--preset",
        default="quick",
        help="quick (CPU minutes), converged (trained until the loss stops moving, "
        "docs/synthetic.md) or paper (the paper's sizes)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--seed", type=int, help="a single seed")
    group.add_argument(
        "--seeds", type=_seeds, help="comma-separated seeds, e.g. 0,1,2 (vmapped in one jit)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default: results/synthetic; for report: the --results folder)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one preset entry (repeatable; a single experiment only), "
        "e.g. --set lr_router=0.1",
    )
    p.add_argument(
        "--results", default=None, help="report: the folder of <experiment>.json files to judge"
    )
    p.add_argument(
        "--quick",
        default=None,
        help="report: a folder of quick-preset results for the 'quick' column (optional)",
    )
    return p


def report(args: argparse.Namespace) -> int:

    if args.results is None:
        raise errors.ConfigError("report: --results DIR is required")
    results = pathlib.Path(args.results)
    if not results.is_dir():
        raise errors.InputFileError(f"report: --results {results} is not a folder")
    quick = pathlib.Path(args.quick) if args.quick else None
    paths, missing = fidelity.write(results, quick, pathlib.Path(args.out) if args.out else results)
    for name in missing:
        print(
            f"moe-jax synthetic report: {results / (name + '.json')} is missing; "
            "its rows are left out",
            file=sys.stderr,
        )
    print(pathlib.Path(paths["md"]).read_text())
    print(f"wrote {paths['md']} and {paths['png']}")
    return 0


def replot(args: argparse.Namespace) -> int:
    """``moe-jax synthetic plot --results DIR [--out DIR]``: redraws ``<name>.png`` from each
    ``<name>.json`` in DIR whose experiment can plot from its JSON alone (no training)."""

    if args.results is None or not pathlib.Path(args.results).is_dir():
        raise errors.ConfigError("plot: --results DIR (a folder of <experiment>.json) is required")
    out = pathlib.Path(args.out or args.results)
    for path in sorted(pathlib.Path(args.results).glob("*.json")):
        name = json.loads(path.read_text()).get("experiment")
        experiment = load(name) if name in EXPERIMENTS else None
        if experiment is None or experiment.plot is None:
            print(
                f"moe-jax synthetic plot: {path.name}: {name} plots only when it runs",
                file=sys.stderr,
            )
            continue
        print(
            "wrote",
            plotting.save(
                experiment.plot(json.loads(path.read_text())),
                str(out / f"{name}.png"),
                dpi=80,
                fixed_size=True,
            ),
        )
    return 0


def experiment_help(name: str) -> str:
    """``moe-jax synthetic NAME --help``: the experiment, its options and each preset's
    entries (what ``--set KEY=VALUE`` may change)."""
    experiment = load(name)
    lines = [
        f"usage: moe-jax synthetic {name} [--preset {'|'.join(PRESETS)}] "
        "[--seed N | --seeds 0,1,2] [--out DIR] [--set KEY=VALUE ...]",
        "",
        experiment.description,
        "",
        "options: --preset (default quick), --seed / --seeds (default "
        + ", ".join(f"{p}: {','.join(map(str, s))}" for p, s in DEFAULT_SEEDS.items())
        + "), --out (default results/synthetic), --set KEY=VALUE (an entry of the preset)",
        "",
        "presets:",
    ]
    for preset in PRESETS:
        entries = experiment.presets.get(preset) or {}
        lines.append(f"  {preset}: " + ", ".join(f"{k}={v!r}" for k, v in entries.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = [a for a in argv if not a.startswith("-")][:1]
    if named and named[0] in EXPERIMENTS and {"-h", "--help"} & set(argv):
        print(experiment_help(named[0]))
        return 0
    args = parser().parse_args(argv)
    if args.experiment == "list":
        width = max(map(len, EXPERIMENTS))
        for name in EXPERIMENTS:
            print(f"{name:<{width}}  {load(name).description}")
        return 0
    if args.experiment == "report":
        return report(args)
    if args.experiment == "plot":
        return replot(args)
    if args.preset not in PRESETS:
        raise errors.ConfigError(
            f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}"
        )
    names = list(SUITE) if args.experiment == "all" else [args.experiment]
    if args.experiment != "all" and args.experiment not in EXPERIMENTS:
        raise errors.ConfigError(
            f"unknown experiment {args.experiment!r}; choose one of "
            f"{', '.join(EXPERIMENTS)}, all, list, report"
        )
    if args.overrides and args.experiment == "all":
        raise errors.ConfigError(
            "--set changes one experiment's preset; name the experiment instead of 'all'"
        )
    try:
        configs = {
            name: apply_overrides(
                load(name).presets[args.preset], args.overrides, f"{name}'s {args.preset} preset"
            )
            for name in names
        }
    except ValueError as err:
        raise errors.ConfigError(str(err)) from None
    seeds = [args.seed] if args.seed is not None else (args.seeds or DEFAULT_SEEDS[args.preset])
    out = pathlib.Path(args.out or "results/synthetic")
    timings = {}
    for name in names:
        start = time.perf_counter()
        result = load(name).run_preset(args.preset, configs[name], seeds, out)
        timings[name] = time.perf_counter() - start
        print(
            f"\n{name} ({args.preset}, seeds {','.join(map(str, seeds))}):\n{console_table(result)}"
        )
        print(f"{name}: {timings[name]:.1f}s -> {result['files']['json']}", flush=True)
    if len(names) > 1:
        print(
            json.dumps(
                {
                    "total_s": round(sum(timings.values()), 1),
                    "per_experiment_s": {k: round(v, 1) for k, v in timings.items()},
                }
            )
        )
    return 0
