"""`moe-jax export`: a checkpoint to the export format (:mod:`moe_jax.interop.export_format`),
or to a Hugging Face model folder (``--format=hf``).

    moe-jax export --checkpoint=MODEL_DIR[/STEP] --out=EXPORT_DIR [--gin_file=...]

The export holds the parameters as safetensors, the initial routers, ``config.json``, the
run's ``config.gin`` and its vocabulary (the format's docstring lists them); `moe-jax import`
(:mod:`moe_jax.commands.import_run`) reads it back bit for bit. Gin: ``runs/export.gin``
(the model) is added to the run's config; ``--gin_file`` / ``--gin.NAME=VALUE`` override as
elsewhere. ``--out`` must be new or empty (``--overwrite``: a non-empty one), and never a run
directory (``checkpoints/`` or a ``LOCK``). The config a run directory brings names no code
to import that the command line does not
(:func:`~moe_jax.runtime.config_gate.check_run_config`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import param_paths, storage
from moe_jax.interop import hf
from moe_jax.interop.export_format import (
    CONFIG_GIN,
    CONFIG_JSON,
    FORMAT,
    FORMAT_VERSION,
    PROBE_SHAPES,
    ROUTER_INIT_FILE,
    RUN_SPEC_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    ExportError,
    architecture,
    arrays_for_export,
    check_target,
    listed_files,
    name_map,
    safetensors_bytes,
    vocabulary_file,
)
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    distributed,
    gin_flags,
    gin_utils,
    output_lock,
    router_init,
    run_config,
    train_state,
)
from moe_jax.runtime.checkpoint_checks import CheckpointMismatchError
from moe_jax.runtime.run_dir import RunDir


@gin.configurable(
    module="export_script", denylist=["checkpoint_path", "out_dir", "config_gin", "run_spec"]
)
def export_checkpoint(
    checkpoint_path: str,
    out_dir: str,
    config_gin: str | None = None,
    run_spec: str | None = None,
    *,
    model: Any = gin.REQUIRED,
) -> dict[str, Any]:
    """Writes the export of ``checkpoint_path`` (``MODEL_DIR``, ``MODEL_DIR/STEP``) to
    ``out_dir``, with the run's ``config_gin`` (None: the operative config) and its spec
    ``run_spec`` (``run.json`` as of the step; None: none) beside it; returns the
    ``config.json`` content.

    Multi-host: every process restores its shards on the mesh of the gin config
    (``partitioning.make_mesh``, as `moe-jax eval` does), each array is then gathered whole
    onto every process (host memory: the whole model per process), and only process 0
    writes ``out_dir`` (which need not exist on the other hosts).

    Raises:
      ExportError: the checkpoint cannot be read (names it and the cause).
    """
    params, step = _restore_for_export(checkpoint_path, model)
    arrays = arrays_for_export(params)
    names = {v: k for k, v in name_map(list(param_paths.named_leaves(params))).items()}
    initial = router_init.load(RunDir.of_checkpoint(checkpoint_path)[0])
    exported_routers = arrays_for_export(initial) if initial else {}
    config = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "source_checkpoint": storage.normalize(checkpoint_path),
        "step": step,
        **architecture(model),
        "routing": {"router_mode": configured.router_mode()},
        "num_parameters": int(sum(a.size for a in arrays.values())),
        "arrays": {
            name: {"shape": list(a.shape), "dtype": str(a.dtype), "moe_jax_name": names[name]}
            for name, a in sorted(arrays.items())
        },
        "router_init": (
            {"file": ROUTER_INIT_FILE, "arrays": sorted(exported_routers)}
            if exported_routers
            else None
        ),
        "run_spec": RUN_SPEC_FILE if run_spec else None,
    }
    if jax.process_index() == 0:
        _write_export(out_dir, config, arrays, exported_routers, model, (config_gin, run_spec))
    return config


def _restore_for_export(checkpoint_path: str, model: Any) -> tuple[Any, int]:
    """The parameters of ``checkpoint_path`` per layer (``Model.per_layer``) on the gin
    config's mesh, and their step.

    Raises:
      ExportError: the checkpoint cannot be read (names it and the cause).
    """
    ctx = configured.run_context()
    target = model.per_layer(
        train_state.abstract_with_shardings(
            builders.abstract_params(model, PROBE_SHAPES),
            train_state.param_shardings(model, PROBE_SHAPES, ctx.mesh, ctx.rules),
        )
    )
    try:
        params, _, step, _ = checkpoints.restore_from(checkpoint_path, target)
    except (FileNotFoundError, CheckpointMismatchError):
        raise
    except Exception as err:  # orbax/TensorStore errors of a damaged checkpoint
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ExportError(
            f"cannot read the checkpoint at {checkpoint_path!r}: {type(err).__name__}: {first}"
        ) from err
    return params, step


def _write_export(
    out_dir: str,
    config: dict[str, Any],
    arrays: Mapping[str, np.ndarray],
    exported_routers: Mapping[str, np.ndarray],
    model: Any,
    run_files: tuple[str | None, str | None],
) -> None:
    """Writes the export's files to ``out_dir`` (weights, initial routers, vocabulary,
    ``config.json``, ``config.gin``, ``run.json``: ``run_files`` holds the run's config and
    spec) and removes an earlier export's files it no longer has."""
    config_gin, run_spec = run_files
    step = config["step"]
    storage.write_bytes(
        storage.join(out_dir, WEIGHTS_FILE),
        safetensors_bytes(
            arrays, {"format": FORMAT, "version": str(FORMAT_VERSION), "step": str(step)}
        ),
    )
    if exported_routers:
        storage.write_bytes(
            storage.join(out_dir, ROUTER_INIT_FILE),
            safetensors_bytes(
                exported_routers,
                {
                    "format": FORMAT,
                    "version": str(FORMAT_VERSION),
                    "content": "initial routers",
                },
            ),
        )
    if (vocab := vocabulary_file(model)) is not None:
        storage.write_bytes(storage.join(out_dir, VOCAB_FILE), storage.read_bytes(vocab))
    storage.write_text(storage.join(out_dir, CONFIG_JSON), json.dumps(config, indent=1))
    storage.write_text(
        storage.join(out_dir, CONFIG_GIN),
        storage.read_text(config_gin) if config_gin else gin_utils.operative_config(),
    )
    if run_spec:
        storage.write_text(storage.join(out_dir, RUN_SPEC_FILE), storage.read_text(run_spec))
    for stale in {ROUTER_INIT_FILE, VOCAB_FILE, RUN_SPEC_FILE} - set(listed_files(config)):
        storage.remove(storage.join(out_dir, stale))  # an earlier export's, overwritten


def _export(args) -> dict[str, Any]:
    distributed.initialize(args)  # before the lock: process 0 decides it for all processes
    with output_lock.writing(args.out):  # no other export checks or writes it meanwhile
        check_target(args.out, "--out", args.overwrite)  # never into a run directory
        return _export_checked(args)


def _export_checked(args) -> dict[str, Any]:
    run_files = run_config.run_gin_files(
        args, args.checkpoint, ["runs/export.gin"], command="moe-jax export"
    )
    config = run_config.checkpoint_config(args.checkpoint, args)
    config = config if config in run_files else None  # copied into the export as it is
    spec = run_config.run_spec_file(args.checkpoint) if config else None  # and its spec
    args.gin_file = run_files
    gin_utils.parse_gin(args)
    if args.format == "hf":
        return export_hf(args.checkpoint, args.out)
    return export_checkpoint(args.checkpoint, args.out, config, spec)


@gin.configurable(module="export_script", denylist=["checkpoint_path", "out_dir"])
def export_hf(checkpoint_path: str, out_dir: str, *, model: Any = gin.REQUIRED) -> dict[str, Any]:
    """Writes ``checkpoint_path`` as a Hugging Face model folder ``out_dir``
    (``config.json``, ``model.safetensors``, ``spiece.model`` for a SentencePiece
    vocabulary); returns the export's summary (``step``, ``num_parameters``, ``arrays``).

    Raises:
      moe_jax.interop.hf.HfError: naming the option the model has that Hugging Face's T5 /
        Switch Transformers cannot express (before anything is read or written).
    """
    network = model.module.config
    config = hf.config_json(network, model.eos_id)  # refuses before any restore or write
    params, step = _restore_for_export(checkpoint_path, model)
    tensors = hf.from_export_arrays(arrays_for_export(params), network)
    if jax.process_index() == 0:
        storage.write_bytes(
            storage.join(out_dir, hf.WEIGHTS), safetensors_bytes(tensors, {"format": "pt"})
        )
        storage.write_text(storage.join(out_dir, hf.CONFIG_JSON), json.dumps(config, indent=1))
        if (vocab := vocabulary_file(model)) is not None:
            storage.write_bytes(storage.join(out_dir, hf.SPIECE), storage.read_bytes(vocab))
    return {
        "step": step,
        "num_parameters": int(sum(a.size for a in tensors.values())),
        "arrays": tensors,
    }


def main(argv: list[str] | None = None) -> int:

    parser = builders.build_parser(
        "moe-jax export", "write a checkpoint as safetensors + JSON config"
    )
    parser.add_argument(
        "--checkpoint",
        type=storage.normalize,
        required=True,
        metavar="DIR[/STEP]",
        help="a MODEL_DIR (latest step), MODEL_DIR/STEP or MODEL_DIR/checkpoints/STEP",
    )
    parser.add_argument(
        "--out",
        type=storage.normalize,
        required=True,
        metavar="DIR",
        help="the export directory (new or empty; never a run directory)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty --out (an earlier export)"
    )
    parser.add_argument(
        "--format",
        choices=("moe-jax", "hf"),
        default="moe-jax",
        help="moe-jax: this project's export; hf: a Hugging Face T5 / Switch Transformers "
        "folder (config.json, model.safetensors, spiece.model)",
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    result = _export(args)
    print(
        f"[moe-jax] exported step {result['step']} of {args.checkpoint} "
        f"({result['num_parameters']:,} parameters in {len(result['arrays'])} arrays) to "
        f"{args.out}",
        file=sys.stderr,
        flush=True,
    )
    return 0
