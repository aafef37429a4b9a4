"""T5X-style command-line flags of the binaries: the gin flags, their help, and the values
the user's command line gives.

Flags, as in T5X:
  --gin_file=PATH          repeatable; resolved against the working directory, then the
                           search paths (default: the repository's ``gin/`` folder)
  --gin.NAME=VALUE         one binding ``NAME = VALUE`` (``--gin.MODEL_DIR=/tmp/x``,
                           ``--gin.train.eval_period=100``); a bare word is taken as a string
  --gin_bindings=STR       repeatable; raw gin binding lines
  --gin_search_paths=A,B   comma-separated, repeatable
  --tfds_data_dir=DIR      where TFDS datasets live (sets ``TFDS_DATA_DIR``)

:func:`parse_flags` keeps what the user gave (``command_line_bindings``,
``command_line_gin_files``) apart from what a command adds later (a run's config, its
recorded settings); :func:`user_value` reads a macro from the former only.
:func:`moe_jax.runtime.gin_utils.parse_gin` parses the result.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from collections.abc import Sequence
from typing import Any

from moe_jax import storage
from moe_jax.runtime import config_gate
from moe_jax.runtime.gin_text import (
    REPO_GIN_DIR,
    GinConfigError,
    config_bindings,
    resolve,
    search_paths,
)

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
    args.recorded_spec = None  # a run's spec whose model is %MODEL (run_config.run_gin_files)
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
        path = resolve(given, roots)
        if not config_gate.in_run_directory(path):
            value = config_bindings(storage.read_text(path), path).get(name, value)
    return value


def first_checkpoint(args: argparse.Namespace) -> str | None:
    """The first checkpoint a command names: ``--checkpoint`` (one or a list) or T5X's
    ``--gin.CHECKPOINT_PATH``; None when neither is given."""
    given = getattr(args, "checkpoint", None) or command_line_value(args, "CHECKPOINT_PATH")
    if isinstance(given, (list, tuple)):
        given = given[0] if given else None
    return storage.normalize(given) if given else None
