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
import json
import pathlib
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
from moe_jax.moe.collections import AUX_LOSS_COLLECTION, BIAS_COLLECTION, MOE_METRICS_COLLECTION
from moe_jax.moe.grouped_matmul import fallbacks
from moe_jax.moe.options import GROUPED_MATMULS
from moe_jax.runtime import compute_copies

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

    def objective(p, x):  # the sum in float32, whatever ``dtype`` y has
        y, aux = apply(p, x)
        y = y.astype(jnp.float32)
        return jnp.sum(y if r is None else y * r), aux

    step = jax.grad if loss == "sum" else jax.value_and_grad
    return jax.jit(step(objective, argnums=(0, 1), has_aux=True))


def moe_run(
    d_model: int,
    d_ff: int,
    experts: int,
    dispatch: str,
    loss: str,
    tokens: tuple[int, int] = TOKENS,
    dtype=jnp.float32,
    **parts: dict,
) -> tuple:
    """Fwd+bwd of a training-mode MoeLayer configured by ``layer_config`` (no auxiliary
    losses) on ``tokens`` (batch, length) inputs of ``dtype`` (the layer computes in it;
    parameters float32, those it reads cast passed cast, as the train step's compute copies:
    ``compute_copies.read_as_copies``); a balancing bias is passed in, updated and returned,
    as in a train step."""
    parts.setdefault("losses", dict(load_balancing_loss_weight=0.0, router_z_loss_weight=0.0))
    layer = MoeLayer(layer_config(experts, d_ff, dispatch, **parts), dtype=dtype)
    x = jax.random.normal(jax.random.PRNGKey(0), (*tokens, d_model), dtype)
    variables = nn.unbox(jax.jit(layer.init)(jax.random.PRNGKey(1), x))
    state = {k: v for k, v in variables.items() if k == BIAS_COLLECTION}

    def apply(p, x):
        y, written = layer.apply(
            {"params": p, **state},
            x,
            deterministic=False,
            mutable=[AUX_LOSS_COLLECTION, MOE_METRICS_COLLECTION, *state],
        )
        return y, {name: written[name] for name in state}

    grad = _grad_fn(apply, x.shape, loss)
    return grad, (compute_copies.read_as_copies(apply, variables["params"], x), x)


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


def dense_run(
    d_model: int, hidden: int, loss: str, tokens: int = TOKENS[0] * TOKENS[1], dtype=jnp.float32
) -> tuple:
    """Fwd+bwd of a dense ReLU FFN ``[tokens, d_model] -> hidden -> d_model`` computing in
    ``dtype``, its float32 parameters passed as the train step's compute copies (as the MoE
    layer's)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (tokens, d_model), dtype)
    params = {
        "wi": jax.random.normal(keys[1], (d_model, hidden)) * 0.02,
        "wo": jax.random.normal(keys[2], (hidden, d_model)) * 0.02,
    }

    def apply(p, x):
        wi, wo = p["wi"].astype(dtype), p["wo"].astype(dtype)
        return jnp.maximum(x @ wi, 0) @ wo, ()

    return _grad_fn(apply, x.shape, loss), (compute_copies.read_as_copies(apply, params, x), x)


# ----------------------------------------------------------------------------- device table

# Implementation name: (ExecutionConfig.dispatch, the other layer_config parts). ``dropless``
# takes the grouped matmul ``execution.resolve_plan`` picks for the device (tokamax on GPU);
# ``dropless:<name>`` names one of ``options.GROUPED_MATMULS``.
IMPLEMENTATIONS: dict[str, tuple[str, dict]] = {
    "einsum": ("einsum", {}),
    "sort": ("sort", {}),
    "dropless": ("sort", dict(capacity=dict(dropless=True))),
    **{
        f"dropless:{name}": (
            "sort",
            dict(capacity=dict(dropless=True), execution=dict(grouped_matmul=name)),
        )
        for name in GROUPED_MATMULS
    },
}
# What each implementation's outputs and gradients are compared with, in the same run.
REFERENCES = {
    "sort": "einsum",
    "dropless": "dropless:xla",
    **{f"dropless:{n}": "dropless:xla" for n in GROUPED_MATMULS if n != "xla"},
}


def _max_relative_difference(a, b) -> float:
    """Largest |a - b| over the largest |b|, across all leaves (loss, outputs, gradients)."""
    worst = 0.0
    for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = jnp.asarray(leaf_a, jnp.float32), jnp.asarray(leaf_b, jnp.float32)
        scale = float(jnp.max(jnp.abs(y)))
        if scale > 0:
            worst = max(worst, float(jnp.max(jnp.abs(x - y))) / scale)
    return worst


def measure_layers(
    num_experts: int,
    implementations: tuple[str, ...],
    tokens: tuple[int, int],
    d_model: int,
    d_ff: int,
    dtype=jnp.bfloat16,
    *,
    group_size: int = 4096,
    matmul_n: int = 8192,
    reps: int = 20,
    check: bool = True,
) -> list[dict]:
    """Times jitted fwd+bwd (``value_and_grad`` of ``sum(y * r)``) of the MoE layer in each
    of ``implementations`` (keys of ``IMPLEMENTATIONS``) on the default device, beside a
    dense ReLU FFN of the capacity layer's useful FLOPs and a ``[matmul_n]^3`` matmul in
    ``dtype``, all in the same rounds (best of ``reps`` after a warm-up, one of each per
    round). Top-2, capacity factor 1.25 (training), T5X rule, groups of ``group_size``;
    activations ``dtype``, weights as the train step passes them (bfloat16 compute copies
    with bfloat16 activations).

    Useful FLOPs: 3 (fwd + bwd) x 2 matmuls x 2 x rows x d_model x d_ff, with rows = the
    capacity slots (E x capacity x groups) for ``einsum`` / ``sort`` and the dense FFN, and
    the routed assignments (tokens x 2) for dropless.

    Returns one dict per timed run (the implementations, ``dense FFN``, ``matmul``) with
    ``device``, ``experts``, ``impl``, ``ms``, ``vs_dense`` (dense ms / ms: the time against
    the FLOP-matched dense FFN), ``useful_tflops``, ``of_dense_rate`` (useful rate / the
    dense FFN's: dropless computes every assignment, 1.6x the capacity layer's rows at
    factor 1.25 and top-2, so it is judged by its rate), ``of_matmul`` (useful rate / the
    matmul's rate), and with ``check``, for implementations with a reference
    (``REFERENCES``) in the same list, ``max_rel_diff`` (outputs and gradients vs the
    reference's, same parameters and inputs). An implementation that fails to compile or
    run on the device, or whose grouped matmul kernel fell back to ``xla``
    (``grouped_matmul.fallbacks``), gives a dict with ``error`` instead.
    """
    num_tokens = tokens[0] * tokens[1]
    groups, per_group = group_layout(num_tokens, group_size)
    capacity = expert_capacity(per_group, num_experts, 2, 1.25, 4, "t5x")
    slots = num_experts * capacity * groups
    rows = {
        impl: num_tokens * 2 if impl.startswith("dropless") else slots for impl in implementations
    }
    group = dict(capacity=dict(group_size=group_size))
    runs, failed = {}, {}
    for impl in implementations:
        dispatch, parts = IMPLEMENTATIONS[impl]
        merged = {**parts, "capacity": {**group["capacity"], **parts.get("capacity", {})}}
        try:  # a kernel the device lacks fails here; the others are still timed
            runs[impl] = moe_run(
                d_model, d_ff, num_experts, dispatch, "cotangent", tokens, dtype, **merged
            )
            jax.block_until_ready(runs[impl][0](*runs[impl][1]))
        except Exception as error:
            failed[impl] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            runs.pop(impl, None)
            continue
        kernel = parts.get("execution", {}).get("grouped_matmul")
        if kernel in fallbacks():  # it ran, but not the kernel the row names
            failed[impl] = f"fell back to xla ({fallbacks()[kernel][:200]})"
            runs.pop(impl)
    runs["dense FFN"] = dense_run(
        d_model, d_ff * slots // num_tokens, "cotangent", num_tokens, dtype
    )
    a = jnp.ones((matmul_n, matmul_n), dtype)
    runs["matmul"] = (jax.jit(lambda a: a @ a), (a,))
    timings = timed_interleaved(runs, reps)
    matmul_rate = 2 * matmul_n**3 / (timings["matmul"].ms * 1e-3)
    dense_rate = useful_flops(slots, d_model, d_ff) / (timings["dense FFN"].ms * 1e-3)
    device = jax.devices()[0].device_kind
    results = []
    for name, timing in timings.items():
        useful = (
            2 * matmul_n**3
            if name == "matmul"
            else useful_flops(rows.get(name, slots), d_model, d_ff)
        )
        rate = useful / (timing.ms * 1e-3)
        results.append(
            dict(
                device=device,
                dtype=jnp.dtype(dtype).name,
                experts=num_experts,
                capacity=capacity,
                impl=name,
                ms=timing.ms,
                vs_dense=timings["dense FFN"].ms / timing.ms,
                useful_tflops=rate / 1e12,
                of_dense_rate=rate / dense_rate,
                of_matmul=rate / matmul_rate,
            )
        )
    results += [
        dict(device=device, experts=num_experts, impl=impl, error=error)
        for impl, error in failed.items()
    ]
    if check:
        outputs = {impl: runs[impl][0](*runs[impl][1]) for impl in implementations if impl in runs}
        for row in results:
            reference = REFERENCES.get(row["impl"])
            if reference in outputs and row["impl"] in outputs:
                row["max_rel_diff"] = _max_relative_difference(
                    outputs[row["impl"]], outputs[reference]
                )
    return results


# Sizes of the device table: the issue's H100 shape, and a tiny one for a CPU check.
DEVICE_SIZES = dict(tokens=(64, 512), d_model=768, d_ff=2048, group_size=4096, matmul_n=8192)
QUICK_SIZES = dict(tokens=(2, 64), d_model=32, d_ff=64, group_size=64, matmul_n=128)


def device_table(
    experts: tuple[int, ...], implementations: tuple[str, ...], quick: bool, reps: int
) -> list[dict]:
    """``measure_layers`` for each E (bfloat16 on an accelerator, float32 on CPU); prints
    one Markdown table, returns its rows."""
    sizes = QUICK_SIZES if quick else DEVICE_SIZES
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    print(
        f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{jnp.dtype(dtype).name}; "
        f"{sizes['tokens'][0]} x {sizes['tokens'][1]} tokens, d_model {sizes['d_model']}, "
        f"d_ff {sizes['d_ff']}, groups of {sizes['group_size']}, top-2, capacity factor 1.25"
    )
    print(
        "| E | impl | ms | time vs dense FFN | useful TFLOP/s | of dense FFN rate "
        "| of matmul rate | max rel. diff vs reference |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for e in experts:
        for row in measure_layers(e, implementations, dtype=dtype, reps=reps, **sizes):
            rows.append(row)
            if "error" in row:
                print(f"| {e} | {row['impl']} | failed: {row['error']} | | | | | |", flush=True)
                continue
            name = (
                f"{jnp.dtype(dtype).name} matmul {sizes['matmul_n']}^3"
                if row["impl"] == "matmul"
                else row["impl"]
            )
            diff = row.get("max_rel_diff")
            check = "" if diff is None else f"{diff:.1e} vs {REFERENCES[row['impl']]}"
            print(
                f"| {e} | {name} | {row['ms']:.3f} | {row['vs_dense']:.3f}x | "
                f"{row['useful_tflops']:.3g} | {row['of_dense_rate']:.2f} | "
                f"{row['of_matmul']:.0%} | {check} |",
                flush=True,
            )
    return rows


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
    parser.add_argument(
        "--device",
        action="store_true",
        help="the device table instead: each implementation at the issue's accelerator shape "
        "(64 x 512 tokens, bfloat16) on the default device; with --quick, tiny float32 sizes",
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["einsum", "sort", "dropless", "dropless:xla"],
        choices=sorted(IMPLEMENTATIONS),
        help="implementations of the device table",
    )
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--json", type=pathlib.Path, help="device table: write its rows here")
    args = parser.parse_args()
    if args.device:
        rows = device_table(tuple(args.experts), tuple(args.impls), args.quick, args.reps)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        return
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
