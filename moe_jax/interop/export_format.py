"""The export format: a checkpoint's parameters as safetensors under stable names, with a
JSON config, and what reads and checks it (:mod:`moe_jax.commands.export` writes one,
:mod:`moe_jax.commands.import_run` reads one into a run directory).

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

Names and layouts: :func:`arrays_for_export` (a parameter tree to exported arrays) and
:func:`params_from_export` (back, checked against the model's shapes). Files:
:func:`safetensors_bytes` / :func:`safetensors_arrays`, :func:`read_export` (weights and
``config.json``, checked by :func:`check_export_arrays`), :func:`read_router_init`. Neither
command writes over another run (:func:`check_target`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from moe_jax import param_paths, storage
from moe_jax.errors import UserError
from moe_jax.runtime import output_lock
from moe_jax.runtime.run_dir import RunDir

WEIGHTS_FILE = "model.safetensors"
ROUTER_INIT_FILE = "router_init.safetensors"
CONFIG_JSON = "config.json"
CONFIG_GIN = "config.gin"
VOCAB_FILE = "vocabulary.model"
RUN_SPEC_FILE = "run.json"
FORMAT = "moe-jax-export"
# 2: the MoE layers' configs inside ``t5_config`` (``moe``, ``decoder_moe``); 1 wrote
# ``routing.moe_layer`` (MoeLayer's gin fields). Import reads either (from ``config.gin``).
FORMAT_VERSION = 2
# Shapes the model is built with to list its parameters (parameter shapes do not depend on them).
PROBE_SHAPES = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 8)}

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
    """``{exported name: host array in T5X layout}`` of a per-layer parameter tree
    (``Model.per_layer``; or a flat ``{moe-jax name: array}`` dict of per-layer names).
    Arrays sharded over several processes are gathered whole onto every process (a
    collective: every process must call this)."""
    from jax.experimental import multihost_utils

    def host(leaf) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    flat = {name: host(leaf) for name, leaf in param_paths.named_leaves(params).items()}
    mapping = name_map(list(flat))
    return {
        mapping[name]: leaf.reshape(export_shape(mapping[name], leaf.shape))
        for name, leaf in flat.items()
    }


def params_from_export(arrays: Mapping[str, np.ndarray], abstract_params, where: str):
    """The per-layer parameter tree of ``abstract_params``'s structure (per layer,
    ``Model.per_layer``) filled from exported ``arrays``, each reshaped back from T5X's
    layout to the model's (host arrays).

    Raises:
      ExportError: naming missing or extra arrays, or an array whose shape differs from the
        one the gin config's model expects (both shapes named).
    """
    flat = param_paths.named_leaves(abstract_params)
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
    return jax.tree.unflatten(jax.tree.structure(abstract_params), leaves)


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


def listed_files(config: Mapping[str, Any]) -> list[str]:
    """The files an export's ``config.json`` lists beside ``model.safetensors``,
    ``config.json`` and ``config.gin``: its initial routers, vocabulary and run spec, when
    it has them. ``import`` reads only these, whatever else the directory holds."""
    return [
        name
        for name, entry in (
            (ROUTER_INIT_FILE, config.get("router_init")),
            (VOCAB_FILE, (config.get("vocabulary") or {}).get("file")),
            (RUN_SPEC_FILE, config.get("run_spec")),
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
    """``{per-layer moe-jax router parameter name: initial weights}`` from the export's
    ``router_init.safetensors``; empty when its ``config`` lists none (:func:`listed_files`).
    ``abstract_params``: the model's parameters per layer (``Model.per_layer``).

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
    routers = param_paths.router_params(abstract_params)
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


def check_target(directory: str, flag: str, overwrite: bool, own_run: str | None = None) -> None:
    """Refuses to write into ``directory`` (given as ``flag``) when it holds a run other than
    ``own_run`` (even with ``overwrite``), or when it is not empty and ``overwrite`` is False.

    Raises:
      ExportError: naming the flag, the directory and what it holds.
    """
    entries = [e for e in storage.listdir(directory) if e != output_lock.WRITING_FILE]
    if not entries:
        return
    if holds_saved_run(RunDir(directory)) and storage.normalize(directory) != own_run:
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


def holds_saved_run(run_dir: RunDir) -> bool:
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
