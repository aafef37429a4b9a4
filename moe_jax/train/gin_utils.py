"""T5X-style command-line flags and gin parsing shared by the train/eval/infer binaries.

Flags, as in T5X:
  --gin_file=PATH          repeatable; resolved against the working directory, then the
                           search paths (default: the repository's ``gin/`` folder)
  --gin.NAME=VALUE         one binding ``NAME = VALUE`` (``--gin.MODEL_DIR=/tmp/x``,
                           ``--gin.train.eval_period=100``); a bare word is taken as a string
  --gin_bindings=STR       repeatable; raw gin binding lines
  --gin_search_paths=A,B   comma-separated, repeatable
  --tfds_data_dir=DIR      where TFDS datasets live (sets ``TFDS_DATA_DIR``)

Every gin error names the file (or ``--gin...`` flag) and line: gin already does for
unknown configurables and parameters; :func:`parse_gin` adds it for macros referenced but
never defined, and refuses macros set on the command line that nothing uses (a typo such
as ``--gin.TRAIN_STEP=10`` would otherwise be silently ignored).

Config files that come with a run directory (``MODEL_DIR/config.gin``, perhaps downloaded)
are read through :func:`run_config_file`, which refuses ``import`` lines of modules outside
the project (gin would import, i.e. run, them). :func:`config_changes` lists the bindings
that differ between a run's saved config and the operative one (`train` refuses to resume
with changes unless ``--allow_config_change``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
from collections.abc import Iterable, Sequence

import gin
from gin import config_parser

from moe_jax import errors

REPO_GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"

# Modules whose configurables the gin files may name. Imported before parsing so that
# gin files need no `import` lines (T5X binaries do the same for t5x.*).
CONFIGURABLE_MODULES: tuple[str, ...] = (
    "moe_jax.partitioning",
    "moe_jax.moe",
    "moe_jax.moe.layer",
    "moe_jax.models.model",
    "moe_jax.data.tasks",
    "moe_jax.data.pipeline",
    "moe_jax.train.optimizers",
    "moe_jax.train.summaries",
    "moe_jax.train.train",
    "moe_jax.train.evaluate",
    "moe_jax.train.infer",
)

_MACRO_REF = re.compile(r"%([A-Za-z_][\w./]*)")
_MACRO_DEF = re.compile(r"^\s*([A-Za-z_][\w]*)\s*=")


# Modules a run directory's config file may import (gin runs an import when parsing).
PROJECT_MODULES: tuple[str, ...] = ("moe_jax",)

# Bindings that may differ when a run resumes: its length, periods and paths.
RESUMABLE_CHANGES = re.compile(
    r"^(MODEL_DIR|TRAIN_STEPS|.*(_period|_dir|_path|\.path|total_steps|eval_steps|keep_checkpoints|"
    r"async_checkpointing))$")


class GinConfigError(errors.UserError, ValueError):
    """A gin file, binding or flag is wrong; the message names where."""


class ConfigChangedError(GinConfigError):
    """A run would resume with another gin config than it was trained with."""


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    """Adds T5X's gin flags to ``parser`` (``--gin.NAME=VALUE`` is handled by :func:`parse_flags`)."""
    parser.add_argument("--gin_file", action="append", default=[], metavar="PATH",
                        help="gin file (repeatable); later files override earlier ones")
    parser.add_argument("--gin_bindings", action="append", default=[], metavar="BINDING",
                        help="extra gin binding line (repeatable)")
    parser.add_argument("--gin_search_paths", action="append", default=[], metavar="DIRS",
                        help=f"comma-separated gin search paths (default: {REPO_GIN_DIR})")
    parser.add_argument("--tfds_data_dir", default=None, metavar="DIR",
                        help="TFDS data directory (sets TFDS_DATA_DIR)")


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parses ``argv``; ``--gin.NAME=VALUE`` flags become ``args.gin_dot_bindings``.

    Unknown flags are refused by name (argparse's usual exit code 2).
    """
    dot_bindings: list[str] = []
    rest: list[str] = []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin."):].partition("=")
            if not sep or not name:
                parser.error(f"{arg!r}: expected --gin.NAME=VALUE")
            dot_bindings.append(f"{name} = {_as_gin_value(value)}")
        else:
            rest.append(arg)
    args = parser.parse_args(rest)
    args.gin_dot_bindings = dot_bindings
    if args.tfds_data_dir:
        os.environ["TFDS_DATA_DIR"] = args.tfds_data_dir
    return args


def _as_gin_value(value: str) -> str:
    """T5X wants ``--gin.MODEL_DIR="'/x'"``; a bare word or path is quoted for the user."""
    v = value.strip()
    if not v or v[0] in "'\"@%([{-" or v[0].isdigit() or v in ("True", "False", "None"):
        return v
    if re.fullmatch(r"[A-Za-z_][\w.]*\(\)", v):  # a configurable call without '@' prefix
        return v
    return repr(v)


def search_paths(flag_values: Iterable[str]) -> list[str]:
    """The gin search paths: each comma-separated entry of the flag, then ``REPO_GIN_DIR``."""
    paths = [p for value in flag_values for p in value.split(",") if p]
    return [*paths, str(REPO_GIN_DIR), str(REPO_GIN_DIR.parent)]


def import_configurables(modules: Sequence[str] = CONFIGURABLE_MODULES) -> None:
    """Imports the modules that register gin configurables; a module not built yet is skipped."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise


def parse_gin(args: argparse.Namespace, *, finalize: bool = True) -> None:
    """Parses the gin files and bindings of ``args`` (from :func:`parse_flags`).

    Raises:
      GinConfigError: naming the file/flag and line of a syntax error, an unknown
        configurable or parameter, an undefined macro, or an unused command-line macro.
    """
    import_configurables()
    gin.clear_config()
    roots = search_paths(args.gin_search_paths)
    for path in roots:
        gin.add_config_file_search_path(path)
    files = [_resolve(f, roots) for f in args.gin_file]
    bindings = [*args.gin_bindings, *args.gin_dot_bindings]
    try:
        parsed = gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    except (ValueError, SyntaxError, TypeError) as err:
        raise GinConfigError(f"gin: {err}") from None
    _check_macros([_resolve(f, roots) for f in _walk_files(parsed)], bindings)
    if finalize:
        try:
            gin.finalize()
        except ValueError as err:
            raise GinConfigError(f"gin: {err}") from None


def _resolve(path: str, roots: Sequence[str]) -> str:
    """``path`` as given when it exists, else under the first search path holding it.

    Raises:
      GinConfigError: naming ``path`` and the places searched when none holds it.
    """
    if os.path.exists(path) or "://" in path:
        return path
    for root in roots:
        if os.path.exists(os.path.join(root, path)):
            return os.path.join(root, path)
    raise GinConfigError(f"--gin_file={path}: no such file in the working directory or the "
                         f"gin search paths ({', '.join(roots)})")


def _walk_files(parsed) -> Iterable[str]:
    for item in parsed:
        yield item.filename
        yield from _walk_files(item.includes)


def _statements(text: str, origin: str) -> Iterable[tuple[str, int, str]]:
    """(origin, line number, line without comment) for each line of a gin text."""
    for lineno, line in enumerate(text.splitlines(), 1):
        yield origin, lineno, line.split("#", 1)[0]


def _check_macros(files: Sequence[str], bindings: Sequence[str]) -> None:
    lines = []
    for path in files:
        lines += _statements(_read(path), f"file {path!r}")
    binding_lines = [s for b in bindings for s in _statements(b, f"binding {b.strip()!r}")]
    defined = {m.group(1) for _, _, text in lines + binding_lines if (m := _MACRO_DEF.match(text))
               and "." not in m.group(1)}
    referenced = set()
    for origin, lineno, text in lines + binding_lines:
        for name in _MACRO_REF.findall(text):
            referenced.add(name)
            if (name not in defined and "/" not in name and not name.startswith("gin.")
                    and not _gin_has_macro(name)):
                raise GinConfigError(f"gin: macro %{name} is used but never defined\n"
                                     f"  In {origin}, line {lineno}\n    {text.strip()}")
    for origin, _, text in binding_lines:
        if (m := _MACRO_DEF.match(text)) and m.group(1).isupper() and m.group(1) not in referenced:
            raise GinConfigError(f"gin: macro {m.group(1)} set by {origin} is not used by any gin "
                                 f"file (typo?); macros used: {sorted(referenced)}")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _gin_has_macro(name: str) -> bool:
    return (name, "gin.macro") in gin.config._CONFIG  # noqa: SLF001 - gin has no public query


def operative_config() -> str:
    """The gin config actually used (T5X writes it to ``MODEL_DIR/config.gin``)."""
    return gin.operative_config_str()


class _InertDelegate(config_parser.ParserDelegate):
    """Parses references as text (``@name()``, ``%MACRO``) without looking anything up."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return f"@{scoped_configurable_name}{'()' if evaluate else ''}"

    def macro(self, macro_name):
        return f"%{macro_name}"


def _parse_statements(text: str, origin: str) -> list:
    try:
        return list(config_parser.ConfigParser(text, _InertDelegate()))
    except (SyntaxError, ValueError) as err:
        raise GinConfigError(f"gin: {origin}: {err}") from None


def run_config_file(model_dir: str, allowed_modules: Sequence[str] = ()) -> str | None:
    """``MODEL_DIR/config.gin`` (None when the run has none), checked to be safe to parse:
    every ``import`` names a module of the project (:data:`PROJECT_MODULES`) or of
    ``allowed_modules``, and it includes no other file. The CLIs that read a run's config
    (analyze, eval, infer) call this rather than parsing the file directly.

    Raises:
      GinConfigError: naming the file and line of an import of another module, or of an include.
    """
    path = os.path.join(model_dir, "config.gin")
    if not os.path.exists(path):
        return None
    allowed = (*PROJECT_MODULES, *allowed_modules)
    for statement in _parse_statements(_read(path), path):
        line = statement.location.line_num if hasattr(statement, "location") else "?"
        if isinstance(statement, config_parser.ImportStatement):
            if not any(statement.module == m or statement.module.startswith(m + ".") for m in allowed):
                raise GinConfigError(
                    f"{path}, line {line}: refusing `{statement.format()}`: a run directory's config "
                    f"may import only the project's modules ({', '.join(allowed)}); parsing it would run "
                    f"{statement.module}")
        elif isinstance(statement, config_parser.IncludeStatement):
            raise GinConfigError(f"{path}, line {line}: refusing `include {statement.filename!r}`: "
                                 "a run directory's config must be self-contained")
    return path


def config_bindings(text: str, origin: str = "config") -> dict[str, object]:
    """``{"scope/configurable.param" or "MACRO": value}`` of a gin config text (an operative
    config as written to ``config.gin``); values as parsed, references as text."""
    out = {}
    for statement in _parse_statements(text, origin):
        if isinstance(statement, config_parser.BindingStatement):
            name = ".".join(p for p in (statement.selector, statement.arg_name) if p)
            out[f"{statement.scope}/{name}" if statement.scope else name] = statement.value
    return out


def config_changes(saved: str, current: str) -> list[str]:
    """The bindings set in both configs whose values differ, except those a resumed run may
    change (:data:`RESUMABLE_CHANGES`), as ``"name: saved -> current"`` lines.

    Bindings in only one of the two are not compared: an operative config lists only the
    configurables the run called, which differs between a fresh start and a resumption.
    """
    before, after = config_bindings(saved, "saved config.gin"), config_bindings(current, "operative config")
    return [f"{name}: {before[name]!r} -> {after[name]!r}" for name in sorted(set(before) & set(after))
            if before[name] != after[name] and not RESUMABLE_CHANGES.match(name.rsplit("/", 1)[-1])]


def record_run_config(model_dir: str, operative: str, step: int, *, allow_change: bool = False) -> str:
    """Keeps the run's gin config: writes ``MODEL_DIR/config.gin`` on the first start; on a
    resumption (at ``step``) compares ``operative`` with it, which is never overwritten.

    Returns:
      the path the operative config is kept at: ``config.gin``, or ``config.step-N.gin``
      when a resumption changed something and ``allow_change`` let it.

    Raises:
      ConfigChangedError: listing the differing bindings, when ``allow_change`` is False.
    """
    first = os.path.join(model_dir, "config.gin")
    if not os.path.exists(first):
        _write(first, operative)
        return first
    changes = config_changes(_read(first), operative)
    if not changes:
        return first
    if not allow_change:
        raise ConfigChangedError(
            f"MODEL_DIR={model_dir} was trained with another gin config ({first}); resuming at step "
            f"{step} would change {len(changes)} binding(s) (pass --allow_config_change to resume "
            "with them; kept as config.step-N.gin):\n  " + "\n  ".join(changes))
    kept = os.path.join(model_dir, f"config.step-{step}.gin")
    _write(kept, f"# resumed at step {step} with --allow_config_change; changed from config.gin:\n"
                 + "".join(f"#   {line}\n" for line in changes) + operative)
    return kept


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
