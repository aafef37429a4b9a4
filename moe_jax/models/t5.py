"""The T5 v1.1 encoder-decoder with MoE feed-forward blocks at chosen depths.

Layout (pre-layer-norm residual blocks, as in T5 v1.1 / T5X / Flaxformer):

    encoder: embed -> dropout -> L x [self-attention block, feed-forward block] -> norm -> dropout
    decoder: embed -> dropout -> L x [causal self-attention block, cross-attention block,
             feed-forward block] -> norm -> dropout -> logits

Each block is ``x + dropout(sublayer(rms_norm(x)))``. The feed-forward block of a *sparse*
layer is the project's ``MoeLayer`` (or, for the FLOP-matched dense baseline, a wider
dense MLP); which layers are sparse is given by :func:`sparse_layer_indices`.

With ``T5Config.scan_layers`` a run of layers that repeats a block (the 12 identical layers
of a dense stack; the dense-dense-dense-MoE block of the ``mixed`` layout) is one
``nn.scan`` over the block (:func:`layer_groups`): traced and compiled once, its
parameters stacked on a leading ``layers`` axis under ``scan_<k>/layers_<i>_<j>_...``
(the block position that holds layers ``i, j, ...``). Outside the model every tree is per
layer (``encoder/layers_<i>/...``): ``EncoderDecoderModel.per_layer`` / ``own_layout``
convert (:mod:`moe_jax.models.layer_stacking`). Outputs are the same as the unrolled layers'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.models import layer_stacking
from moe_jax.models.attention import (
    AttentionKernel,
    AttentionMask,
    MultiHeadDotProductAttention,
)
from moe_jax.models.embedding import Embed
from moe_jax.models.mlp import MlpBlock
from moe_jax.models.normalization import RMSNorm
from moe_jax.models.relative_position import RelativePositionBiases
from moe_jax.moe.config import MoeConfig
from moe_jax.moe.config import default_config as default_moe_config
from moe_jax.moe.config import from_dict as moe_config_from_dict
from moe_jax.moe.layer import MoeLayer

SPARSE_LAYOUTS = ("bottom", "middle", "top", "mixed", "switch")
SPARSE_LAYER_TYPES = ("moe", "dense")
# ``T5Config.padding_semantics``: how padding positions (token id 0) are computed.
PaddingSemantics = Literal["mask", "hf"]
PADDING_SEMANTICS: tuple[PaddingSemantics, ...] = ("mask", "hf")

# What each layer keeps for the backward pass (``T5Config.remat_policy``); anything not kept
# is recomputed from the layer's input. ``None``: no rematerialisation (keep everything).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    # keep only each layer's input: the whole layer runs twice (least memory)
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep the outputs of matmuls without batch dimensions (the projections: q/k/v/o,
    # MLP in/out, logits); recompute attention scores, softmax, norms, MoE dispatch and
    # the experts' per-expert (batched) matmuls. MaxText's 'minimal'.
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep every matmul output, the experts' and attention's batched ones included
    "dots": jax.checkpoint_policies.dots_saveable,
}


def sparse_layer_indices(num_layers: int, num_sparse: int, layout: str) -> tuple[int, ...]:
    """Which of ``num_layers`` layers have a sparse (MoE) feed-forward block (T5X layouts).

    ``bottom``: the first ``num_sparse``; ``top``: the last; ``middle``: a centred run;
    ``mixed``: evenly spaced, layer ``i`` sparse when ``i % (L // S) == L // S - 1``
    (layers 3, 7, 11 for 3 of 12); ``switch``: evenly spaced as Switch Transformers /
    Hugging Face place them, layer ``i`` sparse when ``i % (L // S) == 1`` (every layer when
    ``L == S``; layers 1, 5, 9 for 3 of 12).

    Raises:
      ValueError: naming the option when the layout is unknown, ``num_sparse`` is out of
        range, or ``mixed`` would not give exactly ``num_sparse`` layers.
    """
    if layout not in SPARSE_LAYOUTS:
        raise ValueError(f"sparse_layout={layout!r} is not one of {SPARSE_LAYOUTS}")
    if not 0 <= num_sparse <= num_layers:
        raise ValueError(f"num_sparse_layers={num_sparse} must be in [0, num_layers={num_layers}]")
    if num_sparse == 0:
        return ()
    if layout == "bottom":
        return tuple(range(num_sparse))
    if layout == "top":
        return tuple(range(num_layers - num_sparse, num_layers))
    if layout == "middle":
        start = num_layers // 2 - num_sparse // 2
        return tuple(range(start, start + num_sparse))
    period = num_layers // num_sparse
    offset = period - 1 if layout == "mixed" else min(1, period - 1)
    layers = tuple(i for i in range(num_layers) if i % period == offset)
    if len(layers) != num_sparse:
        raise ValueError(
            f"sparse_layout={layout!r} with num_layers={num_layers} gives sparse layers "
            f"{layers}, not num_sparse_layers={num_sparse}; choose a divisor of "
            f"{num_layers} or another layout"
        )
    return layers


def layer_groups(
    kinds: Sequence[Hashable], min_layers: int = 2
) -> tuple[tuple[int, int, int], ...]:
    """``(start, period, repeats)`` runs covering a stack whose layer ``i`` is of kind
    ``kinds[i]``: layers ``start`` to ``start + period * repeats - 1`` are ``repeats``
    copies of the block ``kinds[start:start + period]``. From each start, the run with at
    least 2 repeats that covers most layers (the shortest block among equals), if it covers
    at least ``min_layers``; a layer that starts no such run is a run of its own (period
    and repeats 1).

    ``(D, D, D, S) * 3`` -> ``((0, 4, 3),)``; ``(S, S, D, D, D)`` -> ``((0, 1, 2), (2, 1, 3))``;
    ``(D, S)`` -> ``((0, 1, 1), (1, 1, 1))``; ``(D, D)`` with ``min_layers=3`` -> ``((0, 1,
    1), (1, 1, 1))``.
    """
    kinds, groups, start = tuple(kinds), [], 0
    while start < len(kinds):
        best = (1, 1)  # (period, repeats)
        for period in range(1, (len(kinds) - start) // 2 + 1):
            block, repeats = kinds[start : start + period], 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 1 and period * repeats > max(best[0] * best[1], min_layers - 1):
                best = (period, repeats)
        groups.append((start, *best))
        start += best[0] * best[1]
    return tuple(groups)


# Routers whose output depends on their module path (``RandomRouter`` salts its matrix with
# it): the layers of a scan share one path, so layers with such a router are not scanned.
PATH_SALTED_ROUTERS = ("random",)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Every hyperparameter of the network (gin: ``T5Config.<field> = ...``).

    Attributes:
      vocab_size: embedding rows / logits width (T5: 32128, a multiple of 128).
      emb_dim: d_model.
      num_heads, head_dim: attention shape, independent of ``emb_dim``.
      mlp_dim: d_ff of the dense feed-forward blocks.
      num_encoder_layers, num_decoder_layers: depth of each stack.
      mlp_activations: ``('gelu', 'linear')`` = gated GELU (v1.1); ``('relu',)`` = v1.0.
      dropout_rate: dropout after embeddings, every sublayer, attention weights, MLP hidden.
      logits_via_embedding: tie the output logits to the token embedding.
      activation_dtype_name: activation dtype (``'float32'`` or ``'bfloat16'``; gin macro
        ``ACTIVATION_DTYPE``); :attr:`activation_dtype` is its ``jnp.dtype``.
      param_dtype: parameter dtype (keep ``'float32'``).
      float32_attention_logits: the attention logits and their softmax in float32 (q.k
        accumulated in float32 from bfloat16 q and k: ``attention.logits_in_float32``);
        False: in the activations' dtype.
      attention_kernel: who computes attention (``attention.ATTENTION_KERNELS``):
        ``'xla'`` (every platform), ``'cudnn'`` (cuDNN's fused attention on NVIDIA GPUs,
        bfloat16 activations, no attention dropout; its softmax is always float32) or
        ``'pallas'`` (the project's flash kernel, ``models/flash_attention.py``: Triton on
        NVIDIA GPUs, Pallas's interpreter elsewhere; no attention dropout; float32 softmax).
      relpos_num_buckets, relpos_max_distance: T5 relative position buckets.
      num_sparse_encoder_layers, num_sparse_decoder_layers: sparse layers per stack.
      sparse_layout: ``bottom``, ``middle``, ``top``, ``mixed`` or ``switch`` (see
        :func:`sparse_layer_indices`).
      sparse_encoder_layers, sparse_decoder_layers: the sparse layers of a stack by index
        (as a Hugging Face checkpoint's ``encoder_sparse_step`` places them), instead of
        the layout; ``num_sparse_*_layers`` is then their count (0: taken from the list).
      sparse_layer_type: ``'moe'`` puts ``MoeLayer`` at the sparse positions (configured
        by ``moe`` / ``decoder_moe``); ``'dense'`` puts a dense MLP of width
        ``flop_matched_mlp_dim`` there (the FLOP-matched dense baseline).
      flop_matched_mlp_dim: d_ff of those dense layers (top-k routing: ``k * mlp_dim``).
      remat_policy: activation checkpointing of each encoder/decoder layer (one of
        :data:`REMAT_POLICIES`: ``'none'``, ``'full'``, ``'minimal'``, ``'dots'``); the
        loss and gradients are the same, the backward pass recomputes what was not kept.
      scan_layers: run each repeated block of layers as one ``nn.scan`` (see
        :meth:`layer_groups`; parameters stacked on a leading ``layers`` axis). The same
        outputs; deep stacks trace and compile faster. Without remat the
        backward pass keeps every layer's intermediates (about twice the memory per
        device); with ``remat_policy='minimal'`` less than unrolled (off by default;
        docs/model.md has the numbers).
      scan_min_layers: the fewest layers a scanned run covers; shorter runs are unrolled
        (a scan traces about as slowly as 3 or 4 unrolled layers, so short runs gain nothing).
      moe: the MoE layers' :class:`~moe_jax.moe.config.MoeConfig` (the encoder's, and the
        decoder's unless ``decoder_moe`` is set). A model with MoE layers and no ``moe``
        gets the default ``MoeConfig`` (gin files bind ``T5Config.moe = @MoeConfig()``).
      decoder_moe: the decoder's MoE config when it differs from the encoder's (Flaxformer's
        ``sparse_decoder``; gin: ``T5Config.decoder_moe = @decoder/MoeConfig()`` with
        ``decoder/...`` bindings). Checked for routing that reads later tokens of a group.
      padding_semantics: how padding positions (token id 0) are computed. ``'mask'``: a
        padding position attends to nothing (its whole attention row is masked) and the MoE
        layers route it nowhere. ``'hf'``: as Hugging Face transformers computes them
        (``moe-jax import --hf`` sets it): attention masks only padding keys (a padding
        query attends to the real tokens; the decoder's self-attention is causal only, as
        transformers' without a ``decoder_attention_mask``) and the MoE layers route padding
        like a real token, so it takes expert capacity (``MoeLayer.route_padding``). Real
        tokens compute the same in both as long as padding cannot take their capacity
        (capacity per sequence, ``group_by_sequence``, filled in token order: padding comes
        after its sequence's real tokens); the losses read real tokens only, except the
        ``hf_stack`` router losses, which read every position.
    """

    vocab_size: int = 32128
    emb_dim: int = 768
    num_heads: int = 12
    head_dim: int = 64
    mlp_dim: int = 2048
    num_encoder_layers: int = 12
    num_decoder_layers: int = 12
    mlp_activations: Sequence[str] = ("gelu", "linear")
    dropout_rate: float = 0.0
    logits_via_embedding: bool = False
    activation_dtype_name: str = "float32"
    param_dtype: str = "float32"
    float32_attention_logits: bool = True
    attention_kernel: AttentionKernel = "xla"
    relpos_num_buckets: int = 32
    relpos_max_distance: int = 128
    num_sparse_encoder_layers: int = 0
    num_sparse_decoder_layers: int = 0
    sparse_layout: str = "mixed"
    sparse_encoder_layers: Sequence[int] | None = None
    sparse_decoder_layers: Sequence[int] | None = None
    sparse_layer_type: str = "moe"
    flop_matched_mlp_dim: int | None = None
    remat_policy: str = "none"
    scan_layers: bool = False
    scan_min_layers: int = 6
    moe: MoeConfig | None = None
    decoder_moe: MoeConfig | None = None
    padding_semantics: PaddingSemantics = "mask"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "emb_dim",
            "num_heads",
            "head_dim",
            "mlp_dim",
            "num_encoder_layers",
            "num_decoder_layers",
            "scan_min_layers",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"T5Config.{name}={getattr(self, name)} must be positive")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"T5Config.dropout_rate={self.dropout_rate} must be in [0, 1)")
        for name in ("activation_dtype_name", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(
                    f"T5Config.{name}={getattr(self, name)!r}: use 'float32' or 'bfloat16'"
                )
        if self.sparse_layer_type not in SPARSE_LAYER_TYPES:
            raise ValueError(
                f"T5Config.sparse_layer_type={self.sparse_layer_type!r} is not one "
                f"of {SPARSE_LAYER_TYPES}"
            )
        if self.sparse_layer_type == "dense" and not self.flop_matched_mlp_dim:
            raise ValueError("T5Config.sparse_layer_type='dense' needs flop_matched_mlp_dim")
        if self.padding_semantics not in PADDING_SEMANTICS:
            raise ValueError(
                f"T5Config.padding_semantics={self.padding_semantics!r} is not one of "
                f"{PADDING_SEMANTICS}"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"T5Config.remat_policy={self.remat_policy!r} is not one of {tuple(REMAT_POLICIES)}"
            )
        object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
        for stack in ("encoder", "decoder"):
            self._set_explicit_sparse_layers(stack)
        self.sparse_layers("encoder")  # validates layout and counts early
        self.sparse_layers("decoder")
        if self.has_moe and self.moe is None:
            object.__setattr__(self, "moe", default_moe_config())
        for name in ("moe", "decoder_moe"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), MoeConfig):
                raise ValueError(f"T5Config.{name}={getattr(self, name)!r} is not a MoeConfig")
        if self.has_moe and self.num_sparse_decoder_layers:
            self.moe_config("decoder").check_causal("the decoder")

    def _set_explicit_sparse_layers(self, stack: str) -> None:
        """Checks ``sparse_<stack>_layers`` (as a sorted tuple) against the stack's depth and
        ``num_sparse_<stack>_layers`` (set to its length when 0).

        Raises:
          ValueError: naming the option when an index is out of range or repeated, or the
            count disagrees.
        """
        option, count = f"sparse_{stack}_layers", f"num_sparse_{stack}_layers"
        layers = getattr(self, option)
        if layers is None:
            return
        depth = getattr(self, f"num_{stack}_layers")
        layers = tuple(sorted(int(i) for i in layers))
        if len(set(layers)) != len(layers) or any(not 0 <= i < depth for i in layers):
            raise ValueError(
                f"T5Config.{option}={list(layers)} must be distinct layer indices in "
                f"[0, num_{stack}_layers={depth})"
            )
        if getattr(self, count) == 0:
            object.__setattr__(self, count, len(layers))
        if getattr(self, count) != len(layers):
            raise ValueError(
                f"T5Config.{option}={list(layers)} has {len(layers)} layers but "
                f"{count}={getattr(self, count)}"
            )
        object.__setattr__(self, option, layers)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the MoE configs as ``MoeConfig.to_dict``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["mlp_activations"] = list(self.mlp_activations)
        for name in ("sparse_encoder_layers", "sparse_decoder_layers"):
            out[name] = None if out[name] is None else list(out[name])
        for name in ("moe", "decoder_moe"):
            out[name] = None if out[name] is None else out[name].to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> T5Config:
        """The config of :meth:`to_dict`'s output (every field passed: no gin binding read).

        Raises:
          ValueError: naming an unknown field.
        """
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"T5Config has no field {', '.join(unknown)}")
        data = {
            **data,
            **{
                name: moe_config_from_dict(data[name])
                for name in ("moe", "decoder_moe")
                if data.get(name) is not None
            },
        }
        return cls(**{f.name: data.get(f.name, f.default) for f in dataclasses.fields(cls)})

    def moe_config(self, stack: str) -> MoeConfig:
        """The MoE config of ``stack``'s sparse layers (``'encoder'`` or ``'decoder'``).

        Raises:
          ValueError: the model has no MoE layers (see :attr:`has_moe`).
        """
        if not self.has_moe or self.moe is None:
            raise ValueError("T5Config: the model has no MoE layers, so no MoE config")
        if stack == "decoder" and self.decoder_moe is not None:
            return self.decoder_moe
        return self.moe

    def sparse_layers(self, stack: str) -> tuple[int, ...]:
        """Indices of the sparse layers of ``stack`` (``'encoder'`` or ``'decoder'``): its
        explicit list (``sparse_<stack>_layers``), else those of the layout."""
        explicit = {"encoder": self.sparse_encoder_layers, "decoder": self.sparse_decoder_layers}
        if explicit.get(stack) is not None:
            return tuple(explicit[stack] or ())
        if stack == "encoder":
            return sparse_layer_indices(
                self.num_encoder_layers, self.num_sparse_encoder_layers, self.sparse_layout
            )
        if stack == "decoder":
            return sparse_layer_indices(
                self.num_decoder_layers, self.num_sparse_decoder_layers, self.sparse_layout
            )
        raise ValueError(f"stack={stack!r} is not 'encoder' or 'decoder'")

    def layer_groups(self, stack: str) -> tuple[tuple[int, int, int], ...]:
        """``stack``'s layers as ``(start, period, repeats)`` runs (:func:`layer_groups`
        with ``scan_min_layers``): a run with ``repeats > 1`` is scanned. Without
        ``scan_layers`` every layer is a run of its own; a layer with a
        :data:`PATH_SALTED_ROUTERS` router always is."""
        sparse = self.sparse_layers(stack)
        count = self.num_encoder_layers if stack == "encoder" else self.num_decoder_layers
        if not self.scan_layers:
            return tuple((i, 1, 1) for i in range(count))
        salted = self.has_moe and self.moe_config(stack).router_type in PATH_SALTED_ROUTERS
        kinds = [(i in sparse, i if salted and i in sparse else None) for i in range(count)]
        return layer_groups(kinds, self.scan_min_layers)

    @property
    def has_moe(self) -> bool:
        """Whether any layer holds an ``MoeLayer``."""
        return self.sparse_layer_type == "moe" and (
            self.num_sparse_encoder_layers + self.num_sparse_decoder_layers > 0
        )

    @property
    def activation_dtype(self) -> Any:
        return jnp.dtype(self.activation_dtype_name)

    @property
    def parameter_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)


class AttentionBlock(nn.Module):
    """``x + dropout(attention(rms_norm(x), kv))``: self-attention when ``kv`` is None.

    Attributes:
      config: the network's :class:`T5Config`.
    """

    config: T5Config

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        kv: jnp.ndarray | None = None,
        mask: AttentionMask | None = None,
        bias: jnp.ndarray | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
    ) -> jnp.ndarray:
        """``x [batch, q_len, d_model]``, ``kv [batch, k_len, d_model]`` -> ``[batch, q_len,
        d_model]``."""
        cfg = self.config
        y = RMSNorm(dtype=cfg.activation_dtype, param_dtype=cfg.parameter_dtype, name="pre_norm")(x)
        y = MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.activation_dtype,
            param_dtype=cfg.parameter_dtype,
            dropout_rate=cfg.dropout_rate,
            float32_logits=cfg.float32_attention_logits,
            kernel=cfg.attention_kernel,
            name="attention",
        )(y, y if kv is None else kv, mask, bias, deterministic=deterministic, decode=decode)
        y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
        return nn.with_logical_constraint(x + y, ("batch", "length", "embed"))


class FeedForwardBlock(nn.Module):
    """``x + dropout(ffn(rms_norm(x)))`` where ffn is a dense MLP or the MoE layer.

    Attributes:
      config: the network's :class:`T5Config`.
      sparse: whether this layer is one of the stack's sparse layers.
      is_decoder: passed to the MoE layer as ``causal``.
    """

    config: T5Config
    sparse: bool = False
    is_decoder: bool = False

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        *,
        token_ids: jnp.ndarray | None,
        padding_mask: jnp.ndarray | None,
        deterministic: bool,
    ) -> jnp.ndarray:
        """``[batch, length, d_model] -> [batch, length, d_model]``.

        ``token_ids``/``padding_mask`` (``[batch, length]``) are only used by the MoE layer.
        """
        cfg = self.config
        y = RMSNorm(dtype=cfg.activation_dtype, param_dtype=cfg.parameter_dtype, name="pre_norm")(x)
        if self.sparse and cfg.sparse_layer_type == "moe":
            y = MoeLayer(
                cfg.moe_config("decoder" if self.is_decoder else "encoder"),
                causal=self.is_decoder,
                dtype=cfg.activation_dtype,
                route_padding=cfg.padding_semantics == "hf",
                name="moe",
            )(y, token_ids=token_ids, padding_mask=padding_mask, deterministic=deterministic)
        else:
            width = cfg.flop_matched_mlp_dim if self.sparse else cfg.mlp_dim
            assert width is not None  # T5Config refuses a dense sparse layer without its width
            y = MlpBlock(
                intermediate_dim=width,
                activations=cfg.mlp_activations,
                intermediate_dropout_rate=cfg.dropout_rate,
                dtype=cfg.activation_dtype,
                param_dtype=cfg.parameter_dtype,
                name="mlp",
            )(y, deterministic=deterministic)
        y = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
        return nn.with_logical_constraint(x + jnp.asarray(y, x.dtype), ("batch", "length", "embed"))


class EncoderLayer(nn.Module):
    """Bidirectional self-attention block then feed-forward block.

    Arguments are positional so that :func:`remat_layer` can mark ``deterministic`` static.
    """

    config: T5Config
    sparse: bool = False

    @nn.compact
    def __call__(self, x, mask, bias, token_ids, padding_mask, deterministic: bool) -> jnp.ndarray:
        """``[batch, length, d_model] -> [batch, length, d_model]``; ``mask [batch, 1, L, L]``."""
        x = AttentionBlock(self.config, name="self_attention")(
            x, None, mask, bias, deterministic=deterministic
        )
        return FeedForwardBlock(self.config, self.sparse, is_decoder=False, name="ffn")(
            x, token_ids=token_ids, padding_mask=padding_mask, deterministic=deterministic
        )


class DecoderLayer(nn.Module):
    """Causal self-attention block, cross-attention block, then feed-forward block.

    Arguments are positional so that :func:`remat_layer` can mark ``deterministic`` and
    ``decode`` static.
    """

    config: T5Config
    sparse: bool = False

    @nn.compact
    def __call__(
        self,
        x,
        encoded,
        self_mask,
        cross_mask,
        bias,
        token_ids,
        padding_mask,
        deterministic: bool,
        decode: bool = False,
    ) -> jnp.ndarray:
        """``x [batch, Ld, d_model]``, ``encoded [batch, Le, d_model]`` -> ``[batch, Ld,
        d_model]``."""
        x = AttentionBlock(self.config, name="self_attention")(
            x, None, self_mask, bias, deterministic=deterministic, decode=decode
        )
        x = AttentionBlock(self.config, name="cross_attention")(
            x, encoded, cross_mask, None, deterministic=deterministic
        )
        return FeedForwardBlock(self.config, self.sparse, is_decoder=True, name="ffn")(
            x, token_ids=token_ids, padding_mask=padding_mask, deterministic=deterministic
        )


def remat_layer(
    layer_cls: type[nn.Module],
    config: T5Config,
    static_argnums: tuple[int, ...],
    decode: bool = False,
    scanned: bool = False,
) -> type[nn.Module]:
    """``layer_cls`` wrapped in ``nn.remat`` with the config's policy (unchanged for
    ``'none'`` and when decoding: no backward pass). ``static_argnums`` count ``self`` as 0;
    ``scanned``: the layer runs inside ``nn.scan``, where XLA cannot merge the recomputation
    with the forward pass, so no barrier against that is needed (``prevent_cse=False``).
    Parameter names and shapes do not change."""
    if config.remat_policy == "none" or decode:
        return layer_cls
    return nn.remat(
        layer_cls,
        policy=REMAT_POLICIES[config.remat_policy],
        static_argnums=static_argnums,
        prevent_cse=not scanned,
    )


class ScannedBlock(nn.Module):
    """The body of a scanned run of layers: one copy of its block, layer after layer.

    Attributes:
      layer_cls: :class:`EncoderLayer` or :class:`DecoderLayer` (remat-wrapped or not).
      config: the network's :class:`T5Config`.
      sparse: per block position, whether its layers are sparse.
      names: per block position, its module name (``layers_3_7_11``: it holds layers 3, 7
        and 11, one per scan step).
      static: the layer's trailing static arguments (``deterministic`` [, ``decode``]).
    """

    layer_cls: Any
    config: T5Config
    sparse: tuple[bool, ...]
    names: tuple[str, ...]
    static: tuple[bool, ...]

    @nn.compact
    def __call__(self, x: jnp.ndarray, *args: Any) -> tuple[jnp.ndarray, None]:
        """``x [batch, length, d_model]`` (the scan carry) -> ``(x, None)``; ``args``: the
        layer's other inputs, the same at every step."""
        for sparse, name in zip(self.sparse, self.names, strict=True):
            x = self.layer_cls(self.config, sparse=sparse, name=name)(x, *args, *self.static)
        return x, None


def run_layers(
    config: T5Config,
    stack: str,
    layer_cls: type[nn.Module],
    x: jnp.ndarray,
    args: tuple[Any, ...],
    static: tuple[bool, ...],
    decode: bool = False,
) -> jnp.ndarray:
    """Runs ``stack``'s layers on ``x [batch, length, d_model]`` inside the calling stack
    module: a run of :meth:`T5Config.layer_groups` that repeats is one ``nn.scan`` of a
    :class:`ScannedBlock` named ``scan_<k>`` (every collection stacked on axis 0, the
    parameters' logical axis ``layers``; fresh ``params`` and ``dropout`` keys per step),
    any other layer is ``layers_<i>``. Each layer ``layer_cls(config, sparse)`` is called
    on ``(x, *args, *static)``, ``static`` being its static arguments (Python bools: remat
    keeps them static); ``decode``: the decoder decodes (no remat)."""
    static_argnums = tuple(range(2 + len(args), 2 + len(args) + len(static)))  # self is 0
    plain = remat_layer(layer_cls, config, static_argnums, decode=decode)
    in_scan = remat_layer(layer_cls, config, static_argnums, decode=decode, scanned=True)
    sparse = config.sparse_layers(stack)
    scans = 0
    for start, period, repeats in config.layer_groups(stack):
        if repeats == 1:
            x = plain(config, sparse=start in sparse, name=f"layers_{start}")(x, *args, *static)
            continue
        positions = layer_stacking.block_positions(start, period, repeats)
        scan = nn.scan(
            ScannedBlock,
            variable_axes={True: 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=nn.broadcast,
            length=repeats,
            metadata_params={nn.PARTITION_NAME: layer_stacking.LAYERS_AXIS},
        )
        x, _ = scan(
            in_scan,
            config,
            sparse=tuple(p[0] in sparse for p in positions),
            names=tuple(layer_stacking.scanned_name(p) for p in positions),
            static=static,
            name=layer_stacking.scan_group_name(scans),
        )(x, *args)
        scans += 1
    return x


def _relative_position_bias(cfg: T5Config, length: int, *, bidirectional: bool) -> jnp.ndarray:
    """The stack's ``[1, heads, length, length]`` relative-position bias (its ``relpos_bias``
    table, shared by its layers), in float32 where the attention logits are
    (``float32_attention_logits``: each layer would cast it back), so that its gradient is
    summed over the layers in float32; else in the activation dtype."""
    return RelativePositionBiases(
        cfg.num_heads,
        cfg.relpos_num_buckets,
        cfg.relpos_max_distance,
        dtype=jnp.float32 if cfg.float32_attention_logits else cfg.activation_dtype,
        param_dtype=cfg.parameter_dtype,
        name="relpos_bias",
    )(length, length, bidirectional=bidirectional)


def _embed_inputs(
    embedder: Embed, tokens: jnp.ndarray, rate: float, deterministic: bool
) -> jnp.ndarray:
    """Token embedding followed by dropout: ``[batch, length] -> [batch, length, d_model]``."""
    x = embedder(tokens)
    return nn.Dropout(rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


def _final_norm(config: T5Config, x: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
    """Final RMS norm (named ``final_norm``) then dropout, inside the calling stack."""
    x = RMSNorm(
        dtype=config.activation_dtype, param_dtype=config.parameter_dtype, name="final_norm"
    )(x)
    x = nn.Dropout(config.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
    """The encoder stack; relative position biases shared by its layers."""

    config: T5Config
    shared_embedding: Embed

    @nn.compact
    def __call__(
        self, tokens: jnp.ndarray, mask: AttentionMask, *, deterministic: bool
    ) -> jnp.ndarray:
        """``tokens [batch, Le]``, ``mask [batch, 1, Le, Le]`` -> ``[batch, Le, d_model]``."""
        cfg = self.config
        x = _embed_inputs(self.shared_embedding, tokens, cfg.dropout_rate, deterministic)
        length = tokens.shape[1]
        bias = _relative_position_bias(cfg, length, bidirectional=True)
        x = run_layers(
            cfg,
            "encoder",
            EncoderLayer,
            x,
            (mask, bias, tokens, tokens > 0),
            (deterministic,),
        )
        return _final_norm(cfg, x, deterministic)


class Decoder(nn.Module):
    """The decoder stack and output logits."""

    config: T5Config
    shared_embedding: Embed

    @nn.compact
    def __call__(
        self,
        encoded: jnp.ndarray,
        tokens: jnp.ndarray,
        self_mask: AttentionMask | None,
        cross_mask: AttentionMask | None,
        padding_mask: jnp.ndarray | None,
        *,
        deterministic: bool,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> jnp.ndarray:
        """Logits ``[batch, Ld, vocab]`` for decoder inputs ``tokens [batch, Ld]``.

        In ``decode`` mode ``tokens`` is one step ``[batch, 1]`` and the self-attention
        bias is built for ``max_decode_length`` (the attention slices the current row).
        """
        cfg = self.config
        x = _embed_inputs(self.shared_embedding, tokens, cfg.dropout_rate, deterministic)
        length = max_decode_length if decode and max_decode_length else tokens.shape[1]
        bias = _relative_position_bias(cfg, length, bidirectional=False)
        x = run_layers(
            cfg,
            "decoder",
            DecoderLayer,
            x,
            (encoded, self_mask, cross_mask, bias, tokens, padding_mask),
            (deterministic, decode),
            decode=decode,
        )
        x = _final_norm(cfg, x, deterministic)
        if cfg.logits_via_embedding:
            logits = self.shared_embedding.attend(x) / jnp.sqrt(jnp.asarray(cfg.emb_dim, x.dtype))
        else:
            kernel = self.param(
                "logits_dense",
                nn.with_logical_partitioning(
                    nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                    ("embed", "vocab"),
                ),
                (cfg.emb_dim, cfg.vocab_size),
                cfg.parameter_dtype,
            )
            logits = jnp.einsum("bld,dv->blv", x, jnp.asarray(kernel, cfg.activation_dtype))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def encoder_mask(
    tokens: jnp.ndarray,
    segment_ids: jnp.ndarray | None,
    padding_semantics: PaddingSemantics = "mask",
) -> AttentionMask:
    """Encoder self-attention mask (``[batch, 1, Le, Le]``): non-padding, same segment.
    ``padding_semantics='hf'`` masks padding keys only (``T5Config.padding_semantics``)."""
    valid = tokens > 0
    queries = jnp.ones_like(valid) if padding_semantics == "hf" else valid
    segments = None if segment_ids is None else (segment_ids, segment_ids)
    return AttentionMask.from_padding(queries, valid, segments=segments)


def decoder_masks(
    encoder_tokens: jnp.ndarray,
    decoder_input_tokens: jnp.ndarray,
    decoder_target_tokens: jnp.ndarray | None,
    encoder_segment_ids: jnp.ndarray | None,
    decoder_segment_ids: jnp.ndarray | None,
    padding_semantics: PaddingSemantics = "mask",
) -> tuple[AttentionMask, AttentionMask]:
    """(causal self-attention mask ``[batch, 1, Ld, Ld]``, cross mask ``[batch, 1, Ld, Le]``).

    Decoder padding is read from ``decoder_target_tokens > 0`` (the inputs start with the
    pad id 0 as BOS, so they cannot tell); without targets, or with
    ``padding_semantics='hf'`` (``T5Config.padding_semantics``: only the encoder's padding
    keys are masked), every decoder position counts. Packed segments are kept apart.
    """
    dec_valid = (
        jnp.ones_like(decoder_input_tokens, bool)
        if decoder_target_tokens is None or padding_semantics == "hf"
        else decoder_target_tokens > 0
    )
    self_segments = cross_segments = None
    if decoder_segment_ids is not None:
        self_segments = (decoder_segment_ids, decoder_segment_ids)
        if encoder_segment_ids is not None:
            cross_segments = (decoder_segment_ids, encoder_segment_ids)
    self_mask = AttentionMask.from_padding(
        dec_valid, dec_valid, causal=True, segments=self_segments
    )
    cross_mask = AttentionMask.from_padding(dec_valid, encoder_tokens > 0, segments=cross_segments)
    return self_mask, cross_mask


class EncoderDecoder(nn.Module):
    """The full network; call signature follows T5X's ``EncoderDecoder``.

    Attributes:
      config: :class:`T5Config` (gin: ``EncoderDecoder.config = @T5Config()``).
    """

    config: T5Config = dataclasses.field(default_factory=T5Config)

    def setup(self) -> None:
        cfg = self.config
        self.token_embedder = Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=cfg.activation_dtype, param_dtype=cfg.parameter_dtype
        )
        self.encoder = Encoder(cfg, self.token_embedder)
        self.decoder = Decoder(cfg, self.token_embedder)

    def encode(
        self,
        encoder_input_tokens: jnp.ndarray,
        encoder_segment_ids: jnp.ndarray | None = None,
        *,
        enable_dropout: bool = True,
    ) -> jnp.ndarray:
        """``[batch, Le]`` tokens -> encoded ``[batch, Le, d_model]``."""
        mask = encoder_mask(
            encoder_input_tokens, encoder_segment_ids, self.config.padding_semantics
        )
        return self.encoder(encoder_input_tokens, mask, deterministic=not enable_dropout)

    def decode(
        self,
        encoded: jnp.ndarray,
        encoder_input_tokens: jnp.ndarray,
        decoder_input_tokens: jnp.ndarray,
        decoder_target_tokens: jnp.ndarray | None = None,
        encoder_segment_ids: jnp.ndarray | None = None,
        decoder_segment_ids: jnp.ndarray | None = None,
        *,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> jnp.ndarray:
        """Logits ``[batch, Ld, vocab]``; in ``decode`` mode one step ``[batch, 1]`` at a time."""
        if decode:
            self_mask = None  # the KV cache masks positions not yet written
            cross_mask = AttentionMask.from_padding(
                jnp.ones_like(decoder_input_tokens, bool), encoder_input_tokens > 0
            )
            padding_mask = None
        else:
            self_mask, cross_mask = decoder_masks(
                encoder_input_tokens,
                decoder_input_tokens,
                decoder_target_tokens,
                encoder_segment_ids,
                decoder_segment_ids,
                self.config.padding_semantics,
            )
            padding_mask = None if decoder_target_tokens is None else decoder_target_tokens > 0
        return self.decoder(
            encoded,
            decoder_input_tokens,
            self_mask,
            cross_mask,
            padding_mask,
            deterministic=not enable_dropout,
            decode=decode,
            max_decode_length=max_decode_length,
        )

    def __call__(
        self,
        encoder_input_tokens: jnp.ndarray,
        decoder_input_tokens: jnp.ndarray,
        decoder_target_tokens: jnp.ndarray | None = None,
        encoder_segment_ids: jnp.ndarray | None = None,
        decoder_segment_ids: jnp.ndarray | None = None,
        encoder_positions: jnp.ndarray | None = None,
        decoder_positions: jnp.ndarray | None = None,
        *,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> jnp.ndarray:
        """Logits ``[batch, Ld, vocab]`` from the EncDecFeatureConverter features.

        ``*_positions`` are accepted for interface parity with T5X and unused: relative
        positions are computed from ``arange`` (each packed segment is contiguous, so
        within-segment offsets agree and cross-segment pairs are masked).
        """
        del encoder_positions, decoder_positions
        encoded = self.encode(
            encoder_input_tokens, encoder_segment_ids, enable_dropout=enable_dropout
        )
        return self.decode(
            encoded,
            encoder_input_tokens,
            decoder_input_tokens,
            decoder_target_tokens,
            encoder_segment_ids,
            decoder_segment_ids,
            enable_dropout=enable_dropout,
            decode=decode,
            max_decode_length=max_decode_length,
        )
