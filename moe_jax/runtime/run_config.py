"""A run's recorded gin config: kept when `train` starts, compared when it resumes, and
found by the commands that read a run (eval, infer, analyze, export, import).

`train` writes ``MODEL_DIR/config.gin`` on the first start; a resumption whose operative
config differs from the run's config as last accepted is refused (:func:`config_changes`)
unless ``--allow_config_change``, which keeps the new one as ``config.step-N.gin``. A command
reading a run takes the config as of its checkpoint's step (:func:`run_config_file`),
through the gate of :mod:`~moe_jax.runtime.config_gate`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import gin
from gin import config_parser

from moe_jax import storage
from moe_jax.runtime import config_gate
from moe_jax.runtime.gin_text import (
    GinConfigError,
    config_bindings,
    parse_statements,
    resolve,
    search_paths,
)
from moe_jax.runtime.run_dir import RunDir

# Bindings that may differ when a run resumes: its length, periods and paths.
RESUMABLE_CHANGES = re.compile(
    r"^(MODEL_DIR|TRAIN_STEPS|.*(_period|_dir|_path|\.path|total_steps|eval_steps|keep_checkpoints|"
    r"async_checkpointing))$"
)


class ConfigChangedError(GinConfigError):
    """A run would resume with another gin config than it was trained with."""


# What to bind instead of ``MoeLayer.*`` (the MoE settings became MoeConfig and its parts).
MOE_LAYER_HINT = (
    "MoeLayer takes no gin bindings: the MoE settings are MoeConfig.*, <Router>Config.*, "
    "CapacityConfig.*, ExecutionConfig.*, AuxLossConfig.*; docs/moe.md"
)


def unknown_configurable(path: str, line: object, binding: str, selector: str) -> str:
    """The one-line message of ``binding`` (line ``line`` of the gin file ``path``), which
    names ``selector``, a configurable this version does not have."""
    message = f"{path}, line {line}: `{binding}`: no configurable {selector!r} in this version"
    run = config_gate.in_run_directory(path)
    if selector.rsplit(".", 1)[-1] == "MoeLayer":
        # run directories of the unreleased development snapshots of 2026-11-21..25
        message += (
            " (MoeLayer.* is the MoE settings of the unreleased development snapshots of "
            "2026-11-21..25, whose runs are not read since they became MoeConfig.*: train the "
            "run again; CHANGELOG.md)"
            if run
            else f" ({MOE_LAYER_HINT})"
        )
    elif run:
        message += " (the run's config was written by another version)"
    return message


def unknown_configurables(text: str, origin: str) -> list[tuple[int, str, str]]:
    """``(line, binding, configurable)`` of each binding of the gin config ``text`` (read
    from ``origin``) whose configurable gin does not know (call once the configurables are
    imported, e.g. after :func:`~moe_jax.runtime.gin_utils.parse_gin`)."""
    found = []
    for statement in parse_statements(text, origin):
        if not isinstance(statement, config_parser.BindingStatement) or not statement.arg_name:
            continue  # a macro, an import or an include
        try:
            known = gin.config._REGISTRY.get_match(statement.selector) is not None
        except KeyError:  # ambiguous: several configurables of that name
            known = True
        if not known:
            location = statement.location
            found.append((location.line_num, location.line_content.strip(), statement.selector))
    return found


def _macros_resolved(bindings: dict[str, object]) -> dict[str, object]:
    """``bindings`` (of :func:`config_bindings`) with each value that is a macro of the same
    config (``"%NAME"``) replaced by the macro's value, so that ``k = %K`` with ``K = 2``
    equals ``k = 2`` (the same value, written another way)."""

    def value(v: object, depth: int = 0) -> object:
        if isinstance(v, str) and v.startswith("%") and v[1:] in bindings and depth < 10:
            return value(bindings[v[1:]], depth + 1)
        return v

    return {name: value(v) for name, v in bindings.items()}


def config_changes(saved: str, current: str) -> list[str]:
    """The bindings set in both configs whose values differ, except those a resumed run may
    change (:data:`RESUMABLE_CHANGES`), as ``"name: saved -> current"`` lines.

    Bindings in only one of the two are not compared: an operative config lists only the
    configurables the run called, which differs between a fresh start and a resumption.
    """
    before, after = (
        _macros_resolved(config_bindings(saved, "saved config.gin")),
        _macros_resolved(config_bindings(current, "operative config")),
    )
    return [
        f"{name}: {before[name]!r} -> {after[name]!r}"
        for name in sorted(set(before) & set(after))
        if before[name] != after[name] and not RESUMABLE_CHANGES.match(name.rsplit("/", 1)[-1])
    ]


def record_run_config(
    run_dir: RunDir, operative: str, step: int, *, allow_change: bool = False
) -> str:
    """Keeps the run's gin config: writes ``MODEL_DIR/config.gin`` on the first start; on a
    resumption (at ``step``) compares ``operative`` with the run's config as last accepted
    (:meth:`RunDir.recorded_config <moe_jax.runtime.run_dir.RunDir.recorded_config>`). No
    recorded config is ever overwritten, so a plain resume
    that would undo an accepted change is refused like any other change.

    Returns:
      the path the operative config is kept at: the recorded one it equals, or
      ``config.step-N.gin`` when this resumption changed something and ``allow_change`` let it.

    A recorded config binding a configurable this version does not have (a run of another
    version) cannot be compared: it is refused, naming the file and the first such binding,
    unless ``allow_change`` (which lists each unknown configurable as changed).

    Raises:
      ConfigChangedError: listing the differing bindings, or naming a binding of an unknown
        configurable, when ``allow_change`` is False.
    """
    first = run_dir.config_file
    if not storage.exists(first):
        storage.write_text(first, operative)
        return first
    recorded = run_dir.recorded_config(step)
    saved = storage.read_text(recorded)
    unknown = unknown_configurables(saved, recorded)
    if unknown and not allow_change:
        raise ConfigChangedError(
            unknown_configurable(recorded, *unknown[0])
            + "; the run's config cannot be compared with this one (pass "
            "--allow_config_change to resume with the current config, kept as "
            "config.step-N.gin)"
        )
    changes = [
        *(
            f"{selector}.*: no such configurable in this version"
            for selector in dict.fromkeys(selector for _, _, selector in unknown)
        ),
        *config_changes(saved, operative),
    ]
    if not changes:
        return recorded
    if not allow_change:
        raise ConfigChangedError(
            f"MODEL_DIR={run_dir} was trained with another gin config ({recorded}); resuming at "
            f"step {step} would change {len(changes)} binding(s) (pass --allow_config_change to "
            "resume with them; kept as config.step-N.gin):\n  " + "\n  ".join(changes)
        )
    return keep_accepted_config(run_dir, step, recorded, changes, operative)


def keep_accepted_config(
    run_dir: RunDir, step: int, recorded: str, changes: Sequence[str], operative: str
) -> str:
    """Writes ``operative``, a config accepted with ``--allow_config_change`` when resuming at
    ``step``, as ``config.step-N.gin``, headed by the ``changes`` (``"name: old -> new"``)
    from the ``recorded`` file it replaces; returns its path."""
    kept = run_dir.accepted_config_file(step)
    storage.write_text(
        kept,
        f"# resumed at step {step} with --allow_config_change; changed from "
        f"{storage.basename(recorded)}:\n"
        + "".join(f"#   {line}\n" for line in changes)
        + operative,
    )
    return kept


def run_config_file(
    run_dir: RunDir, args: argparse.Namespace, step: int | None = None
) -> str | None:
    """The run's config as of checkpoint ``step`` (``config.gin`` or a newer accepted
    ``config.step-N.gin``; None when there is none), as :func:`checked_config` reads it.
    Every command that reads a run's config (analyze, eval, infer, export) finds it here.

    Raises:
      GinConfigError: as :func:`~moe_jax.runtime.config_gate.check_run_config`.
    """
    return checked_config(run_dir.recorded_config(step), args)


def checked_config(path: str, args: argparse.Namespace) -> str | None:
    """The config file at ``path`` that came with a run or an export (None when there is
    none), passed through :func:`~moe_jax.runtime.config_gate.check_run_config`.

    Raises:
      GinConfigError: as :func:`~moe_jax.runtime.config_gate.check_run_config`.
    """
    if not storage.exists(path):
        return None
    config_gate.check_run_config(path, args)
    return path


def checkpoint_config(checkpoint: str, args: argparse.Namespace) -> str | None:
    """:func:`run_config_file` of the run ``checkpoint`` (``MODEL_DIR[/STEP]``) belongs to, as
    of its step (the latest when none is given)."""
    run_dir, step = _run_and_step(checkpoint)
    return run_config_file(run_dir, args, step)


def recorded_spec_file(args: argparse.Namespace, checkpoint: str) -> str | None:
    """The spec (``run.json`` or ``run.step-N.json``, :mod:`~moe_jax.runtime.run_record`) of
    the run ``checkpoint`` belongs to as of its step, whose model a command reading the run
    builds (:func:`~moe_jax.runtime.gin_utils.parse_gin` binds ``%MODEL`` to it); None when
    the run has none, or when the command line binds anything or names a gin file (gin then
    builds the model from the run's config and the command line)."""
    if args.command_line_bindings or args.command_line_gin_files:
        return None
    return run_spec_file(checkpoint)


def run_spec_file(checkpoint: str) -> str | None:
    """The spec of the run ``checkpoint`` (``MODEL_DIR[/STEP]``) belongs to as of its step,
    whatever the command line binds (an export carries it beside the run's config.gin);
    None when the run has none."""
    run_dir, step = _run_and_step(checkpoint)
    return run_dir.recorded_spec(step)


def _run_and_step(checkpoint: str) -> tuple[RunDir, int | None]:
    """The run ``checkpoint`` (``MODEL_DIR[/STEP]``) belongs to and its step (the run's
    latest when none is given)."""
    run_dir, step = RunDir.of_checkpoint(checkpoint)
    return run_dir, run_dir.reached_step() if step is None else step


def run_gin_files(
    args: argparse.Namespace,
    checkpoint: str | None,
    defaults: Sequence[str],
    *,
    extend_run_config: bool = False,
    command: str = "moe-jax",
) -> list[str]:
    """The gin files of a command reading a run's checkpoint (eval, infer, analyze, export)
    and a line on stderr saying which config that is, and where its model comes from.

    ``defaults`` (the command's own files, e.g. ``runs/eval.gin``; resolved against the
    search paths) come first, then the run's ``MODEL_DIR/config.gin``, so the run's macros
    (task, feature lengths, batch size) win over the defaults'. The run's config is used when
    no ``args.gin_file`` are given, or with ``extend_run_config`` before them (``analyze``:
    the command line overrides the run); it goes through
    :func:`~moe_jax.runtime.config_gate.check_run_config`. The model is the run's spec's
    when the run's config is used and :func:`recorded_spec_file` finds it
    (``args.recorded_spec``).

    Raises:
      FileNotFoundError: naming ``checkpoint`` when it is no run directory's checkpoint, or
        when the run has no config.gin and no gin file was given.
      ValueError: neither a checkpoint nor a gin file was given.
    """

    roots = search_paths([])
    defaults = [resolve(f, roots) for f in defaults]
    gin_files = args.gin_file
    config = None
    if checkpoint is None:
        if not gin_files:
            raise ValueError("no checkpoint: pass --checkpoint=DIR (or --gin.CHECKPOINT_PATH=DIR)")
    else:
        run_dir = RunDir.of_checkpoint(checkpoint)[0]
        if not storage.isdir(run_dir.checkpoints_dir):
            raise FileNotFoundError(
                f"--checkpoint={checkpoint!r}: no checkpoints there "
                f"({run_dir.checkpoints_dir} does not exist)"
            )
        if extend_run_config or not gin_files:
            config = checkpoint_config(checkpoint, args)
    if config is None and not gin_files:
        raise FileNotFoundError(
            f"--checkpoint={checkpoint!r}: the run has no "
            f"{run_dir.config_file}; pass its model and data "
            "gin files with --gin_file"
        )
    files = [*defaults, *([config] if config else []), *gin_files]
    used = (
        f"the run's {config}" + (f" + {', '.join(gin_files)}" if gin_files else "")
        if config
        else ", ".join(gin_files)
    )
    args.recorded_spec = recorded_spec_file(args, checkpoint) if config and checkpoint else None
    model = f"; model: the run's {args.recorded_spec}" if args.recorded_spec else ""
    print(
        f"[{command}] gin config: {used} (defaults: {', '.join(defaults) or 'none'}){model}",
        file=sys.stderr,
        flush=True,
    )
    return files
