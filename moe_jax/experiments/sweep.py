"""`moe-jax sweep`: expand an experiment family into training runs, then collect their
eval curves into the paper's plots.

A family is a TOML file (``configs/*.toml``)::

    name = "fig5_cpu"
    gin_files = ["experiments/cpu_scale.gin"]   # overlays, after each run's own files
    seeds = [0, 1, 2]                            # -> --gin.RANDOM_SEED
    metric = "accuracy"                          # eval metric to plot (default accuracy)
    [bindings]                                   # --gin.KEY=VALUE for every run
    TRAIN_STEPS = 600
    [axes]                                       # optional: a run per value (product)
    NUM_EXPERTS = [8, 16, 32, 64]
    [runs.frozen]
    gin_files = ["experiments/fig5_frozen.gin"]
    bindings = {}                                # optional, per run

Every (run, axis values, seed) becomes one ``moe-jax train`` invocation whose MODEL_DIR is
``ROOT/<run>[/<AXIS>-<value>...]/seed<N>``. Subcommands::

    moe-jax sweep run FAMILY --root=DIR [--parallel=N] [--dry-run] [--only=RUN,...] \\
        [--set KEY=VALUE ...] [--gin.NAME=VALUE ...]
    moe-jax sweep collect FAMILY --root=DIR --out=DIR [--metric=loss] [--set KEY=VALUE ...]
    moe-jax sweep plot FAMILY OUT/<family>.json        # redraw collect's PNGs from its JSON

``--set KEY=VALUE`` (repeatable) changes the family as loaded, without editing the file: a
top-level key (``seeds=[0]``, ``gin_files=[...]``, ``metric=loss``), ``steps=N`` (=
``bindings.TRAIN_STEPS``), or a key inside a table by its path (``bindings.BATCH_SIZE=8``,
``axes.NUM_EXPERTS=[8,16]``, ``runs.frozen.bindings.KEY=...``); VALUE is a Python/TOML
literal or else a plain string. ``--gin.NAME=VALUE`` is passed to every run's ``train``
after the family's bindings (gin syntax, as ``train``'s own flag). E.g. a family tried
small before booking a pod::

    moe-jax sweep run configs/fig7.toml --root=/tmp/fig7_try --set steps=20 --set seeds=[0] \\
        --set "gin_files=['experiments/cpu_scale.gin']" --gin.BATCH_SIZE=8

``run`` starts ``--parallel`` trainings at a time, writes each one's log to
``<MODEL_DIR>/log.txt`` (and echoes it, each line prefixed ``[sweep <run> seed <N>]``: the
trainers' timestamped progress lines) and a ``DONE`` marker when it exits cleanly; runs
with a marker are skipped, runs without one resume from their last checkpoint (the
trainer's own resume).
``--dry-run`` prints the commands, one per line, e.g. to hand them to ``launch/`` scripts.
``run`` records the family as resolved (the file with ``--set`` applied, the ``--gin``
flags) in ``ROOT/<name>.family.json``; ``collect`` reads the runs that record names (its own
``--set`` applied on top; the file alone where there is none), so that a sweep run with
``--set`` is collected without repeating it. ``collect`` reads each run's ``metrics.jsonl``
eval records and writes ``<name>.json``
(per-step mean/std/min/max over seeds, final values, paired per-seed gaps between runs),
``<name>_curves.png`` (metric vs steps per run, band = seed range) and, when the family
has an axis, ``<name>_vs_<axis>.png`` (final metric vs axis value per run).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Sequence
from typing import Any

import numpy as np

from moe_jax import plotting, storage
from moe_jax.errors import UserError
from moe_jax.runtime import gin_text
from moe_jax.runtime.metrics import read_metrics
from moe_jax.runtime.run_dir import RunDir

FAMILY_KEYS = frozenset(
    {"name", "description", "gin_files", "seeds", "metric", "bindings", "axes", "runs"}
)
RUN_KEYS = frozenset({"gin_files", "bindings"})


class FamilyError(UserError, ValueError):
    """A family file that cannot be expanded; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of a family."""

    run: str  # the family's run name, e.g. "learned"
    axes: tuple[tuple[str, Any], ...]  # ((axis, value), ...) in family order
    seed: int
    gin_files: tuple[str, ...]
    bindings: tuple[tuple[str, Any], ...]
    gin_flags: tuple[str, ...] = ()  # ``--gin.NAME=VALUE`` of the command line, as given

    @property
    def group(self) -> str:
        """The run and its axis values without the seed, e.g. ``learned/NUM_EXPERTS-8``."""
        return "/".join([self.run, *(f"{k}-{v}" for k, v in self.axes)])

    def model_dir(self, root: str) -> str:
        return storage.join(root, self.group, f"seed{self.seed}")

    def run_dir(self, root: str) -> RunDir:
        """The run directory of this run under the sweep ``root``."""
        return RunDir(self.model_dir(root))

    def command(self, root: str) -> list[str]:
        """The ``moe-jax train`` argv of this run."""
        flags = [f"--gin_file={f}" for f in self.gin_files]
        flags += [f"--gin.{k}={_gin_literal(v)}" for k, v in self.bindings]
        flags += list(self.gin_flags)
        flags += [f"--gin.MODEL_DIR={self.model_dir(root)}", f"--gin.RANDOM_SEED={self.seed}"]
        return ["moe-jax", "train", *flags]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    metric: str
    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    runs: tuple[RunSpec, ...]


def _gin_literal(value: Any) -> str:
    """A TOML value as gin text (strings quoted, booleans capitalised)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise FamilyError(f"{path}: {message}")


def _require_folder_name(name: str, path: str, what: str) -> None:
    """Refuses a run name or axis value that is not one folder name under ``--root`` (one
    holding ``/`` or ``\\``, or ``.`` / ``..``: a MODEL_DIR outside the sweep's root)."""
    _require(
        name not in ("", ".", "..") and not set(name) & {"/", "\\"},
        path,
        f"{what} must be one folder name (no '/', '\\', '.' or '..'): it names MODEL_DIR "
        "under --root",
    )


SET_ALIASES = {"steps": "bindings.TRAIN_STEPS"}
_TABLES = ("bindings", "axes")  # tables whose keys may hold dots ("train_script.train.eval_period")


def apply_sets(raw: dict[str, Any], sets: Sequence[tuple[str, Any]], path: str) -> dict[str, Any]:
    """A copy of the family file's ``raw`` TOML with each ``--set`` ``(KEY, VALUE)`` applied
    (module docstring); an unknown key or run is a :class:`FamilyError` naming it."""
    raw = json.loads(json.dumps(raw))  # a deep copy (TOML values are JSON values)
    for key, value in sets:
        where = f"--set {key}"
        parts = SET_ALIASES.get(key, key).split(".", 1)
        top = parts[0]
        _require(
            top in FAMILY_KEYS,
            path,
            f"{where}: no family key {top!r}; keys: {sorted(FAMILY_KEYS)}, "
            f"or {sorted(SET_ALIASES)}",
        )
        if top in _TABLES and len(parts) == 2:
            raw.setdefault(top, {})[parts[1]] = value
        elif top == "runs" and len(parts) == 2:
            run, _, rest = parts[1].partition(".")
            _require(
                run in raw.get("runs", {}),
                path,
                f"{where}: no run {run!r}; runs: {sorted(raw.get('runs', {}))}",
            )
            field, _, name = rest.partition(".")
            _require(
                field in RUN_KEYS,
                path,
                f"{where}: expected runs.{run}.gin_files or runs.{run}.bindings.NAME",
            )
            if field == "bindings" and name:
                raw["runs"][run].setdefault("bindings", {})[name] = value
            else:
                raw["runs"][run][field] = value
        else:
            _require(len(parts) == 1, path, f"{where}: {top!r} is not a table")
            raw[top] = value
    return raw


def family_file(path: str) -> str:
    """Where family file ``path`` is: as given (from the working directory), else a relative
    path inside the repository (``configs/fig7_cpu.toml`` from anywhere, as gin files are
    found)."""
    in_repo = gin_text.REPO_GIN_DIR.parent / path
    if os.path.exists(path) or os.path.isabs(path) or not in_repo.is_file():
        return path
    return str(in_repo)


def read_family_file(path: str, sets: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
    """The family file's TOML (:func:`family_file`) with the ``--set`` changes applied; a
    missing or bad file is a :class:`FamilyError` naming it."""
    try:
        with open(family_file(path), "rb") as f:
            return apply_sets(tomllib.load(f), sets, path)
    except FileNotFoundError:
        raise FamilyError(
            f"{path}: no such family file (looked in the working directory and "
            f"{gin_text.REPO_GIN_DIR.parent})"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise FamilyError(f"{path}: not valid TOML ({err})") from None


def load_family(
    path: str, sets: Sequence[tuple[str, Any]] = (), gin_flags: Sequence[str] = ()
) -> Family:
    """Parse and validate a family file, with the command line's ``--set`` changes and
    ``--gin.NAME=VALUE`` flags for every run; errors name the file and the offending key."""
    return build_family(read_family_file(path, sets), path, gin_flags)


def build_family(raw: dict[str, Any], path: str, gin_flags: Sequence[str] = ()) -> Family:
    """The :class:`Family` of a family's TOML ``raw`` (as read from ``path``); errors name
    ``path`` and the offending key."""
    unknown = sorted(set(raw) - FAMILY_KEYS)
    _require(not unknown, path, f"unknown key(s) {unknown}; allowed: {sorted(FAMILY_KEYS)}")
    name = raw.get("name", os.path.splitext(os.path.basename(path))[0])
    seeds = raw.get("seeds", [0])
    _require(
        isinstance(seeds, list) and bool(seeds) and all(isinstance(s, int) for s in seeds),
        path,
        f"'seeds' must be a non-empty list of integers, got {seeds!r}",
    )
    runs = raw.get("runs", {})
    _require(isinstance(runs, dict) and bool(runs), path, "needs at least one [runs.<name>] table")
    axes = raw.get("axes", {})
    for axis, values in axes.items():
        _require(
            isinstance(values, list) and bool(values), path, f"axes.{axis} must be a non-empty list"
        )
        for value in values:
            _require_folder_name(f"{axis}-{value}", path, f"axes.{axis} value {value!r}")
    common_files = raw.get("gin_files", [])
    common_bindings = raw.get("bindings", {})
    specs = []
    for run_name, run in runs.items():
        _require(isinstance(run, dict), path, f"runs.{run_name} must be a table")
        unknown = sorted(set(run) - RUN_KEYS)
        _require(
            not unknown,
            path,
            f"runs.{run_name}: unknown key(s) {unknown}; allowed: {sorted(RUN_KEYS)}",
        )
        _require(bool(run.get("gin_files")), path, f"runs.{run_name}.gin_files is missing or empty")
        _require_folder_name(str(run_name), path, f"run name {run_name!r}")
        for point in itertools.product(*axes.values()):
            axis_values = tuple(zip(axes, point, strict=True))
            bindings = {**common_bindings, **run.get("bindings", {}), **dict(axis_values)}
            for seed in seeds:
                specs.append(
                    RunSpec(
                        run_name,
                        axis_values,
                        seed,
                        (*run["gin_files"], *common_files),
                        tuple(bindings.items()),
                        tuple(gin_flags),
                    )
                )
    return Family(
        name,
        raw.get("metric", "accuracy"),
        tuple((k, tuple(v)) for k, v in axes.items()),
        tuple(specs),
    )


# ---------------------------------------------------------------------------------- run


def family_record_path(root: str, family_name: str) -> str:
    """``ROOT/<family>.family.json``: the family as `sweep run` resolved it."""
    return storage.join(root, f"{family_name}.family.json")


def record_family(root: str, raw: dict[str, Any], path: str, gin_flags: Sequence[str]) -> str:
    """Writes the family as resolved (the file with ``--set`` applied, the ``--gin`` flags)
    into ``root``, for ``collect`` to find the runs that ran; returns its path."""
    record = family_record_path(root, build_family(raw, path).name)
    storage.write_text(
        record, json.dumps({"file": path, "family": raw, "gin_flags": list(gin_flags)}, indent=1)
    )
    return record


def recorded_family(
    root: str, path: str, sets: Sequence[tuple[str, Any]]
) -> tuple[dict[str, Any], list[str]] | None:
    """The family `sweep run` recorded in ``root`` (``collect``'s own ``--set`` applied on
    top) and its ``--gin`` flags, or None when it recorded none."""
    record = family_record_path(root, load_family(path, sets).name)
    if not storage.exists(record):
        return None
    saved = json.loads(storage.read_text(record))
    print(f"[sweep] the family as `sweep run` resolved it: {record}", file=sys.stderr)
    return apply_sets(saved["family"], sets, path), saved["gin_flags"]


_ECHO_LOCK = threading.Lock()


def _execute(spec: RunSpec, root: str, executable: Sequence[str]) -> tuple[RunSpec, int, float]:
    """Runs one training, its output appended to ``<MODEL_DIR>/log.txt`` and echoed line by
    line, prefixed with the run, to this process's stdout (the trainer writes plain
    timestamped progress lines there, stdout not being a terminal)."""
    run_dir = spec.run_dir(root)
    storage.makedirs(run_dir.path)
    log_path = run_dir.log_file
    local = storage.is_local(log_path)
    start = time.time()
    prefix = f"[sweep {spec.group} seed {spec.seed}] "
    with open(log_path, "ab") if local else tempfile.TemporaryFile() as log:
        child = subprocess.Popen(
            [*executable, *spec.command(root)[2:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            log.flush()
            with _ECHO_LOCK:
                print(prefix + line.decode(errors="replace").rstrip(), flush=True)
        rc = child.wait()
        if not local:  # an object store cannot append: the log is uploaded when the run ends
            log.seek(0)
            earlier = storage.read_bytes(log_path) if storage.exists(log_path) else b""
            storage.write_bytes(log_path, earlier + log.read())
    if rc == 0:
        storage.write_text(run_dir.done_file, f"{time.time() - start:.1f} s\n")
    return spec, rc, time.time() - start


def run_family(
    family: Family,
    root: str,
    parallel: int = 1,
    executable: Sequence[str] = (sys.executable, "-m", "moe_jax.cli", "train"),
) -> int:
    """Train every run of ``family`` not yet marked DONE; returns the number that failed."""
    todo = [s for s in family.runs if not storage.exists(s.run_dir(root).done_file)]
    todo.sort(key=lambda s: s.seed)  # whole seeds first: a cut-short sweep still compares runs
    print(
        f"[sweep] {family.name}: {len(family.runs)} runs, {len(family.runs) - len(todo)} done, "
        f"{len(todo)} to run, {parallel} at a time",
        flush=True,
    )
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(_execute, s, root, executable) for s in todo]
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            spec, rc, seconds = future.result()
            status = "done" if rc == 0 else f"FAILED (exit {rc}; see {spec.run_dir(root).log_file})"
            print(
                f"[sweep] {i}/{len(todo)} {spec.group} seed {spec.seed}: {status} in "
                f"{seconds / 60:.1f} min",
                flush=True,
            )
            failed += rc != 0
    return failed


# ------------------------------------------------------------------------------ collect


def read_eval_curve(run_dir: RunDir, metric: str) -> dict[int, float]:
    """``{step: value}`` of ``metric`` over the eval records of ``MODEL_DIR/metrics.jsonl``."""
    return {
        int(record["step"]): float(record[metric])  # a resumed run's later record wins
        for record in read_metrics(run_dir, "eval")
        if metric in record
    }


def _stats(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()),
        "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
        "min": float(values.min()),
        "max": float(values.max()),
        "n": len(values),
    }


def summarize(family: Family, root: str) -> dict[str, Any]:
    """Per group: the curve over steps all its seeds reached, and the final value per seed;
    per pair of runs at the same axis point: per-seed final gaps (paired by seed)."""
    groups: dict[str, dict[str, Any]] = {}
    for spec in family.runs:
        curve = read_eval_curve(spec.run_dir(root), family.metric)
        group = groups.setdefault(
            spec.group, {"run": spec.run, "axes": dict(spec.axes), "seeds": {}}
        )
        if curve:
            group["seeds"][spec.seed] = curve
    for group in groups.values():
        curves = group.pop("seeds")
        if not curves:
            group.update(missing=True)
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves.values())))
        values = np.array([[c[s] for s in steps] for c in curves.values()])  # [seeds, steps]
        group["steps"] = steps
        group["curve"] = {
            k: [_stats(values[:, j])[k] for j in range(len(steps))]
            for k in ("mean", "min", "max", "std")
        }
        group["final_step"] = steps[-1] if steps else None
        group["final"] = {str(seed): c[steps[-1]] for seed, c in curves.items()} if steps else {}
        group["final_stats"] = _stats(values[:, -1]) if steps else None
    gaps = []
    complete = {k: g for k, g in groups.items() if g.get("final")}
    for (b_name, b), (a_name, a) in itertools.combinations(complete.items(), 2):
        if a["axes"] != b["axes"]:  # a later run of the file minus an earlier one
            continue
        seeds = sorted(set(a["final"]) & set(b["final"]))
        if not seeds:
            continue
        diff = np.array([a["final"][s] - b["final"][s] for s in seeds])
        gaps.append(
            {
                "a": a_name,
                "b": b_name,
                "per_seed": dict(zip(seeds, diff.tolist(), strict=True)),
                "a_higher": int((diff > 0).sum()),
                **_stats(diff),
            }
        )
    return {"family": family.name, "metric": family.metric, "groups": groups, "gaps": gaps}


# Units of the eval metrics a family plots.
METRIC_LABELS = {
    "accuracy": "eval token accuracy (fraction of targets)",
    "cross_entropy": "eval cross-entropy (nats per target token)",
    "loss": "eval loss (nats per target token, with auxiliary losses)",
}


def plot_summary(summary: dict[str, Any], family: Family, out: str) -> list[str]:
    """Write the curve plot and, for families with axes, the final-vs-axis plots: one
    distinct colour / line style per run, legends beside the axes, runs without eval
    records named in the title."""

    plt = plotting.pyplot()
    metric, written = summary["metric"], []
    ylabel = METRIC_LABELS.get(metric, f"eval {metric}")
    groups = {k: g for k, g in summary["groups"].items() if not g.get("missing")}
    missing = [k for k, g in summary["groups"].items() if g.get("missing")]
    note = f" ({len(missing)} run(s) without eval records: {', '.join(missing)})" if missing else ""
    styles = plotting.run_styles(list(dict.fromkeys(g["run"] for g in groups.values())))
    points = sorted({tuple(g["axes"].items()) for g in groups.values()})
    fig, axs = plt.subplots(1, len(points), figsize=(5 * len(points) + 2.2, 4), squeeze=False)
    for ax, point in zip(axs[0], points, strict=True):
        for g in groups.values():
            if tuple(g["axes"].items()) != point:
                continue
            n = g["final_stats"]["n"]
            style = styles[g["run"]]
            ax.plot(
                g["steps"],
                g["curve"]["mean"],
                ms=3,
                label=f"{g['run']} ({n} seed{'s' * (n != 1)})",
                **style,
            )
            if n > 1:
                ax.fill_between(
                    g["steps"],
                    g["curve"]["min"],
                    g["curve"]["max"],
                    color=style["color"],
                    alpha=0.15,
                )
        ax.set(
            xlabel="training step",
            ylabel=ylabel,
            title=(", ".join(f"{k}={v}" for k, v in point) or summary["family"]) + note,
        )
        ax.grid(alpha=0.3)
    several = any(g["final_stats"]["n"] > 1 for g in groups.values())
    plotting.legend_outside(axs[0, -1], title="run (band: seed range)" if several else "run")
    written.append(
        plotting.save(fig, storage.join(out, f"{summary['family']}_curves.png"), dpi=120)
    )
    for axis, values in family.axes:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for run in dict.fromkeys(g["run"] for g in groups.values()):
            xs, ys, lo, hi = [], [], [], []
            for value in values:
                match = [
                    g for g in groups.values() if g["run"] == run and g["axes"].get(axis) == value
                ]
                if match:
                    s = match[0]["final_stats"]
                    xs.append(value)
                    ys.append(s["mean"])
                    lo.append(s["mean"] - s["min"])
                    hi.append(s["max"] - s["mean"])
            ax.errorbar(xs, ys, yerr=[lo, hi], capsize=3, label=run, **styles[run])
        ax.set(xlabel=axis, ylabel=f"final {ylabel}", title=summary["family"] + note)
        if all(isinstance(v, (int, float)) and v > 0 for v in values):
            ax.set_xscale("log", base=2)
            ax.set_xticks(values, [str(v) for v in values])
        ax.grid(alpha=0.3)
        plotting.legend_outside(ax, title="run (bars: seed range)" if several else "run")
        written.append(
            plotting.save(fig, storage.join(out, f"{summary['family']}_vs_{axis}.png"), dpi=120)
        )
    return written


def format_table(summary: dict[str, Any]) -> str:
    """Final values and paired gaps as text (what ``collect`` prints)."""
    metric = summary["metric"]
    lines = [
        f"{'run':<32} {'step':>7} {'mean ' + metric:>16} {'std':>8} {'min':>8} {'max':>8} seeds"
    ]
    for name, g in summary["groups"].items():
        if g.get("missing"):
            lines.append(f"{name:<32} (no eval records yet)")
            continue
        s = g["final_stats"]
        lines.append(
            f"{name:<32} {g['final_step']:>7} {s['mean']:>16.4f} {s['std']:>8.4f} "
            f"{s['min']:>8.4f} {s['max']:>8.4f} {s['n']}"
        )
    for gap in summary["gaps"]:
        lines.append(
            f"gap {gap['a']} - {gap['b']}: {gap['mean']:+.4f} ± {gap['std']:.4f} "
            f"(min {gap['min']:+.4f}, max {gap['max']:+.4f}; {gap['a']} higher in "
            f"{gap['a_higher']}/{gap['n']} seeds)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-jax sweep", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="train every run of a family")
    collect = sub.add_parser("collect", help="gather eval curves into JSON and PNG plots")
    replot = sub.add_parser(
        "plot", help="redraw the PNGs of a JSON that `collect` wrote (no runs needed)"
    )
    replot.add_argument("family", help="family file, e.g. configs/fig5_cpu.toml")
    replot.add_argument("summary", help="the <family>[_<metric>].json that collect wrote")
    replot.add_argument(
        "--out", type=storage.normalize, help="where the PNGs go (default: the JSON's folder)"
    )
    replot.add_argument(
        "--set",
        type=_set_flag,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="sets",
        help="as for collect",
    )
    for p in (run, collect):
        p.add_argument("family", help="family file, e.g. configs/fig5_cpu.toml")
        p.add_argument(
            "--root", type=storage.normalize, required=True, help="parent of the runs' MODEL_DIRs"
        )
        p.add_argument(
            "--set",
            type=_set_flag,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            dest="sets",
            help="change the family as loaded: seeds=[0], steps=20 (bindings.TRAIN_STEPS), "
            "bindings.NAME=VALUE, axes.NAME=[...], runs.RUN.bindings.NAME=VALUE (repeatable)",
        )
    run.add_argument("--parallel", type=int, default=1, help="trainings at a time (default 1)")
    run.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    run.add_argument(
        "--only",
        default=None,
        metavar="RUN[,RUN]",
        help="only these runs of the family (e.g. the source of an upcycled run first)",
    )
    run.epilog = (
        "--gin.NAME=VALUE (repeatable): a gin binding passed to every run's train after "
        "the family's own bindings, so it wins over them."
    )
    collect.add_argument(
        "--out", type=storage.normalize, help="where the JSON and PNGs go (default: ROOT)"
    )
    collect.add_argument(
        "--metric",
        help="eval metric to collect (default: the family's, else accuracy); "
        "outputs are named <family>_<metric> when given",
    )
    return parser


def _set_flag(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, value)``: VALUE a Python literal (``20``, ``[0, 1]``, ``'x'``,
    ``True``; ``true``/``false`` as in TOML) or else the plain string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    value = {"true": "True", "false": "False"}.get(value.strip(), value.strip())
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    gin_flags = [flag for flag in rest if flag.startswith("--gin.") and "=" in flag]
    unknown = [flag for flag in rest if flag not in gin_flags]
    if unknown or (gin_flags and args.action != "run"):
        parser.error(
            f"unrecognized arguments: {' '.join(unknown or gin_flags)}"
            + (" (--gin.NAME=VALUE is a flag of `sweep run`)" if gin_flags and not unknown else "")
        )
    raw = read_family_file(args.family, args.sets)
    if args.action == "collect":
        raw, gin_flags = recorded_family(args.root, args.family, args.sets) or (raw, gin_flags)
    family = build_family(raw, args.family, gin_flags)
    if args.action == "run":
        if args.only:
            names = args.only.split(",")
            unknown = sorted(set(names) - {s.run for s in family.runs})
            if unknown:
                raise FamilyError(f"--only={args.only}: no run {unknown} in {args.family}")
            family = dataclasses.replace(
                family, runs=tuple(s for s in family.runs if s.run in names)
            )
        if args.dry_run:
            import shlex

            for spec in family.runs:
                print(shlex.join(spec.command(args.root)))
            return 0
        record_family(args.root, raw, args.family, gin_flags)
        return 1 if run_family(family, args.root, args.parallel) else 0
    if args.action == "plot":
        with open(args.summary) as f:
            summary = json.load(f)
        for png in plot_summary(
            summary, family, args.out or os.path.dirname(os.path.abspath(args.summary))
        ):
            print("wrote", png)
        return 0
    if args.metric:
        family = dataclasses.replace(
            family, name=f"{family.name}_{args.metric}", metric=args.metric
        )
    out = args.out or args.root
    summary = summarize(family, args.root)
    if all(g.get("missing") for g in summary["groups"].values()):
        raise FamilyError(f"no eval records under {args.root} for family {family.name}")
    path = storage.join(out, f"{family.name}.json")
    storage.write_text(path, json.dumps(summary, indent=1))
    pngs = plot_summary(summary, family, out)
    print(format_table(summary))
    print("wrote", path, *pngs)
    return 0
