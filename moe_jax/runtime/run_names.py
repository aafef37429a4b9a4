"""How runs of one family are named: ``MODEL_DIR`` = ``<family>/seed<N>``.

`moe-jax sweep` writes the seeds of a family that way; `moe-jax eval` labels a checkpoint
``<family>_seed<N>``; the comparisons over seeds (`moe-jax eval`'s seed table, the languages
analysis, the sweep's plots) group runs by :func:`family_of`.
"""

from __future__ import annotations

import re

_SEED_NAME = re.compile(r"(?:(?P<family>.+)[/_])?seed\d+")


def seed_family(name: str) -> str | None:
    """The family of a run named by its seed directory (``learned/seed0``, or the label
    ``learned_seed0`` that `moe-jax eval` gives it) -> ``learned`` (``""`` for a bare
    ``seed0``); None when ``name`` does not end in a seed."""
    match = _SEED_NAME.fullmatch(name)
    return None if match is None else match.group("family") or ""


def family_of(run: str) -> str:
    """``learned/seed0`` -> ``learned``: a run without its seed directory (else the run)."""
    return seed_family(run) or run
