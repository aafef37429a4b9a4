"""Per-token routing of a trained checkpoint on a dataset.

Checkpoints are restored with :func:`moe_jax.runtime.builders.restore_model` (parameters and
state collections, as `moe-jax eval` does); :func:`collect_routing` runs batches through the
network with the MoE layers' opt-in ``routing`` collection mutable and returns, for each MoE
layer (``"encoder/layers_3"``, ``"decoder/layers_7"``, ...), every token's expert choices,
router probabilities and router inputs together with its position in its sequence.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import param_paths, partitioning
from moe_jax.models.model import FEATURES, Batch
from moe_jax.moe.collections import ROUTING_COLLECTION
from moe_jax.runtime.model_protocol import Model

if TYPE_CHECKING:
    from moe_jax.runtime.builders import RestoredModel, RunContext

_SKIPPED_PATH_PARTS = ("ffn", "moe")


@dataclasses.dataclass
class LayerRouting:
    """One MoE layer's routing of ``n`` rows of ``length`` token slots.

    Attributes:
      expert_index: ``int32 [n, length, k]`` chosen experts, best first (``num_experts``
        on padding); expert-choice layers: the argmax expert, ``k = 1``.
      router_probs: ``float32 [n, length, num_experts]`` router softmax.
      router_inputs: ``float32 [n, length, d_model]`` what the router read (after pre-norm).
      positions: ``int32 [n, length]`` position of each token in its sequence (0-based).
      segments: ``int32 [n, length]`` sequence id within its row (packed rows hold several),
        0 on padding.
      kept: ``bool [n, length, k]`` whether each choice reached its expert (False: dropped
        by capacity, or padding); expert-choice layers: whether any expert took the token.
    """

    expert_index: np.ndarray
    router_probs: np.ndarray
    router_inputs: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    kept: np.ndarray

    @property
    def num_experts(self) -> int:
        return int(self.router_probs.shape[-1])

    @property
    def valid(self) -> np.ndarray:
        """``bool [n, length]``: real (non-padding) tokens."""
        return self.segments > 0

    def first_rows(self, n: int) -> LayerRouting:
        """The first ``n`` rows (without the padding rows of a last, partly filled batch)."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name)[:n] for f in dataclasses.fields(self)}
        )


def _positions_and_segments(
    tokens: jax.Array, valid: jax.Array, batch: Batch, prefix: str
) -> tuple[jax.Array, jax.Array]:
    """``[batch, length]`` positions and segment ids (0 = padding) of one stack's tokens:
    the packed features when present, else the column index and one segment per row."""
    positions = batch.get(f"{prefix}_positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    segments = batch.get(f"{prefix}_segment_ids")
    segments = jnp.ones_like(tokens, jnp.int32) if segments is None else segments.astype(jnp.int32)
    return positions.astype(jnp.int32), jnp.where(valid, segments, 0)


def _layer_name(path) -> tuple[str, str]:
    """(layer name without the ffn/moe parts, sown variable name) of a collection path."""
    names = param_paths.path_name(path, skip_indices=True).split("/")
    return "/".join(n for n in names[:-1] if n not in _SKIPPED_PATH_PARTS), names[-1]


def sown_by_layer(model: Model, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{layer ("encoder/layers_3"): {sown name: value}}`` of the ``routing`` collection in
    the variables ``state`` an ``apply`` of ``model``'s network returned (per layer,
    :meth:`Model.per_layer <moe_jax.runtime.model_protocol.Model.per_layer>`)."""
    out: dict[str, dict[str, Any]] = {}
    sown = model.per_layer(state.get(ROUTING_COLLECTION, {}))
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
        layer, name = _layer_name(path)
        out.setdefault(layer, {})[name] = leaf
    return out


def routing_fn(
    model: Model,
    params_shardings: Any,
    mesh: jax.sharding.Mesh,
    rules: partitioning.LogicalRules,
    batch_axes: tuple[str, ...] = partitioning.BATCH_AXES,
    collections_shardings: Any = None,
):
    """Jitted ``(params, batch, collections=None) -> {layer: {name: array}}``: the
    deterministic forward pass (eval capacity factor) with the ``routing`` collection sown,
    plus per stack ``positions``/``segments`` of the global batch; outputs replicated on
    every process. ``collections``: the model's non-parameter state collections (e.g. the
    bias router's ``router_bias``, laid out as ``collections_shardings``), read, not updated."""
    from jax.sharding import NamedSharding, PartitionSpec

    def fn(params, batch, collections):
        args = [batch.get(k) for k in FEATURES[:3]] + [batch.get(k) for k in FEATURES[4:]]
        _, state = model.module.apply(
            {"params": params, **collections},
            *args,
            enable_dropout=False,
            mutable=[ROUTING_COLLECTION],
        )
        out: dict[str, dict[str, jax.Array]] = sown_by_layer(model, state)
        enc = batch["encoder_input_tokens"]
        dec_targets = batch["decoder_target_tokens"]
        out["_positions"] = {}
        for prefix, tokens in (("encoder", enc), ("decoder", dec_targets)):
            pos, seg = _positions_and_segments(tokens, tokens > 0, batch, prefix)
            out["_positions"][f"{prefix}_positions"] = pos
            out["_positions"][f"{prefix}_segments"] = seg
        return out

    jitted = jax.jit(
        fn,
        in_shardings=(
            params_shardings,
            NamedSharding(mesh, PartitionSpec(batch_axes)),
            collections_shardings or {},
        ),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )

    def run(params, batch, collections=None):
        with partitioning.activate(mesh, rules):
            return jitted(params, batch, collections or {})

    return run


def restored_routing_fn(model: Model, restored: RestoredModel, ctx: RunContext):
    """:func:`routing_fn` of a model restored by ``builders.restore_model`` on ``ctx``'s
    mesh (its parameters and state collections laid out as restored)."""
    return routing_fn(
        model,
        restored.params_shardings,
        ctx.mesh,
        ctx.rules,
        ctx.batch_axes,
        restored.collections_shardings,
    )


def layer_order(name: str) -> tuple:
    """Encoder layers first, then decoder ones, each by depth."""
    return tuple(
        (0, int(p)) if p.isdigit() else (1, {"encoder": "0", "decoder": "1"}.get(p, p))
        for p in re.split(r"[/_]", name)
    )


def collect_routing(
    fn, params: Any, batches: Iterable[Batch], collections: Any = None
) -> dict[str, LayerRouting]:
    """Runs ``fn`` (from :func:`routing_fn`; ``collections``: the state collections it is
    given) over global ``batches`` and concatenates the rows: ``{"encoder/layers_3":
    LayerRouting, ...}``, encoder layers first, by depth.

    Raises:
      ValueError: no batches, or a model without MoE layers.
    """
    parts: dict[str, dict[str, list[np.ndarray]]] = {}
    for batch in batches:
        out = jax.device_get(fn(params, batch, collections))
        for layer, arrays in out.items():
            for name, value in arrays.items():
                parts.setdefault(layer, {}).setdefault(name, []).append(np.asarray(value))
    if not parts:
        raise ValueError("the dataset gave no batches to analyse")
    pos = {name: np.concatenate(v) for name, v in parts.pop("_positions").items()}
    if not parts:
        raise ValueError("the model has no MoE layers (nothing sowed per-token routing)")
    layers = {}
    for layer, arrays in sorted(parts.items(), key=lambda item: layer_order(item[0])):
        stack = re.match(r"^(encoder|decoder)\b", layer)
        prefix = stack.group(1) if stack else "encoder"
        cat = {name: np.concatenate(v) for name, v in arrays.items()}
        probs = cat["router_probs"].astype(np.float32)
        segments = pos[f"{prefix}_segments"]
        index = cat.get("expert_index")
        if index is None:  # expert choice: a token's own choice is its argmax expert
            index = np.argmax(probs, axis=-1)[..., None]
        index = np.where(segments[..., None] > 0, index, probs.shape[-1]).astype(np.int32)
        layers[layer] = LayerRouting(
            expert_index=index,
            router_probs=probs,
            router_inputs=cat["router_inputs"].astype(np.float32),
            positions=pos[f"{prefix}_positions"],
            segments=segments,
            kept=cat["kept"].astype(bool) & (segments[..., None] > 0),
        )
    return layers
