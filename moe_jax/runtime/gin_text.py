"""Gin text read without running it: where gin files are found (the search paths), their
text (local or ``gs://``), and their statements and bindings parsed inertly (references
kept as text, no ``import`` run, nothing looked up). The other gin modules build on it:
:mod:`~moe_jax.runtime.gin_flags`, :mod:`~moe_jax.runtime.gin_utils`,
:mod:`~moe_jax.runtime.config_gate`, :mod:`~moe_jax.runtime.run_config`.
"""

from __future__ import annotations

import io
import os
import pathlib
from collections.abc import Iterable, Sequence

import gin
from gin import config_parser

from moe_jax import errors, storage

REPO_GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"


class GinConfigError(errors.UserError, ValueError):
    """A gin file, binding or flag is wrong; the message names where."""


def _open_url(path: str) -> io.StringIO:
    return io.StringIO(storage.read_text(path))


# gin opens files with `open`; a run's config.gin on an object store (gs://) is read here.
gin.config.register_file_reader(
    _open_url, lambda path: not storage.is_local(path) and storage.exists(path)
)


def search_paths(flag_values: Iterable[str]) -> list[str]:
    """The gin search paths: each comma-separated entry of the flag, then ``REPO_GIN_DIR``."""
    paths = [p for value in flag_values for p in value.split(",") if p]
    return [*paths, str(REPO_GIN_DIR), str(REPO_GIN_DIR.parent)]


def resolve(path: str, roots: Sequence[str]) -> str:
    """``path`` as given when it exists, else under the first search path holding it.

    Raises:
      GinConfigError: naming ``path`` and the places searched when none holds it.
    """
    if not storage.is_local(path) or os.path.exists(path):
        return path
    for root in roots:
        if os.path.exists(os.path.join(root, path)):
            return os.path.join(root, path)
    raise GinConfigError(
        f"--gin_file={path}: no such file in the working directory or the "
        f"gin search paths ({', '.join(roots)})"
    )


class InertDelegate(config_parser.ParserDelegate):
    """Parses references as text (``@name()``, ``%MACRO``) without looking anything up."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return f"@{scoped_configurable_name}{'()' if evaluate else ''}"

    def macro(self, macro_name):
        return f"%{macro_name}"


def parse_statements(text: str, origin: str) -> list:
    """The statements of a gin text (``origin`` names it in an error), parsed inertly.

    Raises:
      GinConfigError: naming ``origin`` and what cannot be parsed.
    """
    try:
        return list(config_parser.ConfigParser(text, InertDelegate()))
    except (SyntaxError, ValueError) as err:
        raise GinConfigError(f"gin: {origin}: {err}") from None


def config_bindings(text: str, origin: str = "config") -> dict[str, object]:
    """``{"scope/configurable.param" or "MACRO": value}`` of a gin config text (an operative
    config as written to ``config.gin``); values as parsed, references as text."""
    out = {}
    for statement in parse_statements(text, origin):
        if isinstance(statement, config_parser.BindingStatement):
            name = ".".join(p for p in (statement.selector, statement.arg_name) if p)
            out[f"{statement.scope}/{name}" if statement.scope else name] = statement.value
    return out
