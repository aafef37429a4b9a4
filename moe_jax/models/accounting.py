"""Parameter counts and analytic FLOPs of the T5 (MoE) network."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from moe_jax import param_paths
from moe_jax.models.t5 import T5Config
from moe_jax.moe.config import MoeConfig


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What FLOP accounting needs to know of the MoE layers.

    Attributes:
      num_experts: experts per MoE layer (router width).
      num_selected_experts: experts each token is processed by (top-k).
      expert_mlp_dim: d_ff of one expert.
      num_input_matrices: input projections per expert (2 for gated GELU, 1 for ReLU).
      shared_mlp_dim: total hidden width of the always-active shared experts (0: none).

    With fine-grained experts (granularity m) ``num_experts`` and ``num_selected_experts``
    are the routed ``m * E`` and ``m * k``, ``expert_mlp_dim`` is ``d_ff / m``.
    """

    num_experts: int
    num_selected_experts: int
    expert_mlp_dim: int
    num_input_matrices: int
    shared_mlp_dim: int = 0


def moe_shape(config: MoeConfig) -> MoeShape:
    """The :class:`MoeShape` of an MoE layer's config (routed experts after granularity,
    assignments per token, shared experts' total width)."""
    return MoeShape(
        config.routed_experts,
        config.choices_per_token,
        config.expert_d_ff,
        2 if config.activation == "gated_gelu" else 1,
        config.num_shared_experts * config.shared_d_ff,
    )


def num_params(params: Any) -> int:
    """Total number of parameters (boxed ``nn.Partitioned`` or plain arrays)."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params))))


def _group(path: str) -> str:
    """Coarse category of a parameter path, for the start-up summary."""
    for key, group in (
        ("router", "moe router"),
        ("/moe/", "moe experts"),
        ("token_embedder", "embedding"),
        ("logits_dense", "logits"),
        ("relpos", "relative positions"),
        ("attention", "attention"),
        ("/mlp/", "dense mlp"),
        ("norm", "layer norms"),
    ):
        if key in f"/{path}/":
            return group
    return "other"


def describe_params(params: Any) -> str:
    """A table of every parameter (path, shape, logical axes, count) and totals by group."""
    logical = nn.get_partition_spec(params)
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(params))[0]
    specs = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    rows: list[str] = []
    groups: dict[str, int] = {}
    for (path, leaf), spec in zip(flat, specs, strict=True):
        name = param_paths.path_name(path)
        count = int(np.prod(leaf.shape))
        groups[_group(name)] = groups.get(_group(name), 0) + count
        rows.append(f"  {name:<70} {tuple(leaf.shape)!s:<20} {tuple(spec)!s:<36} {count:>12,}")
    total = sum(groups.values())
    lines = ["Parameters:", *rows, "By group:"]
    lines += [
        f"  {g:<20} {c:>14,}  ({100.0 * c / max(total, 1):5.1f}%)"
        for g, c in sorted(groups.items())
    ]
    lines.append(f"Total parameters: {total:,}")
    return "\n".join(lines)


def forward_flops_per_example(config: T5Config, encoder_length: int, decoder_length: int) -> float:
    """Forward-pass FLOPs (2 per multiply-add) of one example, matmuls only.

    Counts every projection, the attention scores and weighted sums (full, not halved for
    causality), the dense MLPs, the logits, and for MoE layers the router plus the
    ``num_selected_experts`` experts each token uses and the shared experts (active experts only:
    capacity padding and dispatch/combine einsums are not counted). Norms, softmax and element-wise
    work are ignored. Each stack's MoE layers have the shape of its MoE config
    (``T5Config.moe_config``).
    """
    d, hk, V = config.emb_dim, config.num_heads * config.head_dim, config.vocab_size
    n_in = len(config.mlp_activations)

    def ffn_macs(sparse: bool, stack: str) -> float:
        if not sparse:
            return (n_in + 1) * d * config.mlp_dim
        if config.sparse_layer_type == "dense":
            assert config.flop_matched_mlp_dim  # T5Config refuses a dense sparse layer without it
            return (n_in + 1) * d * config.flop_matched_mlp_dim
        moe = moe_shape(config.moe_config(stack))
        expert = (moe.num_input_matrices + 1) * d * moe.expert_mlp_dim
        shared = (moe.num_input_matrices + 1) * d * moe.shared_mlp_dim
        return d * moe.num_experts + moe.num_selected_experts * expert + shared

    Le, Ld = encoder_length, decoder_length
    macs = 0.0
    enc_sparse, dec_sparse = config.sparse_layers("encoder"), config.sparse_layers("decoder")
    for i in range(config.num_encoder_layers):
        macs += Le * (4 * d * hk + 2 * Le * hk + ffn_macs(i in enc_sparse, "encoder"))
    for i in range(config.num_decoder_layers):
        self_attn = Ld * (4 * d * hk + 2 * Ld * hk)
        cross_attn = Ld * (2 * d * hk + 2 * Le * hk) + Le * 2 * d * hk
        macs += self_attn + cross_attn + Ld * ffn_macs(i in dec_sparse, "decoder")
    macs += Ld * d * V
    return 2.0 * macs
