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
the project (gin would import, i.e. run, them), and modules to import that neither the
command line nor the user's list of trusted modules (:func:`trusted_modules`) names.
:func:`config_changes` lists the bindings that differ between a run's saved config and
the operative one (`train` refuses to resume with changes unless ``--allow_config_change``).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import difflib
import importlib
import importlib.util
import io
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import tokenize
from collections.abc import Iterable, Sequence
from typing import Any

import gin
from gin import config_parser

from moe_jax import errors, storage
from moe_jax.moe import legacy_gin
from moe_jax.runtime import checkpoints

REPO_GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"

# Modules whose configurables the gin files may name. Imported before parsing so that
# gin files need no `import` lines (T5X binaries do the same for t5x.*). None of them imports
# TensorFlow or seqio: the data modules load them when data is read.
CONFIGURABLE_MODULES: tuple[str, ...] = (
    "moe_jax.partitioning",
    "moe_jax.moe",
    "moe_jax.moe.layer",
    "moe_jax.models.model",
    "moe_jax.data.pipeline",
    "moe_jax.data.sources",
    "moe_jax.data.vocab",
    "moe_jax.runtime.optimizers",
    "moe_jax.runtime.summaries",
    "moe_jax.commands.train",
    "moe_jax.commands.evaluate",
    "moe_jax.commands.infer",
    "moe_jax.commands.export",
)

_SEARCH_PATHS_ADDED: set[str] = set()
_MACRO_REF = re.compile(r"%([A-Za-z_][\w./]*)")
_MACRO_DEF = re.compile(r"^\s*([A-Za-z_][\w]*)\s*=")
_ACCEPTED_CONFIG = re.compile(r"config\.step-(\d+)\.gin")  # record_run_config's


# Modules a run directory's config file may import (gin runs an import when parsing).
PROJECT_MODULES: tuple[str, ...] = ("moe_jax",)
# Bindings whose value names a module (or .py file) that is imported, i.e. run: the macro
# and (configurable, parameter) pairs (T5X's MIXTURE_OR_TASK_MODULE, imported by
# utils.DatasetConfig).
IMPORT_MACROS: tuple[str, ...] = ("MIXTURE_OR_TASK_MODULE",)
IMPORT_PARAMETERS: tuple[tuple[str, str], ...] = (("DatasetConfig", "module"),)

# Bindings that may differ when a run resumes: its length, periods and paths.
RESUMABLE_CHANGES = re.compile(
    r"^(MODEL_DIR|TRAIN_STEPS|.*(_period|_dir|_path|\.path|total_steps|eval_steps|keep_checkpoints|"
    r"async_checkpointing))$"
)


class GinConfigError(errors.UserError, ValueError):
    """A gin file, binding or flag is wrong; the message names where."""


class ConfigChangedError(GinConfigError):
    """A run would resume with another gin config than it was trained with."""


class UntrustedCodeError(GinConfigError):
    """A run directory's or export's config names code to import that the command line does
    not name."""


# Macros the repository's gin files define, by the file that defines them (shown by --help).
MACROS: dict[str, tuple[str, str]] = {
    "MODEL_DIR": ("runs/pretrain.gin", "run directory: checkpoints, config.gin, metrics"),
    "TRAIN_STEPS": ("runs/pretrain.gin", "total training steps"),
    "BATCH_SIZE": ("runs/pretrain.gin", "global batch size (all processes together)"),
    "RANDOM_SEED": ("runs/pretrain.gin", "parameter init, dropout and data order"),
    "MIXTURE_OR_TASK_NAME": (
        "runs/pretrain.gin",
        "seqio task or mixture: mc4_span_corruption, "
        "mc4_<lang>_prefix_lm, text_span_corruption, text_<label>_..., yours",
    ),
    "MIXTURE_OR_TASK_MODULE": (
        "runs/pretrain.gin",
        "module (or .py file) that registers your own "
        "seqio tasks/mixtures, imported before the data is read (T5X)",
    ),
    "TASK_FEATURE_LENGTHS": ("runs/pretrain.gin", "{'inputs': I, 'targets': T}"),
    "USE_CACHED_TASKS": ("runs/pretrain.gin", "read seqio's offline cache"),
    "TFDS_DATA_DIR": ("data/embedded.gin", "TFDS data directory (data/mc4.gin: where mC4 lives)"),
    "TEXT_TRAIN_FILES": (
        "data/text.gin",
        "your text files: a glob, or {label: glob} per language/domain",
    ),
    "TEXT_VALIDATION_FILES": ("data/text.gin", "validation files, same form (default: held out)"),
    "TEXT_VALIDATION_FRACTION": (
        "data/text.gin",
        "fraction of training lines held out for validation",
    ),
    "VOCAB_SIZE": ("models/t5_dense.gin", "embedding rows (>= the vocabulary's size)"),
    "EMBED_DIM": (
        "models/t5_dense.gin",
        "d_model (also MLP_DIM, NUM_HEADS, HEAD_DIM, NUM_ENCODER_LAYERS, NUM_DECODER_LAYERS)",
    ),
    "DROPOUT_RATE": ("models/t5_dense.gin", "dropout everywhere"),
    "ACTIVATION_DTYPE": ("models/t5_dense.gin", "'float32' or 'bfloat16' activations"),
    "NUM_EXPERTS": (
        "models/t5_moe.gin",
        "experts per MoE layer (also NUM_SELECTED_EXPERTS, "
        "NUM_SPARSE_LAYERS, SPARSE_LAYOUT, GROUP_SIZE)",
    ),
    "TRAIN_CAPACITY_FACTOR": (
        "models/t5_moe.gin",
        "expert capacity factor (EVAL_CAPACITY_FACTOR in eval)",
    ),
    "CHECKPOINT_PATH": ("runs/eval.gin", "eval/infer: the checkpoint (T5X; same as --checkpoint)"),
    "EVAL_OUTPUT_DIR": ("runs/eval.gin", "eval: where results go (T5X; same as --output_dir)"),
    "INFER_OUTPUT_DIR": ("runs/infer.gin", "infer: writes predictions.jsonl there (T5X)"),
}

GIN_FLAG_HELP = """\
gin flags, as in T5X:
  --gin.NAME=VALUE      bind one gin parameter or macro, e.g. --gin.TRAIN_STEPS=1000,
                        --gin.train_script.train.eval_period=100, --gin.MODEL_DIR=/tmp/run
                        (a bare word or path is quoted for you; lists and dicts in gin syntax:
                        --gin.TASK_FEATURE_LENGTHS="{'inputs': 64, 'targets': 16}")
  --gin_file, --gin_bindings, --gin_search_paths: see above. Later files and flags override
  earlier ones; a binding no gin file uses is refused as a likely typo.
"""


def _open_url(path: str) -> io.StringIO:
    return io.StringIO(storage.read_text(path))


# gin opens files with `open`; a run's config.gin on an object store (gs://) is read here.
gin.config.register_file_reader(
    _open_url, lambda path: not storage.is_local(path) and storage.exists(path)
)


def gin_help(macros: Sequence[str] = ()) -> str:
    """The help epilog: the gin flags and the macros (all of :data:`MACROS` by default)."""
    names = list(macros) or list(MACROS)
    lines = [GIN_FLAG_HELP, "macros (set with --gin.NAME=VALUE; defined in gin/<file>):"]
    lines += [f"  {name:<25} {MACROS[name][1]} [{MACROS[name][0]}]" for name in names]
    return "\n".join(lines)


def add_gin_flags(parser: argparse.ArgumentParser, macros: Sequence[str] = ()) -> None:
    """Adds T5X's gin flags to ``parser`` (``--gin.NAME=VALUE`` is handled by
    :func:`parse_flags`) and, in ``--help``, their description and the ``macros``."""
    parser.add_argument(
        "--gin_file",
        action="append",
        default=[],
        metavar="PATH",
        help="gin file (repeatable); later files override earlier ones",
    )
    parser.add_argument(
        "--gin_bindings",
        action="append",
        default=[],
        metavar="BINDING",
        help="extra gin binding line (repeatable)",
    )
    parser.add_argument(
        "--gin_search_paths",
        action="append",
        default=[],
        metavar="DIRS",
        help=f"comma-separated gin search paths (default: {REPO_GIN_DIR})",
    )
    parser.add_argument(
        "--tfds_data_dir",
        default=None,
        metavar="DIR",
        help="TFDS data directory (sets TFDS_DATA_DIR)",
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = gin_help(macros)


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parses ``argv``; ``--gin.NAME=VALUE`` flags become ``args.gin_dot_bindings``.

    Unknown flags are refused by name (argparse's usual exit code 2).
    """
    dot_bindings: list[str] = []
    rest: list[str] = []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin.") :].partition("=")
            if not sep or not name:
                parser.error(f"{arg!r}: expected --gin.NAME=VALUE")
            dot_bindings.append(f"{name} = {_as_gin_value(value)}")
        else:
            rest.append(arg)
    args = parser.parse_args(rest)
    args.gin_dot_bindings = dot_bindings
    # what the user gave, kept apart from what a command adds (a run's config, its settings)
    args.command_line_bindings = [*args.gin_bindings, *dot_bindings]
    args.command_line_gin_files = list(args.gin_file)
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
        if path not in _SEARCH_PATHS_ADDED:  # gin keeps them across clear_config()
            gin.add_config_file_search_path(path)
            _SEARCH_PATHS_ADDED.add(path)
    files = [_resolve(f, roots) for f in args.gin_file]
    for given in args.command_line_gin_files:  # e.g. train --gin_file=RUN/config.gin
        if (path := _resolve(given, roots)) and in_run_directory(path):
            check_run_config(path, args)
    files = [new_form_config(f) if f and in_run_directory(f) else f for f in files]
    bindings = [*args.gin_bindings, *args.gin_dot_bindings]
    for binding in args.gin_bindings:
        _check_binding(binding, f"--gin_bindings={binding!r}")
    for binding in args.gin_dot_bindings:
        _check_binding(binding, "--gin.{}={}".format(*binding.split(" = ", 1)))
    try:
        with _quiet_include_search():
            parsed = gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    except (ValueError, SyntaxError, TypeError, OSError) as err:
        hint = (
            "\n(MoeLayer takes no gin bindings: the MoE settings are MoeConfig.*, "
            "<Router>Config.*, CapacityConfig.*, ExecutionConfig.*, AuxLossConfig.*; docs/moe.md)"
            if "'MoeLayer'" in str(err)
            else ""
        )
        raise GinConfigError(f"gin: {_readable(err)}{hint}") from None
    _check_macros([_resolve(f, roots) for f in _walk_files(parsed)], bindings)
    if finalize:
        try:
            gin.finalize()
        except ValueError as err:
            raise GinConfigError(f"gin: {err}") from None


def _check_binding(binding: str, origin: str) -> None:
    """Parses one command-line binding on its own: gin parses all of them as one text, so an
    unclosed bracket would be blamed on the next binding's line.

    Raises:
      GinConfigError: naming ``origin`` (the flag as given) and what cannot be parsed.
    """
    try:
        list(config_parser.ConfigParser(binding, _InertDelegate()))
    except tokenize.TokenError:
        raise GinConfigError(
            f"gin: {origin}: cannot parse it (a bracket or quote is not closed)"
        ) from None
    except (SyntaxError, ValueError) as err:
        raise GinConfigError(f"gin: {origin}: cannot parse it: {_readable(err)}") from None


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


def _resolve(path: str, roots: Sequence[str]) -> str:
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


def _walk_files(parsed) -> Iterable[str]:
    for item in parsed:
        yield item.filename
        yield from _walk_files(item.includes)


def _statements(text: str, origin: str) -> Iterable[tuple[str, int, str]]:
    """(origin, line number, line without comment) for each line of a gin text."""
    for lineno, line in enumerate(text.splitlines(), 1):
        yield origin, lineno, line.split("#", 1)[0]


def _check_macros(files: Sequence[str], bindings: Sequence[str]) -> None:
    lines: list[tuple[str, int, str]] = []
    for path in files:
        lines += _statements(_read(path), f"file {path!r}")
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
    for origin, _, text in binding_lines:
        if (m := _MACRO_DEF.match(text)) and m.group(1).isupper() and m.group(1) not in referenced:
            close = difflib.get_close_matches(m.group(1), sorted(referenced), n=3)
            guess = f"did you mean {' or '.join(close)}? " if close else "typo? "
            raise GinConfigError(
                f"gin: macro {m.group(1)} set by {origin} is not used by any gin file; "
                f"{guess}macros used: {sorted(referenced)}"
            )


def _read(path: str) -> str:
    return storage.read_text(path)


def _gin_has_macro(name: str) -> bool:
    return (name, "gin.macro") in gin.config._CONFIG


def command_line_value(args: argparse.Namespace, name: str) -> Any:
    """The value ``--gin.NAME=...`` / ``--gin_bindings='NAME = ...'`` gives macro ``name``
    (the last one wins), as a Python literal; None when the command line does not set it."""
    value = None
    for binding in [*args.gin_bindings, *args.gin_dot_bindings]:
        left, sep, right = binding.partition("=")
        if sep and left.strip() == name:
            try:
                value = ast.literal_eval(right.strip())
            except (ValueError, SyntaxError):
                raise GinConfigError(
                    f"gin: {name} = {right.strip()}: expected a path or a list of paths"
                ) from None
    return value


def user_value(args: argparse.Namespace, name: str) -> Any:
    """The value the user gives macro ``name``: its ``--gin.NAME`` / ``--gin_bindings`` (the
    last wins), else the last of the user's own ``--gin_file``s binding it (not a run
    directory's); None when neither does. Where a command writes comes from here, never from
    a run's recorded config (``EVAL_OUTPUT_DIR = '/elsewhere'`` in ``RUN/config.gin``)."""
    value = command_line_value(args, name)
    if value is not None:
        return value
    roots = search_paths(args.gin_search_paths)
    for given in args.command_line_gin_files:
        path = _resolve(given, roots)
        if not in_run_directory(path):
            value = config_bindings(_read(path), path).get(name, value)
    return value


def first_checkpoint(args: argparse.Namespace) -> str | None:
    """The first checkpoint a command names: ``--checkpoint`` (one or a list) or T5X's
    ``--gin.CHECKPOINT_PATH``; None when neither is given."""
    given = getattr(args, "checkpoint", None) or command_line_value(args, "CHECKPOINT_PATH")
    if isinstance(given, (list, tuple)):
        given = given[0] if given else None
    return storage.normalize(given) if given else None


def run_gin_files(
    args: argparse.Namespace,
    checkpoint: str | None,
    defaults: Sequence[str],
    *,
    extend_run_config: bool = False,
    command: str = "moe-jax",
) -> list[str]:
    """The gin files of a command reading a run's checkpoint (eval, infer, analyze, export)
    and a line on stderr saying which config that is.

    ``defaults`` (the command's own files, e.g. ``runs/eval.gin``; resolved against the
    search paths) come first, then the run's ``MODEL_DIR/config.gin``, so the run's macros
    (task, feature lengths, batch size) win over the defaults'. The run's config is used when
    no ``args.gin_file`` are given, or with ``extend_run_config`` before them (``analyze``:
    the command line overrides the run); it goes through :func:`check_run_config`.

    Raises:
      FileNotFoundError: naming ``checkpoint`` when it is no run directory's checkpoint, or
        when the run has no config.gin and no gin file was given.
      ValueError: neither a checkpoint nor a gin file was given.
    """

    roots = search_paths([])
    defaults = [_resolve(f, roots) for f in defaults]
    gin_files = args.gin_file
    config = None
    if checkpoint is None:
        if not gin_files:
            raise ValueError("no checkpoint: pass --checkpoint=DIR (or --gin.CHECKPOINT_PATH=DIR)")
    else:
        model_dir = checkpoints.split_checkpoint_path(checkpoint)[0]
        if not storage.isdir(storage.join(model_dir, "checkpoints")):
            raise FileNotFoundError(
                f"--checkpoint={checkpoint!r}: no checkpoints there "
                f"({storage.join(model_dir, 'checkpoints')} does not exist)"
            )
        if extend_run_config or not gin_files:
            config = checkpoint_config(checkpoint, args)
    if config is None and not gin_files:
        raise FileNotFoundError(
            f"--checkpoint={checkpoint!r}: the run has no "
            f"{storage.join(model_dir, 'config.gin')}; pass its model and data "
            "gin files with --gin_file"
        )
    files = [*defaults, *([config] if config else []), *gin_files]
    used = (
        f"the run's {config}" + (f" + {', '.join(gin_files)}" if gin_files else "")
        if config
        else ", ".join(gin_files)
    )
    print(
        f"[{command}] gin config: {used} (defaults: {', '.join(defaults) or 'none'})",
        file=sys.stderr,
        flush=True,
    )
    return files


def bound_value(name: str, default: Any) -> Any:
    """The value gin binds to ``name`` (``scope/configurable.parameter`` or
    ``MACRO/macro.value``), or ``default`` where nothing binds it."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


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
                    and _in_modules(found.wrapped.__module__, MODEL_MODULES)
                    and not any(
                        selector == found.selector and (not scope or scope in used.split("/"))
                        for used, selector in called
                    )
                ):
                    unread.append(binding)
    return unread


def _in_modules(module: str, roots: Sequence[str]) -> bool:
    """``module`` is one of ``roots`` or a submodule of one."""
    return any(module == m or module.startswith(m + ".") for m in roots)


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


def run_config_file(
    model_dir: str, args: argparse.Namespace, step: int | None = None
) -> str | None:
    """The run's config as of checkpoint ``step`` (:func:`recorded_run_config`: ``config.gin``
    or a newer accepted ``config.step-N.gin``; an export's ``config.gin``; None when there is
    none), passed through :func:`check_run_config`. Every command that reads a run's or an
    export's config (analyze, eval, infer, export, import) finds it here. A config written
    before ``MoeConfig`` (``MoeLayer.*`` bindings) is read as a local copy in the new form
    (:func:`new_form_config`).

    Raises:
      GinConfigError: as :func:`check_run_config`.
    """
    path = recorded_run_config(model_dir, step)
    if not storage.exists(path):
        return None
    check_run_config(path, args)
    return new_form_config(path)


def checkpoint_config(checkpoint: str, args: argparse.Namespace) -> str | None:
    """:func:`run_config_file` of the run ``checkpoint`` (``MODEL_DIR[/STEP]``) belongs to, as
    of its step (the latest when none is given)."""

    model_dir, step = checkpoints.split_checkpoint_path(checkpoint)
    return run_config_file(
        model_dir, args, checkpoints.reached_step(model_dir) if step is None else step
    )


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
    for statement in _parse_statements(_read(path), path):
        line = statement.location.line_num if hasattr(statement, "location") else "?"
        if isinstance(statement, config_parser.ImportStatement):
            if not _in_modules(statement.module, PROJECT_MODULES):
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
    refuse_untrusted_modules(path, import_bindings(_read(path), path), args)


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
    if not (_is_module_name(module) and _in_modules(module, PROJECT_MODULES)):
        return False
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    origin = pathlib.Path(spec.origin).resolve()
    return any(
        (root := _package_root(m)) is not None and origin.is_relative_to(root)
        for m in PROJECT_MODULES
    )


def _package_root(name: str) -> pathlib.Path | None:
    """The folder of installed package ``name``."""
    spec = importlib.util.find_spec(name)
    return pathlib.Path(str(spec.origin)).resolve().parent if spec and spec.origin else None


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
        s for s in _parse_statements(text, origin) if isinstance(s, config_parser.BindingStatement)
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
    :func:`parse_flags`, before a command adds a run's config or recorded settings)."""
    found = []
    for binding in args.command_line_bindings:
        with contextlib.suppress(GinConfigError):  # parse_gin reports a bad binding
            found += import_bindings(binding, f"binding {binding!r}")
    roots = search_paths(args.gin_search_paths)
    for name in args.command_line_gin_files:
        with contextlib.suppress(GinConfigError, OSError):
            path = _resolve(name, roots)
            if not in_run_directory(path):
                found += import_bindings(_read(path), path)
    return [module for _, _, module in found]


def in_run_directory(path: str) -> bool:
    """``path`` lies in a run directory (beside ``checkpoints/`` or a ``LOCK``) or an export
    (beside ``model.safetensors``): its config is the run's, not the user's."""
    folder = storage.parent(path)
    return any(
        storage.exists(storage.join(folder, name))
        for name in ("checkpoints", "LOCK", "model.safetensors")
    )


def new_form_config(path: str) -> str:
    """``path``, or, when it is in an earlier form (``MoeLayer.*`` bindings of a run written
    before ``MoeConfig``, ``T5Config.dtype``, MoE config parts left None), a local copy
    translated by :func:`moe_jax.moe.legacy_gin.translate` (said on stderr, with the options
    it leaves out), removed when the process exits.

    Raises:
      GinConfigError: naming ``path`` and an option that cannot be translated.
    """
    text = _read(path)
    try:
        translated, warnings = legacy_gin.translate(text)
    except legacy_gin.LegacyOptionError as err:
        raise GinConfigError(f"{path}: {err}") from None
    if translated == text:
        return path
    folder = tempfile.mkdtemp(prefix="moe_jax_config_")
    atexit.register(shutil.rmtree, folder, True)
    copy = os.path.join(folder, "config.gin")
    storage.write_text(copy, translated)
    written = (
        "binds MoeLayer.* (written before MoeConfig)"
        if legacy_gin.binds_moe_layer(text)
        else "was written by an earlier version"
    )
    print(
        f"[moe-jax] {path} {written}; read in the new form from {copy}",
        file=sys.stderr,
        flush=True,
    )
    for warning in warnings:
        print(f"[moe-jax] warning: {path}: {warning}", file=sys.stderr, flush=True)
    return copy


def config_bindings(text: str, origin: str = "config") -> dict[str, object]:
    """``{"scope/configurable.param" or "MACRO": value}`` of a gin config text (an operative
    config as written to ``config.gin``); values as parsed, references as text."""
    out = {}
    for statement in _parse_statements(text, origin):
        if isinstance(statement, config_parser.BindingStatement):
            name = ".".join(p for p in (statement.selector, statement.arg_name) if p)
            out[f"{statement.scope}/{name}" if statement.scope else name] = statement.value
    return out


def _macros_resolved(bindings: dict[str, object]) -> dict[str, object]:
    """``bindings`` (of :func:`config_bindings`) with each value that is a macro of the same
    config (``"%NAME"``) replaced by the macro's value, so that ``k = %K`` with ``K = 2``
    equals ``k = 2`` (a config translated from ``MoeLayer.*`` binds literals)."""

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
    model_dir: str, operative: str, step: int, *, allow_change: bool = False
) -> str:
    """Keeps the run's gin config: writes ``MODEL_DIR/config.gin`` on the first start; on a
    resumption (at ``step``) compares ``operative`` with the run's config as last accepted
    (:func:`recorded_run_config`). No recorded config is ever overwritten, so a plain resume
    that would undo an accepted change is refused like any other change.

    Returns:
      the path the operative config is kept at: the recorded one it equals, or
      ``config.step-N.gin`` when this resumption changed something and ``allow_change`` let it.

    Raises:
      ConfigChangedError: listing the differing bindings, when ``allow_change`` is False.
    """
    first = storage.join(model_dir, "config.gin")
    if not storage.exists(first):
        storage.write_text(first, operative)
        return first
    recorded = recorded_run_config(model_dir, step)
    changes = config_changes(legacy_gin.translate(_read(recorded))[0], operative)
    if not changes:
        return recorded
    if not allow_change:
        raise ConfigChangedError(
            f"MODEL_DIR={model_dir} was trained with another gin config ({recorded}); resuming at "
            f"step {step} would change {len(changes)} binding(s) (pass --allow_config_change to "
            "resume with them; kept as config.step-N.gin):\n  " + "\n  ".join(changes)
        )
    kept = storage.join(model_dir, f"config.step-{step}.gin")
    storage.write_text(
        kept,
        f"# resumed at step {step} with --allow_config_change; changed from "
        f"{storage.basename(recorded)}:\n"
        + "".join(f"#   {line}\n" for line in changes)
        + operative,
    )
    return kept


def recorded_run_config(model_dir: str, step: int | None = None) -> str:
    """The run's gin config as of ``step``: the newest ``config.step-N.gin`` (written when a
    resumption at step N changed the config with ``--allow_config_change``) with N <= ``step``
    (any N when ``step`` is None), else ``config.gin``."""
    accepted = {
        int(m.group(1)): name
        for name in storage.listdir(model_dir)
        if (m := _ACCEPTED_CONFIG.fullmatch(name)) and (step is None or int(m.group(1)) <= step)
    }
    return storage.join(model_dir, accepted[max(accepted)] if accepted else "config.gin")
