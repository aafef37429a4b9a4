"""Small shared helpers for the MoE tests (imported by the test modules)."""

from __future__ import annotations

from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.moe import CapacityConfig, MoeConfig, MoeLayer, TopKRouterConfig
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION

# A small layer: 4 experts of d_ff 16, top-2, routing groups of 16 tokens, capacity >= 1.
# Tests change it with ``dataclasses.replace`` (a part: ``replace(SMALL.capacity, ...)``).
SMALL = MoeConfig(
    num_experts=4,
    d_ff=16,
    router=TopKRouterConfig(num_selected_experts=2),
    capacity=CapacityConfig(group_size=16, min_expert_capacity=1),
)


# The references the model file binds (gin/models/t5_moe.gin: the MoE config and each of its
# parts built from its own bindings), for tests that parse router files without it.
MODEL_FILE_REFERENCES: dict[str, str] = {
    "T5Config.moe": "@MoeConfig()",
    "MoeConfig.router": "@TopKRouterConfig()",
    "MoeConfig.capacity": "@CapacityConfig()",
    "MoeConfig.execution": "@ExecutionConfig()",
    "MoeConfig.losses": "@AuxLossConfig()",
}


def make_inputs(batch: int = 4, length: int = 8, d_model: int = 8, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, d_model))


def _split(kwargs: dict) -> tuple[dict, dict]:
    static = {k: v for k, v in kwargs.items() if isinstance(v, bool)}
    return static, {k: v for k, v in kwargs.items() if k not in static}


def init_params(layer: MoeLayer, x: jax.Array, **kwargs) -> dict:
    """Unboxed params of ``layer`` (jitted init)."""
    static, dynamic = _split(kwargs)
    init = jax.jit(lambda key, x, kw: layer.init(key, x, **kw, **static))
    return nn.unbox(init(jax.random.PRNGKey(1), x, dynamic)["params"])


def apply(layer: MoeLayer, params: dict, x: jax.Array, **kwargs):
    """Jitted apply; returns (outputs, sown collections)."""
    static, dynamic = _split(kwargs)
    fn = jax.jit(
        lambda p, x, kw: layer.apply(
            {"params": p},
            x,
            mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION],
            **kw,
            **static,
        )
    )
    return fn(params, x, dynamic)


def metric(state: dict, name: str) -> jax.Array:
    return state[MOE_METRICS_COLLECTION][name][0]


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all``'s documented semantics from a dense ``all_to_all``, for
    XLA:CPU, which cannot compile the primitive (its lowering is only compile-tested, for TPU).
    Slice ``i`` (``len(input_offsets) / axis size`` per destination) is cut out of
    ``operand`` padded to ``operand``'s length, all-to-all'd, and written into ``output`` at
    the offset its sender chose; ``tests/moe/test_ragged_expert_parallel.py`` checks it on the
    example in jax's docstring."""
    rows = jnp.arange(operand.shape[0])
    take = input_offsets[:, None] + rows
    chunks = jnp.where(
        (rows < send_sizes[:, None]).reshape(take.shape + (1,) * (operand.ndim - 1)),
        operand[jnp.clip(take, 0, operand.shape[0] - 1)],
        0,
    )  # [slices, n, ...]
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    starts = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    put = jnp.where(
        rows < recv_sizes[:, None], starts[:, None] + rows, output.shape[0]
    )  # past the end: dropped
    return output.at[put.reshape(-1)].set(received.reshape((-1, *operand.shape[1:])), mode="drop")


def compile_fwd_bwd(layer: MoeLayer, x: jax.ShapeDtypeStruct, mesh: jax.sharding.Mesh):
    """``layer``'s forward + backward (gradients of the sum of squared outputs w.r.t.
    parameters and inputs) compiled under ``mesh`` (e.g. a TPU topology's devices) from
    abstract shapes."""
    params = nn.unbox(jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)["params"])

    def step(p, x):
        def loss(p, x):
            out = layer.apply({"params": p}, x, deterministic=False, mutable=[AUX_LOSS_COLLECTION])[
                0
            ]
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(p, x)

    with jax.set_mesh(mesh):
        return jax.jit(step).lower(params, x).compile()


def with_execution(layer: MoeLayer, **changes) -> MoeLayer:
    """``layer`` with ``ExecutionConfig`` fields changed: how it runs, not what it computes
    (same parameters)."""
    return layer.clone(
        config=replace(layer.config, execution=replace(layer.config.execution, **changes))
    )
