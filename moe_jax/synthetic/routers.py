"""Routers: functions from inputs to routing logits over E experts (Section 2).

Parameters are plain dicts of arrays. Every ``apply_*`` returns ``(logits, features)``:
``logits`` ``[n, E]`` and ``features`` ``[n, f]`` (the CNN's penultimate layer, handed to the
experts in the CIFAR-100 task) or ``None``.

Router *modes* are realised elsewhere: "learned" and "frozen" differ only in the optimizer
(``train.make_optimizer`` zeroes a frozen router's updates), "data" initialisation sets the
linear router's rows to training examples (Theorem 2), and the "shuffled" baseline
(Section 2.1) permutes the input columns of a trained router (``shuffle_columns``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Params = dict[str, Any]

ROUTERS = ("linear", "mlp", "cnn")


def dense_init(key: Array, fan_in: int, fan_out: int) -> Params:
    """One dense layer: w ``[fan_in, fan_out]`` ~ N(0, 1/fan_in), b ``[fan_out]`` = 0."""
    return {"w": jax.random.normal(key, (fan_in, fan_out)) / fan_in**0.5, "b": jnp.zeros(fan_out)}


def mlp_init(key: Array, sizes: list[int]) -> list[Params]:
    """An MLP with layer widths ``sizes`` (``[d_in, h, ..., d_out]``)."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [dense_init(k, a, b) for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def mlp_apply(layers: list[Params], x: Array) -> Array:
    """ReLU MLP: ``x`` ``[..., d_in]`` -> ``[..., d_out]`` (no activation after the last layer)."""
    for layer in layers[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


# --- linear: softmax(W x), W [E, d] (rows are the per-expert router vectors w_i) ---------


def linear_init(key: Array, d: int, num_experts: int) -> Params:
    """W ``[E, d]`` ~ N(0, 1/d)."""
    return {"w": jax.random.normal(key, (num_experts, d)) / d**0.5}


def data_init(key: Array, x_train: Array, num_experts: int) -> Params:
    """Theorem 2's initialisation: the rows of W ``[E, d]`` are random training examples
    (``x_train`` ``[n, d]``, drawn without replacement)."""
    index = jax.random.choice(key, x_train.shape[0], (num_experts,), replace=False)
    return {"w": x_train[index]}


def linear_apply(params: Params, x: Array) -> tuple[Array, None]:
    """``x`` ``[n, d]`` -> logits ``[n, E]``."""
    return x @ params["w"].T, None


# --- depth-3 MLP router (mixture of subspaces, Appendix C.1) -------------------------------


def mlp_router_init(key: Array, d: int, num_experts: int, hidden: int) -> Params:
    """d -> hidden -> hidden -> E."""
    return {"layers": mlp_init(key, [d, hidden, hidden, num_experts])}


def mlp_router_apply(params: Params, x: Array) -> tuple[Array, None]:
    """``x`` ``[n, d]`` -> logits ``[n, E]``."""
    return mlp_apply(params["layers"], x), None


# --- CNN router (CIFAR-100, Section 3.4), pure JAX via lax.conv ----------------------------


def cnn_init(
    key: Array,
    num_experts: int,
    channels: tuple[int, ...] = (32, 64),
    hidden: int = 128,
    in_channels: int = 3,
) -> Params:
    """3x3 convs (stride 2) with ``channels``, global average pool, dense ``hidden`` (the
    penultimate features), dense -> E logits."""
    keys = jax.random.split(key, len(channels) + 2)
    convs, c_in = [], in_channels
    for k, c_out in zip(keys[:-2], channels, strict=True):
        convs.append(
            {
                "w": jax.random.normal(k, (3, 3, c_in, c_out)) / (9 * c_in) ** 0.5,
                "b": jnp.zeros(c_out),
            }
        )
        c_in = c_out
    return {
        "convs": convs,
        "hidden": dense_init(keys[-2], c_in, hidden),
        "out": dense_init(keys[-1], hidden, num_experts),
    }


def cnn_apply(params: Params, images: Array) -> tuple[Array, Array]:
    """``images`` ``[n, H, W, C]`` (float, ~unit scale) -> (logits ``[n, E]``, features
    ``[n, hidden]``)."""
    h = images
    for conv in params["convs"]:
        h = jax.lax.conv_general_dilated(
            h, conv["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        h = jax.nn.relu(h + conv["b"])
    h = h.mean(axis=(1, 2))
    features = jax.nn.relu(h @ params["hidden"]["w"] + params["hidden"]["b"])
    return features @ params["out"]["w"] + params["out"]["b"], features


def apply(kind: str, params: Params, x: Array) -> tuple[Array, Array | None]:
    """Dispatch on the router ``kind`` (one of ``ROUTERS``)."""
    return {"linear": linear_apply, "mlp": mlp_router_apply, "cnn": cnn_apply}[kind](params, x)


def input_weight(kind: str, params: Params) -> Array:
    """The router weights that read the input, as ``[E or hidden, d]`` (rows per unit)."""
    if kind == "linear":
        return params["w"]
    if kind == "mlp":
        return params["layers"][0]["w"].T
    raise ValueError(f"router {kind!r} has no input weight matrix over a feature vector")


def expert_weight(kind: str, params: Params) -> Array:
    """The router weights feeding each expert's logit, ``[E, fan_in]`` (the M_i of the
    norm-uniformity metric, Appendix C.1): W's rows for the linear router, the last layer's
    columns for the MLP router."""
    if kind == "linear":
        return params["w"]
    if kind == "mlp":
        return params["layers"][-1]["w"].T
    raise ValueError(f"expert_weight is defined for 'linear' and 'mlp' routers, not {kind!r}")


def shuffle_columns(kind: str, params: Params, key: Array) -> Params:
    """The shuffled-router baseline of Section 2.1: the columns of W (input dims) permuted.

    Keeps every statistic of the entries of W (norms, scale) but breaks its alignment with
    the data. For the MLP router the first layer's input rows are permuted.
    """
    if kind == "linear":
        perm = jax.random.permutation(key, params["w"].shape[1])
        return {"w": params["w"][:, perm]}
    if kind == "mlp":
        first, *rest = params["layers"]
        perm = jax.random.permutation(key, first["w"].shape[0])
        return {"layers": [{"w": first["w"][perm], "b": first["b"]}, *rest]}
    raise ValueError(f"shuffled router is defined for 'linear' and 'mlp' routers, not {kind!r}")
