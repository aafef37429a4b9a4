"""Float32 matmul rate of each matmul in the MoE layer's and the dense FFN's fwd+bwd.

Usage: python benchmarks/matmul_shapes.py [--experts E] [--reps N] [--batched]

Times, in isolation and side by side, the six matmuls of one expert MLP at the T5-Base
shape of ``benchmarks/moe_layer.py`` (d_model 768, d_ff 2048, capacity rows per expert
from the T5X rule: 640 at E = 8) and the six of the dense FFN with the same useful FLOPs
(4096 tokens, hidden 2048 x E x capacity / 4096), each in the layout XLA emits for the
forward (``x @ w``), the input gradient (``dy @ w^T``) and the weight gradient
(``x^T @ dy``). It prints each one's GFLOP/s, then the sum over a whole step (x E for the
experts) against the 2048^3 reference: how fast the layer could be if it were nothing but
its matmuls. ``benchmarks/RESULTS.md`` ("The expert matmuls alone") reads the gap between
that and the measured layer. ``--batched`` times each expert matmul instead as one einsum
over all E experts (``[experts, rows, d_model]`` operands: the loop-free formulation).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from moe_layer import timed_interleaved, useful_flops

from moe_jax.moe.capacity import expert_capacity

D_MODEL, D_FF, TOKENS = 768, 2048, 4096
LAYOUTS = {"x @ w": ((1,), (0,)), "dy @ w^T": ((1,), (1,)), "x^T @ dy": ((0,), (0,))}


def matmul(m: int, k: int, n: int, layout: str) -> tuple:
    """A jitted ``[m, k] x [k, n]`` product with its operands stored as ``layout`` says."""
    lhs_contract, rhs_contract = LAYOUTS[layout]
    lhs = jnp.ones((k, m) if lhs_contract == (0,) else (m, k))
    rhs = jnp.ones((n, k) if rhs_contract == (1,) else (k, n))
    fn = jax.jit(lambda a, b: lax.dot_general(a, b, ((lhs_contract, rhs_contract), ((), ()))))
    return fn, (lhs, rhs)


def batched_matmul(experts: int, m: int, k: int, n: int, layout: str) -> tuple:
    """``matmul(m, k, n, layout)`` for each of ``experts`` experts as one batched einsum."""
    lhs, rhs = {"x @ w": ("emk", "ekn"), "dy @ w^T": ("emk", "enk"), "x^T @ dy": ("ekm", "ekn")}[
        layout
    ]
    spec = f"{lhs},{rhs}->emn"
    sizes = {"e": experts, "m": m, "k": k, "n": n}
    operands = tuple(jnp.ones([sizes[c] for c in term]) for term in (lhs, rhs))
    return jax.jit(lambda a, b: jnp.einsum(spec, a, b)), operands


def ffn_matmuls(rows: int, hidden: int) -> dict[str, tuple[int, int, int, str]]:
    """The six ``(m, k, n, layout)`` matmuls of a ReLU FFN's fwd+bwd on ``rows`` tokens."""
    return {
        "fwd x @ wi": (rows, D_MODEL, hidden, "x @ w"),
        "fwd h @ wo": (rows, hidden, D_MODEL, "x @ w"),
        "bwd dy @ wo^T": (rows, D_MODEL, hidden, "dy @ w^T"),
        "bwd dh @ wi^T": (rows, hidden, D_MODEL, "dy @ w^T"),
        "bwd x^T @ dh": (D_MODEL, rows, hidden, "x^T @ dy"),
        "bwd h^T @ dy": (hidden, rows, D_MODEL, "x^T @ dy"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--batched",
        action="store_true",
        help="time the expert matmuls as one einsum over all experts instead of per expert",
    )
    args = parser.parse_args()
    capacity = expert_capacity(TOKENS, args.experts, 2, 1.25, 4, "t5x")
    hidden = D_FF * args.experts * capacity // TOKENS
    shapes = {("expert", name): s for name, s in ffn_matmuls(capacity, D_FF).items()}
    shapes |= {("dense FFN", name): s for name, s in ffn_matmuls(TOKENS, hidden).items()}
    shapes[("reference", "2048^3")] = (2048, 2048, 2048, "x @ w")
    runs = {
        key: (
            batched_matmul(args.experts, *s) if args.batched and key[0] == "expert" else matmul(*s)
        )
        for key, s in shapes.items()
    }
    timings = timed_interleaved(runs, args.reps)
    reference_rate = 2 * 2048**3 / (timings[("reference", "2048^3")].ms * 1e-3)
    print(
        f"backend {jax.default_backend()}; E = {args.experts}, "
        f"capacity {capacity} rows per expert, dense FFN hidden {hidden}; "
        f"expert matmuls {'batched over experts' if args.batched else 'per expert'}"
    )
    print("| matmul | m x k x n | ms | GFLOP/s | of 2048^3 rate |")
    print("| --- | --- | --- | --- | --- |")
    totals = {"expert": 0.0, "dense FFN": 0.0}
    for (owner, name), (m, k, n, _) in shapes.items():
        ms = timings[(owner, name)].ms
        per_expert = args.batched and owner == "expert"
        rate = 2 * m * k * n * (args.experts if per_expert else 1) / (ms * 1e-3)
        print(
            f"| {owner}: {name} | {m} x {k} x {n} | {ms:.2f} | {rate / 1e9:.1f} "
            f"| {rate / reference_rate:.0%} |"
        )
        if owner in totals:
            totals[owner] += ms * (args.experts if owner == "expert" and not args.batched else 1)
    useful = useful_flops(args.experts * capacity, D_MODEL, D_FF)
    for owner, ms in totals.items():
        rate = useful / (ms * 1e-3)
        times_e = " (x E)" if owner == "expert" and not args.batched else ""
        print(
            f"sum of the {owner} matmuls of one step{times_e}: {ms:.1f} ms "
            f"= {rate / 1e9:.1f} GFLOP/s = {rate / reference_rate:.0%} of the 2048^3 rate"
        )


if __name__ == "__main__":
    main()
