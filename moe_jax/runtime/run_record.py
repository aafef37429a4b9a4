"""What `train` records of a run, and what a resumption compares: ``MODEL_DIR/run.json``
(the run's :class:`~moe_jax.runtime.run_spec.RunSpec`) beside ``config.gin`` (the operative
gin text, which the commands parse for their own settings).

The first start writes both. A resumption compares the recorded spec as of its step
(``run.json``, or the newest ``run.step-N.json``) with the new one field by field; a changed
field that :data:`~moe_jax.runtime.run_spec.RESUMABLE` does not list is refused, naming its
dotted path (``optimizer.learning_rate.base_learning_rate: 0.003 -> 0.5``), unless
``--allow_config_change``, which keeps the new spec as ``run.step-N.json`` and its gin text as
``config.step-N.gin``. A run an older version started (``config.gin`` and no spec) is
compared by its gin text as before (:func:`~moe_jax.runtime.run_config.record_run_config`),
and gets its spec as ``run.step-N.json`` at that first resumption.

The commands that read a run (eval, infer, analyze, export, ``moe_jax.load``) take its
model (:func:`read_model`) and its data from its spec when their command line changes
nothing (:func:`~moe_jax.runtime.run_config.recorded_spec_file`,
:func:`~moe_jax.runtime.gin_utils.bind_recorded_run`). ``export`` carries the spec,
``import`` restores it and ``upcycle`` writes one for the run it creates.
"""

from __future__ import annotations

import json
from typing import Any

from moe_jax import errors, storage
from moe_jax.runtime import run_config, run_spec
from moe_jax.runtime.run_dir import RunDir
from moe_jax.runtime.run_spec import ModelSpec, RunSpec


def record_run(
    run_dir: RunDir, spec: RunSpec, operative: str, step: int, *, allow_change: bool = False
) -> str:
    """Keeps the run's spec and gin config at ``step`` (see the module docstring); no
    recorded file is ever overwritten, so a plain resume that would undo an accepted change
    is refused like any other change.

    Returns:
      the path of the spec the run continues with.

    Raises:
      ConfigChangedError: listing the changed fields (or bindings, for a run without a spec)
        when ``allow_change`` is False.
    """
    recorded = run_dir.recorded_spec(step)
    if recorded is None:
        first = not storage.exists(run_dir.config_file)
        run_config.record_run_config(run_dir, operative, step, allow_change=allow_change)
        kept = run_dir.spec_file if first else run_dir.accepted_spec_file(step)
        storage.write_text(kept, spec.to_json())
        return kept
    changes = spec_changes(read_spec(recorded), spec)
    if not changes:
        return recorded
    if not allow_change:
        raise run_config.ConfigChangedError(
            f"MODEL_DIR={run_dir} was trained with another config ({recorded}); resuming at "
            f"step {step} would change {len(changes)} field(s) (pass --allow_config_change to "
            "resume with them; kept as run.step-N.json and config.step-N.gin):\n  "
            + "\n  ".join(changes)
        )
    run_config.keep_accepted_config(run_dir, step, recorded, changes, operative)
    kept = run_dir.accepted_spec_file(step)
    storage.write_text(kept, spec.to_json())
    return kept


def spec_changes(recorded: dict[str, Any], spec: RunSpec) -> list[str]:
    """The fields of ``spec`` that differ from the ``recorded`` spec's (its JSON dict), except
    those a resumed run may change (:func:`~moe_jax.runtime.run_spec.resumable`), as
    ``"dotted.path: recorded -> now"`` lines."""
    return [
        f"{path}: {old!r} -> {new!r}"
        for path, old, new in run_spec.diff(recorded, spec)
        if not run_spec.resumable(path)
    ]


def read_spec(path: str) -> dict[str, Any]:
    """The spec recorded at ``path`` as its JSON dict (nothing built from it, so no task
    module it names is imported).

    Raises:
      InputFileError: naming the file when it is not a spec's JSON.
    """
    try:
        recorded = json.loads(storage.read_text(path))
    except ValueError as err:  # not JSON, not UTF-8
        recorded = err
    if not isinstance(recorded, dict) or "model" not in recorded:
        why = recorded if isinstance(recorded, ValueError) else "not a run's spec"
        raise errors.InputFileError(f"{path} is unreadable ({why}); the run's spec is lost")
    return recorded


def read_model(path: str) -> ModelSpec:
    """The model of the spec recorded at ``path``.

    Raises:
      InputFileError: naming the file when it is unreadable or describes no model this
        version builds.
    """
    try:
        return run_spec.model_from_dict(read_spec(path))
    except (ValueError, TypeError) as err:
        raise errors.InputFileError(f"{path}: no model this version builds ({err})") from None
