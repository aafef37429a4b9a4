"""`moe-jax export` / `moe-jax import`: a checkpoint to safetensors and back.

    moe-jax export --checkpoint=MODEL_DIR[/STEP] --out=EXPORT_DIR [--gin_file=...]
    moe-jax import --export=EXPORT_DIR --model_dir=NEW_MODEL_DIR [--gin_file=...]

An export directory holds:

* ``model.safetensors``: every parameter as one float array under a stable name close to
  T5X/Flaxformer's (``encoder/layers_0/attention/query/kernel``,
  ``decoder/layers_1/mlp/expert/wi_0/kernel``, ``token_embedder/embedding``; the map is
  :data:`NAME_RULES`, documented in docs/training.md). Attention kernels are stored as
  T5X stores them, 2-D: query/key/value ``[d_model, heads * head_dim]``, out
  ``[heads * head_dim, d_model]``; expert kernels ``[experts, d_in, d_out]``.
* ``router_init.safetensors`` (when the run kept them: ``MODEL_DIR/router_init.npz``,
  written at step 0 by `moe-jax train`): the routers' *initial* weights under the same
  exported names as in ``model.safetensors``, so that an imported run reports how far its
  routers drifted from initialisation (`moe-jax eval`) and can be evaluated with them
  (`moe-jax analyze`'s ``init`` router). Not part of the model.
* ``config.json``: the architecture (``T5Config``, with the encoder's and the decoder's
  ``MoeConfig``), the router mode (learned/frozen), the vocabulary, the source checkpoint and step,
  and for every array its shape, dtype and moe-jax parameter name.
* ``config.gin``: the run's gin config (its ``MODEL_DIR/config.gin``), so that `import`
  rebuilds the same model without any gin file.
* ``vocabulary.model`` (SentencePiece vocabularies): a copy of the model file the run
  tokenized with, so that an export needs nothing outside its folder; `import` copies it
  into the new run directory and binds ``vocab.get_vocabulary.path`` to that copy.

`import` reads an export into a new run directory: an orbax checkpoint at the export's step
(parameters as exported, a fresh optimizer state) and the run's ``config.gin``, so that
`eval`, `infer`, `analyze` and `train` (fine-tuning) use it like any run, and
``MODEL_DIR/router_init.npz`` from ``router_init.safetensors``. The round trip gives
bit-identical parameters and initial routers. Gin: ``runs/export.gin`` (the model of both commands)
is added to the run's config; ``--gin_file`` / ``--gin.NAME=VALUE`` override as elsewhere.

Neither writes over another run: ``--out`` / ``--model_dir`` must be new or empty
(``--overwrite``: a non-empty one), and never a run directory (``checkpoints/`` or a
``LOCK``), except for `import` into the very run the export came from (with ``--overwrite``;
its ``config.gin`` is kept). The config an export or run directory brings names no code to
import that the command line does not (:func:`~moe_jax.runtime.config_gate.check_run_config`).
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

from moe_jax import param_paths, storage
from moe_jax.errors import UserError
from moe_jax.interop import hf
from moe_jax.models import layer_stacking
from moe_jax.moe import freeze
from moe_jax.runtime import (
    builders,
    checkpoints,
    configured,
    distributed,
    gin_flags,
    gin_text,
    gin_utils,
    output_lock,
    router_init,
    run_config,
    run_lock,
    train_state,
)
from moe_jax.runtime.checkpoint_checks import CheckpointMismatchError
from moe_jax.runtime.run_dir import RunDir

WEIGHTS_FILE = "model.safetensors"
ROUTER_INIT_FILE = "router_init.safetensors"
CONFIG_JSON = "config.json"
CONFIG_GIN = "config.gin"
VOCAB_FILE = "vocabulary.model"
FORMAT = "moe-jax-export"
# 2: the MoE layers' configs inside ``t5_config`` (``moe``, ``decoder_moe``); 1 wrote
# ``routing.moe_layer`` (MoeLayer's gin fields). Import reads either (from ``config.gin``).
FORMAT_VERSION = 2
# Shapes the model is built with to list its parameters (parameter shapes do not depend on them).
_PROBE_SHAPES = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}

# (moe-jax parameter name pattern, exported name); first match wins. Names that match no
# rule are exported unchanged.
NAME_RULES: tuple[tuple[str, str], ...] = (
    (
        r"encoder/layers_(\d+)/self_attention/pre_norm/scale",
        r"encoder/layers_\1/pre_attention_layer_norm/scale",
    ),
    (
        r"encoder/layers_(\d+)/self_attention/attention/(query|key|value|out)",
        r"encoder/layers_\1/attention/\2/kernel",
    ),
    (
        r"decoder/layers_(\d+)/self_attention/pre_norm/scale",
        r"decoder/layers_\1/pre_self_attention_layer_norm/scale",
    ),
    (
        r"decoder/layers_(\d+)/self_attention/attention/(query|key|value|out)",
        r"decoder/layers_\1/self_attention/\2/kernel",
    ),
    (
        r"decoder/layers_(\d+)/cross_attention/pre_norm/scale",
        r"decoder/layers_\1/pre_cross_attention_layer_norm/scale",
    ),
    (
        r"decoder/layers_(\d+)/cross_attention/attention/(query|key|value|out)",
        r"decoder/layers_\1/encoder_decoder_attention/\2/kernel",
    ),
    (
        r"(encoder|decoder)/layers_(\d+)/ffn/pre_norm/scale",
        r"\1/layers_\2/pre_mlp_layer_norm/scale",
    ),
    (r"(encoder|decoder)/layers_(\d+)/ffn/mlp/(wi|wi_\d+|wo)", r"\1/layers_\2/mlp/\3/kernel"),
    (
        r"(encoder|decoder)/layers_(\d+)/ffn/moe/expert/(wi|wi_\d+|wo)",
        r"\1/layers_\2/mlp/expert/\3/kernel",
    ),
    (
        r"(encoder|decoder)/layers_(\d+)/ffn/moe/router/weights/w",
        r"\1/layers_\2/mlp/router/router_weights/w/kernel",
    ),
    (
        r"(encoder|decoder)/layers_(\d+)/ffn/moe/router/(\w+)/w",
        r"\1/layers_\2/mlp/router/\3/w/kernel",
    ),
    (r"(encoder|decoder)/layers_(\d+)/ffn/moe/(.+)", r"\1/layers_\2/mlp/\3"),
    (r"encoder/final_norm/scale", r"encoder/encoder_norm/scale"),
    (r"decoder/final_norm/scale", r"decoder/decoder_norm/scale"),
    (r"decoder/logits_dense", r"decoder/logits_dense/kernel"),
)
_ATTENTION = re.compile(
    r"/(attention|self_attention|encoder_decoder_attention)/(query|key|value|out)/kernel$"
)


class ExportError(UserError, ValueError):
    """An export cannot be written or read; the message names the file, array or checkpoint."""


def export_name(name: str) -> str:
    """The exported name of moe-jax parameter ``name`` (``encoder/layers_0/...``)."""
    for pattern, template in NAME_RULES:
        if re.fullmatch(pattern, name):
            return re.sub(f"^{pattern}$", template, name)
    return name


def name_map(param_names: list[str]) -> dict[str, str]:
    """``{moe-jax name: exported name}``; refuses two parameters mapped to one name."""
    mapping = {name: export_name(name) for name in param_names}
    seen: dict[str, str] = {}
    for name, exported in mapping.items():
        if exported in seen:
            raise ExportError(
                f"parameters {seen[exported]!r} and {name!r} would both be exported as {exported!r}"
            )
        seen[exported] = name
    return mapping


def export_shape(exported: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """T5X's layout of an array of ``shape``: attention query/key/value ``[d, h, hd] ->
    [d, h*hd]``, out ``[h, hd, d] -> [h*hd, d]``; every other shape unchanged."""
    match = _ATTENTION.search(exported)
    if match is None or len(shape) != 3:
        return tuple(shape)
    if match.group(2) == "out":
        return (shape[0] * shape[1], shape[2])
    return (shape[0], shape[1] * shape[2])


def arrays_for_export(params) -> dict[str, np.ndarray]:
    """``{exported name: host array in T5X layout}`` of a parameter tree (or of a flat
    ``{moe-jax name: array}`` dict), one array per layer (a scanned model's stacked layers
    split). Arrays sharded over several processes are gathered whole onto every process (a
    collective: every process must call this)."""
    from jax.experimental import multihost_utils

    def host(leaf) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    flat = layer_stacking.unstack_names(
        {name: host(leaf) for name, leaf in param_paths.named_leaves(params).items()}
    )
    mapping = name_map(list(flat))
    return {
        mapping[name]: leaf.reshape(export_shape(mapping[name], leaf.shape))
        for name, leaf in flat.items()
    }


def params_from_export(arrays: Mapping[str, np.ndarray], abstract_params, where: str):
    """The parameter tree of ``abstract_params``'s structure filled from exported
    ``arrays``, each reshaped back to the model's layout (a scanned model's layers stacked).

    Raises:
      ExportError: naming missing or extra arrays, or an array whose shape differs from the
        one the gin config's model expects (both shapes named).
    """
    per_layer = layer_stacking.unstack_layers(abstract_params)
    flat = param_paths.named_leaves(per_layer)
    mapping = name_map(list(flat))
    missing = sorted(mapping[n] for n in flat if mapping[n] not in arrays)
    extra = sorted(set(arrays) - set(mapping.values()))
    if missing or extra:
        raise ExportError(
            f"{where} does not hold the gin config's model: "
            + (f"arrays the model needs but the export lacks: {missing[:8]}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"arrays the model does not have: {extra[:8]}" if extra else "")
        )
    leaves = []
    for name, leaf in flat.items():
        exported = mapping[name]
        array = arrays[exported]
        expected = export_shape(exported, leaf.shape)
        if array.shape != expected:
            raise ExportError(
                f"{where}: array {exported!r} has shape {list(array.shape)} in the export but "
                f"{list(expected)} in the gin config's model (moe-jax parameter {name})"
            )
        leaves.append(array.reshape(leaf.shape).astype(leaf.dtype, copy=False))
    filled = jax.tree.unflatten(jax.tree.structure(per_layer), leaves)
    return layer_stacking.stack_layers(filled, layer_stacking.tree_layout(abstract_params))


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def architecture(model) -> dict[str, Any]:
    """The network's ``T5Config`` (``T5Config.to_dict``: its MoE configs included; read back
    by ``T5Config.from_dict``) and the vocabulary it was trained with."""
    vocabulary = getattr(model.vocabulary, "resolved", model.vocabulary)
    return {
        "t5_config": _jsonable(model.module.config.to_dict()),
        "vocabulary": {
            "size": model.vocab_size,
            "eos_id": model.eos_id,
            "type": type(vocabulary).__name__,
            "file": VOCAB_FILE if vocabulary_file(model) else None,
        },
    }


def vocabulary_file(model) -> str | None:
    """The SentencePiece model file of ``model``'s vocabulary; None for one without a file
    (bytes)."""
    vocabulary = getattr(model.vocabulary, "resolved", model.vocabulary)
    return getattr(vocabulary, "sentencepiece_model_file", None)


@gin.configurable(module="export_script", denylist=["checkpoint_path", "out_dir", "config_gin"])
def export_checkpoint(
    checkpoint_path: str, out_dir: str, config_gin: str | None = None, *, model: Any = gin.REQUIRED
) -> dict[str, Any]:
    """Writes the export of ``checkpoint_path`` (``MODEL_DIR``, ``MODEL_DIR/STEP``) to
    ``out_dir``; returns the ``config.json`` content.

    Multi-host: every process restores its shards on the mesh of the gin config
    (``partitioning.make_mesh``, as `moe-jax eval` does), each array is then gathered whole
    onto every process (host memory: the whole model per process), and only process 0
    writes ``out_dir`` (which need not exist on the other hosts).

    Raises:
      ExportError: the checkpoint cannot be read (names it and the cause).
    """
    params, step = _restore_for_export(checkpoint_path, model)
    arrays = arrays_for_export(params)
    per_layer = [
        n for name in param_paths.named_leaves(params) for n in layer_stacking.layer_names(name)
    ]
    names = {v: k for k, v in name_map(per_layer).items()}
    initial = router_init.load(RunDir.of_checkpoint(checkpoint_path)[0])
    exported_routers = arrays_for_export(initial) if initial else {}
    config = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "source_checkpoint": storage.normalize(checkpoint_path),
        "step": step,
        **architecture(model),
        "routing": {"router_mode": freeze.router_mode()},
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
    }
    if jax.process_index() == 0:
        _write_export(out_dir, config, arrays, exported_routers, model, config_gin)
    return config


def _restore_for_export(checkpoint_path: str, model: Any) -> tuple[Any, int]:
    """The parameters of ``checkpoint_path`` on the gin config's mesh, and their step.

    Raises:
      ExportError: the checkpoint cannot be read (names it and the cause).
    """
    ctx = configured.run_context()
    target = train_state.abstract_with_shardings(
        builders.abstract_params(model, _PROBE_SHAPES),
        train_state.param_shardings(model, _PROBE_SHAPES, ctx.mesh, ctx.rules),
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
    config_gin: str | None,
) -> None:
    """Writes the export's files to ``out_dir`` (weights, initial routers, vocabulary,
    ``config.json``, ``config.gin``) and removes an earlier export's files it no longer has."""
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
    for stale in {ROUTER_INIT_FILE, VOCAB_FILE} - set(listed_files(config)):
        storage.remove(storage.join(out_dir, stale))  # an earlier export's, overwritten


def listed_files(config: Mapping[str, Any]) -> list[str]:
    """The files an export's ``config.json`` lists beside ``model.safetensors``,
    ``config.json`` and ``config.gin``: its initial routers and vocabulary, when it has them.
    ``import`` reads only these, whatever else the directory holds."""
    return [
        name
        for name, entry in (
            (ROUTER_INIT_FILE, config.get("router_init")),
            (VOCAB_FILE, (config.get("vocabulary") or {}).get("file")),
        )
        if entry
    ]


def safetensors_bytes(arrays: Mapping[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file's bytes (written whole through :mod:`moe_jax.storage`)."""
    from safetensors.numpy import save

    return save(dict(arrays), metadata=metadata)


def safetensors_arrays(path: str) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file (local or ``gs://``)."""
    return safetensors_load(storage.read_bytes(path))


def safetensors_load(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file's bytes."""
    from safetensors.numpy import load

    return load(data)


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes (its JSON header, after the
    header's 8-byte little-endian length); empty when it has none."""
    size = int.from_bytes(data[:8], "little")
    with contextlib.suppress(ValueError):
        header = json.loads(data[8 : 8 + size])
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        return dict(metadata) if isinstance(metadata, dict) else {}
    return {}


def read_router_init(
    export_dir: str, config: Mapping[str, Any], abstract_params
) -> dict[str, np.ndarray]:
    """``{moe-jax router parameter name: initial weights}`` from the export's
    ``router_init.safetensors``; empty when its ``config`` lists none (:func:`listed_files`).

    Raises:
      ExportError: the file is unreadable, or its arrays are not the routers of the gin
        config's model (names or shapes, as for the parameters).
    """
    from safetensors import SafetensorError

    path = storage.join(export_dir, ROUTER_INIT_FILE)
    if ROUTER_INIT_FILE not in listed_files(config):
        return {}
    try:
        arrays = safetensors_arrays(path)
    except (SafetensorError, OSError) as err:
        raise ExportError(f"--export={export_dir}: cannot read {path}: {err}") from None
    routers = param_paths.router_params(layer_stacking.unstack_layers(abstract_params))
    return params_from_export(arrays, routers, path)


def read_export(export_dir: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and ``config.json`` of an export directory.

    Raises:
      ExportError: naming the file that is missing or not an export.
    """
    from safetensors import SafetensorError

    config = read_export_config(export_dir)
    weights = storage.join(export_dir, WEIGHTS_FILE)
    if not storage.exists(weights):
        raise ExportError(
            f"--export={export_dir}: {weights} does not exist (not an export directory?)"
        )
    try:
        raw = storage.read_bytes(weights)
        arrays = safetensors_load(raw)
    except (SafetensorError, OSError) as err:
        raise ExportError(f"--export={export_dir}: cannot read {err}") from None
    check_export_arrays(arrays, safetensors_metadata(raw), config, weights)
    return arrays, config


def check_export_arrays(
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str],
    config: Mapping[str, Any],
    path: str,
) -> None:
    """Refuses an export whose weights file (``path``) is not what its ``config.json``
    declares (array names, shapes, dtypes; the step in the file's metadata) or holds NaN /
    Inf: every reader of the imported run would call its step unreadable.

    Raises:
      ExportError: naming the file, the array or field, and both values.
    """
    declared = config.get("arrays")
    if isinstance(declared, dict):
        missing, extra = sorted(set(declared) - set(arrays)), sorted(set(arrays) - set(declared))
        if missing or extra:
            raise ExportError(
                f"{path} does not hold the arrays its {CONFIG_JSON} lists: "
                f"listed but absent {missing[:4]}, present but unlisted {extra[:4]}"
            )
        for name, array in arrays.items():
            entry = declared[name]
            found = {"shape": list(array.shape), "dtype": str(array.dtype)}
            for key, value in found.items():
                if key in entry and entry[key] != value:
                    raise ExportError(
                        f"{path}: array {name!r} has {key} {value} but {CONFIG_JSON} declares "
                        f"{entry[key]}"
                    )
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            bad = int(array.size - np.count_nonzero(np.isfinite(array)))
            raise ExportError(
                f"{path}: array {name!r} holds NaN or Inf ({bad} of {array.size} values); "
                "refusing to import it"
            )
    if "step" in metadata and str(config.get("step")) != metadata["step"]:
        raise ExportError(
            f"{path} holds step {metadata['step']} but {CONFIG_JSON} says step "
            f"{config.get('step')} (an interrupted export --overwrite?); export again"
        )


def check_architecture(config: Mapping[str, Any], model: Any, path: str) -> None:
    """Refuses an export whose ``config.json`` (at ``path``) describes another network than
    its ``config.gin`` builds (``T5Config`` fields named with both values).

    Raises:
      ExportError: naming the file and the differing fields.
    """
    declared = config.get("t5_config")
    if config.get("version") != FORMAT_VERSION or not isinstance(declared, dict):
        return
    declared, built = _flat(declared), _flat(_jsonable(model.module.config.to_dict()))
    differ = [k for k in sorted(set(declared) | set(built)) if declared.get(k) != built.get(k)]
    if differ:
        shown = "; ".join(
            f"{k}: {declared.get(k)!r} in {CONFIG_JSON}, {built.get(k)!r} in config.gin"
            for k in differ[:3]
        )
        raise ExportError(
            f"{path} describes another network than the export's config.gin ({shown}); "
            "export the run again"
        )


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"moe.router.type": ...}`` of a nested config dict."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_export_config(export_dir: str) -> dict[str, Any]:
    """An export directory's ``config.json``.

    Raises:
      ExportError: naming the file when it is missing, unreadable or not an export's.
    """
    path = storage.join(export_dir, CONFIG_JSON)
    if not storage.exists(path):
        raise ExportError(
            f"--export={export_dir}: {path} does not exist (not an export directory?)"
        )
    try:
        config = json.loads(storage.read_text(path))
    except (json.JSONDecodeError, OSError) as err:
        raise ExportError(f"--export={export_dir}: cannot read {err}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else None
        raise ExportError(f"{path} is not a {FORMAT} config (format {found!r})")
    return config


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
    ``initial_routers(abstract params)`` when given. Nothing is written when the arrays do
    not fit.

    Raises:
      ExportError: the arrays do not fit the model, or the run has a checkpoint at ``step``.
    """
    run = configured.train_setup(model, _PROBE_SHAPES, configured.run_context(), seed=random_seed)
    host_params = params_from_export(arrays, run.abstract_state.params, where)
    routers = initial_routers(run.abstract_state.params) if initial_routers else {}
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


def check_target(directory: str, flag: str, overwrite: bool, own_run: str | None = None) -> None:
    """Refuses to write into ``directory`` (given as ``flag``) when it holds a run other than
    ``own_run`` (even with ``overwrite``), or when it is not empty and ``overwrite`` is False.

    Raises:
      ExportError: naming the flag, the directory and what it holds.
    """
    entries = [e for e in storage.listdir(directory) if e != output_lock.WRITING_FILE]
    if not entries:
        return
    if _holds_saved_run(RunDir(directory)) and storage.normalize(directory) != own_run:
        raise ExportError(
            f"{flag}={directory} holds another run ({', '.join(entries[:4])}); "
            "refusing to write into it, even with --overwrite: pick a new directory"
        )
    if not overwrite:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        if RunDir(directory).holds_run():
            shown += "; an interrupted import's: no config.gin, no metrics.jsonl"
        raise ExportError(
            f"{flag}={directory} is not empty ({shown}); pass --overwrite to write into it"
        )


def _holds_saved_run(run_dir: RunDir) -> bool:
    """``run_dir`` holds a run (``checkpoints/`` or a ``LOCK``) that wrote a ``config.gin``,
    a ``metrics.jsonl`` or set a step aside (`moe-jax train` writes its config first). A
    ``LOCK``, ``checkpoints/`` and temporary files without them are what an interrupted
    `moe-jax import` leaves (it writes ``config.gin`` last; a live holder of the lock is
    refused when it is taken)."""
    return run_dir.holds_run() and (
        storage.exists(run_dir.config_file)
        or storage.exists(run_dir.metrics_file)
        or bool(run_dir.set_aside_steps())
    )


def _export(args) -> dict[str, Any]:
    with output_lock.writing(args.out):  # no other export checks or writes it meanwhile
        check_target(args.out, "--out", args.overwrite)  # never into a run directory
        return _export_checked(args)


def _export_checked(args) -> dict[str, Any]:
    distributed.initialize(args)
    run_files = run_config.run_gin_files(
        args, args.checkpoint, ["runs/export.gin"], command="moe-jax export"
    )
    config = run_config.checkpoint_config(args.checkpoint, args)
    config = config if config in run_files else None  # copied into the export as it is
    args.gin_file = run_files
    gin_utils.parse_gin(args)
    if args.format == "hf":
        return export_hf(args.checkpoint, args.out)
    return export_checkpoint(args.checkpoint, args.out, config)


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


def export_main(argv: list[str] | None = None) -> int:

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
    own_run = _holds_saved_run(run_dir)  # the run exported: its config.gin stays as it is
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
    has_vocab = VOCAB_FILE in listed_files(read_export_config(args.export))
    if has_vocab:  # the export's copy, not the path of the machine that exported it
        args.gin_bindings = [*args.gin_bindings, f"vocab.get_vocabulary.path = {exported_vocab!r}"]
    gin_utils.parse_gin(args)
    with _importing(run_dir, args.overwrite):
        step = import_export(args.export, run_dir, own_config=export_model_only)
        if jax.process_index() == 0 and not own_run:
            text = config_text if config_text is not None else gin_utils.operative_config()
            if has_vocab:
                copy = run_dir.vocabulary_file
                storage.write_bytes(copy, storage.read_bytes(exported_vocab))
                text = with_vocabulary_path(text, copy)
            storage.write_text(run_dir.config_file, text)
    return step


@contextlib.contextmanager
def _importing(run_dir: RunDir, overwrite: bool) -> Iterator[None]:
    """Holds ``run_dir``'s lock while an import writes it (no trainer writes the run
    meanwhile), after removing an interrupted import's checkpoints (``overwrite``: decided
    under the lock); on failure removes the run directory the import created if it is
    still empty (the lock's folder, refused before any write)."""
    created = not run_dir.exists()
    try:
        with run_lock.hold(run_dir):
            if overwrite and not _holds_saved_run(run_dir):
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


def import_main(argv: list[str] | None = None) -> int:

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
