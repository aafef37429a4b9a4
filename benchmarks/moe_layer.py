"""MoE layer forward+backward: dispatch implementations vs a dense FFN of equal useful FLOPs.

Usage: python benchmarks/moe_layer.py [--quick] [--reps N]

For each shape (T5-Base: d_model 768, d_ff 2048; small: d_model 32, d_ff 256), 8 x 512
tokens, top-2, capacity factor 1.25 (training), T5X capacity rule, group size 4096, and
E in {8, 32, 64}, it times jitted forward+backward (gradients w.r.t. params and inputs)
of each dispatch implementation and of a dense ReLU FFN whose hidden size gives the same
useful FLOPs. Useful FLOPs = the expert matmuls on the filled capacity slots:
3 (fwd + bwd) x 2 matmuls x 2 x (E x capacity x groups) x d_model x d_ff. The float32
matmul rate (2048^3, jitted) is measured in the same run. Every time is the best of
--reps runs after a warm-up (the machine is shared; other jobs only add time). --quick runs T5-Base with E=8
only plus the small shape.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.hardware import measured_matmul_flops
from moe_jax.moe import MoeLayer
from moe_jax.moe.capacity import expert_capacity, group_layout

TOKENS = (8, 512)
SHAPES = {"t5-base": (768, 2048), "small": (32, 256)}


def _best_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)  # best of reps: the machine is shared, load only adds time


def _grad_fn(apply):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x)), argnums=(0, 1)))


def time_moe(d_model: int, d_ff: int, experts: int, dispatch: str, reps: int) -> float:
    layer = MoeLayer(num_experts=experts, num_selected_experts=2, d_ff=d_ff, dispatch=dispatch,
                     train_capacity_factor=1.25, capacity_rule="t5x", group_size=4096,
                     load_balancing_loss_weight=0.0, router_z_loss_weight=0.0)
    x = jax.random.normal(jax.random.PRNGKey(0), TOKENS + (d_model,))
    params = nn.unbox(jax.jit(layer.init)(jax.random.PRNGKey(1), x)["params"])
    grad = _grad_fn(lambda p, x: layer.apply({"params": p}, x, deterministic=False,
                                             mutable=["aux_loss", "moe_metrics"])[0])
    return _best_ms(grad, params, x, reps=reps)


def time_dense(d_model: int, hidden: int, reps: int) -> float:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (TOKENS[0] * TOKENS[1], d_model))
    params = (jax.random.normal(keys[1], (d_model, hidden)) * 0.02, jax.random.normal(keys[2], (hidden, d_model)) * 0.02)
    grad = _grad_fn(lambda p, x: jnp.maximum(x @ p[0], 0) @ p[1])
    return _best_ms(grad, params, x, reps=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T5-Base with E=8 only, plus the small shape")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rate = measured_matmul_flops(repeats=max(args.reps, 5))
    print(f"backend {jax.default_backend()}, {len(jax.devices())} device(s); "
          f"float32 matmul rate {rate / 1e9:.1f} GFLOP/s")
    print("| shape | E | capacity | impl | ms | vs einsum | useful GFLOP/s | of matmul rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    tokens = TOKENS[0] * TOKENS[1]
    for shape, (d_model, d_ff) in SHAPES.items():
        for experts in (8, 32, 64):
            if args.quick and shape == "t5-base" and experts != 8:
                continue
            groups, per_group = group_layout(tokens, 4096)
            capacity = expert_capacity(per_group, experts, 2, 1.25, 4, "t5x")
            slots = experts * capacity * groups
            useful = 3 * 2 * 2 * slots * d_model * d_ff
            results = {impl: time_moe(d_model, d_ff, experts, impl, args.reps) for impl in ("einsum", "sort")}
            results["dense FFN"] = time_dense(d_model, d_ff * slots // tokens, args.reps)
            for impl, ms in results.items():
                achieved = useful / (ms * 1e-3)
                print(f"| {shape} | {experts} | {capacity} | {impl} | {ms:.1f} | "
                      f"{results['einsum'] / ms:.2f}x | {achieved / 1e9:.1f} | {achieved / rate:.0%} |",
                      flush=True)


if __name__ == "__main__":
    main()
