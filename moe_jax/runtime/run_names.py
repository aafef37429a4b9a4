"""How runs are named: ``MODEL_DIR`` = ``<family>/seed<N>``, and the labels every command
gives runs.

`moe-jax sweep` writes the seeds of a family as ``ROOT/<run>[/<AXIS>-<value>...]/seed<N>``;
`moe-jax eval`, `moe-jax analyze` and the sweep label a run by :func:`run_labels` (the
shortest path suffix that tells it from the other runs, or the user's ``--label``); the
comparisons over seeds (`moe-jax eval`'s seed table, the languages analysis, the sweep's
plots) group runs by :func:`family_of`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from moe_jax import errors

_SEED_NAME = re.compile(r"(?:(?P<family>.+)[/_])?seed\d+")


def seed_family(name: str) -> str | None:
    """The family of a run named by its seed directory (``learned/seed0``, or a label
    ``learned_seed0``) -> ``learned`` (``""`` for a bare ``seed0``); None when ``name``
    does not end in a seed."""
    match = _SEED_NAME.fullmatch(name)
    return None if match is None else match.group("family") or ""


def family_of(run: str) -> str:
    """``learned/seed0`` -> ``learned``: a run without its seed directory (else the run)."""
    return seed_family(run) or run


def _parts(model_dir: str) -> list[str]:
    """``gs://b/x/learned/seed0`` -> ``['gs:', 'b', 'x', 'learned', 'seed0']``."""
    return [part for part in model_dir.rstrip("/").split("/") if part] or [model_dir]


def _suffix(parts: list[str], length: int) -> str:
    return "/".join(parts[-length:])


def run_labels(model_dirs: Sequence[str]) -> list[str]:
    """One label per run directory: the shortest suffix of its path (at least the seed's
    family and seed, ``learned/seed0``) that no other of the distinct ``model_dirs`` ends
    with; the same directory gets the same label. E.g. ``ROOT/learned/NUM_EXPERTS-8/seed0``
    and ``ROOT/frozen/NUM_EXPERTS-8/seed0`` -> ``learned/NUM_EXPERTS-8/seed0`` and
    ``frozen/NUM_EXPERTS-8/seed0``; ``/runs/learned`` and ``/runs/frozen`` -> ``learned``
    and ``frozen``."""
    split = {d: _parts(d) for d in model_dirs}
    labels = {}
    for model_dir, parts in split.items():
        others = [p for d, p in split.items() if d != model_dir]
        length = 2 if seed_family(parts[-1]) is not None and len(parts) > 1 else 1
        while length < len(parts) and any(
            _suffix(o, length) == _suffix(parts, length) for o in others
        ):
            length += 1
        labels[model_dir] = _suffix(parts, length)
    return [labels[d] for d in model_dirs]


def checked_labels(given: Sequence[str], count: int) -> list[str]:
    """The user's ``--label`` values for ``count`` runs: one per run, distinct, without
    ``:`` (which separates a label from a router); a refusal says which."""
    if len(given) != count:
        raise errors.UserError(
            f"{len(given)} --label for {count} --checkpoint: give one per checkpoint"
        )
    repeated = sorted({label for label in given if list(given).count(label) > 1})
    if repeated or any(":" in label or not label for label in given):
        raise errors.UserError(
            f"--label {repeated or list(given)}: labels must be distinct, non-empty, without ':'"
        )
    return list(given)


def file_stem(label: str) -> str:
    """A label as a file name: ``learned/seed0:init`` -> ``learned_seed0_init``."""
    return re.sub(r"[/:]", "_", label)


# a folder name stays well below the 255 bytes file systems allow
_MAX_FOLDER_NAME = 120


def comparison_folder(labels: Sequence[str], routers: Sequence[str] = ("learned",)) -> str:
    """The default output folder name of a comparison of runs ``labels`` (each with
    ``routers``), so that different comparisons of one run never share a folder:
    ``learned+frozen``; ``learned.routers-learned+random+hash``. A name over 120 characters
    keeps its first label, the count and a hash of the whole
    (``learned_seed0+8_more-1a2b3c4d``)."""
    name = "+".join(file_stem(label) for label in labels)
    if list(routers) != ["learned"]:
        name += ".routers-" + "+".join(routers)
    if name.startswith("."):  # a label such as '..' never names a folder above
        name = "_" + name
    if len(name) <= _MAX_FOLDER_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{file_stem(labels[0])[:60]}+{len(labels) - 1}_more-{digest}"
