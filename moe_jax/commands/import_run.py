"""`moe-jax import`: an export (:mod:`moe_jax.interop.export_format`) or a Hugging Face
model folder (``--hf``, :mod:`moe_jax.interop.hf`) as a new run directory.

    moe-jax import --export=EXPORT_DIR --model_dir=NEW_MODEL_DIR [--gin_file=...]
    moe-jax import --hf=HF_FOLDER --model_dir=NEW_MODEL_DIR [--gin_file=...]

An export becomes an orbax checkpoint at the export's step (parameters as exported, a fresh
optimizer state) and the run's ``config.gin``, so that `eval`, `infer`, `analyze` and
`train` (fine-tuning) use it like any run, and ``MODEL_DIR/router_init.npz`` from
``router_init.safetensors``; the export's vocabulary is copied into the run and
``vocab.get_vocabulary.path`` bound to the copy. The round trip with `moe-jax export` gives
bit-identical parameters and initial routers. Gin: ``runs/export.gin`` (the model) is added
to the run's config; ``--gin_file`` / ``--gin.NAME=VALUE`` override as elsewhere.

``--model_dir`` must be new or empty (``--overwrite``: a non-empty one), and never a run
directory (``checkpoints/`` or a ``LOCK``), except the very run the export came from (with
``--overwrite``; its ``config.gin`` is kept). The config an export brings names no code to
import that the command line does not
(:func:`~moe_jax.runtime.config_gate.check_run_config`).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gin
import jax
import numpy as np

from moe_jax import storage
from moe_jax.interop import hf
from moe_jax.interop.export_format import (
    CONFIG_GIN,
    CONFIG_JSON,
    PROBE_SHAPES,
    RUN_SPEC_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    ExportError,
    check_architecture,
    check_target,
    holds_saved_run,
    listed_files,
    params_from_export,
    read_export,
    read_export_config,
    read_router_init,
)
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    distributed,
    gin_flags,
    gin_text,
    gin_utils,
    router_init,
    run_config,
    run_lock,
    run_record,
    train_state,
)
from moe_jax.runtime.run_dir import RunDir


@gin.configurable(module="export_script", denylist=["export_dir", "run_dir", "own_config"])
def import_export(
    export_dir: str,
    run_dir: RunDir,
    own_config: bool = False,
    *,
    model: Any = gin.REQUIRED,
    random_seed: int = 0,
) -> int:
    """Writes an orbax checkpoint of the export's parameters (at its step, with a fresh
    optimizer state and RNG from ``random_seed``) and, when the export carries them, the
    initial routers (``router_init.npz``) into ``run_dir``; returns the step.
    ``own_config``: the model is the export's ``config.gin``'s, whose network
    ``config.json`` must describe (:func:`check_architecture`).

    Raises:
      ExportError: the export is unreadable, inconsistent, or does not fit the gin config's
        model.
    """

    arrays, config = read_export(export_dir)
    if own_config:
        check_architecture(config, model, storage.join(export_dir, CONFIG_JSON))
    step = int(config.get("step", 0))
    write_checkpoint(
        arrays,
        storage.join(export_dir, WEIGHTS_FILE),
        run_dir,
        model,
        step=step,
        source=export_dir,
        random_seed=random_seed,
        initial_routers=lambda abstract: read_router_init(export_dir, config, abstract),
    )
    return step


@gin.configurable(module="export_script", denylist=["arrays", "where", "run_dir", "source"])
def import_arrays(
    arrays: Mapping[str, np.ndarray],
    where: str,
    run_dir: RunDir,
    source: str,
    *,
    model: Any = gin.REQUIRED,
    random_seed: int = 0,
) -> None:
    """Writes exported ``arrays`` (read from ``where``, e.g. a Hugging Face folder's
    tensors under their export names) as step 0 of ``run_dir``, for the gin config's model.

    Raises:
      ExportError: the arrays do not fit the model.
    """
    write_checkpoint(arrays, where, run_dir, model, step=0, source=source, random_seed=random_seed)


def write_checkpoint(
    arrays: Mapping[str, np.ndarray],
    where: str,
    run_dir: RunDir,
    model: Any,
    *,
    step: int,
    source: str,
    random_seed: int = 0,
    initial_routers: Callable[[Any], dict[str, np.ndarray]] | None = None,
) -> None:
    """Writes an orbax checkpoint of ``model`` with parameters ``arrays`` (exported names;
    read from ``where``) at ``step`` into ``run_dir``, with a fresh optimizer state and RNG
    from ``random_seed``, its metadata naming ``source``; and ``router_init.npz`` from
    ``initial_routers(abstract per-layer params)`` when given. Nothing is written when the arrays do
    not fit.

    Raises:
      ExportError: the arrays do not fit the model, or the run has a checkpoint at ``step``.
    """
    run = configured.train_setup(model, PROBE_SHAPES, configured.run_context(), seed=random_seed)
    abstract = model.per_layer(run.abstract_state.params)
    host_params = model.own_layout(params_from_export(arrays, abstract, where))
    routers = initial_routers(abstract) if initial_routers else {}
    run_dir.check_writable()  # only once the arrays fit the model
    params = jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
        host_params,
        run.shardings.params,
    )
    with jax.set_mesh(run.ctx.mesh):
        opt_state = jax.jit(run.tx.init, out_shardings=run.shardings.opt_state)(params)
    rng = jax.random.split(jax.random.PRNGKey(random_seed))[1]  # as a fresh run's
    state = train_state.TrainState(
        step=jax.device_put(np.int32(step), run.shardings.step),
        params=params,
        opt_state=opt_state,
        rng=jax.device_put(rng, run.shardings.rng),
    )
    ckpt = checkpoints.Checkpointer(run_dir, async_save=False)
    try:
        if step in ckpt.all_steps():
            raise ExportError(f"{run_dir} already has a checkpoint at step {step}")
        ckpt.save(
            state,
            {
                "data_iterators": [],
                "random_seed": random_seed,
                "imported_from": storage.normalize(source),
            },
            force=True,
        )
        ckpt.wait_until_finished()
    finally:
        ckpt.close()
    router_init.write(run_dir, routers)


def _run_config_for_import(config_path: str, run_dir: RunDir) -> str:
    """The export's ``config.gin`` (at ``config_path``, as ``run_config.checked_config`` gave
    it: in the new form) with ``MODEL_DIR`` pointing at the new run directory."""
    text = storage.read_text(config_path)
    return re.sub(r"(?m)^MODEL_DIR = .*$", f"MODEL_DIR = {run_dir.path!r}", text)


def with_vocabulary_path(config_text: str, path: str) -> str:
    """``config_text`` with ``vocab.get_vocabulary.path`` bound to ``path`` (replacing the
    binding it has, or added)."""
    binding = f"vocab.get_vocabulary.path = {path!r}"
    text, found = re.subn(r"(?m)^vocab\.get_vocabulary\.path = .*$", binding, config_text)
    return text if found else f"{config_text.rstrip()}\n{binding}\n"


def _source_run(export_dir: str) -> str | None:
    """The run directory an export was written from (its ``config.json``), if it says."""

    path = storage.join(export_dir, CONFIG_JSON)
    with contextlib.suppress(OSError, ValueError):  # read_export names what is wrong
        source = json.loads(storage.read_text(path)).get("source_checkpoint")
        return RunDir.of_checkpoint(source)[0].path if isinstance(source, str) else None
    return None


def _import(args) -> int:
    check_target(args.model_dir, "--model_dir", args.overwrite, _source_run(args.export))
    run_dir = RunDir(args.model_dir)
    own_run = holds_saved_run(run_dir)  # the run exported: its config.gin stays as it is
    distributed.initialize(args)
    exported_gin = run_config.checked_config(  # perhaps downloaded: checked
        storage.join(args.export, CONFIG_GIN), args
    )
    use_export_config = not args.gin_file and exported_gin is not None
    # the model is the export's config.gin alone: config.json must describe that network
    export_model_only = use_export_config and not (args.gin_dot_bindings or args.gin_bindings)
    if not args.gin_file and not use_export_config:
        raise ExportError(
            f"--export={args.export}: no {CONFIG_GIN} there; pass the model's gin "
            "files with --gin_file"
        )
    config_text = None
    if use_export_config and exported_gin is not None:
        config_text = _run_config_for_import(exported_gin, run_dir)
        args.gin_file = [exported_gin]
    args.gin_file = [str(gin_text.REPO_GIN_DIR / "runs/export.gin"), *args.gin_file]
    exported_vocab = storage.join(args.export, VOCAB_FILE)
    listed = listed_files(read_export_config(args.export))
    has_vocab = VOCAB_FILE in listed
    if has_vocab:  # the export's copy, not the path of the machine that exported it
        args.gin_bindings = [*args.gin_bindings, f"vocab.get_vocabulary.path = {exported_vocab!r}"]
    gin_utils.parse_gin(args)
    spec = (  # read before anything is written
        _imported_spec(args.export, run_dir, has_vocab)
        if export_model_only and RUN_SPEC_FILE in listed
        else None
    )
    with _importing(run_dir, args.overwrite):
        step = import_export(args.export, run_dir, own_config=export_model_only)
        if jax.process_index() == 0 and not own_run:
            text = config_text if config_text is not None else gin_utils.operative_config()
            if has_vocab:
                copy = run_dir.vocabulary_file
                storage.write_bytes(copy, storage.read_bytes(exported_vocab))
                text = with_vocabulary_path(text, copy)
            storage.write_text(run_dir.config_file, text)
            if spec is not None:
                storage.write_text(run_dir.spec_file, spec)
    return step


def _imported_spec(export_dir: str, run_dir: RunDir, has_vocab: bool) -> str:
    """The text of the export's ``run.json`` (the spec of the run it was exported from, as
    of the exported step) as ``run_dir``'s spec: its vocabulary's path the run's copy when
    ``has_vocab``.

    Raises:
      InputFileError: naming the export's ``run.json`` when it is no run's spec.
    """
    recorded = run_record.read_spec(storage.join(export_dir, RUN_SPEC_FILE))
    vocabulary = recorded["model"].get("vocabulary")
    if has_vocab and isinstance(vocabulary, dict):
        vocabulary["path"] = run_dir.vocabulary_file
    return json.dumps(recorded, indent=1) + "\n"


@contextlib.contextmanager
def _importing(run_dir: RunDir, overwrite: bool) -> Iterator[None]:
    """Holds ``run_dir``'s lock while an import writes it (no trainer writes the run
    meanwhile), after removing an interrupted import's checkpoints (``overwrite``: decided
    under the lock); on failure removes the run directory the import created if it is
    still empty (the lock's folder, refused before any write)."""
    created = not run_dir.exists()
    try:
        with run_lock.hold(run_dir):
            if overwrite and not holds_saved_run(run_dir):
                storage.rmtree(run_dir.checkpoints_dir)  # an interrupted import's
            yield
    except Exception:
        if created and jax.process_index() == 0 and not storage.listdir(run_dir.path):
            storage.rmtree(run_dir.path)
        raise


# The data macros a trained run's config has and an imported one gets (the evaluation's
# defaults, gin/runs/eval.gin), so that eval and analyze find them; --gin.NAME=... at import
# or later overrides them.
_HF_RUN_DATA = {
    "MIXTURE_OR_TASK_NAME": "'mc4_span_corruption'",
    "TASK_FEATURE_LENGTHS": "{'inputs': 512, 'targets': 114}",
    "BATCH_SIZE": "32",
    "USE_CACHED_TASKS": "False",
    "MIXTURE_OR_TASK_MODULE": "None",
}


def _import_hf(args) -> int:
    """`moe-jax import --hf=DIR`: the folder's network as a generated gin config (with
    ``--gin_file`` / ``--gin.`` overrides), its weights as step 0, its ``spiece.model`` as
    the run's vocabulary; the run's ``config.gin`` is the operative config."""
    check_target(args.model_dir, "--model_dir", args.overwrite)
    folder = hf.read_folder(args.hf)
    network = hf.t5_config(folder)
    arrays = hf.to_export_arrays(folder, network)  # refuses a missing tensor or shape first
    run_dir = RunDir(args.model_dir)
    distributed.initialize(args)
    generated = storage.join(tempfile.mkdtemp(prefix="moe_jax_hf_"), CONFIG_GIN)
    storage.write_text(generated, hf.gin_config(network, args.hf))
    args.gin_file = [str(gin_text.REPO_GIN_DIR / "runs/export.gin"), generated, *args.gin_file]
    if folder.spiece:
        extra_ids = 0 if hf.architecture(folder.config, args.hf).startswith("MT5") else 100
        args.gin_bindings = [
            "vocab.get_vocabulary.kind = 'sentencepiece'",
            f"vocab.get_vocabulary.extra_ids = {extra_ids}",
            f"vocab.get_vocabulary.path = {folder.spiece!r}",
            *args.gin_bindings,
        ]
    else:
        print(
            f"[moe-jax] {args.hf} has no {hf.SPIECE}: the run tokenizes with the gin config's "
            "vocabulary (--gin.vocab.get_vocabulary.kind=..., default: the embedded one)",
            file=sys.stderr,
            flush=True,
        )
    gin_utils.parse_gin(args)
    # the vocabulary and data are read on first use: the operative config leaves them out
    kept = [
        b
        for b in (*args.gin_bindings, *args.gin_dot_bindings)
        if b.startswith(("vocab.get_vocabulary.", *(f"{m} =" for m in _HF_RUN_DATA)))
    ]
    data = [f"{name} = {value}" for name, value in _HF_RUN_DATA.items()]
    with _importing(run_dir, args.overwrite):
        import_arrays(arrays, args.hf, run_dir, args.hf)
        if jax.process_index() == 0:
            text = "\n".join([gin_utils.operative_config().rstrip(), *data, *kept, ""])
            if folder.spiece:
                storage.write_bytes(run_dir.vocabulary_file, storage.read_bytes(folder.spiece))
                text = with_vocabulary_path(text, run_dir.vocabulary_file)
            storage.write_text(run_dir.config_file, text)
    return 0


def main(argv: list[str] | None = None) -> int:

    parser = builders.build_parser("moe-jax import", "read an export into a new run directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--export", type=storage.normalize, metavar="DIR", help="an export directory"
    )
    source.add_argument(
        "--hf",
        type=storage.normalize,
        metavar="DIR",
        help="a Hugging Face T5 / mT5 / Switch Transformers model folder (config.json, "
        "model.safetensors, spiece.model): its network and weights as step 0",
    )
    parser.add_argument(
        "--model_dir",
        type=storage.normalize,
        required=True,
        metavar="DIR",
        help="the new run directory (new or empty; or the run exported, with --overwrite)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --model_dir that holds no other run",
    )
    args = gin_flags.parse_flags(parser, sys.argv[1:] if argv is None else argv)
    step = _import_hf(args) if args.hf else _import(args)
    print(
        f"[moe-jax] imported {args.hf or args.export} as step {step} of {args.model_dir}",
        file=sys.stderr,
        flush=True,
    )
    return 0
