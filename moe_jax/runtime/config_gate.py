"""The gate a config file that comes with a run directory or an export goes through before
gin parses it: gin runs a config's ``import`` lines, and the data pipeline imports the
module ``MIXTURE_OR_TASK_MODULE`` names, so a config from elsewhere (a colleague's bucket,
a download) could run code.

:func:`check_run_config` refuses ``import`` lines of modules outside the project, ``include``
lines, and bindings naming a module to import that neither the project, nor the command line,
nor the user's list of trusted modules (:func:`trusted_modules`) names.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from gin import config_parser

from moe_jax import storage
from moe_jax.runtime.gin_text import GinConfigError, parse_statements, resolve, search_paths
from moe_jax.runtime.run_dir import RunDir

# Modules a run directory's config file may import (gin runs an import when parsing).
PROJECT_MODULES: tuple[str, ...] = ("moe_jax",)
# The installed package: the folder holding this file, not what ``import moe_jax`` finds (a
# ``moe_jax/`` folder earlier on the path, e.g. ``PYTHONPATH=.`` inside a run folder, is
# imported as the package's ``__init__``, but never decides what the gate trusts).
PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bindings whose value names a module (or .py file) that is imported, i.e. run: the macro
# and (configurable, parameter) pairs (T5X's MIXTURE_OR_TASK_MODULE, imported by
# utils.DatasetConfig).
IMPORT_MACROS: tuple[str, ...] = ("MIXTURE_OR_TASK_MODULE",)
IMPORT_PARAMETERS: tuple[tuple[str, str], ...] = (("DatasetConfig", "module"),)
# The file beside an export's config (``moe-jax export``): its config is the export's too.
EXPORT_WEIGHTS = "model.safetensors"


class UntrustedCodeError(GinConfigError):
    """A run directory's or export's config names code to import that the command line does
    not name."""


def check_run_config(path: str, args: argparse.Namespace) -> None:
    """The gate a config file that comes with a run directory or an export goes through
    before gin parses it (parsing runs ``import`` lines; the data pipeline imports
    ``MIXTURE_OR_TASK_MODULE``): every ``import`` names a module of the project
    (:data:`PROJECT_MODULES`), it includes no other file, and every binding naming code to
    import (:func:`import_bindings`) names the project's own or a module the command line
    names too (:func:`command_line_modules`).

    Raises:
      GinConfigError: naming the file, line and statement refused.
    """
    text = storage.read_text(path)
    for statement in parse_statements(text, path):
        line = statement.location.line_num if hasattr(statement, "location") else "?"
        if isinstance(statement, config_parser.ImportStatement):
            if not in_modules(statement.module, PROJECT_MODULES):
                raise GinConfigError(
                    f"{path}, line {line}: refusing `{statement.format()}`: a run directory's "
                    f"config may import only the project's modules ({', '.join(PROJECT_MODULES)}); "
                    f"parsing it would run {statement.module}"
                )
        elif isinstance(statement, config_parser.IncludeStatement):
            raise GinConfigError(
                f"{path}, line {line}: refusing `include {statement.filename!r}`: "
                "a run directory's config must be self-contained"
            )
    refuse_untrusted_modules(path, import_bindings(text, path), args)


def refuse_untrusted_modules(
    origin: str, found: Iterable[tuple[str, int | None, Any]], args: argparse.Namespace
) -> None:
    """Refuses the first of ``found`` (``(binding, line, module)``, read from ``origin``, a
    run's file) that is neither the project's own module, nor one the command line names,
    nor a module name the user trusts once for all (:func:`trusted_modules`).

    Raises:
      UntrustedCodeError: naming ``origin``, the line and the binding.
    """
    trusted = [*command_line_modules(args), *trusted_modules()]
    for binding, line, module in found:
        if module is None or _is_project_module(module) or _same_module(module, trusted):
            continue
        where = f"{origin}, line {line}" if line else origin
        once = (
            f", or add it to {trusted_modules_file()} to trust it in every command"
            if _is_module_name(module)
            else ""
        )
        raise UntrustedCodeError(
            f"{where}: refusing {binding} = {module!r}: a run's config may name only the "
            "project's modules or those given on the command line (importing it would run its "
            f"code); to trust it, pass --gin.MIXTURE_OR_TASK_MODULE={module}{once}"
        )


def trusted_modules_file() -> str:
    """The user's list of trusted task modules: ``$MOE_JAX_CONFIG_DIR/trusted_modules``
    (default ``$XDG_CONFIG_HOME/moe_jax``, i.e. ``~/.config/moe_jax``)."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    folder = os.environ.get("MOE_JAX_CONFIG_DIR") or os.path.join(config_home, "moe_jax")
    return os.path.join(folder, "trusted_modules")


def trusted_modules() -> list[str]:
    """The module names of :func:`trusted_modules_file` (one per line, ``#`` comments): a run
    naming one of them as its task module is read without repeating it on every command
    line. A trusted module is a name the import system resolves, never a file path.

    Raises:
      GinConfigError: naming the file and line of an entry that is not a dotted module name.
    """
    path = trusted_modules_file()
    if not os.path.isfile(path):
        return []
    names = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            name = line.split("#", 1)[0].strip()
            if name and not _is_module_name(name):
                raise GinConfigError(
                    f"{path}, line {number}: {name!r} is not a module name (a trusted module "
                    "is a dotted name on the Python path, never a file)"
                )
            names += [name] if name else []
    return names


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _is_module_name(module: Any) -> bool:
    """``module`` is a dotted module name, not a ``.py`` file's name or path."""
    return (
        isinstance(module, str)
        and bool(_MODULE_NAME.fullmatch(module))
        and not module.endswith(".py")
    )


def _is_project_module(module: Any) -> bool:
    """``module`` is a module of the installed project (:data:`PROJECT_MODULES`) as the
    import system resolves it: a dotted name whose source lies in the installed package,
    never a file path (``moe_jax.x.py`` names no module, whatever file the working
    directory holds)."""
    if not (_is_module_name(module) and in_modules(module, PROJECT_MODULES)):
        return False
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    return pathlib.Path(spec.origin).resolve().is_relative_to(PROJECT_ROOT)


def _same_module(module: Any, trusted: Iterable[Any]) -> bool:
    """``module`` is one of ``trusted`` (a ``.py`` file: the same file, however written)."""
    for other in trusted:
        if module == other or (
            isinstance(module, str)
            and isinstance(other, str)
            and module.endswith(".py")
            and other.endswith(".py")
            and os.path.abspath(module) == os.path.abspath(other)
        ):
            return True
    return False


def _macro_name(statement: config_parser.BindingStatement) -> str | None:
    """The macro a binding defines (``NAME = v`` or ``NAME/macro.value = v``), else None."""
    if not statement.scope and not statement.arg_name and "." not in statement.selector:
        return statement.selector
    if statement.selector in ("macro", "gin.macro") and statement.arg_name == "value":
        return statement.scope
    return None


def import_bindings(text: str, origin: str) -> list[tuple[str, int, Any]]:
    """``(binding, line, module)`` for each binding of a gin text whose value names code that
    is imported (:data:`IMPORT_MACROS`, :data:`IMPORT_PARAMETERS`), with macros the text
    defines resolved (``DatasetConfig.module = %X`` and ``X = 'mod'`` give ``'mod'``). A
    reference to ``%MIXTURE_OR_TASK_MODULE`` the text does not define is left to the file
    or flag that does; one to any other undefined macro is listed as the reference itself
    (``'%X'``), a value no import binding of the project's configs has."""
    statements = [
        s for s in parse_statements(text, origin) if isinstance(s, config_parser.BindingStatement)
    ]
    macros = {name: s.value for s in statements if (name := _macro_name(s))}
    found = []
    for statement in statements:
        macro = _macro_name(statement)
        parameter = (statement.selector.rsplit(".", 1)[-1], statement.arg_name)
        if macro not in IMPORT_MACROS and parameter not in IMPORT_PARAMETERS:
            continue
        value, seen = statement.value, set()
        while (
            isinstance(value, str)
            and value.startswith("%")
            and value[1:] in macros
            and value not in seen
        ):
            seen.add(value)
            value = macros[value[1:]]
        if isinstance(value, str) and value[1:] in IMPORT_MACROS and value not in seen:
            continue
        parameter_name = f"{statement.selector}.{statement.arg_name}"
        name = macro or "/".join(p for p in (statement.scope, parameter_name) if p)
        found.append((name, statement.location.line_num, value))
    return found


def command_line_modules(args: argparse.Namespace) -> list[Any]:
    """The modules the user's command line names: in ``--gin.NAME=VALUE`` / ``--gin_bindings``
    flags and in the ``--gin_file`` files that are not a run directory's (as given to
    :func:`~moe_jax.runtime.gin_flags.parse_flags`, before a command adds a run's config or
    recorded settings)."""
    found = []
    for binding in args.command_line_bindings:
        with contextlib.suppress(GinConfigError):  # parse_gin reports a bad binding
            found += import_bindings(binding, f"binding {binding!r}")
    roots = search_paths(args.gin_search_paths)
    for name in args.command_line_gin_files:
        with contextlib.suppress(GinConfigError, OSError):
            path = resolve(name, roots)
            if not in_run_directory(path):
                found += import_bindings(storage.read_text(path), path)
    return [module for _, _, module in found]


def in_run_directory(path: str) -> bool:
    """``path`` lies in a run directory (beside ``checkpoints/`` or a ``LOCK``) or an export
    (beside ``model.safetensors``): its config is the run's, not the user's."""
    folder = storage.parent(path)
    return RunDir(folder).holds_run() or storage.exists(storage.join(folder, EXPORT_WEIGHTS))


def in_modules(module: str, roots: Sequence[str]) -> bool:
    """``module`` is one of ``roots`` or a submodule of one."""
    return any(module == m or module.startswith(m + ".") for m in roots)
