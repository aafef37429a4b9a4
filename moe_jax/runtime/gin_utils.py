"""Gin parsing of the binaries: the command line's gin files and bindings into gin's config,
with every error naming its file (or ``--gin...`` flag) and line, and what a parsed config
tells (a bound value, a configurable's arguments, the operative config, bindings nothing
read).

gin already names the place of unknown configurables and parameters; :func:`parse_gin`
adds it for macros referenced but never defined, and refuses macros set on the command line
or in the user's own gin files that nothing uses (a typo such as ``--gin.TRAIN_STEP=10`` or
``NUM_EXPERT = 8`` would otherwise be silently ignored). A ``--gin_file`` that lies in a
run directory goes through the gate of :mod:`~moe_jax.runtime.config_gate` first. The flags
themselves are :mod:`~moe_jax.runtime.gin_flags`'.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import logging
import pathlib
import re
import tokenize
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import gin
from gin import config_parser

from moe_jax import storage
from moe_jax.runtime import config_gate, run_config, run_record
from moe_jax.runtime.gin_text import (
    REPO_GIN_DIR,
    GinConfigError,
    InertDelegate,
    config_bindings,
    resolve,
    search_paths,
)

# Modules whose configurables the gin files may name. Imported before parsing so that
# gin files need no `import` lines (T5X binaries do the same for t5x.*): the library's names
# (all registered by the front door, ``configured``) and the commands' own settings. None of
# them imports TensorFlow or seqio: the data modules load them when data is read.
CONFIGURABLE_MODULES: tuple[str, ...] = (
    "moe_jax.runtime.configured",
    "moe_jax.commands.evaluate",
    "moe_jax.commands.infer",
    "moe_jax.commands.export",
    "moe_jax.commands.import_run",
)

_SEARCH_PATHS_ADDED: set[str] = set()
_MACRO_REF = re.compile(r"%([A-Za-z_][\w./]*)")

_MACRO_DEF = re.compile(r"^\s*([A-Za-z_][\w]*)\s*=")


def import_configurables(modules: Sequence[str] = CONFIGURABLE_MODULES) -> None:
    """Imports the modules that register gin configurables; a module not built yet is skipped."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise


def parse_gin(args: argparse.Namespace, *, finalize: bool = True) -> None:
    """Parses the gin files and bindings of ``args`` (from
    :func:`~moe_jax.runtime.gin_flags.parse_flags`), with the model and data of the spec
    ``args.recorded_spec`` when a command reading a run set it
    (:func:`~moe_jax.runtime.run_config.run_gin_files`; :func:`bind_recorded_run`).

    Raises:
      GinConfigError: naming the file/flag and line of a syntax error, an unknown
        configurable or parameter, an undefined macro, or an unused command-line macro.
    """
    import_configurables()
    gin.clear_config()
    roots = search_paths(args.gin_search_paths)
    for path in roots:
        if path not in _SEARCH_PATHS_ADDED:  # gin keeps them across clear_config()
            gin.add_config_file_search_path(path)
            _SEARCH_PATHS_ADDED.add(path)
    files = [resolve(f, roots) for f in args.gin_file]
    for given in args.command_line_gin_files:  # e.g. train --gin_file=RUN/config.gin
        if (path := resolve(given, roots)) and config_gate.in_run_directory(path):
            config_gate.check_run_config(path, args)
    bindings = [*args.gin_bindings, *args.gin_dot_bindings]
    for binding in args.gin_bindings:
        _check_binding(binding, f"--gin_bindings={binding!r}")
    for binding in args.gin_dot_bindings:
        _check_binding(binding, "--gin.{}={}".format(*binding.split(" = ", 1)))
    try:
        with _quiet_include_search():
            parsed = gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    except (ValueError, SyntaxError, TypeError, OSError) as err:
        raise GinConfigError(_parse_error(err)) from None
    own_files = [
        path
        for given in args.command_line_gin_files
        if not _in_project_gin(path := resolve(given, roots))
        and not config_gate.in_run_directory(path)
    ]
    _check_macros([resolve(f, roots) for f in _walk_files(parsed)], bindings, own_files)
    if args.recorded_spec:
        bind_recorded_run(args.recorded_spec)
    if finalize:
        try:
            gin.finalize()
        except ValueError as err:
            raise GinConfigError(f"gin: {err}") from None


def bind_recorded_run(path: str) -> None:
    """Binds what the run's spec at ``path`` (``run.json``, :mod:`~moe_jax.runtime.run_record`)
    records over what its ``config.gin`` says: ``%MODEL`` to its model, and its data
    (:func:`recorded_data_bindings`), so that a command reads the run as it trained.

    Raises:
      InputFileError: naming the file when it is unreadable or describes no model this
        version builds.
    """
    model = run_record.read_model(path)
    gin.bind_parameter("MODEL/gin.macro.value", model.build())
    for name, value in recorded_data_bindings(run_record.read_spec(path)).items():
        gin.bind_parameter(name, value)


def recorded_data_bindings(recorded: dict[str, Any]) -> dict[str, Any]:
    """The gin bindings of a recorded spec's (its JSON dict) data: its raw-text source
    (``make_source.*`` of ``data.source``), its vocabulary's arguments
    (``vocab.get_vocabulary.*`` of ``model.vocabulary``, when it records them) and its
    training stream's task, feature lengths, batch size and cache use (the macros
    ``MIXTURE_OR_TASK_NAME``, ``TASK_FEATURE_LENGTHS``, ``BATCH_SIZE``, ``USE_CACHED_TASKS``
    the commands' datasets read). The task module stays the config's, which the config
    gate checked."""
    bindings: dict[str, Any] = {
        f"sources.make_source.{name}": value
        for name, value in recorded["data"].get("source", {}).items()
    }
    vocabulary = recorded["model"].get("vocabulary")
    if isinstance(vocabulary, dict):
        bindings.update({f"vocab.get_vocabulary.{k}": v for k, v in vocabulary.items()})
    train = recorded["data"]["train"]
    for macro, field in _DATA_MACROS.items():
        if field in train:
            bindings[f"{macro}/gin.macro.value"] = train[field]
    return bindings


# The data macros of the commands' datasets (gin/runs/eval.gin) and the field of the
# recorded training stream each takes.
_DATA_MACROS = {
    "MIXTURE_OR_TASK_NAME": "mixture_or_task_name",
    "TASK_FEATURE_LENGTHS": "task_feature_lengths",
    "BATCH_SIZE": "batch_size",
    "USE_CACHED_TASKS": "use_cached",
}


def _check_binding(binding: str, origin: str) -> None:
    """Parses one command-line binding on its own: gin parses all of them as one text, so an
    unclosed bracket would be blamed on the next binding's line.

    Raises:
      GinConfigError: naming ``origin`` (the flag as given) and what cannot be parsed.
    """
    try:
        list(config_parser.ConfigParser(binding, InertDelegate()))
    except tokenize.TokenError:
        raise GinConfigError(
            f"gin: {origin}: cannot parse it (a bracket or quote is not closed)"
        ) from None
    except (SyntaxError, ValueError) as err:
        raise GinConfigError(f"gin: {origin}: cannot parse it: {_readable(err)}") from None


# gin's error of a binding whose configurable is unknown, in a file: (configurable, file,
# line number, line).
_UNKNOWN_IN_FILE = re.compile(
    r"No configurable matching '([^']+)'\.\n  In file \"(.*)\", line (\d+)\n +(.*)"
)


def _parse_error(err: BaseException) -> str:
    """The message of gin's parse error ``err``: one line naming the file, line and binding
    of an unknown configurable (a run's config.gin of another version, an old name)."""
    found = _UNKNOWN_IN_FILE.match(str(err))
    if found:
        selector, path, line, binding = found.groups()
        return f"gin: {run_config.unknown_configurable(path, line, binding.strip(), selector)}"
    hint = f"\n({run_config.MOE_LAYER_HINT})" if "'MoeLayer'" in str(err) else ""
    return f"gin: {_readable(err)}{hint}"


_AST_NODE = re.compile(r"malformed node or string on line \d+: <ast\.\w+ object at 0x[0-9a-f]+>")


def _readable(err: BaseException) -> str:
    """gin's message without Python's ``<ast.Name object at 0x...>`` (a bare word where a
    value was expected: a string without quotes)."""
    return _AST_NODE.sub("not a value (strings need quotes)", str(err))


def _drop_path_not_found(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Path not found")


@contextlib.contextmanager
def _quiet_include_search():
    """Silences gin's ``ERROR:root:Path not found`` lines while it tries each search path for
    an ``include`` (it logs one per miss, then uses the path that holds the file). A file
    found nowhere still fails, with gin's ``Unable to open file`` naming the searched paths."""
    root = logging.getLogger()
    root.addFilter(_drop_path_not_found)
    try:
        yield
    finally:
        root.removeFilter(_drop_path_not_found)


def _walk_files(parsed) -> Iterable[str]:
    for item in parsed:
        yield item.filename
        yield from _walk_files(item.includes)


def _statements(text: str, origin: str) -> Iterable[tuple[str, int, str]]:
    """(origin, line number, line without comment) for each line of a gin text."""
    for lineno, line in enumerate(text.splitlines(), 1):
        yield origin, lineno, line.split("#", 1)[0]


def _in_project_gin(path: str) -> bool:
    """``path`` is one of the project's own gin files (under ``gin/``)."""
    return storage.is_local(path) and pathlib.Path(path).resolve().is_relative_to(REPO_GIN_DIR)


def _check_macros(
    files: Sequence[str], bindings: Sequence[str], own_files: Sequence[str] = ()
) -> None:
    """Refuses a macro used but never defined; and a macro that the command line or the
    user's own gin files (``own_files``: given with ``--gin_file``, outside the project's
    ``gin/`` and run directories) set but nothing uses (``NUM_EXPERT = 8``, a typo).

    Raises:
      GinConfigError: naming the macro, where it is set or used, and close names.
    """
    lines: list[tuple[str, int, str]] = []
    for path in files:
        lines += _statements(storage.read_text(path), f"file {path!r}")
    binding_lines = [s for b in bindings for s in _statements(b, f"binding {b.strip()!r}")]
    defined = {
        m.group(1)
        for _, _, text in lines + binding_lines
        if (m := _MACRO_DEF.match(text)) and "." not in m.group(1)
    }
    referenced = set()
    for origin, lineno, text in lines + binding_lines:
        for name in _MACRO_REF.findall(text):
            referenced.add(name)
            if (
                name not in defined
                and "/" not in name
                and not name.startswith("gin.")
                and not _gin_has_macro(name)
            ):
                raise GinConfigError(
                    f"gin: macro %{name} is used but never defined\n"
                    f"  In {origin}, line {lineno}\n    {text.strip()}"
                )
    own_lines = [
        (f"file {path!r}, line {lineno}", text)
        for path in own_files
        for _, lineno, text in _statements(storage.read_text(path), path)
    ]
    for origin, text in [*own_lines, *((origin, text) for origin, _, text in binding_lines)]:
        if (m := _MACRO_DEF.match(text)) and m.group(1).isupper() and m.group(1) not in referenced:
            close = difflib.get_close_matches(m.group(1), sorted(referenced), n=3)
            guess = f"did you mean {' or '.join(close)}? " if close else "typo? "
            raise GinConfigError(
                f"gin: macro {m.group(1)} set by {origin} is not used by any gin file; "
                f"{guess}macros used: {sorted(referenced)}"
            )


def _gin_has_macro(name: str) -> bool:
    return (name, "gin.macro") in gin.config._CONFIG


def bound_value(name: str, default: Any) -> Any:
    """The value gin binds to ``name`` (``scope/configurable.parameter`` or
    ``MACRO/macro.value``), or ``default`` where nothing binds it."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def bound_arguments(fn: Callable[..., Any], selector: str | None = None) -> dict[str, Any]:
    """The keyword arguments gin would give ``fn`` (its ``selector``, e.g. a scoped
    ``warm/learning_rate_schedule``; default ``fn`` itself): its bindings, references and
    macros evaluated, and its defaults where nothing binds them."""
    arguments = {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    arguments.update(gin.get_bindings(selector or fn))
    return arguments


# Modules whose configurables build the model: a command-line binding of one of them that
# the run never called (a router config the chosen router does not read) is refused.
MODEL_MODULES: tuple[str, ...] = ("moe_jax.moe", "moe_jax.models")


def unread_model_bindings(bindings: Sequence[str]) -> list[str]:
    """Those of ``bindings`` (the command line's binding lines) that bind model configurables
    (:data:`MODEL_MODULES`) that this process never called, e.g.
    ``NoisyTopKRouterConfig.init_stddev = 0.5`` for a top-k router. gin keeps such a binding
    without a word (it refuses only unknown names); the run knows which configs it built."""
    called = set(gin.config._OPERATIVE_CONFIG)  # (scope, selector) of every call
    unread = []
    for binding in bindings:
        with contextlib.suppress(GinConfigError):  # parse_gin reports a bad binding
            for key in config_bindings(binding, binding):
                scope, _, name = key.rpartition("/")
                found = gin.config._REGISTRY.get_match(name.rpartition(".")[0])
                if (
                    found is not None
                    and config_gate.in_modules(found.wrapped.__module__, MODEL_MODULES)
                    and not any(
                        selector == found.selector and (not scope or scope in used.split("/"))
                        for used, selector in called
                    )
                ):
                    unread.append(binding)
    return unread


def operative_config() -> str:
    """The gin config actually used (T5X writes it to ``MODEL_DIR/config.gin``)."""
    return gin.operative_config_str()
