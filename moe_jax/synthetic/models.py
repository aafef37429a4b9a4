"""Models of the laboratory: the soft MoE, dense MLP baselines and Appendix F's gated pair.

Every model is a frozen dataclass (hashable, so it can be a static jit argument) with

* ``init(key, x_train) -> params``: a dict with top-level keys ``"router"`` and/or
  ``"experts"`` (the optimizer gives each its own learning rate, ``train.make_optimizer``);
  ``x_train`` ``[n, d]`` is only read by the data-initialised router;
* ``apply(params, x, *, top1=False, expert_count=None) -> (pred [n, out], probs [n, E])``.

Inputs ``x`` are ``[n, d]``; ``[n, s, d]`` token sequences are routed token by token and the
per-token outputs summed (Appendix C.2); the CNN router takes ``x = (images, v)``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moe_jax.synthetic import experts, routers
from moe_jax.synthetic.routers import Params

Array = jax.Array


def _per_token(fn, x: Array):
    """Apply ``fn`` ([m, d] -> (pred [m, out], probs [m, E])) to ``[n, s, d]`` tokens and
    sum the predictions over the sequence; probs come back as ``[n, s, E]``."""
    n, s, d = x.shape
    pred, probs = fn(x.reshape(n * s, d))
    return pred.reshape(n, s, -1).sum(axis=1), probs.reshape(n, s, -1)


@dataclasses.dataclass(frozen=True)
class MoE:
    """f(x) = sum_i p_i(x) E_i(x) with p = softmax(router(x)) while training; the top-1
    expert's output at evaluation (Section 2).

    router: "linear" | "mlp" | "cnn"; expert: "constant" | "linear" | "mlp";
    router_init: "random" | "data" (rows of W = training examples, Theorem 2);
    router_scale: multiplies the random router's initial weights (N(0, 1/fan_in) at 1.0);
    d_in: the router's input dim (for "cnn", the dim of the vector v given to the experts).
    """

    router: str
    expert: str
    num_experts: int
    d_in: int
    d_out: int
    expert_hidden: int | None = None
    router_hidden: int = 96
    router_init: str = "random"
    router_scale: float = 1.0
    cnn_channels: tuple[int, ...] = (32, 64)
    cnn_features: int = 128

    def __post_init__(self) -> None:
        if self.router not in routers.ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of {routers.ROUTERS}")
        if self.expert not in experts.EXPERTS:
            raise ValueError(f"unknown expert {self.expert!r}; choose one of {experts.EXPERTS}")
        if self.router_init not in ("random", "data"):
            raise ValueError(f"router_init must be 'random' or 'data', got {self.router_init!r}")
        if self.router_init == "data" and self.router != "linear":
            raise ValueError("router_init='data' needs the linear router (Theorem 2)")

    @property
    def expert_in(self) -> int:
        return self.d_in + (self.cnn_features if self.router == "cnn" else 0)

    def init(self, key: Array, x_train: Array | None = None) -> Params:
        k_r, k_e = jax.random.split(key)
        if self.router_init == "data":
            if x_train is None:
                raise ValueError("router_init='data' needs x_train to draw the router rows from")
            router = routers.data_init(k_r, x_train, self.num_experts)
        elif self.router == "linear":
            router = routers.linear_init(k_r, self.d_in, self.num_experts)
        elif self.router == "mlp":
            router = routers.mlp_router_init(k_r, self.d_in, self.num_experts, self.router_hidden)
        else:
            router = routers.cnn_init(k_r, self.num_experts, self.cnn_channels, self.cnn_features)
        if self.router_init == "random":
            router = jax.tree.map(lambda w: self.router_scale * w, router)
        return {
            "router": router,
            "experts": experts.init(
                self.expert, k_e, self.num_experts, self.expert_in, self.d_out, self.expert_hidden
            ),
        }

    def apply(
        self, params: Params, x, *, top1: bool = False, expert_count: Array | None = None
    ) -> tuple[Array, Array]:
        if self.router != "cnn" and x.ndim == 3:
            return _per_token(
                lambda t: self.apply(params, t, top1=top1, expert_count=expert_count), x
            )
        if self.router == "cnn":
            images, v = x
            logits, features = routers.cnn_apply(params["router"], images)
            expert_x = jnp.concatenate([v, features], axis=-1)
        else:
            logits, _ = routers.apply(self.router, params["router"], x)
            expert_x = x
        if expert_count is not None:  # only the first `expert_count` experts exist (sweeps over E)
            logits = jnp.where(jnp.arange(self.num_experts) < expert_count, logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1)
        outputs = experts.apply(params["experts"], expert_x)  # [n, E, out]
        if top1:
            pred = jnp.take_along_axis(outputs, jnp.argmax(logits, axis=-1)[:, None, None], axis=1)[
                :, 0
            ]
        else:
            pred = jnp.einsum("ne,neo->no", probs, outputs)
        return pred, probs


@dataclasses.dataclass(frozen=True)
class Dense:
    """A ReLU MLP of ``depth`` layers and width ``hidden`` (the dense baselines, Section 3.1).

    Its params live under "experts" (it trains at the experts' learning rate); probs are a
    single expert with probability one.
    """

    d_in: int
    d_out: int
    hidden: int
    depth: int

    def init(self, key: Array, x_train: Array | None = None) -> Params:
        return {
            "experts": {
                "layers": routers.mlp_init(
                    key, [self.d_in] + [self.hidden] * (self.depth - 1) + [self.d_out]
                )
            }
        }

    def apply(
        self, params: Params, x: Array, *, top1: bool = False, expert_count: Array | None = None
    ) -> tuple[Array, Array]:
        if x.ndim == 3:
            return _per_token(lambda t: self.apply(params, t), x)
        return routers.mlp_apply(params["experts"]["layers"], x), jnp.ones((x.shape[0], 1))

    @classmethod
    def matching(cls, num_params: int, d_in: int, d_out: int, depth: int) -> Dense:
        """The depth-``depth`` MLP whose parameter count is closest to ``num_params``:
        solves (depth-2) h^2 + (d_in + d_out + depth - 1) h + d_out = num_params for h."""
        a, b, c = depth - 2, d_in + d_out + depth - 1, d_out - num_params
        h = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        return cls(d_in, d_out, max(1, round(h)), depth)


def count_params(params: Params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class GatedPair:
    """Appendix F: f(x) = p u + (1 - p)(-u) = (2p - 1) u, p = sigmoid(w^T x).

    Two constant experts +-u sharing one vector, gated by a single router vector w.
    ``init_scale`` sets the (small, "norms tending to 0") random initial norms.
    """

    d_in: int
    d_out: int
    init_scale: float = 1e-3

    def init(self, key: Array, x_train: Array | None = None) -> Params:
        k_w, k_u = jax.random.split(key)
        return {
            "router": {"w": self.init_scale * jax.random.normal(k_w, (self.d_in,))},
            "experts": {"u": self.init_scale * jax.random.normal(k_u, (self.d_out,))},
        }

    def apply(
        self, params: Params, x: Array, *, top1: bool = False, expert_count: Array | None = None
    ) -> tuple[Array, Array]:
        p = jax.nn.sigmoid(x @ params["router"]["w"])
        gate = jnp.sign(p - 0.5) if top1 else 2 * p - 1
        return gate[:, None] * params["experts"]["u"], jnp.stack([p, 1 - p], axis=-1)
