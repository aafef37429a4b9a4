"""Experts, stacked over a leading expert axis E so that all experts run in one einsum.

``apply(kind, params, x)`` maps ``x`` ``[n, d]`` to every expert's output ``[n, E, out]``;
the MoE (``models.MoE``) then mixes them with the router probabilities (training) or picks
the top-1 expert (evaluation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.synthetic.routers import Params

Array = jax.Array

EXPERTS = ("constant", "linear", "mlp")


def init(
    kind: str, key: Array, num_experts: int, d: int, out: int, hidden: int | None = None
) -> Params:
    """Parameters of ``num_experts`` experts of ``kind``.

    constant: u ``[E, out]`` (a learned vector, small init as in Appendix F);
    linear: w ``[E, d, out]``, b ``[E, out]``;
    mlp: depth 3, d -> hidden -> hidden -> out (hidden defaults to 4 d, Appendix C.1),
    each layer w ``[E, in, out]``, b ``[E, out]``.
    """
    if kind == "constant":
        return {"u": 0.01 * jax.random.normal(key, (num_experts, out))}
    if kind == "linear":
        return {"layers": [_stacked_dense(key, num_experts, d, out)]}
    if kind == "mlp":
        hidden = 4 * d if hidden is None else hidden
        keys = jax.random.split(key, 3)
        sizes = [d, hidden, hidden, out]
        return {
            "layers": [
                _stacked_dense(k, num_experts, a, b)
                for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
            ]
        }
    raise ValueError(f"unknown expert kind {kind!r}; choose one of {EXPERTS}")


def _stacked_dense(key: Array, num_experts: int, fan_in: int, fan_out: int) -> Params:
    return {
        "w": jax.random.normal(key, (num_experts, fan_in, fan_out)) / fan_in**0.5,
        "b": jnp.zeros((num_experts, fan_out)),
    }


def apply(params: Params, x: Array) -> Array:
    """Every expert on every input: ``x`` ``[n, d]`` -> ``[n, E, out]``."""
    if "u" in params:
        return jnp.broadcast_to(params["u"], (x.shape[0], *params["u"].shape))
    layers = params["layers"]
    h = jnp.einsum("nd,edh->neh", x, layers[0]["w"]) + layers[0]["b"]
    for layer in layers[1:]:
        h = jnp.einsum("neh,ehk->nek", jax.nn.relu(h), layer["w"]) + layer["b"]
    return h


def num_params(params: Params) -> int:
    """Parameters of one expert (the stack's total divided by E)."""
    leaves = jax.tree.leaves(params)
    return sum(leaf.size for leaf in leaves) // leaves[0].shape[0]
