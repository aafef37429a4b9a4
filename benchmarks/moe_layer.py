"""MoE layer forward+backward: dispatch implementations vs a dense FFN of equal useful FLOPs.

Usage: python benchmarks/moe_layer.py [--quick] [--reps N] [--loss cotangent|sum]
[--options | --orders]

``--options`` times instead, at the T5-Base shape with E = 8 and the sort dispatch, each
routing option of docs/moe.md (shared experts, fine-grained experts, sigmoid scores, the
balancing bias with its update, group-limited routing) against plain top-2 in the same
rounds: the time ratio, the useful-FLOP ratio (what the option adds: a shared expert's
dense FFN on every token; fine-grained experts' wider router) and the cost beyond it,
then the load-independent ratios of XLA's cost analysis of each compiled step (FLOPs and
bytes accessed, with batched expert matmuls). The updated balancing bias is an output of
the timed step, as in a train step, so XLA cannot drop its update.

``--orders`` times the two capacity orders (``CapacityConfig.capacity_order``: ``choice_major``,
T5X's and the encoder's; ``token_major``, the causal decoder's) of each dispatch
implementation in the same rounds, at both shapes with E = 8.

For each shape (T5-Base: d_model 768, d_ff 2048; small: d_model 32, d_ff 256), 8 x 512
tokens, top-2, capacity factor 1.25 (training), T5X capacity rule, group size 4096, and
E in {8, 32, 64}, it times jitted forward+backward (gradients w.r.t. params and inputs)
of each dispatch implementation and of a dense ReLU FFN whose hidden size gives the same
useful FLOPs. Useful FLOPs = the expert matmuls on the filled capacity slots:
3 (fwd + bwd) x 2 matmuls x 2 x (E x capacity x groups) x d_model x d_ff. The float32
matmul rate (2048^3, jitted) is measured in the same timing rounds as each shape's
implementations, so "of matmul rate" compares runs under the same load. Every time is the
best of --reps runs after a warm-up, the implementations timed in turn, one of each per
round (the machine is shared; other jobs only add time). --quick runs T5-Base with E=8
only plus the small shape. The last two columns are the operating system's share of a
step (medians): minor page faults, i.e. first touches of memory XLA:CPU freshly allocated
for that call's outputs and temporaries, and the system CPU time they cost; the matmul
reference reuses its memory and has none.

The timed step is ``value_and_grad`` of ``sum(y * r)`` with a fixed random cotangent ``r``
(``--loss cotangent``, the default), which makes every implementation do the work of a
training step: all six matmuls of fwd+bwd. ``--loss sum`` is the earlier
``grad(sum(y))``: there the dense FFN's second forward matmul is dead code (its output is
needed by neither the gradient nor a returned value) and XLA drops it, while the MoE layer
must keep it (the router gradient reads the expert outputs), so the dense reference did
5/6 of the counted work.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from layer_configs import ROUTING_OPTIONS, layer_config

from moe_jax.hardware import measured_matmul_flops
from moe_jax.moe import MoeLayer
from moe_jax.moe.capacity import expert_capacity, group_layout

TOKENS = (8, 512)
MATMUL_N = 2048
SHAPES = {"t5-base": (768, 2048), "small": (32, 256)}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Best-of-reps wall time of one implementation, and the operating-system cost of a
    call: minor page faults (first touches of freshly allocated memory) and system CPU time,
    medians over the reps."""

    ms: float
    page_faults: float
    system_ms: float


def useful_flops(slots: int, d_model: int, d_ff: int) -> int:
    """FLOPs of the expert matmuls of one fwd+bwd on ``slots`` capacity slots:
    3 (fwd + bwd) x 2 matmuls x 2 x slots x d_model x d_ff."""
    return 3 * 2 * 2 * slots * d_model * d_ff


def timed_interleaved(runs: dict[str, tuple], reps: int) -> dict[str, Timing]:
    """Times each ``name: (fn, args)`` ``reps`` times after a warm-up, the runs taken in
    turn (one of each per round) so that a burst of load on the shared machine hits them all."""
    for fn, args in runs.values():
        jax.block_until_ready(fn(*args))  # compile + warm up
    samples: dict[str, list[tuple[float, int, float]]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, (fn, args) in runs.items():
            before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            samples[name].append(
                (wall, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime)
            )
    return {
        name: Timing(
            ms=1e3 * min(w for w, _, _ in ts),  # load only adds time
            page_faults=statistics.median(f for _, f, _ in ts),
            system_ms=1e3 * statistics.median(st for _, _, st in ts),
        )
        for name, ts in samples.items()
    }


def _grad_fn(apply, out_shape, loss: str):
    """Jitted fwd+bwd of ``apply(params, x) -> (y, aux)``; see the module docstring for
    ``loss``. ``aux`` (the updated balancing bias) is returned, so that XLA keeps the work
    that computes it, as a train step does."""
    r = None if loss == "sum" else jax.random.normal(jax.random.PRNGKey(7), out_shape)

    def objective(p, x):
        y, aux = apply(p, x)
        return jnp.sum(y if r is None else y * r), aux

    step = jax.grad if loss == "sum" else jax.value_and_grad
    return jax.jit(step(objective, argnums=(0, 1), has_aux=True))


def moe_run(
    d_model: int, d_ff: int, experts: int, dispatch: str, loss: str, **parts: dict
) -> tuple:
    """Fwd+bwd of a training-mode MoeLayer configured by ``layer_config`` (no auxiliary
    losses); a balancing bias is passed in, updated and returned, as in a train step."""
    parts.setdefault("losses", dict(load_balancing_loss_weight=0.0, router_z_loss_weight=0.0))
    layer = MoeLayer(layer_config(experts, d_ff, dispatch, **parts))
    x = jax.random.normal(jax.random.PRNGKey(0), (*TOKENS, d_model))
    variables = nn.unbox(jax.jit(layer.init)(jax.random.PRNGKey(1), x))
    state = {k: v for k, v in variables.items() if k == "router_bias"}

    def apply(p, x):
        y, written = layer.apply(
            {"params": p, **state},
            x,
            deterministic=False,
            mutable=["aux_loss", "moe_metrics", *state],
        )
        return y, {name: written[name] for name in state}

    grad = _grad_fn(apply, x.shape, loss)
    return grad, (variables["params"], x)


# name: (the parts of layer_config changed, useful FLOPs relative to plain top-2 at T5-Base /
# E = 8: what the option adds to the expert matmuls on the filled capacity slots).
def _options(d_model: int, d_ff: int, slots: int, tokens: int) -> dict[str, tuple[dict, float]]:
    base = useful_flops(slots, d_model, d_ff)
    router = 3 * 2 * tokens * d_model  # fwd + bwd FLOPs of one router column
    return {
        "top-2 (plain)": ({}, 1.0),
        "shared expert (1 x d_ff) + top-2": (
            ROUTING_OPTIONS["shared expert (1 x d_ff) + top-2"],
            1.0 + useful_flops(tokens, d_model, d_ff) / base,
        ),
        "balancing bias (u = 1e-3)": (ROUTING_OPTIONS["balancing bias (u = 1e-3)"], 1.0),
        "sigmoid scores": (ROUTING_OPTIONS["sigmoid scores"], 1.0),
        "fine-grained m = 4 (32 x d_ff/4, top-8)": (
            ROUTING_OPTIONS["fine-grained m = 4 (4E experts of d_ff / 4, top-8)"],
            1.0 + 24 * router / base,
        ),
        "group-limited G = 4, M = 2": (ROUTING_OPTIONS["group-limited G = 4, M = 2"], 1.0),
    }


def options_table(reps: int, loss: str) -> None:
    """Each routing option vs plain top-2 (sort dispatch, T5-Base, E = 8), same rounds."""
    d_model, d_ff = SHAPES["t5-base"]
    tokens = TOKENS[0] * TOKENS[1]
    groups, per_group = group_layout(tokens, 4096)
    slots = 8 * expert_capacity(per_group, 8, 2, 1.25, 4, "t5x") * groups
    options = _options(d_model, d_ff, slots, tokens)
    runs = {
        name: moe_run(d_model, d_ff, 8, "sort", loss, **kw) for name, (kw, _) in options.items()
    }
    results = timed_interleaved(runs, reps)
    # Load-independent: XLA's cost analysis of each compiled step, with batched expert
    # matmuls (cost_analysis does not multiply a lax.map body by its trip count).
    costs = {}
    for name, (kw, _) in options.items():
        fn, fn_args = moe_run(
            d_model, d_ff, 8, "sort", loss, **kw, execution=dict(per_expert_loop=False)
        )
        cost = fn.lower(*fn_args).compile().cost_analysis()
        costs[name] = (cost.get("flops", float("nan")), cost.get("bytes accessed", float("nan")))
    plain, (plain_flops, plain_bytes) = results["top-2 (plain)"].ms, costs["top-2 (plain)"]
    print(
        "| option (T5-Base, E = 8, sort) | ms | time vs plain | useful FLOPs vs plain "
        "| cost beyond its FLOPs | compiled FLOPs vs plain | compiled bytes accessed vs plain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (_, flop_ratio) in options.items():
        ratio = results[name].ms / plain
        print(
            f"| {name} | {results[name].ms:.1f} | {ratio:.3f}x | {flop_ratio:.3f}x | "
            f"{ratio / flop_ratio - 1:+.1%} | {costs[name][0] / plain_flops:.3f}x | "
            f"{costs[name][1] / plain_bytes:.3f}x |",
            flush=True,
        )


def orders_table(reps: int, loss: str) -> None:
    """Token-major vs choice-major capacity of each dispatch, same rounds (E = 8)."""
    print("| shape | impl | choice_major ms | token_major ms | token / choice |")
    print("| --- | --- | --- | --- | --- |")
    for shape, (d_model, d_ff) in SHAPES.items():
        runs = {
            (impl, order): moe_run(
                d_model, d_ff, 8, impl, loss, capacity=dict(capacity_order=order)
            )
            for impl in ("einsum", "sort")
            for order in ("choice_major", "token_major")
        }
        results = timed_interleaved(runs, reps)
        for impl in ("einsum", "sort"):
            choice, token = results[(impl, "choice_major")].ms, results[(impl, "token_major")].ms
            print(
                f"| {shape} | {impl} | {choice:.1f} | {token:.1f} | {token / choice:.3f}x |",
                flush=True,
            )


def dense_run(d_model: int, hidden: int, loss: str) -> tuple:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (TOKENS[0] * TOKENS[1], d_model))
    params = (
        jax.random.normal(keys[1], (d_model, hidden)) * 0.02,
        jax.random.normal(keys[2], (hidden, d_model)) * 0.02,
    )
    grad = _grad_fn(lambda p, x: (jnp.maximum(x @ p[0], 0) @ p[1], ()), x.shape, loss)
    return grad, (params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="T5-Base with E=8 only, plus the small shape"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=10,
        help="timing rounds; fewer than ~10 scatter the matmul-rate ratio by +-5 points",
    )
    parser.add_argument(
        "--loss",
        choices=("cotangent", "sum"),
        default="cotangent",
        help="value_and_grad of sum(y * r) (training-like), or the earlier grad of sum(y)",
    )
    parser.add_argument(
        "--options",
        action="store_true",
        help="time each routing option against plain top-2 instead (T5-Base, E = 8, sort)",
    )
    parser.add_argument(
        "--orders",
        action="store_true",
        help="time the two capacity orders of each dispatch instead (E = 8, both shapes)",
    )
    args = parser.parse_args()
    if args.orders:
        print(f"backend {jax.default_backend()}, {len(jax.devices())} device(s); loss: {args.loss}")
        orders_table(args.reps, args.loss)
        return
    if args.options:
        print(f"backend {jax.default_backend()}, {len(jax.devices())} device(s); loss: {args.loss}")
        options_table(args.reps, args.loss)
        return
    rate = measured_matmul_flops(MATMUL_N, repeats=max(args.reps, 5))
    print(
        f"backend {jax.default_backend()}, {len(jax.devices())} device(s); "
        f"float32 matmul rate at start {rate / 1e9:.1f} GFLOP/s (median); each shape below is "
        f"compared with the best matmul time of its own timing rounds"
    )
    a = jnp.ones((MATMUL_N, MATMUL_N), jnp.float32)
    matmul = (jax.jit(lambda a: a @ a), (a,))
    print(f"loss: {args.loss}")
    print(
        "| shape | E | capacity | impl | ms | vs einsum | of dense FFN rate | useful GFLOP/s "
        "| of matmul rate | page faults / step | system CPU ms / step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    tokens = TOKENS[0] * TOKENS[1]
    for shape, (d_model, d_ff) in SHAPES.items():
        for experts in (8, 32, 64):
            if args.quick and shape == "t5-base" and experts != 8:
                continue
            groups, per_group = group_layout(tokens, 4096)
            capacity = expert_capacity(per_group, experts, 2, 1.25, 4, "t5x")
            slots = experts * capacity * groups
            useful = useful_flops(slots, d_model, d_ff)
            runs = {
                impl: moe_run(d_model, d_ff, experts, impl, args.loss)
                for impl in ("einsum", "sort")
            }
            runs["dense FFN"] = dense_run(d_model, d_ff * slots // tokens, args.loss)
            runs["matmul"] = matmul
            results = timed_interleaved(runs, args.reps)
            reference = results.pop("matmul")
            rate = 2 * MATMUL_N**3 / (reference.ms * 1e-3)
            print(
                f"| {shape} | {experts} | {capacity} | float32 matmul {MATMUL_N}^3, same rounds | "
                f"| | | {rate / 1e9:.1f} | 100% | {reference.page_faults:.0f} "
                f"| {reference.system_ms:.0f} |"
            )
            for impl, timing in results.items():
                achieved = useful / (timing.ms * 1e-3)
                print(
                    f"| {shape} | {experts} | {capacity} | {impl} | {timing.ms:.1f} | "
                    f"{results['einsum'].ms / timing.ms:.2f}x "
                    f"| {results['dense FFN'].ms / timing.ms:.0%} | "
                    f"{achieved / 1e9:.1f} | {achieved / rate:.0%} | {timing.page_faults:.0f} | "
                    f"{timing.system_ms:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
