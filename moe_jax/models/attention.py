"""Multi-head dot-product attention (T5 style: no logit scaling, the query init absorbs
it), attention masks, and the key/value cache used for autoregressive decoding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, get_args

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from moe_jax.models.flash_attention import flash_attention
from moe_jax.moe.execution import target_platform

DType = Any


def make_attention_mask(
    query_input: jnp.ndarray,
    key_input: jnp.ndarray,
    pairwise_fn: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray] = jnp.logical_and,
) -> jnp.ndarray:
    """``[batch, q_len]`` x ``[batch, k_len]`` -> boolean mask ``[batch, 1, q_len, k_len]``.

    With the default ``pairwise_fn`` a pair is kept when both entries are non-zero
    (padding mask); ``jnp.equal`` on segment ids keeps pairs inside one packed segment.
    """
    mask = pairwise_fn(query_input[:, :, None], key_input[:, None, :])
    return mask[:, None].astype(bool)


def make_causal_mask(x: jnp.ndarray) -> jnp.ndarray:
    """``[batch, length]`` -> lower-triangular boolean mask ``[batch, 1, length, length]``."""
    idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    return make_attention_mask(idxs, idxs, jnp.greater_equal)


def combine_masks(*masks: jnp.ndarray | None) -> jnp.ndarray | None:
    """Logical AND of the given masks (``None`` entries are skipped; all ``None`` -> ``None``)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


@flax.struct.dataclass
class AttentionMask:
    """Which keys each query may attend to, in the two forms attention kernels take: a
    dense boolean array (the XLA path, decoding), and sequence lengths with a causal flag
    (fused kernels, which then need no ``[batch, heads, q_len, k_len]`` array at all).

    Attributes:
      dense: boolean ``[batch, 1, q_len, k_len]``; False = blocked.
      query_lengths: int32 ``[batch]``: each row's real queries are its first
        ``query_lengths`` positions (seqio pads at the end); None when rows are packed
        (segments), which only ``dense`` describes.
      key_lengths: int32 ``[batch]``, the same for keys; None with ``query_lengths``.
      causal: query ``i`` sees keys ``<= i`` only (static; already in ``dense``).
      query_segments: int32 ``[batch, q_len]``, ``0`` on padding queries, a row's segment
        id (1 when unpacked) on the others; None when only ``dense`` is known.
      key_segments: int32 ``[batch, k_len]``, the same for keys: query ``i`` sees key ``j``
        when ``query_segments[i] == key_segments[j] != 0`` (and ``j <= i`` when
        ``causal``), exactly ``dense`` (the form :mod:`moe_jax.models.flash_attention`
        takes, packed rows included).
    """

    dense: jax.Array
    query_lengths: jax.Array | None = None
    key_lengths: jax.Array | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=False)
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None

    @classmethod
    def from_padding(
        cls,
        query_valid: jax.Array,
        key_valid: jax.Array,
        *,
        causal: bool = False,
        segments: tuple[jax.Array, jax.Array] | None = None,
    ) -> AttentionMask:
        """The mask of ``query_valid [batch, q_len]`` x ``key_valid [batch, k_len]``
        (True = a real token), causal or not; ``segments`` (query and key segment ids)
        keeps packed segments apart, and then no lengths are given."""
        dense = combine_masks(
            make_attention_mask(query_valid, key_valid),
            make_causal_mask(query_valid) if causal else None,
            None if segments is None else make_attention_mask(*segments, jnp.equal),
        )
        assert dense is not None  # the padding mask is always there
        q_ids, k_ids = (jnp.ones_like(query_valid), jnp.ones_like(key_valid))
        if segments is not None:  # seqio's ids: 1, 2, ... on real tokens
            q_ids, k_ids = segments
        query_segments = jnp.where(query_valid, q_ids, 0).astype(jnp.int32)
        key_segments = jnp.where(key_valid, k_ids, 0).astype(jnp.int32)
        if segments is not None:
            return cls(
                dense, causal=causal, query_segments=query_segments, key_segments=key_segments
            )
        return cls(
            dense,
            query_lengths=jnp.sum(query_valid, axis=-1, dtype=jnp.int32),
            key_lengths=jnp.sum(key_valid, axis=-1, dtype=jnp.int32),
            causal=causal,
            query_segments=query_segments,
            key_segments=key_segments,
        )


@jax.custom_vjp
def logits_in_float32(query: jnp.ndarray, key: jnp.ndarray) -> jnp.ndarray:
    """``q k^T`` of ``[batch, q_len, heads, head_dim]`` x ``[batch, k_len, heads, head_dim]``
    -> float32 ``[batch, heads, q_len, k_len]``, from inputs kept in their own dtype.

    The matmul accumulates in float32 and returns float32: with bfloat16 inputs every
    product is exact there, so the logits equal those of the inputs cast to float32, from
    a bfloat16 matmul (half the bytes, twice a GPU's TF32 rate). Its backward pass rounds
    the float32 logits' cotangent to the inputs' dtype for the two gradient matmuls, as
    fused (flash) attention kernels do and as a TPU's default-precision float32 matmul does
    anyway; without this JAX would multiply the float32 cotangent in float32.
    """
    return jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)


def _logits_in_float32_fwd(
    query: jnp.ndarray, key: jnp.ndarray
) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray]]:
    return logits_in_float32(query, key), (query, key)


def _logits_in_float32_bwd(
    residuals: tuple[jnp.ndarray, jnp.ndarray], cotangent: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    query, key = residuals
    cotangent = cotangent.astype(jnp.promote_types(query.dtype, key.dtype))
    return (
        jnp.einsum("bhqk,bkhd->bqhd", cotangent, key).astype(query.dtype),
        jnp.einsum("bhqk,bqhd->bkhd", cotangent, query).astype(key.dtype),
    )


logits_in_float32.defvjp(_logits_in_float32_fwd, _logits_in_float32_bwd)


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` summed over the axes that ``shape`` broadcasts (the gradient of a broadcast)."""
    x = jnp.sum(x, axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def softmax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dtype: DType,
) -> jax.Array:
    """``softmax(q k^T + bias, masked) v`` with float32 logits (:func:`logits_in_float32`),
    whose backward pass keeps only the probabilities in ``dtype``, as flash attention's
    does: the softmax gradient's row term ``sum_k P dP`` is ``sum_d dO O`` (``O = P V``),
    read from the ``[batch, q_len, heads, head_dim]`` output and its cotangent, so the
    float32 ``[batch, heads, q_len, k_len]`` logits are written once and never read back
    by the backward pass. The logits' cotangent is rounded to ``dtype`` for the q / k
    gradient matmuls (as in :func:`logits_in_float32`); the bias gradient is the float32
    cotangent summed over the batch.

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key: ``[batch, k_len, heads, head_dim]``.
      value: ``[batch, k_len, heads, head_dim]``.
      bias: broadcastable to ``[batch, heads, q_len, k_len]``, or None.
      mask: boolean, broadcastable to ``[batch, heads, q_len, k_len]``, or None.
      dtype: the probabilities' and the output's dtype.
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``dtype``.
    """
    return _softmax_attention_fwd(query, key, value, bias, mask, dtype)[0]


def _softmax_attention_fwd(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dtype: DType,
) -> tuple[jax.Array, tuple[Any, ...]]:
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + jnp.asarray(bias, jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.asarray(-1e10, jnp.float32))
    # the barrier keeps the compiler from recomputing the probabilities from the float32
    # logits in the backward pass (which would keep the logits alive and read them again)
    probs = jax.lax.optimization_barrier(jax.nn.softmax(logits).astype(dtype))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, jnp.asarray(value, dtype))
    return out, (query, key, value, bias, mask, probs, out)


def _softmax_attention_bwd(
    dtype: DType, residuals: tuple[Any, ...], d_out: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, None]:
    query, key, value, bias, mask, probs, out = residuals
    d_value = jnp.einsum("bhqk,bqhd->bkhd", probs, d_out).astype(value.dtype)
    d_probs = jnp.einsum("bqhd,bkhd->bhqk", d_out, jnp.asarray(value, dtype))
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, q, h]
    row = jnp.swapaxes(row, 1, 2)  # = sum_k P dP, [batch, heads, q_len]
    d_logits = probs.astype(jnp.float32) * (d_probs.astype(jnp.float32) - row[..., None])
    if mask is not None:
        d_logits = jnp.where(mask, d_logits, 0.0)
    d_bias = None if bias is None else _sum_to_shape(d_logits, bias.shape).astype(bias.dtype)
    d_logits = d_logits.astype(jnp.promote_types(query.dtype, key.dtype))
    return (
        jnp.einsum("bhqk,bkhd->bqhd", d_logits, key).astype(query.dtype),
        jnp.einsum("bhqk,bqhd->bkhd", d_logits, query).astype(key.dtype),
        d_value,
        d_bias,
        None,
    )


softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def dot_product_attention(
    query: jnp.ndarray,
    key: jnp.ndarray,
    value: jnp.ndarray,
    bias: jnp.ndarray | None = None,
    mask: jnp.ndarray | None = None,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dtype: DType = jnp.float32,
    float32_logits: bool = True,
) -> jnp.ndarray:
    """Softmax(q k^T + bias, masked) v, without 1/sqrt(d) scaling (T5 convention).

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key: ``[batch, k_len, heads, head_dim]``.
      value: ``[batch, k_len, heads, head_dim]``.
      bias: broadcastable to ``[batch, heads, q_len, k_len]`` (relative positions).
      mask: boolean, broadcastable to ``[batch, heads, q_len, k_len]``; False = blocked.
      dtype: the softmax weights' and the output's dtype.
      float32_logits: logits, bias, mask and softmax in float32 (:func:`logits_in_float32`;
        without attention dropout: :func:`softmax_attention`, whose backward pass reads
        the probabilities, not the logits); False: in the dtype of ``query`` and ``key``.
    Returns:
      ``[batch, q_len, heads, head_dim]``.
    """
    if float32_logits and (deterministic or dropout_rate == 0.0):
        return softmax_attention(query, key, value, bias, mask, dtype)
    if float32_logits:
        logits = logits_in_float32(query, key)
    else:
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)
    if bias is not None:
        logits = logits + jnp.asarray(bias, logits.dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.asarray(-1e10, logits.dtype))
    weights = jax.nn.softmax(logits).astype(dtype)
    if not deterministic and dropout_rate > 0.0:
        assert dropout_rng is not None, "dropout needs dropout_rng"
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = weights * keep.astype(dtype) / jnp.asarray(1.0 - dropout_rate, dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.asarray(value, dtype))


# Who computes softmax(q k^T + bias) v in training and evaluation (decoding steps always
# use ``dot_product_attention``): ``xla`` is ``dot_product_attention`` (every platform);
# ``cudnn`` is cuDNN's fused (flash) attention through ``jax.nn.dot_product_attention``
# (NVIDIA GPUs, bfloat16/float16 activations, no attention dropout), which never writes
# the ``[batch, heads, q_len, k_len]`` logits to memory; ``pallas`` is the project's own
# flash kernel (:mod:`moe_jax.models.flash_attention`: Triton on NVIDIA GPUs, Pallas's
# interpreter elsewhere; no attention dropout), which takes padding and packed segments as
# ids and reduces the shared bias's gradient over the batch in a kernel.
AttentionKernel = Literal["xla", "cudnn", "pallas"]
ATTENTION_KERNELS: tuple[AttentionKernel, ...] = get_args(AttentionKernel)


def fused_attention(
    query: jnp.ndarray,
    key: jnp.ndarray,
    value: jnp.ndarray,
    bias: jnp.ndarray | None,
    mask: AttentionMask | None,
    dtype: DType,
    implementation: Literal["xla", "cudnn"] = "cudnn",
) -> jnp.ndarray:
    """``dot_product_attention`` (unscaled, softmax in float32) as cuDNN's fused kernel
    (``implementation="xla"``: the same call through jax's reference, for checks on CPU).

    The kernel gets what it needs and no more: padding as sequence lengths and causality
    as its mask type (``mask.dense`` only for packed rows, broadcast over heads), the
    bias as given (``[1, heads, q, k]``: shared over the batch, its gradient reduced over
    the batch inside the kernel). Rows past ``mask.query_lengths`` are padding: their
    outputs differ from the XLA path's (which averages over every key) and are never read.

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key: ``[batch, k_len, heads, head_dim]``.
      value: ``[batch, k_len, heads, head_dim]``.
      bias: ``[1 or batch, heads, q_len, k_len]`` or None.
      mask: :class:`AttentionMask` or None (attend everywhere).
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``dtype``.
    """
    query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
    masking: dict[str, Any] = {}
    if mask is not None and mask.query_lengths is not None:
        masking = dict(
            query_seq_lengths=mask.query_lengths,
            key_value_seq_lengths=mask.key_lengths,
            is_causal=mask.causal,
        )
    elif mask is not None:
        shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        masking = dict(mask=jnp.broadcast_to(mask.dense, shape))
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=None if bias is None else jnp.asarray(bias, dtype),
        scale=1.0,
        implementation=implementation,
        **masking,
    )


def check_kernel_platform(kernel: AttentionKernel, platform: str) -> None:
    """Refuses a fused kernel compiled for a platform it does not run on: ``'pallas'``
    runs Triton on NVIDIA GPUs and Pallas's interpreter on a CPU (tests), never on a TPU.

    Raises:
      ValueError: naming the option, the platform and what to use instead.
    """
    if kernel == "pallas" and platform == "tpu":
        raise ValueError(
            "T5Config.attention_kernel='pallas' is a Triton kernel for NVIDIA GPUs; this "
            "step is compiled for a TPU: use attention_kernel = 'xla'"
        )


def _pallas_attention(
    query: jnp.ndarray,
    key: jnp.ndarray,
    value: jnp.ndarray,
    bias: jnp.ndarray | None,
    mask: AttentionMask | None,
    dtype: DType,
) -> jnp.ndarray:
    """``[batch, q_len, heads, head_dim]`` attention through
    :func:`moe_jax.models.flash_attention.flash_attention`, ``mask`` as its segment ids
    (None: every key of every row), the bias shared over the batch
    (``[1, heads, q_len, k_len]``), as T5's relative-position bias is.

    Under a mesh (``jax.set_mesh``) the kernel runs on each device's share, in
    ``shard_map``: the batch split as the logical axis rules split ``batch`` and the heads
    as they split ``heads`` (the lengths and head_dim whole: a compiler cannot partition a
    custom kernel itself); the bias gradient is summed over the batch's devices."""
    mesh = jax.sharding.get_abstract_mesh()
    check_kernel_platform("pallas", target_platform(None if mesh.empty else mesh))
    batch, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
    if mask is None:
        q_segments = jnp.ones((batch, q_len), jnp.int32)
        k_segments = jnp.ones((batch, k_len), jnp.int32)
        causal = False
    elif mask.query_segments is None or mask.key_segments is None:
        raise ValueError(
            "T5Config.attention_kernel='pallas' needs the mask's segment ids "
            "(AttentionMask.from_padding); this mask has only its dense form"
        )
    else:
        q_segments, k_segments, causal = mask.query_segments, mask.key_segments, mask.causal

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, b: Any, qs: jax.Array, ks: jax.Array):
        return flash_attention(q, k, v, b, qs, ks, causal=causal)

    query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
    args = (query, key, value, bias, q_segments, k_segments)
    if mesh.empty or mesh.size == 1:
        return attend(*args)
    # no rules in force: every device computes the whole (replicated) attention
    spec = nn.logical_to_mesh_axes(("batch", "heads")) or (None, None)
    batch_axes, head_axes = spec[0], spec[1]
    rows = jax.P(batch_axes, None, head_axes, None)
    ids = jax.P(batch_axes, None)
    return jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(rows, rows, rows, None if bias is None else jax.P(None, head_axes), ids, ids),
        out_specs=rows,
        check_vma=False,
    )(*args)


class MultiHeadDotProductAttention(nn.Module):
    """Multi-head attention with ``num_heads x head_dim`` independent of d_model.

    Parameters (logical axes): ``query``/``key``/``value`` ``[embed, heads, kv]``,
    ``out`` ``[heads, kv, embed]``.

    In ``decode`` mode a ``cache`` collection holds ``cached_key``/``cached_value``
    ``[batch, max_length, heads, head_dim]`` and ``cache_index``. The first call (with a
    full-length input, used only to create the cache) runs normally; each later call
    takes one token, appends its key/value at ``cache_index``, attends to positions
    ``<= cache_index`` and slices row ``cache_index`` of a full-length ``bias``.

    Attributes:
      num_heads: attention heads.
      head_dim: size of each head (the paper keeps 64 at d_model 32).
      dtype: activation dtype.
      param_dtype: parameter dtype.
      dropout_rate: dropout on the attention weights.
      float32_logits: the logits and their softmax in float32, q.k accumulated in float32
        from q and k in ``dtype`` (:func:`logits_in_float32`; recommended with bf16).
      kernel: one of :data:`ATTENTION_KERNELS` (``cudnn`` needs a bfloat16/float16
        ``dtype``; ``cudnn`` and ``pallas`` no attention dropout; decoding steps always
        use ``xla``).
    """

    num_heads: int
    head_dim: int
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    dropout_rate: float = 0.0
    float32_logits: bool = True
    kernel: AttentionKernel = "xla"

    def _projection(self, name: str, x: jnp.ndarray, init_scale: float) -> jnp.ndarray:
        """``[batch, length, d_model] -> [batch, length, heads, head_dim]``."""
        init = nn.initializers.variance_scaling(
            init_scale, "fan_in", "normal", in_axis=0, out_axis=(1, 2)
        )
        kernel = self.param(
            name,
            nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
            (x.shape[-1], self.num_heads, self.head_dim),
            self.param_dtype,
        )
        y = jnp.einsum("bld,dhk->blhk", jnp.asarray(x, self.dtype), jnp.asarray(kernel, self.dtype))
        return nn.with_logical_constraint(y, ("batch", "length", "heads", "kv"))

    def _update_cache(
        self, key: jnp.ndarray, value: jnp.ndarray, bias: jnp.ndarray | None
    ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray | None, jnp.ndarray | None]:
        """Writes one step into the cache; returns full keys/values, step mask and bias row."""
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialized:
            return key, value, None, bias
        if key.shape[1] != 1:
            raise ValueError(
                f"decode=True takes one token per call after the cache is "
                f"initialised; got a query of length {key.shape[1]}"
            )
        index = cache_index.value
        cache_axes = ("cache_batch", "cache_length", "cache_heads", "cache_kv")
        key = jax.lax.dynamic_update_slice(
            cached_key.value, key.astype(cached_key.value.dtype), (0, index, 0, 0)
        )
        value = jax.lax.dynamic_update_slice(
            cached_value.value, value.astype(cached_value.value.dtype), (0, index, 0, 0)
        )
        cached_key.value = nn.with_logical_constraint(key, cache_axes)
        cached_value.value = nn.with_logical_constraint(value, cache_axes)
        cache_index.value = index + 1
        max_length = key.shape[1]
        step_mask = (jnp.arange(max_length) <= index)[None, None, None, :]
        if bias is not None:
            bias = jax.lax.dynamic_slice_in_dim(bias, index, 1, axis=2)
        return key, value, step_mask, bias

    @nn.compact
    def __call__(
        self,
        inputs_q: jnp.ndarray,
        inputs_kv: jnp.ndarray,
        mask: AttentionMask | None = None,
        bias: jnp.ndarray | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
    ) -> jnp.ndarray:
        """Attends ``inputs_q [batch, q_len, d_model]`` to ``inputs_kv [batch, k_len, d_model]``.

        Args:
          mask: :class:`AttentionMask` (None = attend everywhere).
          bias: ``[1 or batch, heads, q_len, k_len]`` added to the logits.
          deterministic: disables attention dropout.
          decode: use and update the KV cache (decoder self-attention only).
        Returns:
          ``[batch, q_len, d_model]``.
        """
        features = inputs_q.shape[-1]
        # T5: logits are not divided by sqrt(head_dim); the query init is scaled instead.
        query = self._projection("query", inputs_q, 1.0 / self.head_dim)
        key = self._projection("key", inputs_kv, 1.0)
        value = self._projection("value", inputs_kv, 1.0)
        if decode:
            key, value, step_mask, bias = self._update_cache(key, value, bias)
            dense = combine_masks(None if mask is None else mask.dense, step_mask)
            mask = None if dense is None else AttentionMask(dense)
        dropout_rng = (
            None if deterministic or self.dropout_rate == 0.0 else self.make_rng("dropout")
        )
        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"T5Config.attention_kernel={self.kernel!r} is unknown; "
                f"choose one of {ATTENTION_KERNELS}"
            )
        if self.kernel != "xla" and not decode and dropout_rng is not None:
            raise ValueError(
                f"T5Config.attention_kernel={self.kernel!r} has no attention dropout: "
                "set T5Config.dropout_rate = 0.0 or attention_kernel = 'xla'"
            )
        if self.kernel == "cudnn" and not decode:
            heads_out = fused_attention(query, key, value, bias, mask, self.dtype)
        elif self.kernel == "pallas" and not decode:
            heads_out = _pallas_attention(query, key, value, bias, mask, self.dtype)
        else:
            heads_out = dot_product_attention(
                query,
                key,
                value,
                bias=bias,
                mask=None if mask is None else mask.dense,
                dropout_rng=dropout_rng,
                dropout_rate=self.dropout_rate,
                deterministic=deterministic,
                dtype=self.dtype,
                float32_logits=self.float32_logits,
            )
        heads_out = nn.with_logical_constraint(heads_out, ("batch", "length", "heads", "kv"))
        out_kernel = self.param(
            "out",
            nn.with_logical_partitioning(
                nn.initializers.variance_scaling(
                    1.0, "fan_in", "normal", in_axis=(0, 1), out_axis=2
                ),
                ("heads", "kv", "embed"),
            ),
            (self.num_heads, self.head_dim, features),
            self.param_dtype,
        )
        out = jnp.einsum("blhk,hkd->bld", heads_out, jnp.asarray(out_kernel, self.dtype))
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))
