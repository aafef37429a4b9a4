"""Hugging Face T5 / mT5 / Switch Transformers checkpoints: their names, shapes and configs.

A Hugging Face model folder (``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, optionally ``spiece.model``) maps onto the network of
:class:`~moe_jax.models.t5.T5Config` one tensor to one array of the project's export
format (:mod:`moe_jax.interop.export_format`, T5X's layout), so that `moe-jax import --hf` and
`moe-jax export --format=hf` reuse the export's reading and writing of checkpoints:

Hugging Face tensors (``nn.Linear`` weights ``[out, in]``) -> export names (kernels
``[in, out]``, transposed):

* ``shared.weight`` -> ``token_embedder/embedding``; ``lm_head.weight`` (untied) ->
  ``decoder/logits_dense/kernel``;
* ``{s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight [buckets, heads]`` ->
  ``{s}/relpos_bias/rel_embedding [heads, buckets]``;
* ``{s}.block.{i}.layer.0.SelfAttention.{q,k,v,o}`` -> ``{s}/layers_{i}/attention/...``
  (decoder: ``self_attention``), ``decoder.block.{i}.layer.1.EncDecAttention.{q,k,v,o}``
  -> ``decoder/layers_{i}/encoder_decoder_attention/{query,key,value,out}/kernel``;
* ``{s}.block.{i}.layer.{f}.DenseReluDense.{wi_0,wi_1,wi,wo}`` (Switch: ``mlp.{wi,wo}``)
  -> ``{s}/layers_{i}/mlp/{wi_0,wi_1,wi,wo}/kernel``;
* Switch sparse layers: ``...mlp.experts.expert_{e}.{wi,wo}.weight`` stacked ->
  ``{s}/layers_{i}/mlp/expert/{wi,wo}/kernel [experts, in, out]``;
  ``...mlp.router.classifier.weight`` -> ``.../mlp/router/router_weights/w/kernel``,
  ``.../classifier.bias`` -> ``.../mlp/router/weights/b``;
* ``{s}.block.{i}.layer.{n}.layer_norm.weight`` -> ``{s}/layers_{i}/pre_..._layer_norm/scale``,
  ``{s}.final_layer_norm.weight`` -> ``{s}/{s}_norm/scale``.

(``{s}``: ``encoder`` or ``decoder``; ``{f}``: the feed-forward sublayer, 1 in the encoder
and 2 in the decoder.) Transposes are exact, so a round trip is bit for bit. Weights are
read with ``safetensors`` into NumPy (bfloat16 and float8 as ``ml_dtypes``' types,
:func:`load_safetensors`) and converted to float32: no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

import ml_dtypes
import numpy as np

from moe_jax import storage
from moe_jax.errors import UserError
from moe_jax.models.t5 import T5Config
from moe_jax.moe.config import ROUTER_CONFIGS, TopKRouterConfig

T5_ARCHITECTURES = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration")
SWITCH_ARCHITECTURE = "SwitchTransformersForConditionalGeneration"
ARCHITECTURES = (*T5_ARCHITECTURES, SWITCH_ARCHITECTURE)
CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SPIECE = "spiece.model"
# feed_forward_proj -> T5Config.mlp_activations
_T5_FFN = {"gated-gelu": ("gelu", "linear"), "relu": ("relu",)}
_FFN_NAMES = {("gelu", "linear"): ("wi_0", "wi_1", "wo"), ("relu",): ("wi", "wo")}
_ATTENTION = {"q": "query", "k": "key", "v": "value", "o": "out"}
# (tensor, the tied copy that stands for it when a file leaves the tensor out)
_ALIASES = (
    ("shared.weight", "encoder.embed_tokens.weight"),
    ("shared.weight", "decoder.embed_tokens.weight"),
)

Kind = Literal["copy", "transpose", "experts"]
# safetensors dtype -> NumPy dtype (``safetensors.numpy`` reads neither bfloat16 nor float8)
_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class HfError(UserError, ValueError):
    """A Hugging Face folder cannot be read, or a model cannot be written as one; the
    message names the file, tensor or option."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One exported array and the Hugging Face tensor(s) it is.

    Attributes:
      export: the export name (:mod:`moe_jax.interop.export_format`).
      hf: the Hugging Face tensor names (one per expert for ``experts``).
      kind: ``copy``; ``transpose`` (2-D); ``experts``: the experts' ``[out, in]`` weights
        transposed and stacked into ``[experts, in, out]``.
      shape: each Hugging Face tensor's shape.
    """

    export: str
    hf: tuple[str, ...]
    kind: Kind
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Folder:
    """A Hugging Face model folder, read.

    Attributes:
      path: the folder.
      config: its ``config.json``.
      arrays: ``{tensor name: array}`` of its safetensors file(s).
      spiece: the path of its ``spiece.model``, or None.
    """

    path: str
    config: dict[str, Any]
    arrays: dict[str, np.ndarray]
    spiece: str | None


def architecture(config: Mapping[str, Any], where: str) -> str:
    """The one supported architecture ``config.json`` names.

    Raises:
      HfError: naming the architecture when it is not one of :data:`ARCHITECTURES`.
    """
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise HfError(
            f"{where}: architectures={names} is not supported; moe-jax reads one of "
            f"{', '.join(ARCHITECTURES)}"
        )
    return str(names[0])


def load_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (its bytes) as a NumPy array of the file's dtype,
    bfloat16 (most released mT5 / Switch folders) and float8 as ``ml_dtypes``' types.

    Raises:
      HfError: ``where`` (the file) and why: the file is not safetensors, or a tensor's
        dtype (named) is not one of :data:`_DTYPES`.
    """
    from safetensors import SafetensorError, deserialize

    try:
        views = deserialize(data)
    except SafetensorError as err:
        raise HfError(f"{where}: {err}") from None
    arrays = {}
    for name, view in views:
        if view["dtype"] not in _DTYPES:
            raise HfError(
                f"{where}: tensor {name!r} has dtype {view['dtype']}; moe-jax reads "
                f"{', '.join(_DTYPES)}"
            )
        dtype = np.dtype(_DTYPES[view["dtype"]])
        arrays[name] = np.frombuffer(view["data"], dtype).reshape(view["shape"])
    return arrays


def read_folder(path: str) -> Folder:
    """``config.json``, every tensor (``model.safetensors``, or the shards a
    ``model.safetensors.index.json`` lists) and ``spiece.model`` of a model folder.

    Raises:
      HfError: naming the file that is missing or unreadable.
    """
    config_path = storage.join(path, CONFIG_JSON)
    if not storage.exists(config_path):
        raise HfError(f"--hf={path}: {config_path} does not exist (not a Hugging Face model?)")
    try:
        config = json.loads(storage.read_text(config_path))
    except (json.JSONDecodeError, OSError) as err:
        raise HfError(f"--hf={path}: cannot read {config_path}: {err}") from None
    index = storage.join(path, WEIGHTS_INDEX)
    if storage.exists(storage.join(path, WEIGHTS)):
        files = [WEIGHTS]
    elif storage.exists(index):
        try:
            files = sorted(set(json.loads(storage.read_text(index))["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, OSError) as err:
            raise HfError(f"--hf={path}: cannot read {index}: {err!r}") from None
    else:
        raise HfError(
            f"--hf={path}: neither {WEIGHTS} nor {WEIGHTS_INDEX} is there (only safetensors "
            "weights are read: convert a pytorch_model.bin with transformers first)"
        )
    arrays: dict[str, np.ndarray] = {}
    for name in files:
        file = storage.join(path, name)
        try:
            data = storage.read_bytes(file)
        except OSError as err:
            raise HfError(f"--hf={path}: cannot read {file}: {err}") from None
        arrays.update(load_safetensors(data, f"--hf={path}: cannot read {file}"))
    spiece = storage.join(path, SPIECE)
    return Folder(path, config, arrays, spiece if storage.exists(spiece) else None)


def _sparse_layers(config: Mapping[str, Any], stack: str) -> tuple[int, ...]:
    """A Switch stack's sparse layers as transformers places them (:func:`switch_rule`,
    from ``num_sparse_{stack}_layers``)."""
    return switch_rule(_depth(config, stack), int(config.get(f"num_sparse_{stack}_layers", 3)))


def switch_rule(depth: int, num_sparse: int) -> tuple[int, ...]:
    """Where transformers' Switch Transformers puts ``num_sparse`` sparse layers of
    ``depth``: layer ``i`` when ``i % step == 1`` (every layer when ``step == 1``), ``step =
    depth // num_sparse`` (``depth`` when ``num_sparse`` is 0, which still makes layer 1
    sparse)."""
    step = depth // num_sparse if num_sparse > 0 else depth
    return tuple(i for i in range(depth) if i % step == 1 or step == 1)


def _depth(config: Mapping[str, Any], stack: str) -> int:
    if stack == "encoder":
        return int(config["num_layers"])
    return int(config.get("num_decoder_layers") or config["num_layers"])


def _required(config: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in config:
        raise HfError(f"{where}: config.json has no {name!r}")
    return config[name]


def t5_config(folder: Folder) -> T5Config:
    """The :class:`T5Config` of the network ``folder`` holds (float32), computing padding
    positions as transformers does (``padding_semantics='hf'``).

    Raises:
      HfError: naming the ``config.json`` option moe-jax does not implement.
    """
    config, where = folder.config, storage.join(folder.path, CONFIG_JSON)
    arch = architecture(config, where)
    epsilon = config.get("layer_norm_epsilon", 1e-6)
    if not math.isclose(epsilon, 1e-6):
        raise HfError(f"{where}: layer_norm_epsilon={epsilon} is not supported (moe-jax: 1e-6)")
    if arch == SWITCH_ARCHITECTURE:
        if config.get("dense_act_fn", "relu") != "relu":
            raise HfError(f"{where}: dense_act_fn={config['dense_act_fn']!r} is not supported")
        activations: tuple[str, ...] = ("relu",)
    else:
        proj = config.get("feed_forward_proj", "relu")
        if proj not in _T5_FFN:
            raise HfError(
                f"{where}: feed_forward_proj={proj!r} is not supported; one of {tuple(_T5_FFN)}"
            )
        activations = _T5_FFN[proj]
    # transformers >= 5 writes v1.1 configs as tied without output scaling
    scaled = config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True))
    head, shared = folder.arrays.get("lm_head.weight"), folder.arrays.get("shared.weight")
    untied = head is not None and not (
        scaled and shared is not None and np.array_equal(head, shared)
    )
    moe: dict[str, Any] = {}
    if arch == SWITCH_ARCHITECTURE:
        moe = {
            "sparse_encoder_layers": _sparse_layers(config, "encoder"),
            "sparse_decoder_layers": _sparse_layers(config, "decoder"),
            "num_sparse_encoder_layers": len(_sparse_layers(config, "encoder")),
            "num_sparse_decoder_layers": len(_sparse_layers(config, "decoder")),
            "sparse_layer_type": "moe",
            "moe": switch_moe_config(config),
        }
    return T5Config.from_dict(  # every field given: no gin binding of the process read
        {
            "vocab_size": int(_required(config, "vocab_size", where)),
            "emb_dim": int(_required(config, "d_model", where)),
            "num_heads": int(_required(config, "num_heads", where)),
            "head_dim": int(_required(config, "d_kv", where)),
            "mlp_dim": int(_required(config, "d_ff", where)),
            "num_encoder_layers": _depth(config, "encoder"),
            "num_decoder_layers": _depth(config, "decoder"),
            "mlp_activations": activations,
            "dropout_rate": float(config.get("dropout_rate", 0.1)),
            "logits_via_embedding": not untied and bool(scaled),
            "relpos_num_buckets": int(config.get("relative_attention_num_buckets", 32)),
            "relpos_max_distance": int(config.get("relative_attention_max_distance", 128)),
            "padding_semantics": "hf",  # padding computed, and routed, as transformers does
            **moe,
        }
    )


def switch_moe_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE layers of a Switch ``config.json`` (as ``MoeConfig.to_dict`` gives them): top-1
    softmax routing (with the router bias, jitter), a fixed expert capacity per sequence,
    ReLU experts, and transformers' router losses (``router_losses='hf_stack'``: per stack
    and sequence, ``losses.hf_stack_losses``) weighted by its coefficients."""
    return {
        "num_experts": int(config.get("num_experts", 8)),
        "d_ff": int(config["d_ff"]),
        "activation": "relu",
        "router": {
            "type": TopKRouterConfig.router_type,
            "num_selected_experts": 1,
            "router_bias": bool(config.get("router_bias", False)),
            "jitter_noise": float(config.get("router_jitter_noise", 0.01)),
        },
        "capacity": {
            "expert_capacity": int(config.get("expert_capacity", 64)),
            "group_by_sequence": True,
            "min_expert_capacity": 1,
        },
        "losses": {
            "load_balancing_loss_weight": float(config.get("router_aux_loss_coef", 1e-3)),
            "router_z_loss_weight": float(config.get("router_z_loss_coef", 1e-3)),
            "balance_scope": "sequence",
            "router_losses": "hf_stack",
        },
    }


def _linear(export: str, hf: str, out_dim: int, in_dim: int) -> Tensor:
    return Tensor(export, (hf,), "transpose", (out_dim, in_dim))


# per stack: (Hugging Face sublayer, export attention name, export norm name)
_SUBLAYERS = {
    "encoder": (("0.SelfAttention", "attention", "pre_attention_layer_norm"),),
    "decoder": (
        ("0.SelfAttention", "self_attention", "pre_self_attention_layer_norm"),
        ("1.EncDecAttention", "encoder_decoder_attention", "pre_cross_attention_layer_norm"),
    ),
}


def _norm(export: str, hf: str, d: int) -> Tensor:
    return Tensor(export, (hf,), "copy", (d,))


def tensors(cfg: T5Config) -> list[Tensor]:
    """Every tensor of the Hugging Face model of ``cfg`` with its export name.

    Raises:
      HfError: naming the option when ``cfg`` has no Hugging Face model (MoE layers other
        than Switch's: see :func:`check_switch`).
    """
    d = cfg.emb_dim
    out = [Tensor("token_embedder/embedding", ("shared.weight",), "copy", (cfg.vocab_size, d))]
    if not cfg.logits_via_embedding:
        out.append(_linear("decoder/logits_dense/kernel", "lm_head.weight", cfg.vocab_size, d))
    if cfg.has_moe:
        check_switch(cfg)
    if tuple(cfg.mlp_activations) not in _FFN_NAMES:
        raise HfError(
            f"T5Config.mlp_activations={cfg.mlp_activations} has no Hugging Face T5 form; "
            f"one of {list(_FFN_NAMES)}"
        )
    for stack in ("encoder", "decoder"):
        out.append(
            Tensor(
                f"{stack}/relpos_bias/rel_embedding",
                (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",),
                "transpose",
                (cfg.relpos_num_buckets, cfg.num_heads),
            )
        )
        out.append(_norm(f"{stack}/{stack}_norm/scale", f"{stack}.final_layer_norm.weight", d))
        depth = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
        for i in range(depth):
            out.extend(_layer_tensors(cfg, stack, i))
    return out


def _layer_tensors(cfg: T5Config, stack: str, i: int) -> list[Tensor]:
    """Layer ``i`` of ``stack``: its attention sublayers, then its feed-forward sublayer."""
    d, inner = cfg.emb_dim, cfg.num_heads * cfg.head_dim
    block, layer = f"{stack}.block.{i}.layer", f"{stack}/layers_{i}"
    out = []
    for hf_name, name, norm in _SUBLAYERS[stack]:
        number = hf_name.split(".")[0]
        out.append(_norm(f"{layer}/{norm}/scale", f"{block}.{number}.layer_norm.weight", d))
        for short, long in _ATTENTION.items():
            shape = (d, inner) if short == "o" else (inner, d)
            hf = f"{block}.{hf_name}.{short}.weight"
            out.append(_linear(f"{layer}/{name}/{long}/kernel", hf, *shape))
    f = len(_SUBLAYERS[stack])
    out.append(_norm(f"{layer}/pre_mlp_layer_norm/scale", f"{block}.{f}.layer_norm.weight", d))
    if i in cfg.sparse_layers(stack):
        return [*out, *_switch_tensors(cfg, f"{block}.{f}.mlp", f"{layer}/mlp")]
    module = "mlp" if cfg.has_moe else "DenseReluDense"
    for w in _FFN_NAMES[tuple(cfg.mlp_activations)]:
        shape = (d, cfg.mlp_dim) if w == "wo" else (cfg.mlp_dim, d)
        hf = f"{block}.{f}.{module}.{w}.weight"
        out.append(_linear(f"{layer}/mlp/{w}/kernel", hf, *shape))
    return out


def _switch_tensors(cfg: T5Config, hf: str, export: str) -> list[Tensor]:
    """A Switch sparse layer's router and experts."""
    moe, d = cfg.moe_config("encoder"), cfg.emb_dim
    out = [
        _linear(
            f"{export}/router/router_weights/w/kernel",
            f"{hf}.router.classifier.weight",
            moe.num_experts,
            d,
        )
    ]
    if getattr(moe.router, "router_bias", False):
        out.append(
            Tensor(
                f"{export}/router/weights/b",
                (f"{hf}.router.classifier.bias",),
                "copy",
                (moe.num_experts,),
            )
        )
    for w, shape in (("wi", (moe.d_ff, d)), ("wo", (d, moe.d_ff))):
        names = tuple(f"{hf}.experts.expert_{e}.{w}.weight" for e in range(moe.num_experts))
        out.append(Tensor(f"{export}/expert/{w}/kernel", names, "experts", shape))
    return out


def check_switch(cfg: T5Config) -> None:
    """Refuses MoE layers that Hugging Face's Switch Transformers cannot hold, naming the
    option: the encoder's and decoder's MoE configs differ, a router other than top-1
    softmax ``TopKRouterConfig``, experts other than ReLU of the dense layers' shape,
    shared or fine-grained experts, dense layers other than ReLU.

    Raises:
      HfError: naming the option.
    """
    moe = cfg.moe_config("encoder")
    router = moe.router
    problems = {
        "T5Config.decoder_moe (differs from T5Config.moe)": cfg.decoder_moe not in (None, moe),
        f"MoeConfig.router={type(router).__name__}": not isinstance(router, TopKRouterConfig),
        f"num_selected_experts={router.num_selected_experts}": router.num_selected_experts != 1,
        f"score_function={getattr(router, 'score_function', None)!r}": getattr(
            router, "score_function", "softmax"
        )
        != "softmax",
        f"MoeConfig.activation={moe.activation!r}": moe.activation != "relu",
        f"T5Config.mlp_activations={cfg.mlp_activations}": tuple(cfg.mlp_activations) != ("relu",),
        f"MoeConfig.num_shared_experts={moe.num_shared_experts}": moe.num_shared_experts > 0,
        f"MoeConfig.expert_granularity={moe.expert_granularity}": moe.expert_granularity != 1,
    }
    bad = [name for name, is_bad in problems.items() if is_bad]
    if bad:
        raise HfError("the model has no Hugging Face Switch Transformers form: " + ", ".join(bad))


def to_export_arrays(folder: Folder, cfg: T5Config) -> dict[str, np.ndarray]:
    """``{export name: array}`` of ``folder``'s tensors for the network of ``cfg``.

    Raises:
      HfError: naming a tensor ``cfg`` needs that the folder lacks, one whose shape
        disagrees with ``config.json``, or tensors the network does not have.
    """
    arrays, out = dict(folder.arrays), {}
    for name, alias in _ALIASES:
        if name not in arrays and alias in arrays:
            arrays[name] = arrays[alias]
    if folder.config.get("tie_word_embeddings", True) and "shared.weight" in arrays:
        arrays.setdefault("lm_head.weight", arrays["shared.weight"])  # tied, not scaled
    needed = tensors(cfg)
    used = {name for tensor in needed for name in tensor.hf}
    tied = {alias for _, alias in _ALIASES} | {"lm_head.weight"}
    unknown = sorted(set(arrays) - used - tied)
    if unknown:
        raise HfError(
            f"--hf={folder.path}: tensors {unknown[:4]} are not part of the model config.json "
            f"describes ({len(unknown)} in all; e.g. router_bias=false with router biases)"
        )
    for tensor in needed:
        for name in tensor.hf:
            if name not in arrays:
                raise HfError(f"--hf={folder.path}: tensor {name!r} is missing")
            if tuple(arrays[name].shape) != tensor.shape:
                raise HfError(
                    f"--hf={folder.path}: tensor {name!r} has shape {list(arrays[name].shape)}, "
                    f"config.json gives {list(tensor.shape)}"
                )
        parts = [np.asarray(arrays[name], np.float32) for name in tensor.hf]
        if tensor.kind == "copy":
            out[tensor.export] = parts[0]
        elif tensor.kind == "transpose":
            out[tensor.export] = np.ascontiguousarray(parts[0].T)
        else:
            out[tensor.export] = np.stack([p.T for p in parts])
    return out


def from_export_arrays(arrays: Mapping[str, np.ndarray], cfg: T5Config) -> dict[str, np.ndarray]:
    """``{Hugging Face tensor name: array}`` of exported ``arrays`` of the network ``cfg``
    (the inverse of :func:`to_export_arrays`)."""
    out: dict[str, np.ndarray] = {}
    for tensor in tensors(cfg):
        array = np.asarray(arrays[tensor.export])
        if tensor.kind == "copy":
            out[tensor.hf[0]] = np.ascontiguousarray(array)
        elif tensor.kind == "transpose":
            out[tensor.hf[0]] = np.ascontiguousarray(array.T)
        else:
            for name, expert in zip(tensor.hf, array, strict=True):
                out[name] = np.ascontiguousarray(expert.T)
    return out


def config_json(cfg: T5Config, eos_id: int = 1) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model of ``cfg``: a Switch Transformers
    model when it has MoE layers (its sparse layers must be where transformers puts
    them), else T5.

    Raises:
      HfError: naming the option Hugging Face cannot express.
    """
    tensors(cfg)  # refuses what has no Hugging Face form
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.emb_dim,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.mlp_dim,
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_encoder_layers,
        "num_decoder_layers": cfg.num_decoder_layers,
        "relative_attention_num_buckets": cfg.relpos_num_buckets,
        "relative_attention_max_distance": cfg.relpos_max_distance,
        "dropout_rate": cfg.dropout_rate,
        "layer_norm_epsilon": 1e-6,
        "is_encoder_decoder": True,
        "pad_token_id": 0,
        "eos_token_id": eos_id,
        "decoder_start_token_id": 0,
        "tie_word_embeddings": cfg.logits_via_embedding,
    }
    if not cfg.has_moe:
        proj = "gated-gelu" if tuple(cfg.mlp_activations) == ("gelu", "linear") else "relu"
        return {
            "architectures": ["T5ForConditionalGeneration"],
            "model_type": "t5",
            "feed_forward_proj": proj,
            **common,
        }
    moe = cfg.moe_config("encoder")
    counts = {}
    for stack in ("encoder", "decoder"):
        sparse = cfg.sparse_layers(stack)
        depth = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
        counts_first = (*range(1, depth + 1), 0)  # 0 only where nothing else fits
        count = next((n for n in counts_first if switch_rule(depth, n) == sparse), None)
        if count is None:
            raise HfError(
                f"the {stack}'s sparse layers {list(sparse)} are not where Switch Transformers "
                "puts them (layer % step == 1); T5Config.sparse_layout='switch' places them so"
            )
        counts[f"num_sparse_{stack}_layers"] = count
        counts[f"{stack}_sparse_step"] = depth // count if count else depth
    capacity = moe.capacity.expert_capacity
    return {
        "architectures": [SWITCH_ARCHITECTURE],
        "model_type": "switch_transformers",
        "dense_act_fn": "relu",
        **common,
        **counts,
        "num_experts": moe.num_experts,
        "expert_capacity": capacity if capacity is not None else 64,
        "router_bias": bool(getattr(moe.router, "router_bias", False)),
        "router_jitter_noise": float(getattr(moe.router, "jitter_noise", 0.0)),
        "router_dtype": "float32",
        "router_z_loss_coef": moe.losses.router_z_loss_weight,
        "router_aux_loss_coef": moe.losses.load_balancing_loss_weight,
    }


def gin_config(cfg: T5Config, source: str) -> str:
    """A gin file for the network of ``cfg`` on top of ``gin/models/t5_dense.gin``: every
    ``T5Config`` field, and for MoE layers every option of their ``MoeConfig`` and its
    parts."""
    lines = [
        f"# The network of the Hugging Face model {source} (moe-jax import --hf).",
        "include 'gin/models/t5_dense.gin'",
        "import moe_jax.runtime.configured",
    ]
    fields = cfg.to_dict()
    moe = fields.pop("moe")
    fields.pop("decoder_moe")
    lines += [f"T5Config.{name} = {_gin_value(value)}" for name, value in fields.items()]
    if moe is None:
        return "\n".join(lines) + "\n"
    router = dict(moe.pop("router"))
    router_class = ROUTER_CONFIGS[router.pop("type")].__name__
    lines.append("T5Config.moe = @MoeConfig()")
    parts = {
        "capacity": "CapacityConfig",
        "execution": "ExecutionConfig",
        "losses": "AuxLossConfig",
    }
    for name, class_name in parts.items():
        lines.append(f"MoeConfig.{name} = @{class_name}()")
        lines += [f"{class_name}.{k} = {_gin_value(v)}" for k, v in moe.pop(name).items()]
    lines.append(f"MoeConfig.router = @{router_class}()")
    lines += [f"{router_class}.{k} = {_gin_value(v)}" for k, v in router.items()]
    lines += [f"MoeConfig.{k} = {_gin_value(v)}" for k, v in moe.items()]
    return "\n".join(lines) + "\n"


def _gin_value(value: Any) -> str:
    """``value`` as a gin literal (lists as tuples)."""
    if isinstance(value, list):
        return repr(tuple(value))
    return repr(value)
