"""Whether a checkpoint step can be used: its files against its integrity record, its
parameters' names and shapes against the model's, its parameters and optimizer state finite.

Once a step is finalized, process 0 writes ``<step>/moe_jax_files.json`` (:func:`write_integrity`):
every file's size and CRC32C (on GCS both come from one object listing; locally each file is
read once). Before restoring, :func:`check_integrity` compares the files with it: a missing,
resized or changed file raises :class:`UnreadableCheckpointError` (``damaged``) naming the
step, the file and the cause in one line. A step without a record (written by an older
version) counts as damaged when it cannot be decoded; restored parameters or optimizer
states holding NaN or Inf are damage too (:func:`check_finite`: training never saves such a
step).
:func:`check_compatible` refuses another model config's checkpoint with
:class:`CheckpointMismatchError` naming the parameters.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import errors, param_paths, storage

PyTree = Any

INTEGRITY_FILE = "moe_jax_files.json"


class CheckpointMismatchError(errors.CheckpointError, ValueError):
    """A checkpoint does not fit the configured model; the message names the parameters."""


class UnreadableCheckpointError(errors.CheckpointError):
    """A checkpoint's files are missing, truncated or changed, or cannot be decoded
    (``damaged``: moving it aside is safe); names step, file and cause."""

    def __init__(self, message: str, step: int, damaged: bool = True):
        super().__init__(message)
        self.step = step
        self.damaged = damaged


def param_shapes(params: PyTree) -> dict[str, list[int]]:
    """``{"encoder/layers_0/attention/query/kernel": [32, 768], ...}`` for a parameter tree."""
    return {name: list(leaf.shape) for name, leaf in param_paths.named_leaves(params).items()}


def check_compatible(
    saved: dict[str, list[int]], expected: dict[str, list[int]], where: str
) -> None:
    """Raises :class:`CheckpointMismatchError` naming missing, unexpected and reshaped
    parameters when a checkpoint's parameters differ from the configured model's."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    reshaped = sorted(
        f"{k}: checkpoint {saved[k]} vs model {expected[k]}"
        for k in set(saved) & set(expected)
        if list(saved[k]) != list(expected[k])
    )
    if missing or extra or reshaped:

        def show(title, names):
            return (
                f"\n  {title} ({len(names)}): "
                + ", ".join(names[:12])
                + (" ..." if len(names) > 12 else "")
                if names
                else ""
            )

        raise CheckpointMismatchError(
            f"checkpoint {where} was saved from another model config:"
            + show("parameters in the model but not the checkpoint", missing)
            + show("parameters in the checkpoint but not the model", extra)
            + show("parameters with other shapes", reshaped)
        )


def nonfinite_leaves(tree: PyTree) -> list[str]:
    """Names of the floating-point arrays of ``tree`` (parameters or an optimizer state;
    global arrays on any mesh) holding a NaN or an Inf, in tree order; one reduction per
    array, one fetch."""
    named = {
        name: leaf
        for name, leaf in param_paths.named_leaves(tree).items()
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    }
    finite = jax.device_get(
        jax.jit(lambda leaves: [jnp.isfinite(x).all() for x in leaves])(list(named.values()))
    )
    return [name for name, ok in zip(named, finite, strict=True) if not ok]


def check_finite(tree: PyTree, step: int, step_dir: str, what: str = "parameter") -> None:
    """Refuses restored parameters (or, ``what="optimizer state"``, an optimizer state)
    holding NaN or Inf: training never saves such a step, so they are damage (bytes changed
    where no integrity record could tell).

    Raises:
      UnreadableCheckpointError: naming the step and the first such array.
    """
    bad = nonfinite_leaves(tree)
    if bad:
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {step_dir}: {what} {bad[0]} "
            f"({len(bad)} of {len(param_paths.named_leaves(tree))}) holds NaN or Inf",
            step,
        )


def write_integrity(step_dir: str) -> None:
    """Writes ``step_dir/INTEGRITY_FILE``: ``{"files": {path: {"size", "crc32c"}}}`` of every
    file of a finished step (nothing when the step was removed meanwhile by keep-K)."""
    try:
        files = {
            rel: entry
            for rel, entry in storage.file_info(step_dir).items()
            if rel != INTEGRITY_FILE
        }
        if files:
            storage.write_text(storage.join(step_dir, INTEGRITY_FILE), json.dumps({"files": files}))
    except FileNotFoundError:
        return


def check_integrity(step_dir: str, step: int, items: tuple[str, ...] | None = None) -> bool:
    """Compares a step's files (sizes and CRC32C) with its integrity record, when it has one
    (``items``: only files under these item folders). Records of older versions hold
    sizes only; those are compared.

    Returns:
      whether every checked file's checksum matched (False: no record, or sizes only).

    Raises:
      UnreadableCheckpointError: naming the first missing, resized or changed file.
    """
    record_path = storage.join(step_dir, INTEGRITY_FILE)
    if not storage.exists(record_path):
        return False
    try:
        recorded = json.loads(storage.read_text(record_path))["files"]
    except (OSError, ValueError, KeyError) as err:
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {record_path}: {errors.one_line(err)}", step
        ) from None
    wanted = {
        rel: entry if isinstance(entry, dict) else {"size": entry}
        for rel, entry in recorded.items()
        if items is None or rel.split("/", 1)[0] in items
    }
    actual = storage.file_info(step_dir, checksums=False)
    for rel, entry in sorted(wanted.items()):
        path = storage.join(step_dir, rel)
        size = actual.get(rel, {}).get("size")
        if size != entry["size"]:
            cause = (
                "missing"
                if size is None
                else f"{size} bytes, {entry['size']} when saved (truncated)"
            )
        elif "crc32c" in entry and storage.crc32c_file(path) != entry["crc32c"]:
            cause = (
                f"CRC32C differs from the one recorded when saved (content changed, {size} bytes)"
            )
        else:
            continue
        raise UnreadableCheckpointError(
            f"checkpoint step {step} is unreadable: {path}: {cause}", step
        )
    return bool(wanted) and all("crc32c" in entry for entry in wanted.values())
